"""Real weights: Hugging Face layouts (GPT-2, Llama, BERT) and the bundled MiniLM.

``GPT.from_hf(model)``, ``Encoder.from_hf(model)`` (see :mod:`.hf`) and
:mod:`.minilm` (``load()``, ``embed(sentences)``).
"""

from .hf import encoder_from_hf, gpt_from_hf

__all__ = ["gpt_from_hf", "encoder_from_hf"]
