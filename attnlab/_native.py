"""Build and load the native kernel (``attnlab/csrc``) once, with torch's extension tooling.

The C++ sources ship inside the package. The first use (or ``make install``, which
runs :func:`main`, ``python -m attnlab._native --build``) compiles them with ninja into a
directory keyed by the sources, the flags, torch's version and Python's, so a
rebuild happens only when one of them changes:

- ``$ATTNLAB_NATIVE_DIR`` when set;
- else inside the active virtual environment (``<venv>/.attnlab-native/``);
- else the user's cache (``$XDG_CACHE_HOME`` or ``~/.cache``, ``/attnlab/native/``).

A start never waits on a file another process may have left behind. A finished build
is one file, ``<key>/attnlab_native.so``, published by an atomic rename from a private
temporary folder where it was compiled, so a killed build is never used; a start that
finds it loads it with no lock at all. Only a start that must build takes an OS lock
(``<key>/build.lock``, released by the kernel when its holder dies, so it cannot go
stale); a second process waits for the first's build at most ``$ATTNLAB_NATIVE_WAIT``
seconds (600), saying so in one line. Threads of one process share one load.

If there is no compiler, the build fails or the wait runs out, one line on stderr says
so (once per process, with the path of the full log) and attnlab runs its PyTorch paths.
``ATTNLAB_NATIVE=0`` switches the kernel off (tests run both ways).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from . import _fakes

try:
    import fcntl
except ImportError:  # not POSIX: no lock; the private folders keep it correct, if slower
    fcntl = None  # type: ignore[assignment]

ENV_SWITCH = "ATTNLAB_NATIVE"
ENV_DIR = "ATTNLAB_NATIVE_DIR"
ENV_WAIT = "ATTNLAB_NATIVE_WAIT"
WAIT_S = 600.0  # a fresh build takes ~3 min on two cores
LIBRARY = "attnlab_native"  # the TORCH_LIBRARY namespace: torch.ops.attnlab_native
CSRC = Path(__file__).parent / "csrc"
SOURCES = ("flash_attention.cpp", "decode.cpp", "decode_step.cpp", "decode_layers.cpp",
           "products.cpp")
# Portable flags only: the vector loops pick AVX-512/AVX2 at load time (csrc/vec.h),
# so the cached build is safe on any x86-64 machine; -fopenmp compiles at::parallel_for
# (the runtime is torch's own libgomp, already loaded).
CFLAGS = ["-O3", "-DNDEBUG", "-fopenmp"]

_state: dict = {"ops": None, "reason": None, "tried": False, "faked": False}
_first_load = threading.Lock()  # the other threads wait for the first one's load

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


def _wait_s() -> float:
    try:
        return max(0.0, float(os.environ.get(ENV_WAIT, WAIT_S)))
    except ValueError:
        return WAIT_S


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Hold ``<directory>/build.lock`` (flock: the kernel drops it when its holder dies).
    Wait for a live holder at most ``_wait_s()`` seconds, saying once what for."""
    if fcntl is None:
        yield
        return
    path = directory / "build.lock"
    with open(path, "a+") as f:
        deadline, said = time.monotonic() + _wait_s(), False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "?"
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"waited {_wait_s():g} s for process {holder} building "
                                       f"it in {directory} (lock {path})") from None
                if not said:
                    said = True
                    print(f"attnlab: waiting up to {_wait_s():g} s for process {holder}, which "
                          f"is building the native kernel in {directory}", file=sys.stderr)
                time.sleep(0.1)
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))  # who holds it, for the waiters' line
        f.flush()
        yield  # closing the file (or dying) releases the lock


def _ninja_first() -> str:
    """PATH with the ninja wheel's binary (a dependency) first: the build never depends
    on which ninja the system puts first (their build logs do not agree)."""
    path = os.environ.get("PATH", "")
    try:
        import ninja

        return ninja.BIN_DIR + os.pathsep + path
    except ImportError:
        if shutil.which("ninja") is None:
            raise RuntimeError("ninja is not installed (pip install ninja)") from None
        return path


def _build(directory: Path, library: Path, verbose: bool) -> None:
    """Compile in a private folder, then publish ``library`` by one atomic rename.
    Run under the build lock, so earlier killed builds' folders can go."""
    from torch.utils import cpp_extension

    if _compiler() is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH")
    for old in directory.glob("tmp-*"):
        shutil.rmtree(old, ignore_errors=True)
    private = Path(tempfile.mkdtemp(prefix="tmp-", dir=directory))
    path = os.environ.get("PATH")
    os.environ["PATH"] = _ninja_first()
    try:  # loads the library too (from the private folder: same file, same inode)
        cpp_extension.load(
            name=LIBRARY, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=CFLAGS,
            extra_include_paths=[str(CSRC)], build_directory=str(private),
            is_python_module=False, verbose=verbose,
        )
        os.replace(private / f"{LIBRARY}.so", library)
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path
        shutil.rmtree(private, ignore_errors=True)


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _open(verbose: bool):
    """Load the published build, else build and publish it; return torch.ops.attnlab_native."""
    directory = build_dir()
    library = directory / f"{LIBRARY}.so"
    broken = _stamp(library)
    if broken is not None:
        try:
            torch.ops.load_library(str(library))
            return _with_fakes(getattr(torch.ops, LIBRARY))
        except OSError:  # not a library (a build of older attnlab killed mid-link): rebuilt
            pass
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):
        if _stamp(library) not in (None, broken):  # another process published it meanwhile
            torch.ops.load_library(str(library))
        else:
            _build(directory, library, verbose)
    return _with_fakes(getattr(torch.ops, LIBRARY))


def _with_fakes(ops):
    """``ops`` with a fake (meta) kernel registered for each tensor op, once per process.

    A fake computes only what the real op returns, shapes, dtypes and strides, from the
    inputs' metadata, so torch.compile (FakeTensorMode) can trace through the ops. Where
    the real op returns None for inputs it does not read (``linear``),
    the fake repeats the decision from the same metadata: dynamo specialises on it.
    """
    if not _state["faked"]:
        _state["faked"] = True
        from torch.utils._python_dispatch import _disable_current_modes

        # Whether the CPU has the tile kernel (linear's path for more than one row times a
        # weight by columns): asked of the real op once, with two rows and a 2x2 weight by
        # columns, which it takes only then.
        # Device and dtype named, and outside any dispatch mode: the first load may run under
        # torch.device("meta"), another default dtype, or the FakeTensorMode of
        # torch.export (where the real op cannot run, and its failure read as a failed build
        # turned the kernel off for the whole process).
        one = {"device": "cpu", "dtype": torch.float32}
        bf16 = {"device": "cpu", "dtype": torch.bfloat16}
        with _disable_current_modes():
            tiles = ops.linear(torch.ones(2, 2, **one), torch.ones(2, 2, **one).t(), None, None)
            # And whether it has the bf16 dot product, on which more than one row times a
            # bf16 weight by rows runs: asked the same way.
            bf16_dot = ops.linear(torch.ones(2, 2, **bf16), torch.ones(1, 2, **bf16), None,
                                  None)
        tiles, bf16_dot = tiles is not None, bf16_dot is not None
        for name, fake in _fakes.fakes(tiles, bf16_dot).items():
            torch.library.register_fake(f"{LIBRARY}::{name}", fake)
    return ops


def load(verbose: bool = False):
    """``torch.ops.attnlab_native`` with the kernel, or None where it cannot be had.

    The build is tried once per process (other threads wait for it); after a failure
    :func:`unavailable_reason` says why and every later call returns None at once.
    """
    if disabled_reason() is not None:
        return None
    if _state["ops"] is not None or _state["tried"]:
        return _state["ops"]
    with _first_load:
        if not _state["tried"]:
            try:
                _state["ops"] = _open(verbose)
            except TimeoutError as exc:  # a live build elsewhere took too long
                _say(str(exc), None)
            except Exception as exc:  # no compiler, a failed build, a broken cache: say it once
                detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                _say(f"the build failed ({detail})", _write_log(exc))
            _state["tried"] = True
    return _state["ops"]


def _say(reason: str, log: Path | None) -> None:
    _state["reason"] = reason
    where = f"; log: {log}" if log else ""
    print(f"attnlab: native attention kernel unavailable: {reason}{where}; "
          "using the PyTorch paths", file=sys.stderr)


def _write_log(exc: Exception) -> Path | None:
    try:
        path = build_dir() / "build-error.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{type(exc).__name__}: {exc}\n")
        return path
    except OSError:
        return None


PRODUCT_DTYPES = _fakes.PRODUCT_DTYPES


def for_inference(*tensors: torch.Tensor | None, dtypes=(torch.float32,)):
    """The ops when ``tensors`` (None entries skipped) can take the inference-only
    kernels: gradients off, one of ``dtypes`` (float32 unless given) on the CPU, the
    kernel built. Else None."""
    if torch.is_grad_enabled():
        return None
    for t in tensors:
        if t is not None and (t.dtype not in dtypes or t.device.type != "cpu"):
            return None
    return load()


@contextlib.contextmanager
def one_thread_while_busy() -> Iterator[None]:
    """Run the block's torch operations on one thread (of the calling thread only) while
    the kernel has seen the machine busy: two parallel regions whose last worker started
    late, or one with two workers started on one core, within the last 0.1 s
    (``csrc/busy.h``, which the kernel's own products and attention follow too).
    Otherwise, or where the kernel is not loaded, the block runs as it is. For a decoding
    step's small operations over the vocabulary: each of torch's parallel regions ends at a
    barrier that waits a time slice for a thread the OS gave to another process."""
    ops = _state["ops"] if disabled_reason() is None else None
    threads = torch.get_num_threads()
    if ops is None or threads == 1 or ops.workers_for(0.0) > 1:
        yield
        return
    ops.threads_here(1)
    try:
        yield
    finally:
        ops.threads_here(threads)


def available() -> bool:
    """True when the kernel is built, loaded and not switched off."""
    return load() is not None


def known_unavailable() -> bool:
    """Whether the kernel is known not to run (switched off, or its build failed), asked
    without building it: False before a build was tried."""
    return disabled_reason() is not None or (_state["tried"] and _state["ops"] is None)


def constant_under_compile(fn):
    """``torch.compiler.assume_constant_result`` without its import of ``torch._dynamo``
    (about 2 s at every start, for every CLI command): the same marker, which dynamo
    reads when it meets ``fn`` (run, not traced; its result kept as a constant).
    tests/test_compile.py fails if a torch release stops honouring it."""
    fn._dynamo_marked_constant = True
    return fn


# Run, not traced, under torch.compile: the first call may build and load the library
# (locks, files), which dynamo cannot trace; its answer is a constant of the process.
@constant_under_compile
def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    why = disabled_reason()  # read at each call: the switch may change at run time
    if why is not None:
        return why
    ops = _state["ops"] if _state["ops"] is not None or _state["tried"] else load()
    return None if ops is not None else _state["reason"]


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
