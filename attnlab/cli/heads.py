"""``attnlab heads``: what each head does, as a table, a picture and JSON."""

from __future__ import annotations

import argparse

from .options import _model_options, _positive_int, _seed


def add_heads_parser(sub) -> None:
    heads = sub.add_parser("heads", help="what each head does (previous-token, induction, "
                           "sink, ...) as a table",
                           description="Score every head on documented probes (previous-token, "
                           "induction, sink, self, duplicate-token) over random token sequences "
                           "repeated twice; print the layer x head table, write heads.json and "
                           "a picture into --out.")
    _model_options(heads, ckpt_help="an attnlab checkpoint (default, with no --model: "
                                    "./attnlab-demo, which `attnlab demo` writes)")
    heads.add_argument("--length", type=_positive_int, default=None,
                       help="random tokens per copy of the probe sequence (default: 64, or "
                            "half the model's context when shorter)")
    heads.add_argument("--batch", type=_positive_int, default=4,
                       help="how many random sequences the scores average over")
    heads.add_argument("--seed", type=_seed, default=0, help="seed of the random sequences")
    heads.add_argument("--format", choices=["png", "svg"], default="png",
                       help="the picture's format")
    heads.add_argument("--out", default="attnlab-heads", help="output directory")
    heads.set_defaults(func=cmd_heads)


def cmd_heads(args: argparse.Namespace) -> int:
    from ..heads import classify, format_kinds, save_kinds
    from ..interop.auto import load_for_cli
    from ..io.outdir import check_own_dir

    check_own_dir(args.out)  # before the model is loaded (save_kinds checks it again)
    model, tokenizer, _ = load_for_cli(args.ckpt, args.model, demo_fallback=True)
    result = classify(model, tokenizer, length=args.length, batch=args.batch, seed=args.seed)
    print(format_kinds(result))
    source = args.model if args.model is not None else (args.ckpt or "attnlab-demo")
    paths = save_kinds(result, args.out, fmt=args.format, source=source)
    print(f"wrote {paths['json']}")
    print(f"wrote {paths['picture']}")
    return 0
