"""``python -m attnlab.lessons --write-notebooks DIR``: write the lesson notebooks."""

from __future__ import annotations

import argparse
import sys

from . import write_notebooks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnlab.lessons",
                                     description="Write the lessons as Jupyter notebooks.")
    parser.add_argument("--write-notebooks", metavar="DIR", required=True,
                        help="folder to write DIR/en/NN-name.ipynb and DIR/zh/NN-name.ipynb into")
    args = parser.parse_args(argv)
    try:
        written = write_notebooks(args.write_notebooks)
    except (ValueError, OSError, ImportError) as exc:  # ImportError: no nbformat
        print(f"{parser.prog}: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
