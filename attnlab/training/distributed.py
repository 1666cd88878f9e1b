"""Training under ``torchrun``: the device of this rank, joining and leaving the group,
the mean of a value across ranks, and context parallelism (one sequence split over
several ranks)."""

from __future__ import annotations

import os
import sys

import torch


def launch_env(name: str, default: int) -> int:
    """The whole number torchrun puts in the environment variable ``name`` (``WORLD_SIZE``,
    ``RANK``, ``LOCAL_RANK``), ``default`` where it is unset; a clear error where it holds
    something else (set by hand, or left over from another launcher)."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise ValueError(f"the environment variable {name}={value!r} must be a whole number "
                         "0 or more (torchrun sets it); unset it to run in one process")
    return number


def world_size() -> int:
    """How many processes torchrun started (1 without torchrun)."""
    return max(1, launch_env("WORLD_SIZE", 1))


def train_device() -> torch.device:
    """Where a CLI run trains: under torchrun with a GPU for each process of this machine,
    this process's own GPU (``LOCAL_RANK``); otherwise the CPU, as before.

    With more processes on the machine than GPUs it sees (two processes on a one-GPU
    laptop) the ranks past the last GPU would ask for a device that does not exist, and
    the ranks must agree on one backend (nccl or gloo): every rank then trains on the
    CPU, and local rank 0 says so in one line. A process that sees one GPU because its
    launcher gave it one (``CUDA_VISIBLE_DEVICES`` set, per process) trains on it. (The
    rule reads this machine alone: machines of a run with different GPU counts must be
    launched alike by the user.)"""
    if world_size() <= 1 or not torch.cuda.is_available():
        return torch.device("cpu")
    local = launch_env("LOCAL_WORLD_SIZE", world_size())
    gpus = torch.cuda.device_count()
    if gpus == 1 and os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        return torch.device("cuda", 0)  # this process's own GPU, chosen by its launcher
    if local > gpus:
        if launch_env("LOCAL_RANK", 0) == 0:
            print(f"attnlab: {local} processes on this machine but {gpus} CUDA device"
                  f"{'s' if gpus != 1 else ''}: training on the CPU (gloo)", file=sys.stderr)
        return torch.device("cpu")
    return torch.device("cuda", launch_env("LOCAL_RANK", 0))


def _dist_setup(device: torch.device) -> tuple[int, int, bool]:
    """Join the torchrun group: nccl for a model on a GPU, gloo for one on the CPU.
    Returns (rank, world size, whether this call created the group)."""
    world = world_size()
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


# Set once this process has left a group: its worker threads live on (see _leave_group).
_THREADS_LEFT = False


def _leave_group(wait: bool) -> None:
    """Leave the group ``_dist_setup`` created; after a finished run (``wait``), once
    every queued collective has run.

    A gloo worker frees each collective's work item right after running it; when that
    drops the last reference to a tensor Python has seen, freeing it takes the GIL. If
    the main thread is already finalising the interpreter then, the worker is unwound
    and the rank aborts ("terminate called without an active exception", exit status
    -6). The barrier (GIL released) makes that rare, not impossible: a worker can still
    be between finishing a collective and freeing it, and the group's threads are never
    joined, since torch 2.13's DistributedDataParallel keeps the group alive after
    ``destroy_process_group``. So the CLI ends such a process without finalising
    (:func:`attnlab.cli.run`), as ``threads_left()`` tells it to."""
    import torch.distributed as dist

    global _THREADS_LEFT
    if wait:
        dist.barrier()
    dist.destroy_process_group()
    _THREADS_LEFT = True


def threads_left() -> bool:
    """Whether this process left a torchrun group whose worker threads outlive it, so
    that it should end with ``os._exit`` once its output is flushed."""
    return _THREADS_LEFT


def _mean_across(value: torch.Tensor, world: int, group=None) -> float:
    value = value.detach()
    if world > 1:
        import torch.distributed as dist

        value = value.clone()
        dist.all_reduce(value, group=group)
        value /= world
    return float(value)


def context_split(model, world: int, rank: int, size: int, seq_len: int):
    """The :class:`~attnlab.distributed.ContextParallel` of this rank when each sequence
    is split over ``size`` consecutive ranks (``size`` 1: None). Each split gets its own
    group, apart from the default group DistributedDataParallel reduces over, so the
    ring's messages never meet the gradient reductions. Data parallelism runs across the
    ``world // size`` splits."""
    from ..checks import positive_int

    positive_int("context_parallel", size)
    if size == 1:
        return None
    if world % size:
        raise ValueError(f"--context-parallel {size} must divide the number of processes "
                         f"({world}): run it under torchrun --nproc_per_node {size} (or a "
                         "multiple of it)")
    if not hasattr(model, "context_parallel"):
        raise ValueError(f"--context-parallel needs a model that can split its sequence "
                         f"(--model gpt), got {type(model).__name__}")
    import torch.distributed as dist

    from ..distributed import ContextParallel

    groups = [dist.new_group(list(range(start, start + size)))  # every rank makes every group
              for start in range(0, world, size)]
    return ContextParallel(groups[rank // size], layout="zigzag", seq_len=seq_len)
