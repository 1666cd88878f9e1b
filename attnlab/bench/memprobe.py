"""Run one benchmark step in a fresh process and print its peak memory in MB.

``python -m attnlab.bench.memprobe '["module", "function", {kwargs}]'``

Prints the RSS high-water mark (VmHWM) above the RSS measured after imports (and the
module's ``preload()``, where it has one): what building the inputs and running the step
once added at its worst.
"""

from __future__ import annotations

import json
import sys


def _status_mb(field: str) -> float:
    # VmHWM belongs to this address space; ru_maxrss would not do: Linux carries it
    # over fork and exec, so a probe started by a big parent inherits its peak.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"{field} not found in /proc/self/status")


def main(argv: list[str]) -> int:
    module, function, kwargs = json.loads(argv[0])
    import importlib

    from .factory import build

    # Imports, and the libraries the module's ``preload`` loads, are not part of the
    # step's memory.
    preload = getattr(importlib.import_module(module), "preload", None)
    if preload is not None:
        preload()

    baseline = _status_mb("VmRSS")
    step = build((module, function, kwargs))
    step()
    peak = _status_mb("VmHWM")
    print(f"{max(0.0, peak - baseline):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
