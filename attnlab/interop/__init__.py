"""Ready-made models: the bundled MiniLM and the ``--model`` lookup of the command line.

It sits above :mod:`attnlab.models`: :mod:`.minilm` builds the bundled encoder
(``load()``, ``embed(sentences)``) and :mod:`.auto` finds what ``--model`` names (a
checkpoint, a Hugging Face folder, ``minilm``). The plain-data maps from Hugging Face
layouts to attnlab's live one layer below the models, in :mod:`attnlab.layouts`;
``gpt_layout`` and ``encoder_layout`` are re-exported here for older callers.
"""

from ..layouts.hf import encoder_layout, gpt_layout

__all__ = ["gpt_layout", "encoder_layout"]
