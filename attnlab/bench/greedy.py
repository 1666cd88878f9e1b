"""Checking engines' greedy tokens against a reference engine's, in the same case.

Greedy decoding from the same weights and prompt should give the same tokens; a lower
precision (bf16, int8) may part from float32 after a while, where two candidates' logits
are close. What counts is how long they agree: the tokens before the first that differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def new_tokens_of(output, new_tokens: int) -> list[int]:
    """The last ``new_tokens`` ids of what a step returned (attnlab and transformers return
    prompt and continuation, ``(1, prompt + new)``; the peers the continuation)."""
    ids = torch.as_tensor(output).reshape(-1)
    if ids.numel() < new_tokens:
        raise ValueError(f"output must hold at least {new_tokens} tokens, got {ids.numel()}")
    return [int(t) for t in ids[-new_tokens:]]


def agreeing(reference: Sequence[int], tokens: Sequence[int]) -> int:
    """How many of ``tokens`` equal ``reference``'s before the first that differs."""
    n = 0
    for a, b in zip(reference, tokens):
        if a != b:
            break
        n += 1
    return n


def check(outputs: dict, *, reference: str, new_tokens: int) -> dict[str, dict]:
    """``{impl: {"tokens_agree": n, "tokens_checked": new_tokens}}`` for every output
    that is not None, against ``reference``'s (nothing where the reference did not run)."""
    if outputs.get(reference) is None:
        return {}
    ref = new_tokens_of(outputs[reference], new_tokens)
    return {name: {"tokens_agree": agreeing(ref, new_tokens_of(out, new_tokens)),
                   "tokens_checked": new_tokens}
            for name, out in outputs.items() if out is not None}
