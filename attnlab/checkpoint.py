"""Checkpoints: ``model.safetensors`` + ``config.json`` (+ ``tokenizer.json``) in one directory.

Written atomically through :func:`attnlab.io.atomic_dir` (a finished
directory replaces the old one in a rename), read without pickle.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .io import (
    CONFIG_FILE,
    MODEL_FILE,
    OWN_FILES,
    STATE_JSON,
    STATE_TENSORS,
    TOKENIZER_FILE,
    CheckpointError,
    atomic_dir,
    atomic_write_json,
    load_tensors,
    read_json,
    recover_dir,
    save_tensors,
)

FORMAT = 1

__all__ = ["save_checkpoint", "load_checkpoint", "load_checkpoint_tokenizer",
           "write_model_files", "CheckpointError"]


def write_model_files(directory: str | os.PathLike, model: nn.Module, *, tokenizer=None,
                      **extra: Any) -> None:
    """Write the model's weights, config (and tokenizer) into an existing directory."""
    model_type = getattr(model, "model_type", None)
    if model_type is None or not hasattr(model, "config"):
        raise TypeError(
            f"model must be an attnlab model (ToyAttnLM, GPT or Encoder), got "
            f"{type(model).__name__}"
        )
    directory = Path(directory)
    save_tensors(directory / MODEL_FILE, model.state_dict())
    if tokenizer is not None:
        tokenizer.save(directory / TOKENIZER_FILE)
    atomic_write_json(directory / CONFIG_FILE, {
        "format": FORMAT, "model_type": model_type, "config": model.config.to_dict(), **extra,
    })


def save_checkpoint(model: nn.Module, directory: str | os.PathLike, *, tokenizer=None,
                    **extra: Any) -> Path:
    """Save ``model`` (and ``tokenizer``) to ``directory``, replacing it atomically.

    ``extra`` keyword arguments (JSON-serialisable) are stored in ``config.json``.
    """
    with atomic_dir(directory) as tmp:
        write_model_files(tmp, model, tokenizer=tokenizer, **extra)
    return Path(directory)


def read_config(directory: str | os.PathLike) -> dict:
    directory = Path(directory)
    recover_dir(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {str(directory)!r} does not exist")
    return read_json(directory / CONFIG_FILE)


def load_checkpoint(directory: str | os.PathLike, *, map_location: str = "cpu") -> nn.Module:
    """Rebuild the model saved in ``directory`` (in eval mode)."""
    from .models import MODEL_TYPES

    directory = Path(directory)
    meta = read_config(directory)
    model_type = meta.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(
            f"{str(directory / CONFIG_FILE)!r}: model_type must be one of "
            f"{sorted(MODEL_TYPES)}, got {model_type!r}"
        )
    cls, config_cls = MODEL_TYPES[model_type]
    try:
        model = cls(config_cls.from_dict(meta.get("config", {})))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{str(directory / CONFIG_FILE)!r}: bad config: {exc}") from exc
    state = load_tensors(directory / MODEL_FILE, device=map_location)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise CheckpointError(
            f"{str(directory / MODEL_FILE)!r} does not match its config: {first}"
        ) from exc
    return model.to(map_location).eval()


def load_checkpoint_tokenizer(directory: str | os.PathLike):
    """The tokenizer saved beside the model, or None.

    A tokenizer with more ids than the model's vocabulary is refused here: the
    model would fail on the extra ids deep inside its embedding (an IndexError)
    instead of saying which file is wrong.
    """
    from .text import load_tokenizer

    directory = Path(directory)
    recover_dir(directory)
    path = directory / TOKENIZER_FILE
    if not path.exists():
        return None
    tokenizer = load_tokenizer(path)
    if (directory / CONFIG_FILE).exists():
        config = read_config(directory).get("config")
        vocab = config.get("vocab_size") if isinstance(config, dict) else None
        if isinstance(vocab, int) and tokenizer.vocab_size > vocab:
            raise CheckpointError(
                f"{str(path)!r} has {tokenizer.vocab_size} tokens but the model in "
                f"{str(directory / CONFIG_FILE)!r} has vocab_size {vocab}; expected at most "
                f"{vocab} (the tokenizer does not belong to this model)")
    return tokenizer


# ------------------------------------------------------------------ output directories


# What attnlab itself writes into a checkpoint directory (io.OWN_FILES) and the
# temp files an atomic write killed by SIGKILL leaves beside them
# (".<name>.<random>.tmp").
_OWN_TEMP = re.compile(r"\.(" + "|".join(map(re.escape, sorted(OWN_FILES))) + r")\..+\.tmp")


def _is_own_file(entry: Path) -> bool:
    return entry.is_file() and not entry.is_symlink() and (
        entry.name in OWN_FILES or _OWN_TEMP.fullmatch(entry.name) is not None)


def _not_ours(out: Path, why: str) -> ValueError:
    return ValueError(
        f"--out {str(out)!r} is not an attnlab checkpoint ({why}); expected a new or empty "
        "directory or one attnlab wrote (a checkpoint replaces its directory as a whole)")


def check_out_dir(out: str | os.PathLike) -> None:
    """Refuse an ``out`` that a checkpoint cannot be written to, before any work.

    A checkpoint replaces its directory as a whole (atomically), so writing one
    into a folder of other files would delete them. A ``config.json`` alone
    proves nothing (a Hugging Face model has one too): it must be attnlab's, and
    every other entry a file attnlab writes there. And the folder the checkpoint
    is built in must accept new entries, or training would fail only at its end.
    """
    _check_parent_writable(out)
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; expected a directory for the checkpoint")
    entries = list(out.iterdir())
    if not entries:
        return
    if not (out / CONFIG_FILE).is_file():
        raise _not_ours(out, f"no {CONFIG_FILE}, but {entries[0].name!r}")
    try:
        config = read_json(out / CONFIG_FILE)
    except CheckpointError as exc:
        raise _not_ours(out, f"{CONFIG_FILE}: {str(exc).split(': ', 1)[-1]}") from None
    if config.get("format") != FORMAT or not isinstance(config.get("model_type"), str):
        raise _not_ours(out, f"its {CONFIG_FILE} has no attnlab format/model_type")
    foreign = sorted(e.name for e in entries if not _is_own_file(e))
    if foreign:
        raise _not_ours(out, f"it also holds {', '.join(map(repr, foreign[:3]))}"
                        + (" ..." if len(foreign) > 3 else ""))


def _check_parent_writable(out: str | os.PathLike) -> None:
    """The checkpoint is built in a temp folder beside ``out`` and renamed into
    place, so its parent must exist (it is created, as the writer would) and
    accept new entries."""
    parent = Path(os.path.abspath(out)).parent
    blocker = next((p for p in (parent, *parent.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise ValueError(f"--out {str(out)!r} cannot be written: {str(blocker)!r} is a file, "
                         "expected a directory")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=f".{Path(out).name}.probe-", dir=parent))
    except OSError as exc:
        raise ValueError(f"--out {str(out)!r} cannot be written: {exc.strerror or exc} "
                         f"(in {str(parent)!r})") from None


def has_checkpoint(out: str | os.PathLike) -> bool:
    out = Path(out)
    recover_dir(out)  # a writer killed between its two renames left the copy beside it
    return (out / STATE_JSON).exists() and (out / CONFIG_FILE).exists()


@torch.no_grad()
def same_weights(a: nn.Module, b: nn.Module) -> bool:
    """True when two models hold bit-identical parameters and buffers."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
