"""Plain-data layouts: Hugging Face config dicts and state dicts mapped to attnlab's.

Config dict in, attnlab config values out; state dict in, attnlab state dict out.
Nothing here imports a model class (the layer sits below :mod:`attnlab.models`), so
``GPT.from_hf`` and ``Encoder.from_hf`` build from these maps, and
:mod:`attnlab.interop` (above the models) builds ready-made models from them.

- :mod:`.hf`: GPT-2, the table of decoder layouts and the entry points ``gpt_layout`` /
  ``encoder_layout`` / ``read_folder``;
- :mod:`.hf_llama` (Llama, Mistral, Qwen2, Qwen3), :mod:`.hf_gemma2`, :mod:`.hf_bloom`: the other
  decoders;
- :mod:`.hf_encoders`: BERT, RoBERTa, DistilBERT;
- :mod:`.common`: what every converter shares (named state view, shape checks,
  config fields).
"""

from .hf import encoder_layout, gpt_layout, read_folder

__all__ = ["gpt_layout", "encoder_layout", "read_folder"]
