"""A sweep of the public API with bad types and values: each is one ValueError or
TypeError naming the argument (never an IndexError, OverflowError, ZeroDivisionError
or a RuntimeError from deep inside torch), or a correct result."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import attnlab
from attnlab import KVCache, MultiHeadAttention, RotaryEmbedding, attention
from attnlab.models import GPT, GPTConfig, ToyAttnLM, ToyConfig
from attnlab.models.encoder import EncoderConfig

Q = torch.randn(1, 2, 4, 8)
NAN, INF = float("nan"), float("inf")


def _mask(value):
    m = torch.zeros(4, 4)
    m[0, 1] = value
    return m


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=10, d_model=8, num_heads=2, num_layers=1,
                         context_length=16))


BACKENDS = ["eager", "sdpa", "tiled"]

# (case id, call, exception type, what the message must name)
REFUSED = [
    *[(f"scale={s} {b}", lambda s=s, b=b: attention(Q, Q, Q, scale=s, backend=b),
       ValueError, "scale") for s in (NAN, INF, -INF) for b in BACKENDS],
    *[(f"mask {v} {b}", lambda v=v, b=b: attention(Q, Q, Q, mask=_mask(v), backend=b),
       ValueError, "mask") for v in (NAN, INF) for b in BACKENDS],
    *[(f"head_dim 0 {b}", lambda b=b: attention(Q[..., :0], Q[..., :0], Q[..., :0], backend=b),
       ValueError, "head_dim") for b in BACKENDS],
    ("window=0", lambda: attention(Q, Q, Q, window=0), ValueError, "window"),
    ("window=True", lambda: attention(Q, Q, Q, window=True), ValueError, "window"),
    ("causal='no'", lambda: attention(Q, Q, Q, causal="no"), TypeError, "causal"),
    ("dropout_p=nan", lambda: attention(Q, Q, Q, dropout_p=NAN), ValueError, "dropout_p"),
    ("backend='fast'", lambda: attention(Q, Q, Q, backend="fast"), ValueError, "backend"),
    ("int q", lambda: attention(Q.long(), Q.long(), Q.long()), TypeError, "q"),
    ("mask int", lambda: attention(Q, Q, Q, mask=torch.ones(4, 4, dtype=torch.long)),
     TypeError, "mask"),
    ("mha x float64", lambda: MultiHeadAttention(8, 8, 2)(torch.randn(1, 3, 8).double()),
     TypeError, "x"),
    ("mha x long", lambda: MultiHeadAttention(8, 8, 2)(torch.ones(1, 3, 8, dtype=torch.long)),
     TypeError, "x"),
    ("mha causal='no'", lambda: MultiHeadAttention(8, 8, 2, causal="no"), TypeError, "causal"),
    ("mha heads 0", lambda: MultiHeadAttention(8, 8, 0), ValueError, "num_heads"),
    ("mha dropout 2", lambda: MultiHeadAttention(8, 8, 2, dropout=2.0), ValueError, "dropout"),
    ("KVCache device", lambda: KVCache(1, 4, 2, 4, device="nonsense"), ValueError, "device"),
    ("KVCache dtype", lambda: KVCache(1, 4, 2, 4, dtype="float32"), TypeError, "dtype"),
    ("KVCache head_dim 0", lambda: KVCache(1, 4, 2, 0), ValueError, "head_dim"),
    ("rope base nan", lambda: RotaryEmbedding(8, base=NAN), ValueError, "base"),
    ("rope base inf", lambda: RotaryEmbedding(8, base=INF), ValueError, "base"),
    ("gpt rope_base nan", lambda: GPTConfig(positions="rope", rope_base=NAN), ValueError,
     "rope_base"),
    *[(f"gpt {f}='no'", lambda f=f: GPTConfig(**{f: "no"}), TypeError, f)
      for f in ("tie_embeddings", "qkv_bias", "out_bias", "mlp_bias")],
    ("gpt tie_embeddings=1", lambda: GPTConfig(tie_embeddings=1), TypeError, "tie_embeddings"),
    ("gpt dropout 2", lambda: GPTConfig(dropout=2.0), ValueError, "dropout"),
    ("gpt norm_eps nan", lambda: GPTConfig(norm_eps=NAN), ValueError, "norm_eps"),
    ("gpt num_kv_heads 3", lambda: GPTConfig(num_kv_heads=3), ValueError, "num_kv_heads"),
    ("gpt d_model % heads", lambda: GPTConfig(d_model=10, num_heads=4), ValueError, "d_model"),
    ("gpt num_layers 1e6", lambda: GPTConfig(num_layers=10**6, d_model=64, num_heads=2),
     ValueError, "memory"),
    ("gpt d_model 1e9", lambda: GPTConfig(d_model=10**9, num_heads=1), ValueError, "memory"),
    ("gpt window 0", lambda: GPTConfig(window=0), ValueError, "window"),
    ("gpt vocab 0", lambda: GPTConfig(vocab_size=0), ValueError, "vocab_size"),
    ("gpt unknown field", lambda: GPTConfig.from_dict({"layers": 2}), ValueError, "layers"),
    ("toy dropout nan", lambda: ToyConfig(dropout=NAN), ValueError, "dropout"),
    ("toy context 1e9", lambda: ToyConfig(context_length=10**9, d_model=64), ValueError,
     "memory"),
    ("encoder norm_eps 0", lambda: EncoderConfig(norm_eps=0.0), ValueError, "norm_eps"),
    ("forward oov", lambda: _gpt()(torch.tensor([[1, 10]])), ValueError, "ids"),
    ("forward negative", lambda: _gpt()(torch.tensor([[-1, 2]])), ValueError, "ids"),
    ("forward float ids", lambda: _gpt()(torch.tensor([[1.0, 2.0]])), ValueError, "ids"),
    ("toy forward oov", lambda: ToyAttnLM(ToyConfig())(torch.tensor([[40]])), ValueError,
     "ids"),
    ("generate oov", lambda: _gpt().generate([[1, 12]], 2), ValueError, "ids"),
    ("generate float ids", lambda: _gpt().generate([[1.5, 2]], 2), TypeError, "ids"),
    ("generate str", lambda: _gpt().generate("ab", 2), TypeError, "ids"),
    ("generate T nan", lambda: _gpt().generate([[1]], 2, temperature=NAN), ValueError,
     "temperature"),
    ("generate top_p 0", lambda: _gpt().generate([[1]], 2, top_p=0.0), ValueError, "top_p"),
    ("save_checkpoint not a model", lambda: attnlab.save_checkpoint(torch.nn.Linear(2, 2),
                                                                     "/tmp/never-written-x"),
     TypeError, "model"),
]


@pytest.mark.parametrize(("call", "exc", "name"), [c[1:] for c in REFUSED],
                         ids=[c[0] for c in REFUSED])
def test_refused_naming_the_argument(call, exc, name):
    with pytest.raises(exc) as info:
        call()
    assert name in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_hf_layout_configs_name_the_missing_field():
    from attnlab.layouts import hf

    for fn in (hf.gpt2_config, hf.llama_config, hf.bert_config):
        with pytest.raises(ValueError):
            fn({})


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_inputs_agree_across_backends(backend):
    q = Q.clone()
    q[0, 0, 1] = NAN
    out = attention(q, Q, Q, backend=backend)
    ref = attention(q, Q, Q, backend="eager")
    assert torch.equal(out.isnan(), ref.isnan())
    assert out[0, 0, 1].isnan().all() and not out[0, 1].isnan().any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_window_and_empty_inputs_give_correct_results(backend):
    full = attention(Q, Q, Q, backend="eager")
    torch.testing.assert_close(attention(Q, Q, Q, window=2**70, backend=backend), full)
    assert attention(Q[:0], Q[:0], Q[:0], backend=backend).shape == (0, 2, 4, 8)
    assert attention(Q[:, :, :0], Q[:, :, :0], Q[:, :, :0], backend=backend).shape == (1, 2, 0, 8)
    m = _mask(-INF)
    torch.testing.assert_close(attention(Q, Q, Q, mask=m, backend=backend),
                               attention(Q, Q, Q, mask=m, backend="eager"))


@pytest.mark.parametrize(("temperature", "top_p"), [(1e-45, None), (1.0, 1e-300),
                                                    (1e-300, 1e-300), (1e30, None)])
def test_sampling_never_fails(temperature, top_p):
    model = _gpt()
    out = model.generate([[1, 2]], 5, temperature=temperature, top_p=top_p,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 7) and int(out.max()) < 10 and int(out.min()) >= 0


def test_sampling_survives_nan_logits():
    from attnlab.models.generation import sample_next

    logits = torch.tensor([[NAN, 1.0, 2.0], [NAN, NAN, NAN]])
    for t in (0.0, 1.0):
        picked = sample_next(logits, t, None, None, torch.Generator().manual_seed(0))
        assert picked.tolist()[1] in (0, 1, 2) and picked.tolist()[0] in (1, 2)
    # greedy: NaN ranks lowest, and a row of nothing but NaN falls back to token 0
    assert sample_next(logits, 0.0, None, None, None).tolist() == [2, 0]
    assert sample_next(torch.tensor([[1.0, 3.0, NAN, 3.0]]), 0.0, None, None, None).tolist() == [1]


@pytest.mark.parametrize("shapes, needle", [
    (((5, 8), (5, 8), (5, 8)), "q must have at least 3 dimensions"),
    (((2, 5, 8), (5, 8), (5, 8)), "k must have at least 3 dimensions"),
    (((2, 5, 8), (2, 5, 4), (2, 5, 8)), "k has head_dim 4"),
    (((2, 5, 8), (2, 5, 8), (2, 4, 8)), "v has shape (2, 4, 8)"),
    (((3, 5, 8), (2, 5, 8), (2, 5, 8)), "q has 3 heads and k has 2"),
])
def test_the_oracle_refuses_bad_shapes_in_one_line(shapes, needle):
    """reference.attention(x, x, x) on a 2-D x said "not enough values to unpack"."""
    from attnlab import reference

    arrays = [np.ones(s) for s in shapes]
    with pytest.raises(ValueError, match=re.escape(needle)) as info:
        reference.attention(*arrays)
    assert "\n" not in str(info.value)
