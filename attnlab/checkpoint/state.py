"""The training state a run resumes from: optimizer moments, generators, settings, history,
and the best checkpoint kept in ``OUT/best/``; written in the same atomic swap as the model.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from torch import nn

from ..checks import non_negative_int
from ..io import (
    BEST_DIR,
    CONFIG_FILE,
    MODEL_FILE,
    STATE_JSON,
    STATE_TENSORS,
    CheckpointError,
    atomic_dir,
    atomic_write_json,
    load_tensors,
    read_json,
    save_tensors,
)
from ..io.outdir import refuse_foreign
from ..io.reading import CONFIG_LIMIT, STATE_LIMIT
from ..models.loading import load_state
from .format import read_config, write_model_files


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
    with atomic_dir(out, check=refuse_foreign) as tmp:
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

# Settings added after checkpoints were first written, with the value a run that predates
# them trained with (its checkpoint does not name them).
ADDED_SETTINGS = {"pack": False}


def _check_same_settings(saved, now: dict, out: Path) -> None:
    if not isinstance(saved, dict):
        raise ValueError(f"train_config must be a JSON object, got {type(saved).__name__}")
    saved = {**ADDED_SETTINGS, **saved}
    changed = [f"--{name.replace('_', '-')} {saved.get(name, 'missing')!r} in the checkpoint, "
               f"{value!r} now" for name, value in now.items()
               if name not in RESUMABLE_CHANGES and name != "data"
               and saved.get(name, "missing") != value]
    if changed:
        raise CheckpointError(
            f"--resume: the run in {str(out)!r} was trained with other settings ("
            f"{'; '.join(changed)}); resume with the same settings (only --steps and "
            "--checkpoint-every may change) or choose another --out")
    # The text (``data``: its tokens' count and SHA-256), where the checkpoint names it
    # (a run saved before it was kept is taken at its word).
    if "data" in saved and "data" in now and saved["data"] != now["data"]:
        def text(record) -> str:
            return (f"{record.get('tokens')} tokens, SHA-256 {str(record.get('sha256'))[:12]}..."
                    if isinstance(record, dict) else repr(record))
        raise CheckpointError(
            f"--resume: the run in {str(out)!r} was trained on another text "
            f"({text(saved['data'])}; this one: {text(now['data'])}); resume with the same "
            "--text or choose another --out")


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
    state = read_json(out / STATE_JSON, STATE_LIMIT)
    try:  # before the weights: a changed --context is named, not met as a shape
        _check_same_settings(state["train_config"], train_config, out)
        _check_same_model(meta.get("config"), model, out)
    except CheckpointError:
        raise
    except (KeyError, ValueError, TypeError) as exc:
        raise _damaged(out, exc) from None
    load_state(model, load_tensors(out / MODEL_FILE),
               source=f"--resume: the checkpoint in {str(out)!r}")
    tensors = load_tensors(out / STATE_TENSORS)
    per_param: dict[int, dict] = {}
    try:
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
        raise _damaged(out, exc) from None


# Model settings a resume may change: which kernel computes the same attention.
RESUMABLE_MODEL_CHANGES = ("backend",)


def planned_steps(out: Path) -> int | None:
    """The total of steps the run saved in ``out`` was started for (its ``--steps``), or
    None where its state does not say (read after :func:`restore_training_state` checked
    it)."""
    steps = read_json(Path(out) / STATE_JSON, STATE_LIMIT).get("train_config", {}).get("steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def _check_same_model(saved: dict, model: nn.Module, out: Path) -> None:
    """The model being resumed is the one trained: the same config but for
    :data:`RESUMABLE_MODEL_CHANGES`. A softcap, window or sink setting changes no weight's
    shape, so the weights alone would load into another model and train it."""
    config = getattr(model, "config", None)
    if config is None or not isinstance(saved, dict):
        return
    # The saved config through the class: fields added since it was written take their
    # defaults; JSON's lists compare equal to the tuples a config may hold.
    was = json.loads(json.dumps(type(config).from_dict(saved).to_dict()))
    now = json.loads(json.dumps(config.to_dict()))
    changed = [k for k in now if k not in RESUMABLE_MODEL_CHANGES and was.get(k) != now[k]]
    if changed:
        diff = ", ".join(f"{k}={was.get(k)!r} (given {now[k]!r})" for k in changed[:4])
        raise CheckpointError(
            f"--resume: the checkpoint in {str(out)!r} is a {type(model).__name__} with "
            f"{diff}{' ...' if len(changed) > 4 else ''}; resume with the model it was "
            "trained with, or choose another --out")


def _damaged(out: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(f"--resume: the training state in {str(out)!r} is damaged or "
                           f"incomplete ({type(exc).__name__}: {exc})")


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
