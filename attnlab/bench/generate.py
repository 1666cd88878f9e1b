"""``attnlab bench --suite generate``: tokens per second and peak memory of greedy decoding,
attnlab against ``transformers`` and, where installed (``pip install 'attnlab[peers]'``),
llama.cpp and OpenVINO at each precision, on the same weights; against the practical
ceiling of one-sequence decoding on this machine and its read bandwidth.

Greedy decoding of ``new_tokens`` (128) after a ``prompt_len`` (32) token prompt, and,
as its own case, the prefill of a 512-token prompt (one token out: ``tokens_per_s`` is
prompt tokens per second there). Models: a tiny Llama (hidden 256, 4 layers, 8 heads,
2 kv heads, vocab 1024), a GPT-2-small-shaped GPT (~124M) and a SmolLM-135M-shaped Llama
(hidden 576, 30 layers, 9 heads, 3 kv heads, vocab 49152, tied). Each shape is written
once, randomly initialised, as a ``save_pretrained`` safetensors folder in the temp dir;
attnlab (``GPT.from_hf(folder)``) and transformers (``from_pretrained``) load that
folder, llama.cpp the GGUF files and OpenVINO the IRs the bench writes from it
(:mod:`.gguf_files`, :mod:`.llamacpp`, :mod:`.openvino_lm`), in this process for timing
and in a fresh process for memory. Every engine decodes the same prompt, and its greedy
tokens are checked against attnlab float32's: ``tokens_agree`` counts the new tokens
equal to attnlab's before the first that differs (bf16 and int8 may part after a while).

Yardsticks, timed in the same rounds as the engines (batch 1):

- ``one-row ceiling`` (:mod:`.ceiling`): a loop that only multiplies a row by every
  weight matrix once per token, each by the fastest way this machine has. ``of_ceiling``
  is a decoder's tokens/s over the loop's.
- ``read bandwidth`` (:mod:`.bandwidth`): a sum over a buffer as large as the float32
  weights. ``of_bound`` is a decoder's tokens/s over bandwidth / (bytes of its weights at
  its precision read per token): the share of what reading the weights once allows.

Both are the median over the rounds of each round's ratio: the two ran a second apart in
that round, while this machine's speed drifts by 20-30% over minutes, which a ratio of
the two medians would take in. The read bound bounds the decoding steps, not the prompt's
product, so each engine of a batch-1 case also runs beside its one-token twin
(:mod:`.first_token`): ``first_token_ms``, then ``decode_tokens_per_s`` and its share of
the bound, ``decode_of_bound``.

Memory baseline: the probe (``runner.measure_memory``) subtracts the RSS after
importing the factory's module, which imports torch, transformers and attnlab's models
(and the peer's package), then runs its ``preload`` where it has one: here attnlab's
native extension and safetensors, which attnlab loads on first use and a peer's import
loads of its own (3-4 MB). Whatever loading a model imports later (torch's Python
decompositions, about 70 MB, if a random initialisation runs on the meta device)
counts against it.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from functools import partial
from pathlib import Path

import torch

from . import bandwidth, engines, first_token, greedy, peers
from .engines import BASELINE as BASELINE  # what the runner asks of the suite: the peer
from .engines import CEILING, READ, REFERENCE
from .first_token import in_table as in_table  # its table divides by, the columns it
from .generate_tables import summary_table as summary_table  # shows and a table of its own
from .runner import Case, Impl

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers as T  # noqa: E402

from ..models import GPT  # noqa: E402

MOD = __name__
PROMPT_LEN = 32
NEW_TOKENS = 128
PREFILL_LEN = 512

SHAPES = {
    "tiny-llama": dict(kind="llama", vocab_size=1024, hidden_size=256, intermediate_size=688,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                       tie_word_embeddings=False),
    "smollm-135m": dict(kind="llama", vocab_size=49152, hidden_size=576,
                        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3, tie_word_embeddings=True),
    "gpt2-124m": dict(kind="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12),
}


# The weights' standard deviation: transformers' default (0.02) gives models whose greedy
# continuation is one token repeated (SmolLM's shape) or nearly (GPT-2's), so agreeing
# tokens would mean little; at 0.1 each of the 32 tokens after the prompt differed.
INIT_STD = 0.1


def hf_model(shape: str):
    """A randomly initialised transformers model of the named shape (no download)."""
    spec = dict(SHAPES[shape])
    kind = spec.pop("kind")
    torch.manual_seed(0)
    if kind == "llama":
        cfg = T.LlamaConfig(max_position_embeddings=1024, bos_token_id=0, eos_token_id=0,
                            pad_token_id=0, initializer_range=INIT_STD, **spec)
        model = T.LlamaForCausalLM(cfg)
    else:
        cfg = T.GPT2Config(n_positions=1024, bos_token_id=0, eos_token_id=0,
                           initializer_range=INIT_STD, **spec)
        model = T.GPT2LMHeadModel(cfg)
    return model.eval()


def folder_path(shape: str) -> Path:
    """Where the shape's ``save_pretrained`` folder is (see :func:`folder`)."""
    return (Path(tempfile.gettempdir())
            / f"attnlab-bench-{shape}-std{INIT_STD}-tf{T.__version__}")


def folder(shape: str) -> Path:
    """The shape's ``save_pretrained`` folder in the temp dir, written on first use."""
    path = folder_path(shape)
    if not (path / "model.safetensors").is_file():
        part = Path(tempfile.mkdtemp(prefix=path.name + "-", dir=path.parent))
        hf_model(shape).save_pretrained(part)
        try:
            part.rename(path)
        except OSError:  # written meanwhile by another process: keep that one
            shutil.rmtree(part, ignore_errors=True)
    return path


def weight_bytes(shape: str, precision: str = "f32") -> int:
    """Bytes of the weights (a tied output layer once) stored at ``precision`` (an
    :data:`engines.BYTES_PER_WEIGHT` key: its bytes for every matrix, float32 vectors
    except in bf16 and f16, where everything is half)."""
    from ..layouts.hf import read_folder

    _, state = read_folder(folder(shape))
    shapes = state.shapes()
    # attnlab's int8 quantises the linears (and a table tied to the output layer); an
    # untied embedding keeps float32 (modules/quantized.py)
    untied = any(name.endswith("lm_head.weight") for name in shapes)
    total = 0.0
    for name, (shp, _) in shapes.items():
        n = 1
        for d in shp:
            n *= d
        if len(shp) == 2 and precision == "attnlab-q8_0" and untied and "embed" in name:
            total += 4 * n
        elif len(shp) == 2:
            total += engines.matrix_bytes(precision, shp[0], shp[1])
        else:
            total += n * (2 if precision in ("bf16", "f16") else 4)
    return round(total)


def preload() -> None:
    """Load the libraries attnlab's steps load on first use (the memory probe's baseline
    is taken after this, as after a peer's import of its own library)."""
    import safetensors.torch  # noqa: F401

    from .. import _native

    _native.load()


def prompt_ids(batch: int, prompt_len: int) -> torch.Tensor:
    """The prompt every engine decodes from, ``(batch, prompt_len)`` token ids."""
    return torch.randint(1, 1000, (batch, prompt_len), generator=torch.Generator().manual_seed(1))


def make_step(impl: str, shape: str, batch: int, new_tokens: int = NEW_TOKENS,
              prompt_len: int = PROMPT_LEN):
    """A step generating ``new_tokens`` greedily for a batch of random prompts."""
    path = folder(shape)
    prompt = prompt_ids(batch, prompt_len)
    if impl.startswith("attnlab"):
        precision = engines.ATTNLAB_PRECISIONS.get(engines.precision_of(impl), {})
        model = GPT.from_hf(path, **precision)
        use_cache = impl != "attnlab-nocache"

        def step():
            return model.generate(prompt, new_tokens, temperature=0, use_cache=use_cache)
        return step
    if impl == "transformers":
        hf = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        mask = torch.ones_like(prompt)

        def step():
            with torch.inference_mode():
                return hf.generate(prompt, attention_mask=mask, max_new_tokens=new_tokens,
                                   min_new_tokens=new_tokens, do_sample=False,
                                   pad_token_id=0, eos_token_id=None)
        return step
    raise ValueError(f"unknown impl {impl!r}")


def matrix_shapes(shape: str) -> list[tuple[int, int]]:
    """(in, out) of every weight matrix a decoding step multiplies a row by."""
    spec = SHAPES[shape]
    if spec["kind"] == "gpt2":
        d = spec["n_embd"]
        return [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * spec["n_layer"] + [
            (d, spec["vocab_size"])]
    d, f = spec["hidden_size"], spec["intermediate_size"]
    kv = d // spec["num_attention_heads"] * spec["num_key_value_heads"]
    layer = [(d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d)]
    return layer * spec["num_hidden_layers"] + [(d, spec["vocab_size"])]


def bytes_per_token(shape: str, precision: str) -> int:
    """Bytes of weight matrices decoding one token reads at ``precision``."""
    return round(sum(engines.matrix_bytes(precision, n_out, n_in)
                     for n_in, n_out in matrix_shapes(shape)))


def _case(shape, batch, impls, repeats, new_tokens, *, peers=(), prompt_len=PROMPT_LEN):
    args = {"shape": shape, "batch": batch, "new_tokens": new_tokens, "prompt_len": prompt_len}
    out = [Impl(i, (MOD, "make_step", {"impl": i, **args})) for i in impls]
    for e in peers:
        if e.module == MOD:  # attnlab's own precisions, in this process
            out.append(Impl(e.name, (MOD, "make_step", {"impl": e.name, **args})))
            continue
        # A peer runs in a process of its own and imports no torch: everything it
        # needs comes in its arguments (the folder is written by attnlab's step, built
        # before it in the case).
        out.append(Impl(e.name, (e.module, "make_step", {
            "folder": str(folder_path(shape)), "precision": e.precision,
            "prompt": prompt_ids(1, prompt_len)[0].tolist(), "new_tokens": new_tokens,
            "threads": torch.get_num_threads()}), isolated=True))
    prefill = prompt_len == PREFILL_LEN
    if batch == 1 and not prefill:
        out += [first_token.twin(i) for i in out]
        out.append(Impl(CEILING, ("attnlab.bench.ceiling", "make_ceiling",
                                  {"shape": shape, "new_tokens": new_tokens}), memory=False))
        out.append(Impl(READ, ("attnlab.bench.bandwidth", "make_read",
                               {"nbytes": bytes_per_token(shape, "f32")}), memory=False))
    name = (f"{shape} prefill {prompt_len} tokens" if prefill
            else f"{shape} B={batch} +{new_tokens} tokens")
    return Case("generate", name, out, repeats=repeats,
                extra={"batch": batch, "new_tokens": new_tokens, "shape": shape,
                       "prompt_len": prompt_len, "prefill": prefill},
                check=partial(_check, new_tokens=new_tokens) if batch == 1 else None)


def _check(outputs: dict, new_tokens: int) -> dict[str, dict]:
    """The greedy tokens of every engine against attnlab float32's (not the twins': one
    token each)."""
    return greedy.check({k: v for k, v in outputs.items() if not first_token.is_twin(k)},
                        reference=REFERENCE, new_tokens=new_tokens)


def cases(quick: bool = False) -> list[Case]:
    others = engines.available(quick)
    if quick:
        return [_case("tiny-llama", 1, ["attnlab", "attnlab-nocache", "transformers"], 3, 32,
                      peers=others)]
    out = []
    for batch in (1, 8):  # a second each: nine repeats steady the median on a busy machine
        out.append(_case("tiny-llama", batch, ["attnlab", "attnlab-nocache", "transformers"],
                         9, NEW_TOKENS, peers=others if batch == 1 else ()))
    # (no-cache decoding of GPT-2 is left out: about half a minute a step, the tiny
    # model shows what the cache is worth)
    # Batch 1 is what the one-row ceiling bounds: five rounds for a steadier median.
    out.append(_case("gpt2-124m", 1, ["attnlab", "transformers"], 5, NEW_TOKENS,
                     peers=others))
    out.append(_case("gpt2-124m", 8, ["attnlab", "transformers"], 2, NEW_TOKENS))
    for batch in (1, 8):
        out.append(_case("smollm-135m", batch, ["attnlab", "transformers"], 5 if batch == 1 else 3,
                         NEW_TOKENS, peers=others if batch == 1 else ()))
    out.append(_case("smollm-135m", 1, ["attnlab", "transformers"], 5, 1, peers=others,
                     prompt_len=PREFILL_LEN))
    return out


def prologue(log=print, quick: bool = False) -> None:
    """One line for each engine that cannot run here (left out of every case), and with
    ``quick`` one for the installed peers that it leaves out."""
    for line in engines.skip_lines():
        log(line)
    left = [e.name for e in engines.PEERS if peers.missing(e.needs) is None]
    if quick and left:
        log(f"--quick: {', '.join(left)} left out (timed without --quick)")


def annotate(records: list[dict], log=print) -> None:
    """Add ``tokens_per_s`` to every record (prompt tokens per second in a prefill case),
    ``weight_mb`` (the weights as stored) and ``peak_x_weights`` beside each peak;
    for batch 1 ``of_ceiling``: tokens/s as a share of the one-row ceiling's in the same
    case; with the read-bandwidth yardstick, ``gb_per_s`` on its record and on every
    other ``precision``, ``bytes_per_token`` (its weights read per token) and
    ``of_bound``: tokens/s as a share of bandwidth / bytes_per_token. ``weight_mb`` and
    ``peak_x_weights`` are at the engine's own precision (attnlab's int8 counted as the
    Q8_0 it is). Where an engine ran beside its one-token twin (:mod:`.first_token`):
    ``first_token_ms``, ``decode_tokens_per_s`` and ``decode_of_bound``, the rate of the
    decoding steps after the prompt and its share of the read bound."""
    weights: dict[tuple[str, str], int] = {}
    ceilings = {r["case"]: r for r in records if r["impl"] == CEILING and r.get("median_ms")}
    reads = {r["case"]: r for r in records if r["impl"] == READ and r.get("median_ms")}
    lines: dict[int, str] = {}
    for r in records:
        if "new_tokens" not in r or not r.get("median_ms") or first_token.is_twin(r["impl"]):
            continue
        if r["impl"] == READ:
            r["gb_per_s"] = bandwidth.gb_per_s(bytes_per_token(r["shape"], "f32"),
                                               bandwidth.PASSES, r["median_ms"])
            lines[id(r)] = f"    {r['case']:<34s} {READ:<16s} {r['gb_per_s']:9.1f} GB/s"
            continue
        tokens = r["prompt_len"] if r.get("prefill") else r["batch"] * r["new_tokens"]
        r["tokens_per_s"] = tokens / (r["median_ms"] / 1000.0)
        held = engines.stored_as(r["impl"])
        if (r["shape"], held) not in weights:
            weights[(r["shape"], held)] = weight_bytes(r["shape"], held)
        r["weight_mb"] = weights[(r["shape"], held)] / 2**20
        line = f"    {r['case']:<34s} {r['impl']:<16s} {r['tokens_per_s']:9.1f} tokens/s"
        if r.get("peak_mb") is not None:
            r["peak_x_weights"] = r["peak_mb"] / r["weight_mb"]
            line += (f"  peak {r['peak_mb']:.0f} MB = {r['peak_x_weights']:.2f}x the "
                     f"{r['weight_mb']:.0f} MB of weights")
        ceiling = ceilings.get(r["case"])
        if ceiling is not None and r is not ceiling:
            r["of_ceiling"] = _paired_ratio(ceiling, r)
            line += f"  ({r['of_ceiling']:.0%} of the one-row ceiling)"
        read = reads.get(r["case"])
        if read is not None:
            r["precision"] = engines.precision_of(r["impl"])
            r["bytes_per_token"] = bytes_per_token(r["shape"], engines.stored_as(r["impl"]))
            r["of_bound"] = bandwidth.paired_share(
                read.get("times_ms") or [read["median_ms"]], _read_bytes(r["shape"]),
                r.get("times_ms") or [r["median_ms"]], tokens, r["bytes_per_token"])
            line += f"  ({r['of_bound']:.0%} of the {r['precision']} read bound)"
        if r.get("tokens_agree") is not None and r["impl"] != REFERENCE:
            line += f"  tokens = attnlab's: {r['tokens_agree']}/{r['tokens_checked']}"
        lines[id(r)] = line
    for case in dict.fromkeys(r["case"] for r in records):
        read = reads.get(case)
        first_token.annotate([r for r in records if r["case"] == case], read,
                             _read_bytes(read["shape"]) if read else 0)
    for r in records:
        if id(r) not in lines:
            continue
        if r.get("decode_tokens_per_s") is not None:
            lines[id(r)] += (f"  first token {r['first_token_ms']:.1f} ms, then "
                             f"{r['decode_tokens_per_s']:.1f} tokens/s")
            if r.get("decode_of_bound") is not None:
                lines[id(r)] += f" ({r['decode_of_bound']:.0%} of the bound)"
        log(lines[id(r)])


def _read_bytes(shape: str) -> int:
    """Bytes the read-bandwidth yardstick reads in one round."""
    return bandwidth.PASSES * bytes_per_token(shape, "f32")


def _paired_ratio(ceiling: dict, r: dict) -> float:
    """Median over the rounds of ceiling time / ``r``'s time in that round (the ratio
    of the medians where the rounds are not known)."""
    pairs = list(zip(ceiling.get("times_ms") or [], r.get("times_ms") or []))
    if not pairs or len(ceiling["times_ms"]) != len(r["times_ms"]):
        return ceiling["median_ms"] / r["median_ms"]
    return statistics.median(c / t for c, t in pairs)
