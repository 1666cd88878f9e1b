"""A model and its tokenizer from whatever a user points the command line at.

- ``--ckpt DIR``: an attnlab checkpoint (``attnlab train`` / ``save_checkpoint``);
- ``--model minilm``: the bundled all-MiniLM-L6-v2;
- ``--model DIR``: a folder written by transformers' ``save_pretrained`` (a
  ``config.json`` with a supported ``model_type``, safetensors weights and the
  tokenizer's ``tokenizer.json``): decoders become a ``GPT``, encoders an ``Encoder``.

Each kind of folder given to the other option is refused in one line that says
which option takes it.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from ..io import CONFIG_FILE, read_json
from ..io.reading import CONFIG_LIMIT
from ..layouts.hf import ENCODER_LAYOUTS, GPT_LAYOUTS
from ..models import GPT, MODEL_TYPES, Encoder

__all__ = ["load_for_cli", "load_hf_folder", "known_text"]


def _model_type(folder: Path) -> object:
    if not (folder / CONFIG_FILE).is_file():
        return None
    config = read_json(folder / CONFIG_FILE, CONFIG_LIMIT, "config")
    return config.get("model_type") if isinstance(config, dict) else None


def load_hf_folder(folder: str | os.PathLike) -> tuple[nn.Module, object]:
    """``(GPT or Encoder, HFTokenizer)`` of a folder written by ``save_pretrained``."""
    from ..text import HFTokenizer

    path = Path(folder)
    kind = _model_type(path) if path.is_dir() else None
    if kind in MODEL_TYPES and "format" in read_json(path / CONFIG_FILE, CONFIG_LIMIT, "config"):
        raise ValueError(f"--model {str(folder)!r} is an attnlab checkpoint: use --ckpt "
                         f"{str(folder)!r}")
    if path.is_dir() and kind not in GPT_LAYOUTS and kind not in ENCODER_LAYOUTS:
        raise ValueError(f"--model {str(folder)!r}: model_type {kind!r} is not supported "
                         f"(expected one of {sorted(GPT_LAYOUTS)} (decoders) or "
                         f"{sorted(ENCODER_LAYOUTS)} (encoders))")
    model = (Encoder if kind in ENCODER_LAYOUTS else GPT).from_hf(path)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"--model {str(folder)!r} has no tokenizer.json (save it beside the "
                         "model: AutoTokenizer.from_pretrained(...).save_pretrained(folder))")
    tokenizer = HFTokenizer(path / "tokenizer.json")
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"--model {str(folder)!r}: tokenizer.json has {tokenizer.vocab_size} "
                         f"tokens but the model's vocab_size is {model.config.vocab_size}")
    return model, tokenizer


def load_for_cli(ckpt: str | None, model: str | None, *,
                 demo_fallback: bool = False) -> tuple[nn.Module, object, dict]:
    """``(model, tokenizer, meta)`` for ``--ckpt DIR`` or ``--model minilm|DIR``.

    ``meta`` is the attnlab checkpoint's ``config.json`` (``{}`` for ``--model``):
    it holds what training recorded, such as the held-out text. With neither
    option and ``demo_fallback``, the model ``attnlab demo`` wrote in
    ``./attnlab-demo`` is used (with a note on stderr), or the one-line error says
    to run ``attnlab demo`` first.
    """
    import sys

    from ..checkpoint import load_checkpoint, load_checkpoint_tokenizer, read_config
    from ..recipe import DEMO_OUT

    if ckpt is None and model is None and demo_fallback:
        if not (Path(DEMO_OUT) / CONFIG_FILE).is_file():
            raise ValueError(f"no model given and no ./{DEMO_OUT}: run `attnlab demo` first "
                             f"(it trains one into ./{DEMO_OUT}), or give --ckpt DIR (an "
                             "attnlab checkpoint) or --model minilm|DIR (a Hugging Face folder)")
        print(f"note: no --ckpt or --model: using ./{DEMO_OUT}, the model `attnlab demo` "
              "trained", file=sys.stderr)
        ckpt = DEMO_OUT
    if ckpt is None and model is None:
        raise ValueError("give --ckpt DIR (an attnlab checkpoint) or --model minilm|DIR "
                         "(a Hugging Face folder)")
    if model == "minilm" and not Path(model).is_dir():
        from . import minilm

        encoder, tokenizer = minilm.load()
        return encoder, tokenizer, {}
    if model is not None:
        found, tokenizer = load_hf_folder(model)
        return found, tokenizer, {}
    path = Path(ckpt)
    kind = _model_type(path) if path.is_dir() else None
    if kind in GPT_LAYOUTS or kind in ENCODER_LAYOUTS:
        raise ValueError(f"--ckpt {ckpt!r} is a Hugging Face folder (model_type {kind!r}): "
                         f"use --model {ckpt!r}")
    found = load_checkpoint(ckpt)
    tokenizer = load_checkpoint_tokenizer(ckpt)
    if tokenizer is None:
        raise ValueError(f"--ckpt {ckpt!r} has no tokenizer.json")
    return found, tokenizer, read_config(ckpt)


def known_text(meta: dict, tokenizer: object, max_tokens: int = 40) -> str | None:
    """A text the model of checkpoint ``meta`` can read, to offer when the user's cannot:
    the demo's sentence for the demo's model, else the start of the held-out text its
    training recorded (decoded with ``tokenizer``); None when neither is known."""
    from ..recipe import SAMPLE

    if meta.get("demo"):
        return SAMPLE
    ids = (meta.get("held_out") or {}).get("ids") if isinstance(meta, dict) else None
    if not isinstance(ids, list) or not ids:
        return None
    try:
        text = tokenizer.decode(ids[:max_tokens])
    except (ValueError, TypeError, IndexError):
        return None
    return " ".join(text.split()) or None
