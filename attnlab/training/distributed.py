"""Training under ``torchrun``: the device of this rank, joining and leaving the group,
the mean of a value across ranks."""

from __future__ import annotations

import os

import torch


def train_device() -> torch.device:
    """Where a CLI run trains: under torchrun with GPUs, this process's own GPU
    (``LOCAL_RANK``); otherwise the CPU, as before."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _dist_setup(device: torch.device) -> tuple[int, int, bool]:
    """Join the torchrun group: nccl for a model on a GPU, gloo for one on the CPU.
    Returns (rank, world size, whether this call created the group)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, False
    import torch.distributed as dist

    if device.type == "cuda":
        # nccl binds each rank to the current device; without this every rank
        # would talk through cuda:0.
        torch.cuda.set_device(device)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world, created


def _leave_group(wait: bool) -> None:
    """Leave the group ``_dist_setup`` created; after a finished run (``wait``), once
    gloo's worker threads are idle.

    A gloo worker frees each collective's work item right after running it; when that
    drops the last reference to a tensor Python has seen (DDP's, ours), freeing it
    takes the GIL. If the main thread was already finalising the interpreter, the
    worker was unwound there and the rank aborted ("terminate called without an
    active exception", exit status -6: about one two-rank run in 15 here). The
    barrier returns once every queued collective has run, and waits with the GIL
    released, so the workers finish freeing before this process goes on to exit."""
    import torch.distributed as dist

    if wait:
        dist.barrier()
    dist.destroy_process_group()


def _mean_across(value: torch.Tensor, world: int) -> float:
    value = value.detach()
    if world > 1:
        import torch.distributed as dist

        value = value.clone()
        dist.all_reduce(value)
        value /= world
    return float(value)
