"""A benchmark step in a process of its own, run on request: how the peers are timed.

A peer runs in its own process, as it would in use, rather than beside torch: llama.cpp's
CPU backend and torch's wheel both link ``libgomp.so.1`` and the loader gives them one
OpenMP runtime in one process, which slowed llama.cpp's decoding 3-20x here; ONNX
Runtime's and OpenVINO's thread pools would spin beside torch's. :func:`spawn` starts
``python -m attnlab.bench.worker FACTORY``, which builds the step and runs it each time
the returned :class:`Remote` is called; the caller times the call (a pipe's round trip,
tens of microseconds, is in it). The first call returns the step's output (what the
case's check compares); later calls return None. The memory probe needs nothing of
this: it already builds the step in a fresh process.

Protocol, one line each way: the worker says ``ready`` once built (or ``error: ...``);
then the parent writes ``run`` (``run+output`` for the output as JSON) and the worker
answers ``done`` or a JSON line; ``exit`` or the end of its input stops it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from .factory import Factory, build


class Remote:
    """A step running in a worker process; call it to run once, ``close()`` to stop it."""

    def __init__(self, factory: Factory):
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by close())
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, json.dumps(list(factory))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
            bufsize=1)
        self._first = True
        answer = self._proc.stdout.readline().strip()
        if answer != "ready":
            self.close()
            raise RuntimeError(answer or f"worker exited: {self._tail()}")

    def __call__(self) -> Any:
        want = self._first
        self._first = False
        self._proc.stdin.write("run+output\n" if want else "run\n")
        self._proc.stdin.flush()
        answer = self._proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"worker exited: {self._tail()}")
        if answer.startswith("error: "):
            raise RuntimeError(answer[7:].strip())
        return json.loads(answer) if want else None

    def _tail(self) -> str:
        self._stderr.seek(0)
        lines = self._stderr.read().strip().splitlines()
        return lines[-1] if lines else "no message"

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write("exit\n")
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()


def spawn(factory: Factory) -> Remote:
    """Build ``factory``'s step in a new worker process and return its handle."""
    return Remote(factory)


def _jsonable(output: Any) -> Any:
    """A step's output as JSON: tensors and arrays as nested lists."""
    if hasattr(output, "tolist"):
        return output.tolist()
    if isinstance(output, (list, tuple)):
        return [_jsonable(o) for o in output]
    return output


def main(argv: list[str]) -> int:
    # The protocol keeps the pipe to itself: whatever the peer prints, from Python or
    # from its C++ library straight to file descriptor 1, goes to stderr instead.
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        step = build(tuple(json.loads(argv[0])))
    except Exception as exc:  # the parent reports it as this peer's skip reason
        out.write(f"error: {type(exc).__name__}: {exc}".replace("\n", " ")[:300] + "\n")
        out.flush()
        return 1
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        command = line.strip()
        if command not in ("run", "run+output"):
            break
        try:
            result = step()
        except Exception as exc:
            out.write(f"error: {type(exc).__name__}: {exc}".replace("\n", " ")[:300] + "\n")
        else:
            out.write(json.dumps(_jsonable(result)) + "\n" if command == "run+output"
                      else "done\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
