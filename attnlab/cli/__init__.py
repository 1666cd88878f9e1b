"""The ``attnlab`` command: parses arguments and calls library functions, nothing more.

Every ``ValueError``/``TypeError`` (and the library's own checkpoint errors,
which are ValueErrors) becomes one line on stderr and exit status 2. A bare
``attnlab`` is a usage error too: it prints the usage and the list of commands
on stderr and exits with status 2. Every option's help shows its default.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from ..io.reading import normal_line_ends
from .commands import (
    cmd_ablate,
    cmd_bench,
    cmd_check,
    cmd_demo,
    cmd_generate,
    cmd_learn,
    cmd_show,
    cmd_train,
)
from .heads import add_heads_parser
from .options import (
    _index,
    _model_options,
    _new_token_count,
    _non_negative_float,
    _Parser,
    _positive_float,
    _positive_int,
    _probability,
    _seed,
    _step_count,
)

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

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
                       help="UTF-8 text to train on, char-level ('-': standard input; "
                            "default: the built-in corpus)")
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
    train.add_argument("--overwrite", action="store_true",
                       help="train a new model in an --out that holds a run, replacing it at "
                            "the first checkpoint (without --resume or --overwrite such an "
                            "--out is refused)")
    train.add_argument("--context-parallel", type=_positive_int, default=1, metavar="N",
                       help="under torchrun: split each sequence over N processes (ring "
                            "attention; --model gpt); N must divide the number of processes")
    train.add_argument("--pack", action="store_true",
                       help="train on the text's documents (separated by blank lines) packed "
                            "into each row with document ids: no token attends across "
                            "documents; prints the padding tokens this saves against one "
                            "document per row")
    arch = train.add_argument_group(
        "the gpt model's shape and attention (--model gpt; with --resume, the "
        "checkpoint's where not given)")
    for flag, kind, text in (
            ("--layers", _positive_int, "transformer blocks (default: 4)"),
            ("--heads", _positive_int, "query heads (default: 4)"),
            ("--kv-heads", _positive_int, "key/value heads, fewer than --heads for "
             "grouped-query attention (default: --heads)"),
            ("--d-model", _positive_int, "width of the residual stream (default: 128)"),
            ("--positions", ["learned", "rope", "alibi"], "learned position embeddings, "
             "rotary (RoPE) or ALiBi's distance penalty (default: learned)"),
            ("--window", _positive_int, "sliding window: each token sees itself and the "
             "window - 1 before it (default: the whole context)"),
            ("--softcap", _positive_float, "cap attention scores at softcap * tanh(score / "
             "softcap), as Gemma 2 does (default: none)"),
            ("--sinks", None, "a learned sink logit per head that joins each softmax, as "
             "gpt-oss has (default: off)")):
        if kind is None:  # a switch; None when not given, so --resume keeps the checkpoint's
            arch.add_argument(flag, action="store_const", const=True, default=None, help=text)
        elif isinstance(kind, list):
            arch.add_argument(flag, choices=kind, default=None, help=text)
        else:
            arch.add_argument(flag, type=kind, default=None, help=text)
    train.set_defaults(func=cmd_train)

    generate = sub.add_parser("generate", help="sample from a checkpoint, a Hugging Face "
                              "folder, a GGUF file or smollm2 (--model); --chat")
    _model_options(generate, minilm=False)
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text to continue ('-': standard input)")
    prompt.add_argument("--chat", metavar="MESSAGE",
                        help="a user message, put in the model's chat template (a GGUF "
                             "file's, e.g. --model smollm2); the reply stops at the end of "
                             "its turn ('-': standard input)")
    generate.add_argument("--max-new-tokens", type=_new_token_count, default=100,
                          help="tokens to add")
    generate.add_argument("--temperature", type=_non_negative_float, default=1.0,
                          help="sampling temperature; 0 = greedy")
    generate.add_argument("--top-k", type=_positive_int, default=None,
                          help="sample among the k most likely tokens only (default: all)")
    generate.add_argument("--top-p", type=_probability, default=None,
                          help="nucleus sampling: the most likely tokens up to probability p "
                               "(default: all)")
    generate.add_argument("--seed", type=_seed, default=0, help="random seed")
    generate.add_argument("--precision", choices=["float32", "bfloat16", "int8"],
                          help="hold a GPT's weights in bfloat16 (half the bytes read a "
                               "token) or int8 (weight-only, llama.cpp's Q8_0: a GGUF file's "
                               "Q8_0 matrices kept as they are), or float32 (default: as a "
                               "folder or checkpoint holds them, float32 for a GGUF file)")
    generate.set_defaults(func=cmd_generate)

    show = sub.add_parser("show", help="attention of a model on TEXT as PNG heatmaps and an "
                          "HTML explorer")
    show.add_argument("text", help="the text to look at (any script)")
    _model_options(show, ckpt_help="an attnlab checkpoint (default, with no --model: "
                                   "./attnlab-demo, which `attnlab demo` writes)")
    show.add_argument("--rollout", action="store_true",
                      help="add the attention rollout (Abnar & Zuidema 2020) as a last layer")
    show.add_argument("--layer", type=_index, default=None,
                      help="only this layer in the picture (default: every layer; with "
                           "--compare: the layer of the head that differs most)")
    show.add_argument("--head", type=_index, default=None,
                      help="only this head in the picture (default: every head; with "
                           "--compare: the head that differs most)")
    show.add_argument("--compare", metavar="TEXT", default=None,
                      help="a second text: one head on both and their difference where the "
                           "tokens align; the explorer gets a diff mode")
    show.add_argument("--classify", action="store_true",
                      help="label each head with what it does (attnlab heads' probes: one "
                           "more forward pass over a short random sequence)")
    show.add_argument("--format", choices=["png", "svg"], default="png",
                      help="format of the picture (attention.png or attention.svg)")
    show.add_argument("--out", default="attnlab-show", help="output directory")
    show.set_defaults(func=cmd_show)

    ablate = sub.add_parser("ablate", help="the Q/K/V, uniform-attention and per-head "
                            "experiments, as a report")
    _model_options(ablate, ckpt_help="a trained attnlab checkpoint (default: train the demo "
                   "model first, about a minute)")
    ablate.add_argument("--text", metavar="FILE",
                        help="UTF-8 text to evaluate on (an encoder: one sentence a line; "
                             "'-': standard input); default: the checkpoint's held-out text; "
                             "required with --model")
    ablate.add_argument("--heads", action="store_true",
                        help="the head-importance table: each head alone knocked out")
    ablate.add_argument("--layer", type=_index, default=None,
                        help="knock out this layer's heads (all, or --head H) and report")
    ablate.add_argument("--head", type=_index, default=None, help="with --layer: only this head")
    ablate.add_argument("--png", metavar="FILE",
                        help="where --heads draws its layer x head heatmap (default: "
                             "attnlab-heads.png)")
    ablate.add_argument("--json", metavar="FILE",
                        help="also write the results as JSON to FILE ('-': print them on stdout, "
                             "the report on stderr)")
    ablate.add_argument("--out", default="attnlab-demo",
                        help="where the demo model is trained when no --ckpt is given")
    ablate.add_argument("--seed", type=_seed, default=0, help="random seed")
    ablate.set_defaults(func=cmd_ablate)

    add_heads_parser(sub)

    learn = sub.add_parser("learn", help="lesson N of the learner's path (--lang zh|en); "
                           "no N: the list", learner=True)
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
                       choices=["attention", "modules", "generate", "encode", "distributed",
                                "gpu"],
                       help="suite to run, repeatable (default: all but distributed and "
                            "gpu, which run only when named; gpu needs a CUDA device)")
    bench.add_argument("--quick", action="store_true", help="small grid, under two minutes")
    bench.add_argument("--case", metavar="TEXT", action="append",
                       help="only the case named TEXT, or where none is, the cases whose "
                            "name contains it, e.g. 'fwd T=4096 causal' (that case alone) or "
                            "'T=4096' (every case at that length); repeatable (default: all)")
    bench.add_argument("--json", metavar="FILE", help="write one record per case to FILE "
                       "(- : the JSON alone on standard output, the report on stderr)")
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
                           "found, 2 for bad input.", learner=True)
    check.add_argument("spec", metavar="FILE:NAME", help="e.g. my_attention.py:SelfAttention")
    check.add_argument("--lang", choices=["en", "zh"], default=None,
                       help="language of the findings (default: from the locale)")
    check.set_defaults(func=cmd_check)
    parser.learner_commands = ("learn", "check")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:  # checking an option may import torch: a Ctrl-C then is an interruption too
        parser = build_parser()
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        print("attnlab: interrupted", file=sys.stderr)
        return 130
    if args.command is None:  # a bare `attnlab`: what it can do, as a usage error
        parser.print_help(sys.stderr)
        return 2
    if sys.stdout is None:  # started with standard output closed (`>&-`)
        print(f"attnlab {args.command}: error: standard output is closed; redirect it to "
              "a file or /dev/null instead", file=sys.stderr)
        return 2
    _replace_what_cannot_be_printed()
    _expand_home(args)
    if getattr(args, "png", None) == "-":  # not a file named '-' in the working folder
        print(f"attnlab {args.command}: error: --png - : a PNG is an image, not text for "
              "standard output; give a file name", file=sys.stderr)
        return 2
    broken = _read_text_options(args)
    if broken is not None:
        stdin = " or give it on standard input ('-')" if args.command == "generate" else ""
        print(f"attnlab {args.command}: error: {broken} is not UTF-8 text (the terminal "
              f"passed bytes that are not); set the terminal to UTF-8{stdin}", file=sys.stderr)
        return 2
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a reader that went away is caught, not at exit
        return status
    except BrokenPipeError as exc:
        if not _reader_gone(sys.stdout) and not _reader_gone(sys.stderr):
            print(f"attnlab {args.command}: error: {exc}", file=sys.stderr)
            return 2
        # The reader of stdout (or stderr) went away (`| head`): end quietly, as a
        # program killed by SIGPIPE does, with its status; the gone stream goes to
        # /dev/null so that the interpreter's last flush does not raise again.
        null = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            if _reader_gone(stream):
                os.dup2(null, stream.fileno())
        os.close(null)
        return 128 + signal.SIGPIPE
    except (ValueError, TypeError, OSError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"attnlab {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"attnlab {args.command}: interrupted", file=sys.stderr)
        return 130


def run() -> NoReturn:
    """``attnlab`` and ``python -m attnlab``: :func:`main`, its status the process's.

    A process that trained under torchrun ends there without finalising the
    interpreter: gloo's worker threads outlive the group, and one that frees a tensor
    while the interpreter finalises aborts the rank after a finished run (see
    :func:`attnlab.training.distributed._leave_group`), or after an error that ends the
    run (its traceback printed, status 1). Everything it wrote is closed by then; its
    standard streams are flushed here."""
    def threads_left() -> bool:
        group = sys.modules.get("attnlab.training.distributed")
        return group is not None and group.threads_left()

    try:
        status = main()
    except BaseException as exc:  # one main() does not turn into a line (a RuntimeError)
        if not threads_left():
            raise
        traceback.print_exc()
        status = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
    if threads_left():
        for stream in (sys.stdout, sys.stderr):
            # A reader gone or a stream closed: nothing left to keep.
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        os._exit(status)
    raise SystemExit(status)


# The options that hold text to read (not a path, where any bytes may name a file), by
# command: a byte that is not UTF-8 reaches Python as a lone surrogate, which the
# tokenizer would report as an unknown character such as '\udce5'.
_TEXT_OPTIONS = {"generate": ("prompt", "chat"), "show": ("text", "compare"),
                 "learn": ("text",)}


# The options that name a file or folder (the train and ablate --text is a file too).
_PATH_OPTIONS = ("out", "ckpt", "model", "json", "png", "text")


def _expand_home(args: argparse.Namespace) -> None:
    """``--out=~/pics``: the shell expands ``~`` only at the start of a word, so the option
    came with it, and a folder named ``~`` would be made in the working directory (one
    ``rm -rf ~`` away from a disaster). A path option's leading ``~`` is the home folder."""
    for dest in _PATH_OPTIONS:
        value = getattr(args, dest, None)
        if isinstance(value, str) and value.startswith("~") and \
                not (dest == "text" and args.command in _TEXT_OPTIONS):
            setattr(args, dest, os.path.expanduser(value))


def _read_text_options(args: argparse.Namespace) -> str | None:
    """The text options of ``args`` as text (line ends as a file's), or the first one that
    holds bytes that are not UTF-8, named as typed (then nothing is changed after it).

    Bytes Python could not decode are kept as lone surrogates: a terminal not in UTF-8,
    or UTF-8 read under a locale that is not (``LC_ALL=C`` with UTF-8 mode off). The
    latter are taken as the UTF-8 text they are; the rest are named."""
    for dest in _TEXT_OPTIONS.get(args.command, ()):
        value = getattr(args, dest, None)
        if isinstance(value, str) and any("\udc80" <= c <= "\udcff" for c in value):
            try:
                value = value.encode("utf-8", "surrogateescape").decode("utf-8")
            except UnicodeError:
                return "the text" if dest == "text" and args.command == "show" else f"--{dest}"
        if isinstance(value, str):  # a pasted Windows line end reads as a file's does
            setattr(args, dest, normal_line_ends(value))
    return None


def _replace_what_cannot_be_printed() -> None:
    """A console whose encoding lacks a character (GBK on a Chinese Windows, ``LANG=C``)
    shows it as ``?`` instead of ending a generation half-way with an encoding error: the
    text printed is for reading, and files attnlab writes are UTF-8 whatever the console."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        # (surrogateescape: the C locale without UTF-8 mode, which cannot encode text either)
        if reconfigure is not None and getattr(stream, "errors", "strict") in (
                "strict", "surrogateescape"):
            reconfigure(errors="replace")


def _reader_gone(stream) -> bool:
    """Whether ``stream`` is a pipe or socket whose reader is gone: poll reports an error
    (a pipe) or a hang-up (a socket)."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(main())
