"""The ``attnlab`` command: parses arguments and calls library functions, nothing more.

Every ``ValueError``/``TypeError`` (and the library's own checkpoint errors,
which are ValueErrors) becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage too)
        self.exit(2, f"{self.prog}: error: {message}\n")


# --------------------------------------------------------------------------- commands


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import format_worked_example, worked_example

    print(format_worked_example(worked_example()))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    records = bench.run(args.suite, quick=args.quick, memory=not args.no_memory,
                        json_path=args.json)
    if args.markdown:
        print(bench.markdown_table(records, baseline=args.baseline))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="attnlab", description="Attention mechanisms: exact, fast, visible.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser("demo", help="train the toy model on the built-in corpus, show what "
                          "it learned")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="the benchmark suite; --quick, --json FILE")
    bench.add_argument("--suite", action="append",
                       choices=["attention", "modules", "generate", "encode"],
                       help="suite to run (repeatable; default: all)")
    bench.add_argument("--quick", action="store_true", help="small grid, under two minutes")
    bench.add_argument("--json", metavar="FILE", help="write one record per case to FILE")
    bench.add_argument("--no-memory", action="store_true",
                       help="skip the per-case memory subprocesses")
    bench.add_argument("--markdown", action="store_true", help="print a Markdown table at the end")
    bench.add_argument("--baseline", default="torch-sdpa",
                       help="implementation the Markdown ratios refer to")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, PermissionError,
            IsADirectoryError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"attnlab {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"attnlab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
