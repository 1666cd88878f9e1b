"""``attnlab bench --suite encode``: MiniLM sentence embeddings, attnlab against
sentence-transformers on the same bundled weights, batch 32."""

from __future__ import annotations

import os
import random

from .runner import Case, Impl

MOD = __name__
# The peer whose time the Markdown table divides by.
BASELINE = "sentence-transformers"
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


def make_step(impl: str, n: int, batch_size: int = 32):
    texts = sentences(n)
    if impl == "attnlab":
        from ..interop import minilm

        minilm.load()
        return lambda: minilm.embed(texts, batch_size=batch_size)
    if impl == "sentence-transformers":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        from ..interop.minilm import model_path

        model = SentenceTransformer(str(model_path()), device="cpu")
        return lambda: model.encode(texts, batch_size=batch_size, convert_to_tensor=True)
    raise ValueError(f"unknown impl {impl!r}")


def cases(quick: bool = False) -> list[Case]:
    sizes = [256] if quick else [256, 512]
    return [Case("encode", f"{n} sentences B=32",
                 [Impl(i, (MOD, "make_step", {"impl": i, "n": n}))
                  for i in ("attnlab", "sentence-transformers")],
                 repeats=3 if quick else 7, extra={"sentences": n})
            for n in sizes]
