"""Busy neighbours for ``attnlab bench --under-load``: one spinning process per core.

Users' CPUs run other work. A kernel with several parallel regions per call waits at
each barrier for its slowest thread, and a thread the OS has descheduled for a busy
neighbour is very slow; so a kernel can win on a quiet machine and lose on a busy
one. :func:`busy` starts ``n`` processes that spin on floating-point arithmetic,
waits until each one runs, and stops them all when the ``with`` block ends, however
it ends (an exception, Ctrl-C). A child also stops by itself once its parent is gone
(it polls ``getppid``), so not even a killed bench leaves one spinning.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# The child: say it is running, then spin until the parent that started it is gone.
# The marker in argv lets a test (or a person with ps) find them.
MARKER = "attnlab-bench-busy"
_SPIN = (
    "import os, sys\n"
    "parent = int(sys.argv[1])\n"
    "sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdout.close()\n"
    "x = 1.0\n"
    "while os.getppid() == parent:\n"
    "    for _ in range(200000):\n"
    "        x = x * 1.0000001 + 1e-9\n"
)


def cores() -> int:
    """The cores this process may run on (its affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@contextmanager
def busy(n: int | None = None) -> Iterator[list[subprocess.Popen]]:
    """Run the block beside ``n`` spinning processes (default: one per core)."""
    n = cores() if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n (busy processes) must be an int >= 0, got {n!r}")
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _SPIN, str(os.getpid()), MARKER],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL))
        for p in procs:  # each has started spinning before the case is timed
            p.stdout.readline()
            p.stdout.close()
        yield procs
    finally:
        stop(procs)


def stop(procs: list[subprocess.Popen], timeout: float = 5.0) -> None:
    """Terminate, then kill what is left, and reap every one (no zombies)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
