"""``attnlab ablate``: which model, which text, which experiment; then the report.

- the model: ``--ckpt DIR`` (attnlab), ``--model smollm2|minilm|FILE.gguf|DIR``,
  or neither: the demo model is trained first;
- the text: ``--text FILE``, else an attnlab checkpoint's held-out text (what
  training recorded in its ``config.json``: the start of the last 10%); a Hugging
  Face folder has none, so it needs ``--text``;
- the experiment: ``--heads`` (the head-importance table, PNG and JSON),
  ``--layer L [--head H]`` (one knock-out), or by default the Q/K/V and
  uniform-attention report (decoders; with the dropout study for attnlab models).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
from collections.abc import Callable

import torch

from .. import experiments
from ..experiments import heads
from ..interop.auto import load_for_cli

_DEMO_STEPS = 400  # the demo's own length: ~45 s of CPU time, about a minute on a laptop
HEADS_PNG = "attnlab-heads.png"  # --png's default


def _eval_batch(args, model, tokenizer, meta: dict,
                read_text: Callable[[str], str]) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(ids, mask, where the text came from)``."""
    if args.text is not None:
        ids, mask = heads.batch_from_text(model, tokenizer, read_text(args.text))
        return ids, mask, f"--text {args.text!r}"
    if args.model is not None:
        raise ValueError(f"--model {args.model!r} needs --text FILE to evaluate on (a Hugging "
                         "Face folder records no held-out text)")
    held = meta.get("held_out")
    if isinstance(held, dict) and isinstance(held.get("ids"), list) and held["ids"]:
        if not heads.is_decoder(model):
            raise ValueError("this checkpoint is an encoder: pass --text FILE, one sentence "
                             "a line")
        ids, mask = heads.batch_from_ids(held["ids"], model.context_length)
        return ids, mask, (f"the held-out part of the training text ({len(held['ids'])} of its "
                           f"{held.get('tokens', '?')} tokens)")
    if meta.get("demo"):  # a demo checkpoint from before training recorded its held-out text
        ids = experiments.held_out_batch(tokenizer, seed=args.seed)
        return ids, torch.ones_like(ids), "a fresh sample of the demo's pattern corpus"
    raise ValueError(f"--ckpt {args.ckpt!r} records no held-out text (trained by an older "
                     "attnlab): pass --text FILE")


def _full_rows(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The rows without padding (the Q/K/V report takes an unpadded batch)."""
    full = mask.bool().all(dim=1)
    if full.any():
        return ids[full]
    return ids[:1, :int(mask[0].sum())]


def _check_outputs(args: argparse.Namespace) -> None:
    """Every file and folder this run will write, checked before any model is trained
    or loaded: a bad --json must not cost the whole run."""
    from ..checkpoint import check_out_dir
    from ..io.outdir import check_out_file

    if args.ckpt is None and args.model is None:
        check_out_dir(args.out)  # the demo model's checkpoint (run_demo checks it again)
    for path, name in _out_files(args):
        check_out_file(path, name)


def _out_files(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The single files this run writes, each with its option's name."""
    files = [(args.png or HEADS_PNG, "--png")] if args.heads else []
    if args.json is not None and args.json != "-":
        files.append((args.json, "--json"))
    return files


def run_ablate(args: argparse.Namespace, read_text: Callable[[str], str]) -> int:
    from ..io.locks import output_lock

    if args.head is not None and args.layer is None:
        raise ValueError("--head needs --layer L (the layer the head is in)")
    if args.heads and args.layer is not None:
        raise ValueError("--heads knocks out every head in turn; leave out --layer/--head")
    if args.png is not None and not args.heads:
        raise ValueError(f"--png {args.png!r} is where --heads draws its heatmap: add "
                         "--heads, or leave out --png")
    _check_outputs(args)
    with contextlib.ExitStack() as held:  # one run writes these files at a time
        for path, name in _out_files(args):
            held.enter_context(output_lock(path, name))
        return _ablate(args, read_text)


def _ablate(args: argparse.Namespace, read_text: Callable[[str], str]) -> int:
    from ..demo import run_demo
    from ..io.outdir import check_out_file

    # With --json - stdout carries the JSON alone; what a person reads goes to stderr.
    say = functools.partial(print, file=sys.stderr if args.json == "-" else sys.stdout)
    ckpt = args.ckpt
    if ckpt is None and args.model is None:
        ckpt = args.out
        say(f"no --ckpt: training the demo model first ({_DEMO_STEPS} steps into {ckpt}/, "
            "about a minute on a laptop CPU) ...", flush=True)
        run_demo(ckpt, steps=_DEMO_STEPS, seed=args.seed, log=lambda _msg: None)
    model, tokenizer, meta = load_for_cli(ckpt, args.model)
    ids, mask, source = _eval_batch(args, model, tokenizer, meta, read_text)
    say(f"evaluating on {source}: {ids.shape[0]} row(s) of up to {ids.shape[1]} tokens")
    if args.heads:
        results = heads.head_importance(model, ids, mask)
        say(heads.format_head_table(results))
        from ..viz import save_head_importance

        png = args.png or HEADS_PNG
        check_out_file(png, "--png")  # again: a file may have appeared meanwhile
        png = save_head_importance(png, {"head output zeroed": results["zero"],
                                              "uniform attention": results["uniform"]},
                                   measure=results["measure"])
        say(f"wrote {png}")
    elif args.layer is not None:
        layers = heads.attention_layers(model)
        if not 0 <= args.layer < len(layers):
            raise ValueError(f"--layer must be in [0, {len(layers) - 1}] (the model has "
                             f"{len(layers)} layers), got {args.layer}")
        chosen = ([args.head] if args.head is not None
                  else list(range(layers[args.layer].num_heads)))
        results = heads.knockout(model, ids, mask, [(args.layer, h) for h in chosen])
        what = (f"layer {args.layer} head {args.head}" if args.head is not None
                else f"every head of layer {args.layer}")
        say(heads.format_knockout(results, what))
    else:
        if not heads.is_decoder(model):
            raise ValueError(f"the Q/K/V report measures next-token loss, which an encoder "
                             f"({type(model).__name__}) does not have: use --heads or "
                             "--layer L [--head H]")
        results = experiments.run_all(model, _full_rows(ids, mask), seed=args.seed,
                                      dropout_steps=None if args.model else 200)
        say(experiments.format_report(results))
    if args.json == "-":
        print(json.dumps(results, indent=1))
    elif args.json:
        from ..io import atomic_write_json
        from ..io.outdir import signed

        check_out_file(args.json, "--json")
        atomic_write_json(args.json, signed(results))
        print(f"wrote {args.json}")
    return 0
