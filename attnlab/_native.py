"""Build and load the native kernel (``attnlab/csrc``) once, with torch's extension tooling.

The C++ sources ship inside the package. The first use (or ``make install``, which
runs :func:`main`, ``python -m attnlab._native --build``) compiles them with ninja into a
directory keyed by the sources, the flags, torch's version and Python's, so a
rebuild happens only when one of them changes:

- ``$ATTNLAB_NATIVE_DIR`` when set;
- else inside the active virtual environment (``<venv>/.attnlab-native/``);
- else the user's cache (``$XDG_CACHE_HOME`` or ``~/.cache``, ``/attnlab/native/``).

If there is no compiler or the build fails, one line on stderr says so (once per
process, with the path of the full log) and attnlab runs its PyTorch paths.
``ATTNLAB_NATIVE=0`` switches the kernel off (tests run both ways).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

ENV_SWITCH = "ATTNLAB_NATIVE"
ENV_DIR = "ATTNLAB_NATIVE_DIR"
LIBRARY = "attnlab_native"  # the TORCH_LIBRARY namespace: torch.ops.attnlab_native
CSRC = Path(__file__).parent / "csrc"
SOURCES = ("flash_attention.cpp", "decode.cpp", "decode_step.cpp", "decode_layers.cpp")
# Portable flags only: the row loops pick AVX-512/AVX2 at load time (target_clones),
# so the cached build is safe on any x86-64 machine; -fopenmp compiles at::parallel_for
# (the runtime is torch's own libgomp, already loaded).
CFLAGS = ["-O3", "-DNDEBUG", "-fopenmp"]

_state: dict = {"ops": None, "reason": None, "tried": False}


_OFF = ("0", "false", "no", "off")


def disabled_reason() -> str | None:
    """Why the kernel is switched off by the environment, or None."""
    switch = os.environ.get(ENV_SWITCH)
    if switch is not None and switch.strip().lower() in _OFF:
        return f"switched off by {ENV_SWITCH}={switch}"
    return None


def build_dir() -> Path:
    """Where the build for these sources, flags, torch and Python lives."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    key = (f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}-"
           f"{platform.machine()}-{digest.hexdigest()[:12]}")
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]) / key
    if sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK):
        return Path(sys.prefix) / ".attnlab-native" / key
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "attnlab" / "native" / key


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def _build(verbose: bool):
    """Compile (or reuse) and load the library; return torch.ops.attnlab_native."""
    from torch.utils import cpp_extension

    if _compiler() is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH")
    if shutil.which("ninja") is None:
        try:  # the ninja wheel (a dependency) puts its binary next to the interpreter
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError as exc:
            raise RuntimeError("ninja is not installed (pip install ninja)") from exc
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=LIBRARY, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=CFLAGS,
        extra_include_paths=[str(CSRC)], build_directory=str(directory),
        is_python_module=False, verbose=verbose,
    )
    return getattr(torch.ops, LIBRARY)


def load(verbose: bool = False):
    """``torch.ops.attnlab_native`` with the kernel, or None where it cannot be had.

    The build is tried once per process; after a failure :func:`unavailable_reason`
    says why and every later call returns None at once.
    """
    if disabled_reason() is not None:
        return None
    if _state["ops"] is not None:
        return _state["ops"]
    if not _state["tried"]:
        _state["tried"] = True
        try:
            _state["ops"] = _build(verbose)
        except Exception as exc:  # no compiler, a failed build, a broken cache: say it once
            detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            _state["reason"] = f"the build failed ({detail})"
            log = _write_log(exc)
            where = f"; log: {log}" if log else ""
            print(f"attnlab: native attention kernel unavailable: {_state['reason']}{where}; "
                  "using the PyTorch paths", file=sys.stderr)
    return _state["ops"]


def _write_log(exc: Exception) -> Path | None:
    try:
        path = build_dir() / "build-error.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{type(exc).__name__}: {exc}\n")
        return path
    except OSError:
        return None


def for_inference(*tensors: torch.Tensor | None):
    """The ops when ``tensors`` (None entries skipped) can take the inference-only
    kernels: gradients off, float32 on the CPU, the kernel built. Else None."""
    if torch.is_grad_enabled():
        return None
    for t in tensors:
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"):
            return None
    return load()


def available() -> bool:
    """True when the kernel is built, loaded and not switched off."""
    return load() is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    if disabled_reason() is not None:
        return disabled_reason()
    return None if load() is not None else _state["reason"]


def main(argv: list[str] | None = None) -> int:
    """``python -m attnlab._native --build``: build now; never fails an install."""
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--build"]):
        print("usage: python -m attnlab._native [--build]", file=sys.stderr)
        return 2
    if load(verbose=False) is not None:
        print(f"attnlab: native attention kernel ready ({build_dir()})")
    elif disabled_reason() is not None:
        print(f"attnlab: native attention kernel {disabled_reason()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
