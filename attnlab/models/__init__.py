"""Models built from attnlab's modules: ToyAttnLM, GPT (decoder), Encoder (BERT-style)."""

from .encoder import Encoder, EncoderConfig
from .gpt import GPT, GPTConfig
from .toy import ToyAttnLM, ToyConfig

MODEL_TYPES = {
    "toy": (ToyAttnLM, ToyConfig),
    "gpt": (GPT, GPTConfig),
    "encoder": (Encoder, EncoderConfig),
}

__all__ = ["GPT", "GPTConfig", "ToyAttnLM", "ToyConfig", "Encoder", "EncoderConfig",
           "MODEL_TYPES"]
