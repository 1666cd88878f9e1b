"""Real weights: Hugging Face layouts (GPT-2, Llama, Mistral, Qwen2; BERT, RoBERTa,
DistilBERT) and the bundled MiniLM.

:mod:`.hf` maps transformers configs and state dicts to attnlab's (plain data,
no model classes): ``GPT.from_hf(model)`` and ``Encoder.from_hf(model)`` build
from it. :mod:`.minilm` loads the bundled encoder (``load()``, ``embed(sentences)``).
"""

from .hf import encoder_layout, gpt_layout

__all__ = ["gpt_layout", "encoder_layout"]
