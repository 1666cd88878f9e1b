"""Bad input to the variants of ``attnlab.attention``: one clear error each, naming the
argument, what came and what was expected, the same on every backend that is asked."""

from __future__ import annotations

import pytest
import torch

import attnlab

g = torch.Generator().manual_seed(0)
Q = torch.randn(2, 4, 6, 8, generator=g)
K = torch.randn(2, 2, 6, 8, generator=g)
V = torch.randn(2, 2, 6, 8, generator=g)


def _raises(kind, match, **kw):
    with pytest.raises(kind, match=match) as info:
        attnlab.attention(Q, K, V, **kw)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("softcap", [0, -1.0, float("nan"), float("inf")])
def test_softcap_must_be_positive_and_finite(softcap):
    _raises(ValueError, r"softcap must be a positive finite number", softcap=softcap)


def test_softcap_must_be_a_number():
    _raises(TypeError, r"softcap must be a number, got str", softcap="30")
    _raises(TypeError, r"softcap must be a number, got bool", softcap=True)


@pytest.mark.parametrize("slopes, kind, match", [
    (torch.ones(3), ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\).*got \(3,\)"),
    (torch.ones(2, 2, 4), ValueError, r"alibi_slopes must have shape .* got \(2, 2, 4\)"),
    (torch.ones(4, dtype=torch.long), TypeError, r"alibi_slopes must be a floating-point"),
    ([0.5] * 4, TypeError, r"alibi_slopes must be a torch.Tensor, got list"),
    (torch.tensor([0.5, float("nan"), 0.1, 0.1]), ValueError, r"alibi_slopes must hold finite"),
    (torch.ones(4, requires_grad=True), ValueError, r"alibi_slopes must not require grad"),
])
def test_alibi_slopes_of_the_wrong_kind(slopes, kind, match):
    _raises(kind, match, alibi_slopes=slopes)


@pytest.mark.parametrize("sinks, kind, match", [
    (torch.zeros(2), ValueError, r"sinks must have shape \(4,\) \(one per query head\), got"),
    (torch.zeros(2, 4), ValueError, r"sinks must have shape \(4,\)"),
    (torch.zeros(4, dtype=torch.int32), TypeError, r"sinks must be a floating-point tensor"),
    (torch.tensor([0.0, float("-inf"), 0, 0]), ValueError, r"sinks must hold finite values"),
])
def test_sinks_of_the_wrong_shape(sinks, kind, match):
    _raises(kind, match, sinks=sinks)


@pytest.mark.parametrize("ids, kind, match", [
    (torch.tensor([0, 0, 1, 1, 2, 2.0]), TypeError, r"document_ids must be an integer tensor"),
    (torch.tensor([True] * 6), TypeError, r"document_ids must be an integer tensor"),
    (torch.zeros(5, dtype=torch.long), ValueError, r"document_ids must have shape \(6,\) or "
                                                   r"\(2, 6\).*got \(5,\)"),
    (torch.zeros(3, 6, dtype=torch.long), ValueError, r"document_ids must have shape"),
    (torch.tensor([0, 0, 1, 0, 2, 2]), ValueError, r"document_ids must be non-decreasing along "
                                                   r"each sequence .* got 1 then 0 at positions "
                                                   r"2, 3 of sequence 0"),
    ((torch.zeros(6, dtype=torch.long),), TypeError, r"a pair \(q_ids, k_ids\)"),
    ((torch.zeros(6, dtype=torch.long), torch.zeros(5, dtype=torch.long)), ValueError,
     r"document_ids\[1\] \(keys\) must have shape \(6,\)"),
])
def test_document_ids_of_the_wrong_kind(ids, kind, match):
    _raises(kind, match, document_ids=ids)


def test_one_document_tensor_needs_equal_lengths():
    with pytest.raises(ValueError, match=r"q_len == k_len, got q_len 3 and k_len 6; pass a "
                                         r"pair"):
        attnlab.attention(Q[:, :, :3], K, V, document_ids=torch.zeros(6, dtype=torch.long))


def _broken(b, h, q_idx, kv_idx):
    raise RuntimeError("boom")


def test_a_mask_mod_that_raises_is_named_with_its_exception():
    message = _raises(ValueError, r"mask_mod '_broken' raised RuntimeError: boom",
                      mask_mod=_broken)
    assert "vectorisable" in message


@pytest.mark.parametrize("mod, kind, match", [
    (lambda b, h, q, kv: q - kv, TypeError, r"must return a bool tensor .* got dtype torch.int64"),
    (lambda b, h, q, kv: 1, TypeError, r"must return a bool tensor, got int"),
    (lambda b, h, q, kv: torch.ones(3, 3, dtype=torch.bool), ValueError,
     r"returned shape \(3, 3\), which does not broadcast"),
])
def test_a_mask_mod_must_return_bool_of_a_broadcastable_shape(mod, kind, match):
    _raises(kind, match, mask_mod=mod)


def test_mask_mod_and_score_mod_must_be_functions():
    _raises(TypeError, r"mask_mod must be a function .* got int", mask_mod=3)
    _raises(TypeError, r"score_mod must be a function .* got str", score_mod="tanh")


@pytest.mark.parametrize("backend", ["eager", "auto"])
def test_a_score_mod_that_changes_the_shape_is_refused(backend):
    _raises(ValueError, r"score_mod '<lambda>' returned shape .* it must keep the score's "
            r"shape or broadcast to it", score_mod=lambda s, b, h, q, kv: s.sum(-1),
            backend=backend)
    _raises(TypeError, r"score_mod '<lambda>' must return a floating-point tensor",
            score_mod=lambda s, b, h, q, kv: q > kv, backend=backend)
    _raises(ValueError, r"score_mod '<lambda>' raised ZeroDivisionError",
            score_mod=lambda s, b, h, q, kv: 1 / 0, backend=backend)
