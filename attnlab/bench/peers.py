"""The optional benchmark peers (``pip install 'attnlab[peers]'``): which are installed here.

An engine the bench cannot run is left out of every case, and the suite says so once,
in one line, before its cases run (:func:`skip_lines`): nothing else about it is printed.
Nothing here imports a peer; :func:`missing` only looks for the packages.
"""

from __future__ import annotations

import importlib.util

INSTALL = "pip install 'attnlab[peers]'"

# Engine -> the modules it needs, each with the distribution that provides it.
ENGINES: dict[str, tuple[tuple[str, str], ...]] = {
    "llama.cpp": (("llama_cpp", "llama-cpp-python"), ("gguf", "gguf")),
    "openvino": (("openvino", "openvino"),),
    # OpenVINO's int8 weights are compressed by NNCF, its weight-compression tool.
    "openvino int8": (("openvino", "openvino"), ("nncf", "nncf")),
    "onnxruntime": (("onnxruntime", "onnxruntime"), ("onnx", "onnx"),
                    ("onnxscript", "onnxscript")),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent package, or a module without spec
        return False


def missing(engine: str) -> str | None:
    """None when ``engine`` can run here, else why not (the packages it lacks)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {sorted(ENGINES)}, got {engine!r}")
    absent = [dist for module, dist in ENGINES[engine] if not _installed(module)]
    if not absent:
        return None
    return f"{' and '.join(absent)} not installed ({INSTALL})"


def skip_lines(engines: list[str]) -> list[str]:
    """One line per engine of ``engines`` that cannot run here."""
    return [f"{engine}: skipped, {reason}" for engine in engines
            if (reason := missing(engine)) is not None]
