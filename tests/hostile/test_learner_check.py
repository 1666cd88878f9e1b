"""`attnlab check`: each tutorial bug, planted in learner_bugs.py, is named; the library's
own attention (and the book's) passes clean; what nothing explains is said as it is."""

from __future__ import annotations

import os
import re
import string
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import reference
from attnlab.check import messages, oracle

import learner_bugs as lb  # the planted bugs, beside this file  # isort: skip

BUGS_FILE = Path(lb.__file__)


@pytest.mark.parametrize("name, code", [
    ("MultiHeadSqrtEmbedDim", "scale_d_model"),
    ("softmax_wrong_axis", "softmax_axis"),
    ("k_not_transposed", "k_not_transposed"),
    ("mask_inverted", "mask_inverted"),
    ("mask_after_softmax", "mask_after_softmax"),
    ("CausalMaskAfterSoftmax", "mask_after_softmax"),
    ("CausalOffByOne", "causal_excludes_self"),
    ("CausalSeesNext", "causal_sees_next"),
    ("nan_on_masked_row", "nan_masked_row"),
    ("DropoutInEval", "dropout_in_eval"),
    ("MultiHeadWrongSplit", "heads_split_merge"),
    ("MultiHeadForgotTranspose", "heads_merge"),
    ("GroupedQueryWrongRepeat", "gqa_tile"),
    ("MaskMadeInForwardNoScale", "no_scale"),  # causal known from its outputs alone
    ("PerssonNoScale", "no_scale"),
])
def test_each_planted_bug_is_named_and_nothing_else(name, code):
    report = attnlab.check(getattr(lb, name), lang="en")
    assert not report.ok
    bugs = [f.code for f in report.findings if f.severity == "bug"]
    assert bugs == [code], report


@pytest.mark.parametrize("obj", [
    attnlab.attention, reference.attention, attnlab.SimplifiedSelfAttention,
    attnlab.SelfAttentionV1, attnlab.SelfAttentionV2, attnlab.CausalAttention,
    attnlab.MultiHeadAttention, attnlab.MultiHeadAttentionWrapper,
    lb.good_attention, lb.simplified, lb.BookCausalAttention, lb.BookMultiHeadAttention,
    lb.GroupedQueryAttention,
    # signatures beyond (q, k, v, mask): the mask goes in by its name, an option in the
    # fourth place is not taken for it; causal code is known by its outputs; a module
    # of one width is built with one the heads divide
    lb.attn_causal_flag, lb.attn_mask_after_causal, lb.attn_scale_like_sdpa,
    lb.causal_inside, lb.MaskedSelfAttention, lb.MaskMadeInForward, lb.simplified_causal,
    lb.WithContext, lb.PerssonSelfAttention, lb.KarpathyHead,
], ids=lambda o: f"{o.__module__.rsplit('.', 1)[-1]}.{o.__name__}")
def test_the_library_and_clean_tutorial_code_pass(obj):
    report = attnlab.check(obj, lang="en")
    assert report.ok, report
    assert [f.code for f in report.findings] in ([], ["gqa_skipped"]), report
    assert report.lines()[0].startswith(f"OK: {obj.__name__} agrees with the oracle")


def test_code_found_causal_by_its_outputs_says_so_and_dropping_a_key_is_not_causal():
    assert "causal (by its outputs) (q, k, v)" in str(attnlab.check(lb.causal_inside, lang="en"))
    assert "（由输出判断为）因果" in str(attnlab.check(lb.MaskMadeInForward, lang="zh"))
    report = attnlab.check(lb.drops_last_key, lang="en")  # moving key 1 moves row 0
    assert not report.ok and "causal_excludes_self" not in report.codes, report
    assert "causal" not in report.lines()[0] and "differs" in report.codes, report


def test_the_library_takes_grouped_query_inputs_and_causal():
    report = attnlab.check(attnlab.attention)
    # 4 shapes, GQA, 3 masks, 3 causal (one with a mask): 11, none skipped
    assert report.findings == [] and report.cases == 11


@pytest.mark.parametrize("name", ["SelfAttention_v1", "SelfAttention_v2", "CausalAttention",
                                  "MultiHeadAttentionWrapper", "MultiHeadAttention"])
def test_the_books_own_classes_pass(name):
    ch03 = pytest.importorskip("llms_from_scratch.ch03")
    report = attnlab.check(getattr(ch03, name), lang="en")
    assert report.ok and report.findings == [], report


def test_weights_the_check_cannot_place_are_said_not_judged():
    # Helper-found: an nn.MultiheadAttention inside a module was judged against the
    # weight-free oracle ("differs", or "raises" when fed the wrong width).
    with pytest.raises(ValueError, match=r"WrapsTorchMultihead has weights \(mha.in_proj_weight"
                                         r", mha.out_proj.weight\) that attnlab check cannot "
                                         r"place"):
        attnlab.check(lb.WrapsTorchMultihead, lang="en")


def test_the_sqrt_embed_dim_bug_names_the_fix():
    (line,) = attnlab.check(lb.MultiHeadSqrtEmbedDim, lang="en").lines()
    assert "sqrt(d_out) = sqrt(16)" in line and "math.sqrt(embed_dim)" in line
    assert "fix: divide by sqrt(head_dim) = sqrt(4)" in line


def test_two_bugs_at_once_are_both_named():
    report = attnlab.check(lb.no_scale_and_mask_inverted, lang="en")
    assert [f.code for f in report.findings if f.severity == "bug"] == ["no_scale",
                                                                       "mask_inverted"]


def test_what_nothing_explains_is_said_without_a_guess():
    report = attnlab.check(lb.off_by_a_little, lang="en")
    codes = {f.code for f in report.findings if f.severity == "bug"}
    assert codes <= {"differs", "more"} and "differs" in codes, report
    first = next(f for f in report.findings if f.code == "differs")
    assert re.fullmatch(r"differs from the oracle by 0\.07 at \(batch=2 heads=3 seq=5\); "
                        r"none of the known mistakes explains it", first.message), first


def test_a_finite_fill_is_a_note_not_a_bug():
    report = attnlab.check(lb.finite_fill, lang="en")
    assert report.ok and "masked_row_mean" in report.codes


def test_the_learners_module_is_left_as_it_was():
    torch.manual_seed(0)
    m = lb.BookMultiHeadAttention(6, 16, 32, 0.5, 4).train()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    assert attnlab.check(m).ok
    assert m.training and all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_the_module_and_the_function_are_one_name():
    import attnlab.check as module

    assert attnlab.check is module and module(lb.simplified).ok
    assert module.check(lb.simplified).ok


def test_lang_is_refused_by_name():
    with pytest.raises(ValueError, match="lang must be one of en, zh, got 'fr'"):
        attnlab.check(lb.simplified, lang="fr")


def test_both_languages_say_every_finding_with_the_same_numbers():
    for code, en in messages.EN.items():
        zh = messages.ZH[code]
        fields = {f for _, f, _, _ in string.Formatter().parse(en) if f}
        assert fields == {f for _, f, _, _ in string.Formatter().parse(zh) if f}, code
    zh_terms = "".join(messages.ZH.values())
    for term in ("注意力", "查询", "键", "值", "掩码", "因果掩码", "多头注意力", "键值缓存"):
        assert term in zh_terms, term


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2), st.sampled_from([(2, 2), (4, 2), (3, 1)]), st.integers(1, 6),
       st.integers(1, 6), st.booleans(), st.booleans(), st.integers(0, 2**16))
def test_the_oracle_without_bugs_is_the_reference(batch, heads, q_len, k_len, causal, masked,
                                                  seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads[0], q_len, 4))
    k, v = (rng.standard_normal((batch, heads[1], k_len, 4)) for _ in range(2))
    mask = rng.random((q_len, k_len)) < 0.5 if masked else None
    ok = oracle.allowed(q_len, k_len, causal=causal, window=None, mask=mask, bugs=frozenset())
    got = oracle.attend(q, k, v, ok, 0.5, frozenset())
    want = reference.attention(q, k, v, mask, causal=causal, scale=0.5)
    np.testing.assert_allclose(got, want, atol=1e-12)


# ---------------------------------------------------------------------------- the CLI


def test_cli_names_the_fix_and_exits_1(tmp_path, cli):
    proc = cli(["check", f"{BUGS_FILE}:MultiHeadSqrtEmbedDim", "--lang", "en"], cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.count("\n") == 1 and proc.stdout.startswith("[scale_d_model]")
    assert "sqrt(head_dim) = sqrt(4)" in proc.stdout and proc.stderr == ""


def test_cli_speaks_chinese_from_the_locale(tmp_path):
    env = {**os.environ, "LANGUAGE": "", "LC_ALL": "zh_CN.UTF-8",
           "PYTHONPATH": str(Path(attnlab.__file__).parents[1])}
    proc = subprocess.run([sys.executable, "-m", "attnlab", "check",
                           f"{BUGS_FILE}:mask_inverted"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "掩码的含义反了" in proc.stdout, proc.stdout


def test_cli_clean_code_exits_0(tmp_path, cli):
    learner = tmp_path / "my_attention.py"
    learner.write_text("import torch\n\n"
                       "def attention(q, k, v):\n"
                       "    w = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, -1)\n"
                       "    return w @ v\n\n"
                       "if __name__ == '__main__':\n"
                       "    raise SystemExit(3)  # not run: the file is imported\n")
    proc = cli(["check", "my_attention.py:attention", "--lang", "en"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("OK: attention agrees with the oracle on")


@pytest.mark.parametrize("spec, needle", [
    ("missing.py:attention", "FILE 'missing.py' is not a file"),
    ("my_attention.py:Nope", "defines no 'Nope'; it defines: attention"),
    ("my_attention.py", "expected FILE:NAME"),
    ("broken.py:attention", "importing broken.py failed: NameError"),
    ("my_attention.py:CONSTANT", "CONSTANT is a int; expected a function"),
    # a demo at the end of the file, unguarded: it exited 0 ("clean") having checked nothing
    ("exits.py:attention", 'importing exits.py ran sys.exit(0) (or exit()): put the code '
                           'that runs a demo under `if __name__ == "__main__":`'),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, cli, one_line_error, spec, needle):
    (tmp_path / "my_attention.py").write_text("CONSTANT = 3\n\ndef attention(q, k, v):\n"
                                              "    return v\n")
    (tmp_path / "broken.py").write_text("undefined_name\n")
    (tmp_path / "exits.py").write_text("import sys\n\ndef attention(q, k, v):\n"
                                       "    return v\n\nsys.exit(0)\n")
    one_line_error(cli(["check", spec], cwd=tmp_path), needle)


def test_cli_stops_a_function_that_never_returns(tmp_path, one_line_error):
    """A learner's endless loop hung `attnlab check` with no word; now it is stopped after
    CHECK_SECONDS (1 s here) in one line, even through the learner's `except Exception`."""
    from conftest import ROOT

    (tmp_path / "loops.py").write_text(
        "def attention(q, k, v):\n"
        "    while True:\n"
        "        try:\n"
        "            pass\n"
        "        except Exception:\n"
        "            pass\n")
    code = ("import sys; from attnlab.cli import commands, main; commands.CHECK_SECONDS = 1; "
            "sys.exit(main(['check', 'loops.py:attention']))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    one_line_error(proc, "loops.py:attention ran for more than 1 s", "never ends")


def test_cli_check_gives_back_the_callers_own_alarm(tmp_path):
    """Run in-process by a caller with its own alarm (a watchdog, pytest-timeout), the
    check's time limit replaced that alarm and then cancelled it."""
    from conftest import ROOT

    (tmp_path / "ok.py").write_text("import torch\n\ndef attention(q, k, v):\n"
                                    "    w = torch.softmax(q @ k.transpose(-2, -1) / "
                                    "q.shape[-1] ** 0.5, -1)\n    return w @ v\n")
    code = ("import signal; signal.signal(signal.SIGALRM, lambda *a: None); signal.alarm(100)\n"
            "from attnlab.cli import main\nassert main(['check', 'ok.py:attention']) == 0\n"
            "print('left', signal.alarm(0))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    left = int(proc.stdout.split("left")[-1])
    assert 60 <= left <= 100, proc.stdout


def _always_raises(q, k, v):
    raise ValueError("not written yet")


def _returns_none(q, k, v):
    return None


def _exits(q, k, v):
    import sys

    sys.exit(0)  # a learner's early return, typed as in a script


@pytest.mark.parametrize("fn", [_always_raises, _returns_none, _exits])
def test_code_that_never_gives_numbers_is_told_only_that(fn):
    """A function that raises on every input (or returns None) is not a mistake in the
    maths: no "K not transposed" (that mistake also raises, on non-square inputs)."""
    report = attnlab.check(fn, lang="en")
    assert not report.ok
    assert set(report.codes) <= {"raises", "more", "gqa_skipped"}, report.codes


def test_a_chinese_report_says_what_it_checked_in_chinese():
    report = attnlab.check(lambda q, k, v: attnlab.attention(q, k, v), lang="zh")
    assert report.ok and "维的 (q, k, v)" in str(report) and "of rank" not in str(report)
    assert "(q, k, v) of rank" in str(attnlab.check(lambda q, k, v: attnlab.attention(q, k, v),
                                                   lang="en"))


@pytest.mark.parametrize("spec, needle", [
    ("missing.py:attention", "FILE 'missing.py' 不是一个文件"),
    ("my_attention.py:Nope", "里没有定义 'Nope'；它定义了：NeedsSize, attention"),
    ("my_attention.py", "应为 FILE:NAME"),
    ("broken.py:attention", "导入 broken.py 失败：NameError"),
    ("my_attention.py:CONSTANT", "CONSTANT 是 int；应为函数"),
    ("my_attention.py:NeedsSize", "无法构造 NeedsSize：不知道它的参数 'size' 该取什么值"),
])
def test_cli_bad_input_is_said_in_chinese_under_lang_zh(tmp_path, cli, one_line_error, spec,
                                                         needle):
    (tmp_path / "my_attention.py").write_text(
        "import torch\n\nCONSTANT = 3\n\ndef attention(q, k, v):\n    return v\n\n"
        "class NeedsSize(torch.nn.Module):\n    def __init__(self, size):\n"
        "        super().__init__()\n")
    (tmp_path / "broken.py").write_text("undefined_name\n")
    one_line_error(cli(["check", spec, "--lang", "zh"], cwd=tmp_path), needle)
