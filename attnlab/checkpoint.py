"""Checkpoints: ``model.safetensors`` + ``config.json`` (+ ``tokenizer.json``) in one directory.

The one home of the checkpoint directory: its files (names in :mod:`attnlab.io`),
the model and the training state a run resumes from, and the rules for an
output directory (attnlab replaces only folders it wrote). Written atomically
through :func:`attnlab.io.atomic_dir` (a finished directory replaces the old
one in a rename), read without pickle.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checks import non_negative_int
from .io import (
    BEST_DIR,
    CONFIG_FILE,
    MODEL_FILE,
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
from .io.locks import output_lock
from .io.outdir import check_parent_writable, foreign_entries
from .io.reading import CONFIG_LIMIT, STATE_LIMIT
from .io.weights import SafetensorsState
from .models.loading import build_loaded, load_state

FORMAT = 1

__all__ = ["save_checkpoint", "load_checkpoint", "load_checkpoint_tokenizer",
           "write_model_files", "CheckpointError"]


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
    atomic_write_json(directory / CONFIG_FILE, {
        "format": FORMAT, "model_type": model_type, "config": model.config.to_dict(), **extra,
    })


def save_checkpoint(model: nn.Module, directory: str | os.PathLike, *, tokenizer=None,
                    **extra: Any) -> Path:
    """Save ``model`` (and ``tokenizer``) to ``directory``, replacing it atomically.

    ``extra`` keyword arguments (JSON-serialisable) are stored in ``config.json``.
    ``directory`` must be new, empty or an attnlab checkpoint (:func:`check_out_dir`,
    the rule ``--out`` follows too): a folder of other files is refused, not replaced.
    A run writing to it (``attnlab train``) holds its lock, and is not overwritten.
    """
    check_out_dir(directory, "directory")
    with output_lock(directory, "directory"), atomic_dir(directory) as tmp:
        write_model_files(tmp, model, tokenizer=tokenizer, **extra)
    return Path(directory)


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
    from .models import MODEL_TYPES

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
    model = build_loaded(lambda: cls(config), state, source=source)
    bad = next((n for n, t in model.state_dict().items()
                if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
    if bad is not None:  # a diverged run's weights: every output would be NaN
        raise CheckpointError(f"{source}: tensor {bad!r} holds NaN or inf; expected finite "
                              "weights (the run that wrote them diverged)")
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


def _not_ours(out: Path, why: str, name: str) -> ValueError:
    return ValueError(
        f"{name} {str(out)!r} is not an attnlab checkpoint ({why}); expected a new or empty "
        "directory or one attnlab wrote (a checkpoint replaces its directory as a whole)")


def check_out_dir(out: str | os.PathLike, name: str = "--out") -> None:
    """Refuse an ``out`` that a checkpoint cannot be written to, before any work.

    The one rule for every writer of a checkpoint folder (training, the demo,
    :func:`save_checkpoint`). A checkpoint replaces its directory as a whole
    (atomically), so writing one into a folder of other files would delete them.
    A ``config.json`` alone proves nothing (a Hugging Face model has one too): it
    must be attnlab's, and every other entry a file attnlab writes there
    (:func:`attnlab.io.outdir.foreign_entries`). ``name`` is what the message
    calls ``out`` (the CLI option, or the API argument).
    """
    check_parent_writable(out, name)
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"{name} {str(out)!r} is a file; expected a directory for the "
                         "checkpoint")
    entries = sorted(e.name for e in out.iterdir())
    if not entries:
        return
    if not (out / CONFIG_FILE).is_file():
        raise _not_ours(out, f"no {CONFIG_FILE}, but {entries[0]!r}", name)
    try:
        config = read_json(out / CONFIG_FILE, CONFIG_LIMIT)
    except CheckpointError as exc:
        raise _not_ours(out, f"{CONFIG_FILE}: {str(exc).split(': ', 1)[-1]}", name) from None
    if config.get("format") != FORMAT or not isinstance(config.get("model_type"), str):
        raise _not_ours(out, f"its {CONFIG_FILE} has no attnlab format/model_type", name)
    foreign = foreign_entries(out)
    if foreign:
        raise _not_ours(out, f"it also holds {', '.join(map(repr, foreign[:3]))}"
                        + (" ..." if len(foreign) > 3 else ""), name)


def has_checkpoint(out: str | os.PathLike) -> bool:
    out = Path(out)
    recover_dir(out)  # a writer killed between its two renames left the copy beside it
    return (out / STATE_JSON).exists() and (out / CONFIG_FILE).exists()


@torch.no_grad()
def same_weights(a: nn.Module, b: nn.Module) -> bool:
    """True when two models hold bit-identical parameters and buffers."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ------------------------------------------------------------------ training state


def save_training_state(out: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                        gen: torch.Generator, step: int, train_config: dict,
                        history: list, tokenizer=None, meta: dict | None = None,
                        best: dict | None = None) -> None:
    """Write the checkpoint ``out`` of a run at ``step``: the model files and everything
    that makes the next step depend on the steps so far (AdamW moments, the batch
    sampler's generator, torch's RNG, the settings and the loss history), atomically.

    ``best``: ``{"step", "eval_loss", "weights"}`` of the lowest held-out loss so far,
    written as the checkpoint ``out/best/`` in the same atomic swap (the folder is
    replaced as a whole, so the best one travels with every save)."""
    tensors = {"rng.torch": torch.get_rng_state(), "rng.batches": gen.get_state()}
    device = next(model.parameters()).device
    if device.type == "cuda":
        # Dropout on a GPU draws from that device's generator. Only this device's
        # state: under torchrun every rank uses its own GPU the same way, so rank 0's
        # state is each rank's, while the other devices' states in this process
        # were never used.
        tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
    opt = optimizer.state_dict()
    for index, state in opt["state"].items():
        for key, value in state.items():
            tensors[f"optim.{index}.{key}"] = torch.as_tensor(value)
    groups = [{k: v for k, v in g.items()} for g in opt["param_groups"]]
    with atomic_dir(out) as tmp:
        write_model_files(tmp, model, tokenizer=tokenizer, **(meta or {}))
        if best is not None:
            (tmp / BEST_DIR).mkdir()
            write_model_files(tmp / BEST_DIR, model, tokenizer=tokenizer,
                              weights=best["weights"], **(meta or {}),
                              best={"step": best["step"], "eval_loss": best["eval_loss"]})
        save_tensors(tmp / STATE_TENSORS, tensors)
        atomic_write_json(tmp / STATE_JSON, {"step": step, "train_config": train_config,
                                             "param_groups": groups, "history": history})


# Settings a resume may change: ``steps`` is the new total, ``checkpoint_every``
# only decides when state is written, and ``eval_every`` only which steps also get
# an eval loss (its generator is its own; the CLI derives it from ``steps``).
# Everything else changes the weights, so a resume with another value would not
# continue the run it claims to.
RESUMABLE_CHANGES = frozenset({"steps", "checkpoint_every", "eval_every"})


def _check_same_settings(saved, now: dict, out: Path) -> None:
    if not isinstance(saved, dict):
        raise ValueError(f"train_config must be a JSON object, got {type(saved).__name__}")
    changed = [f"--{name.replace('_', '-')} {saved.get(name, 'missing')!r} in the checkpoint, "
               f"{value!r} now" for name, value in now.items()
               if name not in RESUMABLE_CHANGES and saved.get(name, "missing") != value]
    if changed:
        raise CheckpointError(
            f"--resume: the run in {str(out)!r} was trained with other settings ("
            f"{'; '.join(changed)}); resume with the same settings (only --steps and "
            "--checkpoint-every may change) or choose another --out")


def _check_history(history, step) -> list:
    """One ``[step, train_loss, eval_loss|None]`` per step done, as ``_save`` writes it."""
    non_negative_int("step", step)
    if not isinstance(history, list) or len(history) != step or not all(
            isinstance(h, list) and len(h) == 3 for h in history):
        raise ValueError(f"history must be a list of {step} [step, loss, eval] entries, "
                         f"got {str(history)[:60]}")
    return history


def _check_optimizer_state(per_param: dict, groups, optimizer, step: int, out: Path) -> None:
    """AdamW's saved moments and settings, checked before they are loaded: a wrong
    shape would fail only mid-step, betas out of range or NaN moments would train to
    NaN, and a deleted moment would silently restart from zero."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"--resume: the training state in {str(out)!r} is damaged: "
                               f"{why}")

    own = optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(own) or not all(
            isinstance(g, dict) for g in groups):
        raise bad(f"param_groups must be a list of {len(own)} objects, got {str(groups)[:60]}")
    for g in groups:
        betas = g.get("betas")
        if not (isinstance(betas, list | tuple) and len(betas) == 2 and all(
                isinstance(b, int | float) and not isinstance(b, bool) and 0 <= b < 1
                for b in betas)):
            raise bad(f"betas must be two numbers in [0, 1), got {betas!r}")
        for key, low in (("lr", 0.0), ("weight_decay", 0.0), ("eps", 1e-300)):
            value = g.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    math.isfinite(value) and value >= low):
                raise bad(f"{key} must be a finite number >= {low:g}, got {value!r}")
    params = [p for group in own for p in group["params"]]
    expected = set(range(len(params))) if step > 0 else set()
    if set(per_param) != expected:
        missing = sorted(expected - set(per_param))
        extra = sorted(set(per_param) - expected)
        raise bad(f"optimizer moments for parameters {missing or extra} are "
                  f"{'missing' if missing else 'unexpected'}")
    for index, moments in per_param.items():
        shape = tuple(params[index].shape)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            value = moments.get(key)
            want = () if key == "step" else shape
            if value is None:
                raise bad(f"optim.{index}.{key} is missing")
            if tuple(value.shape) != want:
                raise bad(f"optim.{index}.{key} has shape {tuple(value.shape)}, expected {want}")
            if not bool(torch.isfinite(value).all()) or (key == "exp_avg_sq" and bool(
                    (value < 0).any())):
                raise bad(f"optim.{index}.{key} holds NaN, inf or negative values")


def restore_training_state(out: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                           gen: torch.Generator, train_config: dict) -> tuple[int, list]:
    """Load the run saved in ``out`` into ``model``, ``optimizer`` and ``gen`` (and
    torch's RNG); return ``(step, history)``. The saved settings must equal
    ``train_config`` except for :data:`RESUMABLE_CHANGES`."""
    meta = read_config(out)
    if meta.get("model_type") != getattr(model, "model_type", None):
        raise CheckpointError(
            f"--resume: the checkpoint in {str(out)!r} is a {meta.get('model_type')!r} model "
            f"and does not fit the {type(model).__name__} being trained; resume with the "
            "model it was trained with, or choose another --out")
    load_state(model, load_tensors(out / MODEL_FILE),
               source=f"--resume: the checkpoint in {str(out)!r}")
    state = read_json(out / STATE_JSON, STATE_LIMIT)
    tensors = load_tensors(out / STATE_TENSORS)
    per_param: dict[int, dict] = {}
    try:
        _check_same_settings(state["train_config"], train_config, out)
        step = state["step"]
        history = _check_history(state["history"], step)
        for name, value in tensors.items():
            if name.startswith("optim."):
                _, index, key = name.split(".", 2)
                per_param.setdefault(int(index), {})[key] = value
        if step > train_config.get("steps", step):
            raise CheckpointError(
                f"--resume: the checkpoint in {str(out)!r} is at step {step}, beyond --steps "
                f"{train_config['steps']}; give --steps {step} or more (the total)")
        _check_optimizer_state(per_param, state["param_groups"], optimizer, step, out)
        optimizer.load_state_dict({"state": per_param, "param_groups": state["param_groups"]})
        torch.set_rng_state(tensors["rng.torch"])
        gen.set_state(tensors["rng.batches"])
        device = next(model.parameters()).device
        if device.type == "cuda" and "rng.cuda" in tensors:
            torch.cuda.set_rng_state(tensors["rng.cuda"], device)
        return step, history
    except CheckpointError:
        raise
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"--resume: the training state in {str(out)!r} is damaged or "
                              f"incomplete ({type(exc).__name__}: {exc})") from None


def read_best(out: Path) -> dict | None:
    """``{"step", "eval_loss", "weights"}`` of the best checkpoint a run kept in
    ``out/best/`` (:func:`save_training_state`), or None when it has none (a run
    written before there was one)."""
    best = Path(out) / BEST_DIR
    if not (best / CONFIG_FILE).is_file():
        return None
    info = read_json(best / CONFIG_FILE, CONFIG_LIMIT).get("best")
    if not (isinstance(info, dict) and isinstance(info.get("step"), int)
            and isinstance(info.get("eval_loss"), float) and math.isfinite(info["eval_loss"])):
        raise CheckpointError(f"--resume: {str(best / CONFIG_FILE)!r} is damaged: 'best' must "
                              f"be {{step, eval_loss}}, got {str(info)[:60]}")
    return {"step": info["step"], "eval_loss": info["eval_loss"],
            "weights": load_tensors(best / MODEL_FILE)}


def nothing_to_resume(out, log) -> None:
    """A run killed before its first checkpoint left nothing to resume: start it again.

    That is the same run (training is deterministic), so it is a note, not an
    error. A model saved without training state is an error: training it from
    step 0 would replace it.
    """
    if out is None:
        raise CheckpointError("--resume needs --out, the directory holding the checkpoint")
    if (Path(out) / CONFIG_FILE).exists():
        raise CheckpointError(f"--resume: {str(out)!r} holds a model but no training state "
                              f"({STATE_JSON}); train into another --out")
    if log is not None:
        print(f"note: --resume: no checkpoint in {str(out)!r} yet; starting from step 0",
              file=sys.stderr)
