"""The decoding engines of the generate suite beyond attnlab float32 and transformers, and
the precision of each: attnlab's own bf16 and int8 (once the library loads them), and the
optional peers llama.cpp and OpenVINO (:mod:`.peers` says which are installed).

An engine's name ends in its precision (``"llama.cpp q8_0"``, ``"openvino int8"``,
``"attnlab bf16"``); a name without one (``"attnlab"``, ``"transformers"``) is float32.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

from ..interop.auto import PRECISIONS
from . import peers

GENERATE = "attnlab.bench.generate"
# The peer whose time the Markdown table divides by.
BASELINE = "transformers"
# Whose greedy tokens every engine's are checked against, and whose speed the peers'
# table divides by.
REFERENCE = "attnlab"
# The yardsticks timed beside the engines (:mod:`.ceiling`, :mod:`.bandwidth`).
CEILING = "one-row ceiling"
READ = "read bandwidth"


class Engine(NamedTuple):
    name: str
    module: str  # whose ``make_step`` builds its step
    precision: str
    needs: str | None  # the :data:`.peers.ENGINES` entry it needs (None: attnlab's own)


# attnlab's own lower precisions, as the library takes them (``attnlab generate
# --precision``'s): measured as soon as ``GPT.from_hf`` accepts the keyword (until then the
# suite says so in one line).
ATTNLAB_PRECISIONS = {"bf16": PRECISIONS["bfloat16"], "int8": PRECISIONS["int8"]}
PEERS = [Engine(f"llama.cpp {p}", "attnlab.bench.llamacpp", p, "llama.cpp")
         for p in ("f32", "bf16", "f16", "q8_0")] + [
        Engine(f"openvino {p}", "attnlab.bench.openvino_lm", p,
               "openvino int8" if p == "int8" else "openvino") for p in ("f32", "bf16", "int8")]
# Bytes a matrix weight takes at each precision, for rows of ``n`` weights: Q8_0 is 32
# int8 weights and a float16 scale per block (F16 where a row does not split into
# blocks, as :mod:`.gguf_files` writes it); int8 adds one float32 scale per output
# channel (a row), an upper bound for OpenVINO's and attnlab's.
BYTES_PER_WEIGHT = {
    "f32": lambda n: 4.0, "bf16": lambda n: 2.0, "f16": lambda n: 2.0,
    "q8_0": lambda n: 34 / 32 if n % 32 == 0 else 2.0, "int8": lambda n: 1.0 + 4.0 / n,
}


def precision_of(impl: str) -> str:
    """The weights' precision in an implementation's name; float32 where it gives none."""
    last = impl.rsplit(" ", 1)[-1]
    return last if last in BYTES_PER_WEIGHT else "f32"


# attnlab's int8 is llama.cpp's Q8_0 scheme (a float16 scale per block of 32) in a layout
# of its own: a row that does not split into blocks is padded (layouts/int8.py), where a
# GGUF file keeps such a row in F16.
ATTNLAB_FORMAT = {"int8": "attnlab-q8_0"}


def matrix_bytes(fmt: str, n_out: int, n_in: int) -> float:
    """Bytes of an ``(n_out, n_in)`` weight matrix stored as ``fmt`` (a key of
    :data:`BYTES_PER_WEIGHT`, or ``"attnlab-q8_0"``)."""
    if fmt == "attnlab-q8_0":
        from ..layouts.int8 import nbytes

        return float(nbytes(n_out, n_in))
    return n_out * n_in * BYTES_PER_WEIGHT[fmt](n_in)


def stored_as(impl: str) -> str:
    """The format whose bytes per weight an implementation's weights take (its precision,
    but attnlab's int8 is stored as Q8_0)."""
    precision = precision_of(impl)
    return ATTNLAB_FORMAT.get(precision, precision) if impl.startswith("attnlab") else precision


def attnlab_missing(precision: str) -> str | None:
    """None when attnlab loads weights at ``precision`` (a key of ATTNLAB_PRECISIONS)."""
    from ..models import GPT

    (keyword,) = ATTNLAB_PRECISIONS[precision]
    if keyword in inspect.signature(GPT.from_hf).parameters:
        return None
    return f"GPT.from_hf takes no {keyword}= yet"


def available(quick: bool = False) -> list[Engine]:
    """The engines that can run here; ``quick`` (``--quick``): attnlab's own only. The
    peers' worker processes and memory probes took 70-90 s more per suite on this loaded
    machine, and ``--quick`` stays within two minutes."""
    out = [Engine(f"attnlab {p}", GENERATE, p, None) for p in ATTNLAB_PRECISIONS
           if attnlab_missing(p) is None]
    return out if quick else out + [e for e in PEERS if peers.missing(e.needs) is None]


def skip_lines() -> list[str]:
    """One line for each engine that cannot run here (it is left out of every case)."""
    lines = peers.skip_lines(["llama.cpp", "openvino"])
    if peers.missing("openvino") is None:
        lines += peers.skip_lines(["openvino int8"])
    return lines + [f"attnlab {p}: skipped, {why}" for p in ATTNLAB_PRECISIONS
                    if (why := attnlab_missing(p)) is not None]
