"""The tests' thread count switch: ``with threads(n):`` runs a block with n OpenMP threads
and restores the count after it, whatever the block raises."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
