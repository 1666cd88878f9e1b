"""``attnlab bench --suite encode``: MiniLM sentence embeddings, batch 32, attnlab against
sentence-transformers on the same bundled weights (attnlab also with bf16 weights), and,
where installed (``pip install 'attnlab[peers]'``), ONNX Runtime and OpenVINO (float32 and
bf16) on the same weights exported to ONNX (:mod:`.encode_peers`, each timed in a process
of its own). Every engine's embeddings are checked against sentence-transformers':
``min_cosine`` is the lowest cosine similarity over the sentences (the target is 0.9999 in
float32)."""

from __future__ import annotations

import os
import random
from functools import partial

from . import peers
from .runner import Case, Impl

MOD = __name__
# The peer whose time the Markdown table divides by, and whose embeddings the others'
# are checked against.
BASELINE = "sentence-transformers"
# The optional peers: (name, what peers.missing needs).
PEERS = (("onnxruntime", "onnxruntime"), ("openvino", "openvino"), ("openvino bf16", "openvino"))
# attnlab's embeddings at each precision of ``minilm.embed``: the name of its row, the
# precision.
ATTNLAB = {"attnlab": "float32", "attnlab bf16": "bfloat16"}
WORDS = [
    "attention", "model", "token", "query", "key", "value", "head", "layer", "weight",
    "softmax", "sequence", "the", "a", "of", "to", "in", "is", "on", "for", "with", "cat",
    "dog", "sat", "mat", "quick", "brown", "fox", "lazy", "jumps",
]


def sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` short sentences of 4-16 words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))).capitalize() + "."
            for _ in range(n)]


def preload() -> None:
    """The libraries the steps import (the memory probe's baseline is taken after them,
    as the other suites take theirs): each engine's peak is its embedding's, not its
    imports' (sentence-transformers' alone are about 400 MB)."""
    import contextlib

    from ..interop import minilm  # noqa: F401 (torch, the tokenizer, the native kernel)

    with contextlib.suppress(ImportError):
        import sentence_transformers  # noqa: F401


def make_step(impl: str, n: int, batch_size: int = 32):
    texts = sentences(n)
    if impl in ATTNLAB:
        from ..interop import minilm

        minilm.load(ATTNLAB[impl])
        return lambda: minilm.embed(texts, batch_size=batch_size, precision=ATTNLAB[impl])
    if impl == "sentence-transformers":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        from ..interop.minilm import model_path

        model = SentenceTransformer(str(model_path()), device="cpu")
        return lambda: model.encode(texts, batch_size=batch_size, convert_to_tensor=True)
    raise ValueError(f"unknown impl {impl!r}")


def check_cosine(outputs: dict, reference: str = BASELINE) -> dict[str, dict]:
    """``min_cosine`` of every engine's embeddings against ``reference``'s, row by row
    (nothing where the reference did not run)."""
    import torch

    if outputs.get(reference) is None:
        return {}
    ref = torch.as_tensor(outputs[reference], dtype=torch.float64)
    out = {}
    for name, emb in outputs.items():
        emb = torch.as_tensor(emb, dtype=torch.float64)
        if emb.shape != ref.shape:
            raise ValueError(f"{name}'s embeddings must be {tuple(ref.shape)}, got "
                             f"{tuple(emb.shape)}")
        cos = torch.nn.functional.cosine_similarity(emb, ref, dim=1)
        out[name] = {"min_cosine": float(cos.min())}
    return out


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def cases(quick: bool = False) -> list[Case]:
    sizes = [256] if quick else [256, 512]
    out = []
    for n in sizes:
        impls = [Impl(i, (MOD, "make_step", {"impl": i, "n": n}))
                 for i in (*ATTNLAB, "sentence-transformers")]
        impls += [Impl(name, ("attnlab.bench.encode_peers", "make_step",
                              {"engine": name, "texts": sentences(n), "threads": _threads()}),
                       isolated=True)
                  for name, needs in PEERS if not quick and peers.missing(needs) is None]
        out.append(Case("encode", f"{n} sentences B=32", impls, repeats=3 if quick else 7,
                        extra={"sentences": n}, check=partial(check_cosine)))
    return out


def prologue(log=print, quick: bool = False) -> None:
    """One line for each peer that cannot run here (left out of every case), and with
    ``quick`` one for the installed peers that it leaves out."""
    for line in peers.skip_lines(list(dict.fromkeys(needs for _, needs in PEERS))):
        log(line)
    left = [name for name, needs in PEERS if peers.missing(needs) is None]
    if quick and left:
        log(f"--quick: {', '.join(left)} left out (timed without --quick)")


def annotate(records: list[dict], log=print) -> None:
    """Log each engine's lowest cosine against sentence-transformers' embeddings."""
    for r in records:
        if r.get("min_cosine") is not None and r["impl"] != BASELINE:
            log(f"    {r['case']:<24s} {r['impl']:<22s} min cosine to {BASELINE}'s "
                f"embeddings: {r['min_cosine']:.7f}")


def summary_table(records: list[dict]) -> str:
    """Markdown: a row per engine in each case that has a peer beyond sentence-transformers:
    time, speed over attnlab's (above 1: faster than attnlab), lowest cosine to
    sentence-transformers' embeddings, peak memory."""
    lines = ["| case | engine | median | speed x attnlab | min cosine to "
             f"{BASELINE} | peak MB |", "|---|---|---:|---:|---:|---:|"]
    for case in dict.fromkeys(r["case"] for r in records):
        rows = [r for r in records if r["case"] == case and r.get("median_ms")]
        if all(r["impl"] in ("attnlab", BASELINE) for r in rows):
            continue
        ours = next((r for r in rows if r["impl"] == "attnlab"), None)
        for r in rows:
            speed = f"{ours['median_ms'] / r['median_ms']:.2f}x" if ours else "-"
            cos = f"{r['min_cosine']:.7f}" if r.get("min_cosine") is not None else "-"
            peak = f"{r['peak_mb']:.0f}" if r.get("peak_mb") is not None else "-"
            lines.append(f"| {case} | {r['impl']} | {r['median_ms']:.1f} ms | {speed} | {cos} "
                         f"| {peak} |")
    return "\n".join(lines) if len(lines) > 2 else ""
