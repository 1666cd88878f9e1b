"""The checkpoint's file format: ``model.safetensors`` + ``config.json`` (+ ``tokenizer.json``).

Writing a model's files into a directory and reading them back (the model rebuilt on
the meta device and filled from the file, the tokenizer checked against its
vocabulary). File names live in :mod:`attnlab.io`; never pickle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..io import (
    CONFIG_FILE,
    MODEL_FILE,
    TOKENIZER_FILE,
    CheckpointError,
    atomic_write_json,
    read_json,
    recover_dir,
    save_tensors,
)
from ..io.reading import CONFIG_LIMIT
from ..io.weights import SafetensorsState
from ..models.loading import build_loaded, parameter_names
from ..modules import quantized

FORMAT = 1  # config.json's "format": a checkpoint of another layout is refused by number


def write_model_files(directory: str | os.PathLike, model: nn.Module, *, tokenizer=None,
                      weights: dict[str, torch.Tensor] | None = None, **extra: Any) -> None:
    """Write the model's weights, config (and tokenizer) into an existing directory.

    ``weights``: a state dict of ``model``'s to write instead of its current one (the
    best checkpoint of a run, kept from an earlier step)."""
    model_type = getattr(model, "model_type", None)
    if model_type is None or not hasattr(model, "config"):
        raise TypeError(
            f"model must be an attnlab model (ToyAttnLM, GPT or Encoder), got "
            f"{type(model).__name__}"
        )
    directory = Path(directory)
    save_tensors(directory / MODEL_FILE, model.state_dict() if weights is None else weights)
    if tokenizer is not None:
        tokenizer.save(directory / TOKENIZER_FILE)
    # An int8 model's linear layers are stored as they are held (each one's ``data`` and
    # ``scales``, llama.cpp's Q8_0): the config says so, or the loader would build float
    # layers that the file does not fill.
    int8 = any(isinstance(m, quantized.Int8Linear) for m in model.modules())
    atomic_write_json(directory / CONFIG_FILE, {
        "format": FORMAT, "model_type": model_type, "config": model.config.to_dict(),
        **({"quantize": "int8"} if int8 else {}), **extra,
    })


def peek_config(directory: str | os.PathLike) -> dict:
    """The ``config.json`` of ``directory`` as the folder is now ({} where it has none):
    not repaired first, as :func:`read_config` repairs it, which needs the output lock."""
    path = Path(directory) / CONFIG_FILE
    return read_json(path, CONFIG_LIMIT) if path.is_file() else {}


def read_config(directory: str | os.PathLike) -> dict:
    directory = Path(directory)
    recover_dir(directory)
    if directory.is_file():
        raise CheckpointError(f"{str(directory)!r} is a file, expected a checkpoint directory")
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {str(directory)!r} does not exist")
    return read_json(directory / CONFIG_FILE, CONFIG_LIMIT)


def load_checkpoint(directory: str | os.PathLike, *, map_location: str = "cpu") -> nn.Module:
    """Rebuild the model saved in ``directory`` (in eval mode)."""
    from ..models import MODEL_TYPES

    directory = Path(directory)
    meta = read_config(directory)
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{str(directory / CONFIG_FILE)!r}: format must be {FORMAT}, got "
            f"{meta.get('format')!r} (written by another attnlab version, or not by attnlab)")
    model_type = meta.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise CheckpointError(
            f"{str(directory / CONFIG_FILE)!r}: model_type must be one of "
            f"{sorted(MODEL_TYPES)}, got {model_type!r}"
        )
    cls, config_cls = MODEL_TYPES[model_type]
    try:
        config = config_cls.from_dict(meta.get("config", {}))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{str(directory / CONFIG_FILE)!r}: bad config: {exc}") from exc
    # Built on the meta device and checked against the file's header first: a config
    # that does not fit the weights is refused before anything is allocated.
    source = f"{str(directory / MODEL_FILE)!r}"
    state = SafetensorsState([directory / MODEL_FILE], device=str(map_location))
    scheme = meta.get("quantize")
    if scheme is None:
        model = build_loaded(lambda: cls(config), state, source=source)
    elif scheme in quantized.SCHEMES:
        model = _int8_loaded(lambda: cls(config), state, source)
    else:
        raise CheckpointError(f"{str(directory / CONFIG_FILE)!r}: quantize must be one of "
                              f"{quantized.SCHEMES}, got {scheme!r}")
    bad = next((n for n, t in model.state_dict().items()
                if t.is_floating_point() and not _all_finite(t)), None)
    if bad is not None:  # a diverged run's weights: every output would be NaN
        raise CheckpointError(f"{source}: tensor {bad!r} holds NaN or inf; expected finite "
                              "weights (the run that wrote them diverged)")
    return model.to(map_location).eval()


def _all_finite(t: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """No NaN or inf in ``t``, read a million values at a time: isfinite over the whole
    of an embedding made a mask as big as it, the load's peak memory."""
    flat = t.detach().reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + chunk]).all())
               for i in range(0, flat.numel(), chunk))


def _int8_loaded(make, state: SafetensorsState, source: str) -> nn.Module:
    """The int8 model a checkpoint holds: each quantised layer's ``data`` and ``scales``
    copied into its place as they are (no float weight is made), the rest as usual. The
    float model's weights are stood in for by meta placeholders of their shapes (under
    every name of a tied weight: an embedding tied to the output layer), so that names
    and shapes are checked before anything is allocated."""
    with torch.device("meta"):
        model = make()
    pairs, held = {}, set()
    for names in parameter_names(model):
        layer = next((n[:-len(".weight")] for n in names if n.endswith(".weight")
                      and f"{n[:-len('.weight')]}.data" in state), None)
        if layer is None or f"{layer}.scales" not in state:
            continue
        held |= {f"{layer}.data", f"{layer}.scales"}
        for n in names:
            pairs[n] = lambda layer=layer: (state[f"{layer}.data"], state[f"{layer}.scales"])
    shapes = {n: t.shape for n, t in model.state_dict(keep_vars=True).items()}
    view = {n: state[n] for n in state if n not in held}
    view.update({n: torch.empty(shapes[n], device="meta") for n in pairs if n in shapes})
    return build_loaded(make, view, source=source, quantize="int8", int8=pairs)


def load_checkpoint_tokenizer(directory: str | os.PathLike):
    """The tokenizer saved beside the model, or None.

    A tokenizer with more ids than the model's vocabulary is refused here: the
    model would fail on the extra ids deep inside its embedding (an IndexError)
    instead of saying which file is wrong. So is one of attnlab's own (characters, words)
    with fewer: training sizes the model's vocabulary to it, so fewer ids mean another
    text's tokenizer or a damaged file, and the ids past it would print nothing. (A
    Hugging Face tokenizer may have fewer: models pad their vocabulary.)
    """
    from ..text import load_tokenizer

    directory = Path(directory)
    recover_dir(directory)
    path = directory / TOKENIZER_FILE
    if not path.exists():
        return None
    tokenizer = load_tokenizer(path)
    if (directory / CONFIG_FILE).exists():
        config = read_config(directory).get("config")
        vocab = config.get("vocab_size") if isinstance(config, dict) else None
        own = getattr(tokenizer, "type_name", "") in ("char", "word")
        if isinstance(vocab, int) and (tokenizer.vocab_size > vocab or (
                own and tokenizer.vocab_size < vocab)):
            raise CheckpointError(
                f"{str(path)!r} has {tokenizer.vocab_size} tokens but the model in "
                f"{str(directory / CONFIG_FILE)!r} has vocab_size {vocab}; expected "
                f"{'exactly' if own else 'at most'} {vocab} (the tokenizer does not belong "
                "to this model)")
    return tokenizer


@torch.no_grad()
def same_weights(a: nn.Module, b: nn.Module) -> bool:
    """True when two models hold bit-identical parameters and buffers."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
