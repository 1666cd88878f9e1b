"""``attnlab bench --suite generate``: tokens per second and peak memory of greedy decoding,
against ``transformers`` ``generate`` on the same weights, and against the practical
ceiling of one-sequence decoding on this machine.

Greedy decoding of ``new_tokens`` (128) after a ``prompt_len`` (32) token prompt.
Models: a tiny Llama (hidden 256, 4 layers, 8 heads, 2 kv heads, vocab 1024),
a GPT-2-small-shaped GPT (~124M) and a SmolLM-135M-shaped Llama (hidden 576,
30 layers, 9 heads, 3 kv heads, vocab 49152, tied). Each shape is written once,
randomly initialised, as a ``save_pretrained`` safetensors folder in the temp
dir; attnlab (``GPT.from_hf(folder)``) and transformers (``from_pretrained``) both
load that folder, in this process for timing and in a fresh process for memory.

The ceiling (``one-row ceiling``, batch 1): a loop that only multiplies a row by
every weight matrix of the model once per token, each in whichever layout
(``(in, out)`` or ``(out, in)``) and by whichever product (torch's matmul, or
attnlab's streamed row product where the native kernel is built) is fastest here,
timed in the same rounds as the models. Decoding must at least read every weight
once per token, so ``of_ceiling`` (tokens/s over the loop's) says how much of the
machine's speed a decoder reaches. It is the median over the rounds of each round's
ratio: the two ran a second apart in that round, while this machine's speed drifts
by 20-30% over minutes, which a ratio of the two medians would take in.

Memory baseline: the probe (``runner.measure_memory``) subtracts the RSS after
importing this module, which imports torch, transformers and attnlab's models.
Whatever loading a model imports later (torch's Python decompositions, about
70 MB, if a random initialisation runs on the meta device) counts against it.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from .. import _native
from .runner import Case, Impl

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers as T  # noqa: E402

from ..models import GPT  # noqa: E402

MOD = __name__
# The peer whose time the Markdown table divides by.
BASELINE = "transformers"
CEILING = "one-row ceiling"
PROMPT_LEN = 32
NEW_TOKENS = 128

SHAPES = {
    "tiny-llama": dict(kind="llama", vocab_size=1024, hidden_size=256, intermediate_size=688,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                       tie_word_embeddings=False),
    "smollm-135m": dict(kind="llama", vocab_size=49152, hidden_size=576,
                        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3, tie_word_embeddings=True),
    "gpt2-124m": dict(kind="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12),
}


def hf_model(shape: str):
    """A randomly initialised transformers model of the named shape (no download)."""
    spec = dict(SHAPES[shape])
    kind = spec.pop("kind")
    torch.manual_seed(0)
    if kind == "llama":
        cfg = T.LlamaConfig(max_position_embeddings=1024, bos_token_id=0, eos_token_id=0,
                            pad_token_id=0, **spec)
        model = T.LlamaForCausalLM(cfg)
    else:
        cfg = T.GPT2Config(n_positions=1024, bos_token_id=0, eos_token_id=0, **spec)
        model = T.GPT2LMHeadModel(cfg)
    return model.eval()


def folder(shape: str) -> Path:
    """The shape's ``save_pretrained`` folder in the temp dir, written on first use."""
    path = Path(tempfile.gettempdir()) / f"attnlab-bench-{shape}-tf{T.__version__}"
    if not (path / "model.safetensors").is_file():
        part = Path(tempfile.mkdtemp(prefix=path.name + "-", dir=path.parent))
        hf_model(shape).save_pretrained(part)
        try:
            part.rename(path)
        except OSError:  # written meanwhile by another process: keep that one
            shutil.rmtree(part, ignore_errors=True)
    return path


def weight_bytes(shape: str) -> int:
    """Bytes of the weights as stored (a tied output layer once)."""
    from ..layouts.hf import read_folder

    _, state = read_folder(folder(shape))
    total = 0
    for shp, dtype in state.shapes().values():
        n = 1
        for d in shp:
            n *= d
        total += n * torch.empty((), dtype=dtype).element_size()
    return total


def make_step(impl: str, shape: str, batch: int, new_tokens: int = NEW_TOKENS,
              prompt_len: int = PROMPT_LEN):
    """A step generating ``new_tokens`` greedily for a batch of random prompts."""
    path = folder(shape)
    prompt = torch.randint(1, 1000, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    if impl.startswith("attnlab"):
        model = GPT.from_hf(path)
        use_cache = impl == "attnlab"

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


def _matrix_shapes(shape: str) -> list[tuple[int, int]]:
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


# The ways to multiply a row by a matrix the ceiling chooses from: (product, layout).
# "torch" is torch's matmul (the BLAS it links); "attnlab" is the native streamed
# product (csrc/row_product.h) that attnlab's decoding uses where it is built.
WAYS = [(product, layout) for product in ("torch", "attnlab")
        for layout in ("(in, out)", "(out, in)")]


def _product(way: tuple[str, str], n_in: int, n_out: int):
    """A row times a new random ``n_in x n_out`` matrix, multiplied and stored ``way``."""
    import torch.nn.functional as F

    product, layout = way
    w = torch.randn(n_out, n_in) * 0.02
    if layout == "(in, out)":
        wt = w.t().contiguous()
        w = wt.t()  # the (out, in) weight as a view of the (in, out) storage
        if product == "torch":
            return lambda x: x @ wt
    if product == "attnlab":
        ops = _native.load()
        return lambda x: ops.linear(x, w, None, None)
    return lambda x: F.linear(x, w)


def _faster(n_in: int, n_out: int, reps: int = 7) -> tuple[str, str]:
    """The product and layout that multiply a row by an ``n_in x n_out`` matrix fastest
    here, timed as decoding meets it: streamed from memory, not from a cache that holds
    it. Each way is timed over enough distinct matrices to exceed the caches (64 MB)."""
    import time

    count = max(2, min(64, (64 << 20) // (4 * n_in * n_out)))
    x = torch.randn(1, n_in)
    best = {}
    for way in WAYS:
        if way[0] == "attnlab" and not _native.available():
            continue
        products, ts = [_product(way, n_in, n_out) for _ in range(count)], []
        for _ in range(reps):
            start = time.perf_counter()
            for f in products:
                f(x)
            ts.append(time.perf_counter() - start)
        best[way] = sorted(ts)[reps // 2]
        del products
    return min(best, key=best.get)


def make_ceiling(shape: str, new_tokens: int = NEW_TOKENS, **_):
    """The one-row ceiling: per token, a row times every weight matrix (random weights
    of the model's shapes, one matrix each, each in its faster layout)."""
    chosen: dict[tuple[int, int], tuple[str, str]] = {}
    products = []
    for n_in, n_out in _matrix_shapes(shape):
        if (n_in, n_out) not in chosen:
            chosen[(n_in, n_out)] = _faster(n_in, n_out)
        products.append((_product(chosen[(n_in, n_out)], n_in, n_out), torch.randn(1, n_in)))

    @torch.inference_mode()
    def step():
        for _ in range(new_tokens):
            for f, x in products:
                f(x)
    return step


def _case(shape, batch, impls, repeats, new_tokens):
    out = [Impl(i, (MOD, "make_step", {"impl": i, "shape": shape, "batch": batch,
                                        "new_tokens": new_tokens})) for i in impls]
    if batch == 1:
        out.append(Impl(CEILING, (MOD, "make_ceiling", {"shape": shape,
                                                         "new_tokens": new_tokens}),
                        memory=False))
    return Case("generate", f"{shape} B={batch} +{new_tokens} tokens", out, repeats=repeats,
                extra={"batch": batch, "new_tokens": new_tokens, "shape": shape})


def cases(quick: bool = False) -> list[Case]:
    if quick:
        return [_case("tiny-llama", 1, ["attnlab", "attnlab-nocache", "transformers"], 3, 32)]
    out = []
    for batch in (1, 8):  # a second each: nine repeats steady the median on a busy machine
        out.append(_case("tiny-llama", batch, ["attnlab", "attnlab-nocache", "transformers"],
                         9, NEW_TOKENS))
    # (no-cache decoding of GPT-2 is left out: about half a minute a step, the tiny
    # model shows what the cache is worth)
    # Batch 1 is what the one-row ceiling bounds: five rounds for a steadier median.
    out.append(_case("gpt2-124m", 1, ["attnlab", "transformers"], 5, NEW_TOKENS))
    out.append(_case("gpt2-124m", 8, ["attnlab", "transformers"], 2, NEW_TOKENS))
    for batch in (1, 8):
        out.append(_case("smollm-135m", batch, ["attnlab", "transformers"], 5 if batch == 1 else 3,
                         NEW_TOKENS))
    return out


def annotate(records: list[dict], log=print) -> None:
    """Add ``tokens_per_s`` to every record, ``weight_mb`` (the weights as stored) and
    ``peak_x_weights`` beside each peak, and for batch 1 ``of_ceiling``: tokens/s as a
    share of the one-row ceiling's in the same case."""
    weights: dict[str, int] = {}
    ceilings = {r["case"]: r for r in records if r["impl"] == CEILING and r.get("median_ms")}
    for r in records:
        if "new_tokens" not in r or not r.get("median_ms"):
            continue
        r["tokens_per_s"] = r["batch"] * r["new_tokens"] / (r["median_ms"] / 1000.0)
        if r["shape"] not in weights:
            weights[r["shape"]] = weight_bytes(r["shape"])
        r["weight_mb"] = weights[r["shape"]] / 2**20
        line = f"    {r['case']:<34s} {r['impl']:<16s} {r['tokens_per_s']:9.1f} tokens/s"
        if r.get("peak_mb") is not None:
            r["peak_x_weights"] = r["peak_mb"] / r["weight_mb"]
            line += (f"  peak {r['peak_mb']:.0f} MB = {r['peak_x_weights']:.2f}x the "
                     f"{r['weight_mb']:.0f} MB of weights")
        ceiling = ceilings.get(r["case"])
        if ceiling is not None and r is not ceiling:
            r["of_ceiling"] = _paired_ratio(ceiling, r)
            line += f"  ({r['of_ceiling']:.0%} of the one-row ceiling)"
        log(line)


def _paired_ratio(ceiling: dict, r: dict) -> float:
    """Median over the rounds of ceiling time / ``r``'s time in that round (the ratio
    of the medians where the rounds are not known)."""
    pairs = list(zip(ceiling.get("times_ms") or [], r.get("times_ms") or []))
    if not pairs or len(ceiling["times_ms"]) != len(r["times_ms"]):
        return ceiling["median_ms"] / r["median_ms"]
    return statistics.median(c / t for c, t in pairs)


def summary_table(records: list[dict]) -> str:
    """Markdown: per case, attnlab's and transformers' tokens/s, their peaks over the
    weights' bytes, and attnlab's share of the ceiling and of transformers' speed
    (empty where no case has both)."""
    lines = ["| case | attnlab | transformers | peak / weights (attnlab, transformers) "
             "| attnlab: share of the ceiling, x transformers' tokens/s |",
             "|---|---:|---:|---:|---:|"]
    for case in dict.fromkeys(r["case"] for r in records):
        by_impl = {r["impl"]: r for r in records if r["case"] == case}
        ours, peer = by_impl.get("attnlab", {}), by_impl.get(BASELINE, {})
        if not ours.get("tokens_per_s") or not peer.get("tokens_per_s"):
            continue
        peaks = ", ".join("-" if r.get("peak_x_weights") is None else f"{r['peak_x_weights']:.2f}x"
                          for r in (ours, peer))
        share = "-" if ours.get("of_ceiling") is None else f"{ours['of_ceiling']:.0%}"
        name = case.split(" +")[0]
        lines.append(f"| {name} | {ours['tokens_per_s']:.1f} tok/s | {peer['tokens_per_s']:.1f} "
                     f"tok/s | {peaks} ({ours['weight_mb']:.0f} MB) | {share}, "
                     f"{ours['tokens_per_s'] / peer['tokens_per_s']:.2f}x |")
    return "\n".join(lines) if len(lines) > 2 else ""
