"""The ``attnlab`` command: parses arguments and calls library functions, nothing more.

Every ``ValueError``/``TypeError`` (and the library's own checkpoint errors,
which are ValueErrors) becomes one line on stderr and exit status 2. A bare
``attnlab`` is a usage error too: it prints the usage and the list of commands
on stderr and exits with status 2. Every option's help shows its default.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .checks import bounded_int, finite_float, non_negative_int, positive_int


def _option(parse, check):
    """An argparse type: ``parse`` the text, then apply the library's own rule
    (:mod:`attnlab.checks`), so an option says what the argument it feeds says."""
    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            value = text  # the check then names what came
        try:
            return check("", value)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc).strip()) from None
    return convert


_positive_int = _option(int, positive_int)
_positive_float = _option(float, lambda name, value: finite_float(name, value, positive=True))
_non_negative_float = _option(float, lambda name, value: finite_float(name, value, least=0.0))
_index = _option(int, non_negative_int)  # --layer, --head: the upper end needs the model


def _steps(name: str, value: object) -> int:
    from .training import check_steps  # imported when used: the parser stays light

    return check_steps(name, value)


def _new_tokens(name: str, value: object) -> int:
    from .models.generation import MAX_NEW_TOKENS

    return bounded_int(name, value, 1, MAX_NEW_TOKENS)


_step_count = _option(int, _steps)
_new_token_count = _option(int, _new_tokens)


def _seed(text: str) -> int:
    from .training import check_seed

    try:
        return check_seed(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer in [0, 2**63), got {text!r}") from None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default; "off" for a flag, "none" for no value,
    unless the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if action.default is None or action.default is False:
            return f"{text} (default: {'off' if action.default is False else 'none'})".strip()
        return f"{text} (default: %(default)s)".strip()


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # one line, exit 2 (argparse prints usage too)
        self.exit(2, f"{self.prog}: error: {message}\n")


# --------------------------------------------------------------------------- commands


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import format_worked_example, run_demo, worked_example

    if args.worked_example:
        print(format_worked_example(worked_example()))
        return 0
    run_demo(args.out, steps=args.steps, seed=args.seed)  # checks --out before training
    return 0


def _read_text(path: str | None) -> str:
    from .io.reading import TEXT_LIMIT, read_text
    from .text.corpus import pattern_corpus

    if path is None:
        return pattern_corpus()
    # A regular file of at most TEXT_LIMIT: a FIFO or /dev/zero would hang or fill memory.
    text = read_text(path, TEXT_LIMIT, "--text")
    if not text.strip():
        raise ValueError(f"--text {path!r} is empty")
    return text


# The sizes of the models ``attnlab train --model`` builds (besides vocab and context).
_TRAIN_MODELS = {"toy": {"d_model": 64},
                 "gpt": {"d_model": 128, "num_layers": 4, "num_heads": 4}}


def cmd_train(args: argparse.Namespace) -> int:
    import os
    from types import SimpleNamespace

    from .checkpoint import check_out_dir
    from .io.locks import output_lock
    from .training import check_training_fits

    # Before anything is touched: --batch-size and --context that cannot fit are named
    # as such (a lower bound, the vocabulary of one token; the model's own check, once
    # the text is read, would only say the model is too large).
    check_training_fits(SimpleNamespace(vocab_size=1, **_TRAIN_MODELS[args.model]),
                        args.batch_size, args.context,
                        world=max(1, int(os.environ.get("WORLD_SIZE", "1"))))
    # Before anything is read or trained: a bad --out is known at once, and the
    # lock keeps a second run off this --out for the whole of this one. Under
    # torchrun only rank 0 writes, so only rank 0 checks and holds the lock.
    if int(os.environ.get("RANK", "0")) != 0:
        return _train(args)
    check_out_dir(args.out)
    with output_lock(args.out):
        return _train(args)


def _train(args: argparse.Namespace) -> int:
    import torch

    from .checkpoint import load_checkpoint_tokenizer
    from .models import GPT, GPTConfig, ToyAttnLM, ToyConfig
    from .text import CharTokenizer
    from .training import TrainConfig, default_checkpoint_every, train, train_device

    text = _read_text(args.text)
    every = args.checkpoint_every or default_checkpoint_every(args.steps)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, context=args.context,
                      lr=args.lr, seed=args.seed, checkpoint_every=every,
                      eval_every=max(1, min(100, args.steps // 5)))
    tokenizer = load_checkpoint_tokenizer(args.out) if args.resume else None
    tokenizer = tokenizer or CharTokenizer.from_text(text)
    tokens = torch.tensor(tokenizer.encode(text))
    torch.manual_seed(args.seed)
    sizes = {"vocab_size": tokenizer.vocab_size, "context_length": args.context,
             **_TRAIN_MODELS[args.model]}
    if args.model == "toy":
        model = ToyAttnLM(ToyConfig(**sizes))
    else:
        model = GPT(GPTConfig(**sizes, dropout=0.0))
    model.to(train_device())
    summary = train(model, tokens, cfg, out=args.out, resume=args.resume, tokenizer=tokenizer)
    rank0 = summary["world_size"] == 1 or int(__import__("os").environ.get("RANK", "0")) == 0
    if rank0 and summary["resumed_from"] == summary["steps"]:
        print(f"{args.out}/ already holds all {summary['steps']} steps: nothing to do")
    elif rank0:
        from .io import SUMMARY_FILE, atomic_write_json

        atomic_write_json(f"{args.out}/{SUMMARY_FILE}", summary)
        best = (f"; lowest eval {summary['best_eval_loss']:.4f} (step {summary['best_step']}) "
                f"in {args.out}/best/" if summary["best_step"] != summary["steps"] else "")
        print(f"trained {summary['steps']} steps: loss {summary['final_loss']:.4f}, "
              f"eval {summary['eval_loss']:.4f}; checkpoint in {args.out}/{best}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .interop.auto import load_for_cli
    from .models import decoding
    from .models.generation import check_sampling

    # Before the model is loaded (minutes for a large folder): a bad option is one line.
    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    model, tokenizer, _ = load_for_cli(args.ckpt, args.model)
    try:
        ids = tokenizer.encode(args.prompt)
    except ValueError as exc:
        raise ValueError(f"--prompt: {exc}") from None
    if not ids:
        raise ValueError("--prompt is empty")
    if not hasattr(model, "generate"):
        given = f"--ckpt {args.ckpt!r}" if args.ckpt else f"--model {args.model!r}"
        raise ValueError(f"{given} holds a {type(model).__name__}, which does not "
                         "generate text; expected a decoder (ToyAttnLM, GPT, or a GPT-2, Llama, "
                         "Mistral or Qwen2 folder)")
    gen = torch.Generator().manual_seed(args.seed)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    # Text pieces, not one decode per token: a character split over several byte-level
    # tokens is printed once it is whole, never as U+FFFD. Only attnlab's code runs
    # between the tokens here, so the fused decoding plan is made once (as generate).
    with decoding.held(model, [ids]):
        for piece in model.stream([ids], args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, generator=gen,
                                  use_cache=len(ids) + args.max_new_tokens
                                  <= model.context_length, tokenizer=tokenizer):
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from .interop.auto import known_text, load_for_cli
    from .io.outdir import check_own_dir
    from .viz import show_attention

    check_own_dir(args.out)  # before the model is loaded (show_attention checks it again)
    model, tokenizer, meta = load_for_cli(args.ckpt, args.model, demo_fallback=True)
    paths = show_attention(model, tokenizer, args.text, args.out, layer=args.layer,
                           head=args.head, rollout=args.rollout,
                           example=known_text(meta, tokenizer))
    print(f"wrote {paths['png']}")
    print(f"wrote {paths['html']}")
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    from .cli_ablate import run_ablate

    return run_ablate(args, _read_text)


def cmd_learn(args: argparse.Namespace) -> int:
    from .lessons import default_lang, listing, run_lesson

    lang = args.lang or default_lang()
    if args.number is None:
        print(listing(lang))
        return 0
    return 0 if run_lesson(args.number, lang=lang, out=args.out, text=args.text)["passed"] else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench
    from .io.outdir import check_out_file

    if args.baseline is not None and not args.markdown:
        raise ValueError(f"--baseline {args.baseline!r} sets what the Markdown tables divide "
                         "by: add --markdown (the JSON records hold every ratio)")
    if args.json is not None:
        check_out_file(args.json, "--json")
    # bench.run checks --baseline against the chosen cases before any case runs.
    records = bench.run(args.suite, quick=args.quick, memory=not args.no_memory,
                        json_path=args.json, case_filter=args.case, baseline=args.baseline,
                        under_load=args.under_load)
    if args.markdown:
        print(bench.markdown_table(records, baseline=args.baseline))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from .check import check_spec

    report = check_spec(args.spec, lang=args.lang)
    print(report)
    return 0 if report.ok else 1


def _model_options(parser: argparse.ArgumentParser, *, minilm: bool = True,
                   ckpt_help: str = "an attnlab checkpoint") -> None:
    """``--ckpt DIR`` or ``--model DIR`` (a Hugging Face folder; ``minilm`` = the bundled
    MiniLM where it fits), one of them."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--ckpt", metavar="DIR", help=ckpt_help)
    source.add_argument("--model", metavar="minilm|DIR" if minilm else "DIR",
                        help="a folder written by transformers' save_pretrained (GPT-2, "
                             "Llama, Mistral, Qwen2, BERT, RoBERTa, DistilBERT; safetensors "
                             "and tokenizer.json)"
                             + ("; minilm = the bundled all-MiniLM-L6-v2" if minilm else ""))


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__

    parser = _Parser(prog="attnlab", description="Attention mechanisms: exact, fast, visible.",
                     epilog="Run 'attnlab COMMAND --help' for the options of a command.")
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    # Not required: a bare ``attnlab`` gets the full usage (main), not argparse's one line.
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    demo = sub.add_parser("demo", help="train the toy model on the built-in corpus, show what "
                          "it learned")
    demo.add_argument("--out", default="attnlab-demo", help="output directory")
    demo.add_argument("--steps", type=_step_count, default=400, help="training steps")
    demo.add_argument("--seed", type=_seed, default=0, help="random seed")
    demo.add_argument("--worked-example", action="store_true",
                      help="print the 2x2 worked example of attention, step by step, instead")
    demo.set_defaults(func=cmd_demo)

    train = sub.add_parser("train", help="train a model on the built-in corpus or --text FILE; "
                           "--resume")
    train.add_argument("--text", metavar="FILE",
                       help="UTF-8 text to train on, char-level (default: the built-in corpus)")
    train.add_argument("--model", choices=["toy", "gpt"], default="gpt", help="which model")
    train.add_argument("--steps", type=_step_count, default=500, help="total steps")
    train.add_argument("--batch-size", type=_positive_int, default=32, help="rows per step")
    train.add_argument("--context", type=_positive_int, default=128,
                       help="tokens per row (and the model's context length)")
    train.add_argument("--lr", type=_positive_float, default=3e-3, help="peak learning rate")
    train.add_argument("--seed", type=_seed, default=0, help="random seed")
    train.add_argument("--out", default="attnlab-train", help="checkpoint directory")
    train.add_argument("--checkpoint-every", type=_step_count, default=None,
                       help="steps between checkpoints, so a killed run can --resume "
                            "(default: a tenth of --steps)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the checkpoint in --out (--steps is the total)")
    train.set_defaults(func=cmd_train)

    generate = sub.add_parser("generate", help="sample from a checkpoint or a Hugging Face "
                              "folder (--model DIR)")
    _model_options(generate, minilm=False)
    generate.add_argument("--prompt", required=True, help="text to continue (required)")
    generate.add_argument("--max-new-tokens", type=_new_token_count, default=100,
                          help="tokens to add")
    generate.add_argument("--temperature", type=_non_negative_float, default=1.0,
                          help="sampling temperature; 0 = greedy")
    generate.add_argument("--top-k", type=_positive_int, default=None,
                          help="sample among the k most likely tokens only (default: all)")
    generate.add_argument("--top-p", type=_positive_float, default=None,
                          help="nucleus sampling: the most likely tokens up to probability p "
                               "(default: all)")
    generate.add_argument("--seed", type=_seed, default=0, help="random seed")
    generate.set_defaults(func=cmd_generate)

    show = sub.add_parser("show", help="attention of a model on TEXT as PNG heatmaps and an "
                          "HTML explorer")
    show.add_argument("text", help="the text to look at (any script)")
    _model_options(show, ckpt_help="an attnlab checkpoint (default, with no --model: "
                                   "./attnlab-demo, which `attnlab demo` writes)")
    show.add_argument("--rollout", action="store_true",
                      help="add the attention rollout (Abnar & Zuidema 2020) as a last layer")
    show.add_argument("--layer", type=_index, default=None,
                      help="only this layer in the PNG (default: every layer)")
    show.add_argument("--head", type=_index, default=None,
                      help="only this head in the PNG (default: every head)")
    show.add_argument("--out", default="attnlab-show", help="output directory")
    show.set_defaults(func=cmd_show)

    ablate = sub.add_parser("ablate", help="the Q/K/V, uniform-attention and per-head "
                            "experiments, as a report")
    _model_options(ablate, ckpt_help="a trained attnlab checkpoint (default: train the demo "
                   "model first, about a minute)")
    ablate.add_argument("--text", metavar="FILE",
                        help="UTF-8 text to evaluate on (an encoder: one sentence a line); "
                             "default: the checkpoint's held-out text; required with --model")
    ablate.add_argument("--heads", action="store_true",
                        help="the head-importance table: each head alone knocked out")
    ablate.add_argument("--layer", type=_index, default=None,
                        help="knock out this layer's heads (all, or --head H) and report")
    ablate.add_argument("--head", type=_index, default=None, help="with --layer: only this head")
    ablate.add_argument("--png", metavar="FILE", default="attnlab-heads.png",
                        help="where --heads draws its layer x head heatmap")
    ablate.add_argument("--json", metavar="FILE",
                        help="also write the results as JSON to FILE ('-': print them)")
    ablate.add_argument("--out", default="attnlab-demo",
                        help="where the demo model is trained when no --ckpt is given")
    ablate.add_argument("--seed", type=_seed, default=0, help="random seed")
    ablate.set_defaults(func=cmd_ablate)

    learn = sub.add_parser("learn", help="lesson N of the learner's path (--lang zh|en); "
                           "no N: the list")
    learn.add_argument("number", metavar="N", type=int, nargs="?",
                       help="the lesson, 1 to 14 (default: list the lessons)")
    learn.add_argument("--lang", choices=["en", "zh"], default=None,
                       help="language of the lesson (default: zh when LANG or LC_ALL starts "
                            "with zh, else en)")
    learn.add_argument("--text", metavar="SENTENCE",
                       help="your own sentence for the lessons that use one, e.g. "
                            "我喜欢蓝色的天空 (default: the lesson's)")
    learn.add_argument("--out", default="attnlab-lessons", help="folder for the pictures")
    learn.set_defaults(func=cmd_learn)

    bench = sub.add_parser("bench", help="the benchmark suite; --quick, --json FILE")
    bench.add_argument("--suite", action="append",
                       choices=["attention", "modules", "generate", "encode"],
                       help="suite to run, repeatable (default: all)")
    bench.add_argument("--quick", action="store_true", help="small grid, under two minutes")
    bench.add_argument("--case", metavar="TEXT",
                       help="only the cases whose name contains TEXT, e.g. 'T=4096 causal' "
                            "(default: all)")
    bench.add_argument("--json", metavar="FILE", help="write one record per case to FILE")
    bench.add_argument("--no-memory", action="store_true",
                       help="skip the per-case memory subprocesses")
    bench.add_argument("--markdown", action="store_true",
                       help="print Markdown tables at the end (one per suite)")
    bench.add_argument("--baseline", metavar="IMPL",
                       help="implementation the Markdown ratios refer to (default: each "
                            "suite's peer: torch-sdpa, book PyTorchMHA, transformers, "
                            "sentence-transformers)")
    bench.add_argument("--under-load", action="store_true",
                       help="time each case again beside a busy process per core (started "
                            "before, stopped after it) and set the ratios side by side")
    bench.set_defaults(func=cmd_bench)

    check = sub.add_parser("check", help="test a learner's own attention against the oracle, "
                           "name each bug", description="Run FILE's NAME (a function (x), "
                           "(x, mask) or (q, k, v[, mask]), or an nn.Module class) against the "
                           "oracle; one line per finding. Exit 0 when clean, 1 when a bug is "
                           "found, 2 for bad input.")
    check.add_argument("spec", metavar="FILE:NAME", help="e.g. my_attention.py:SelfAttention")
    check.add_argument("--lang", choices=["en", "zh"], default=None,
                       help="language of the findings (default: from the locale)")
    check.set_defaults(func=cmd_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `attnlab`: what it can do, as a usage error
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, OSError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"attnlab {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"attnlab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
