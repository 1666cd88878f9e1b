"""The API a user types first: names on `attnlab` after `import attnlab`, plain tokenizer.json."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hf_tokenizers import wordpiece

import attnlab
from attnlab.text import HFTokenizer, load_tokenizer


@pytest.mark.parametrize("name", ["GPT", "GPTConfig", "Encoder", "EncoderConfig", "ToyAttnLM",
                                  "ToyConfig", "HFTokenizer"])
def test_model_and_tokenizer_classes_are_on_the_package(name):
    from attnlab import models, text

    assert getattr(attnlab, name) is getattr(models if hasattr(models, name) else text, name)
    assert name in dir(attnlab)


@pytest.mark.parametrize("name", ["viz", "experiments", "text", "models", "interop"])
def test_subpackages_are_attributes_after_a_plain_import(name):
    code = f"import attnlab; m = attnlab.{name}; print(m.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == f"attnlab.{name}"


def test_the_heavy_parts_wait_until_used():
    code = ("import sys, attnlab; print('matplotlib' in sys.modules, "
            "'attnlab.experiments' in sys.modules); attnlab.viz.heatmap([[1.0]], ['a']); "
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False", "True"]


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Gpt'"):
        attnlab.Gpt  # noqa: B018


def test_a_plain_hugging_face_tokenizer_json_loads_both_ways(tmp_path):
    path = tmp_path / "tokenizer.json"
    wordpiece().save(str(path))  # what a Hugging Face folder holds: no attnlab "type"
    for tok in (HFTokenizer.load(path), load_tokenizer(path)):
        assert isinstance(tok, HFTokenizer)
        assert tok.decode(tok.encode("the cat sat")) == "the cat sat"


def test_help_never_imports_torch():
    """`attnlab --help` took 1.5 s importing torch through the package's __init__;
    the help of the command and of every subcommand needs none of it."""
    code = ("import argparse, contextlib, io, sys\n"
            "from attnlab.cli import build_parser, main\n"
            "sub = next(a for a in build_parser()._actions\n"
            "           if isinstance(a, argparse._SubParsersAction))\n"
            "for argv in [['--help'], *([name, '--help'] for name in sub.choices)]:\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        main(argv)\n"
            "print(sorted(sub.choices), 'torch' in sys.modules, 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "'train'" in out and out.split("]")[-1].split() == ["False", "False"], out


def test_every_public_name_is_still_on_the_package():
    for name in attnlab.__all__:
        assert getattr(attnlab, name) is not None, name
    assert attnlab.masks.__name__ == "attnlab.masks"
    assert attnlab.reference.attention is __import__("attnlab.reference").reference.attention


def test_all_lists_every_lazy_name():
    assert set(attnlab.__all__) == {"__version__", *attnlab._LAZY_NAMES, *attnlab._LAZY_MODULES}
