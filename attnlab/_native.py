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
import math
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
        # Whether the CPU has the tile kernel (linear's path for more than one row): asked of the
        # real op once, with two rows and a packed 1x1 weight, which it takes only then.
        # Device and dtype named: the first load may run under torch.device("meta") or
        # another default dtype.
        one = {"device": "cpu", "dtype": torch.float32}
        tiles = ops.linear(torch.ones(2, 1, **one), torch.ones(1, 1, **one), None, None)
        tiles = tiles is not None
        # And whether it has the bf16 tile kernel (more than FEW_ROWS rows times a bf16
        # weight by rows): asked the same way.
        bf16 = {"device": "cpu", "dtype": torch.bfloat16}
        bf16_tiles = ops.linear(torch.ones(FEW_ROWS + 1, 2, **bf16), torch.ones(1, 2, **bf16),
                                None, None) is not None
        for name, fake in _fakes(tiles, bf16_tiles).items():
            torch.library.register_fake(f"{LIBRARY}::{name}", fake)
    return ops


# Rows up to which linear leaves a bf16 weight to torch's product (csrc/decode.cpp's
# FEW_ROWS; a test holds the two equal).
FEW_ROWS = 64


def _fakes(tiles: bool, bf16_tiles: bool = False) -> dict:
    """The fake kernels, by op name (the C++ signatures in csrc/*.cpp)."""

    def flash_forward(q, k, v, mask, causal, window, offset, scale, dropout_p, seed, block_q,
                      block_k, softcap, alibi, sinks, documents, block_kinds, block_index,
                      block_partial):
        batch, heads, q_len, _ = q.shape
        out = q.new_empty(batch, heads, q_len, v.shape[-1])
        # The log-sum-exp, one per row, in the accumulation dtype (float32 for bf16/fp16).
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        return out, q.new_empty(batch, heads, q_len, dtype=acc)

    def flash_backward(q, k, v, mask, out, lse, grad_out, causal, window, offset, scale,
                       dropout_p, seed, block_q, block_k, softcap, alibi, sinks, documents,
                       block_kinds, block_index, block_partial):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def rms_norm(x, weight, eps):
        # The kernel's empty_like of x.contiguous() keeps that tensor's strides, even the
        # free ones of size-1 dimensions, which torch.empty_like under fake tensors resets.
        dense = x.contiguous()
        return dense.new_empty_strided(dense.shape, dense.stride())

    def silu_mul(gate_up):
        return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    gelu_mul = silu_mul  # the same shapes

    def usable(t) -> bool:
        return t.dtype == torch.float32 and t.device.type == "cpu"

    def floating(t) -> bool:
        return t.dtype in PRODUCT_DTYPES and t.device.type == "cpu"

    def one_row(x, w, bias, residual):
        if (not floating(x) or not floating(w) or w.dim() != 2 or x.dim() < 1
                or x.shape[-1] != w.shape[1] or math.prod(x.shape[:-1]) != 1
                or not x.is_contiguous()):
            return None
        n_out, n_in = w.shape
        by_rows = w.stride(1) == 1 and (n_out <= 1 or w.stride(0) >= n_in)
        by_columns = not by_rows and w.stride(0) == 1 and (n_in <= 1 or w.stride(1) >= n_out)
        if not by_rows and not by_columns:
            return None
        for t in (bias, residual):
            if t is not None and (not floating(t) or t.numel() != n_out
                                  or not t.is_contiguous()):
                return None
        return x.new_empty(*x.shape[:-1], n_out)

    def bf16_by_rows(x, weight, bias, residual, rows) -> bool:
        n_out, n_in = weight.shape if weight.dim() == 2 else (0, 0)
        return (bf16_tiles and residual is None and floating(x) and x.dim() >= 1
                and x.is_contiguous() and x.shape[-1] == n_in and rows > FEW_ROWS
                and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
                and n_in > 0 and n_in % 2 == 0 and weight.stride(1) == 1
                and (n_out <= 1 or weight.stride(0) >= n_in)
                and (bias is None or (floating(bias) and bias.numel() == n_out
                                      and bias.is_contiguous())))

    def linear(x, weight, bias, residual):
        rows = math.prod(x.shape[:-1]) if x.dim() >= 1 else 0
        if x.dim() >= 1 and rows == 1:
            return one_row(x, weight, bias, residual)
        if bf16_by_rows(x, weight, bias, residual, rows):
            return x.new_empty(*x.shape[:-1], weight.shape[0])
        if (not tiles or residual is not None or not usable(x) or not usable(weight)
                or weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]
                or not x.is_contiguous() or weight.stride(0) != 1
                or weight.stride(1) < weight.shape[0] or weight.shape[1] == 0):
            return None
        if bias is not None and (not usable(bias) or bias.numel() != weight.shape[0]
                                 or not bias.is_contiguous()):
            return None
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    def decode_step(qkv, cos, sin, k_cache, v_cache, pos, window, num_heads, num_kv_heads,
                    scale, softcap=0.0, alibi=None, sinks=None):
        return qkv.new_empty(k_cache.shape[0], 1, num_heads * k_cache.shape[3])

    def int8_linear(x, data, scales, out_features, bias, residual):
        return x.new_empty(*x.shape[:-1], out_features)

    return {"flash_forward": flash_forward, "flash_backward": flash_backward,
            "rms_norm": rms_norm, "silu_mul": silu_mul, "gelu_mul": gelu_mul, "linear": linear,
            "decode_step": decode_step, "int8_linear": int8_linear}


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


# The dtypes the products and the decoding run read (weights, rows, caches).
PRODUCT_DTYPES = (torch.float32, torch.bfloat16)


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


def available() -> bool:
    """True when the kernel is built, loaded and not switched off."""
    return load() is not None


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
