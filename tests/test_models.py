"""Models: generation with and without the cache, padding, sampling, checkpoints."""

from __future__ import annotations

import pytest
import torch

from attnlab.checkpoint import load_checkpoint, same_weights, save_checkpoint
from attnlab.models import GPT, Encoder, EncoderConfig, GPTConfig, ToyAttnLM, ToyConfig

CONFIGS = {
    "gpt2-like": GPTConfig(vocab_size=40, context_length=48, d_model=32, num_layers=2,
                           num_heads=4, mlp="gelu_tanh"),
    "llama-like": GPTConfig(vocab_size=40, context_length=48, d_model=32, num_layers=2,
                            num_heads=4, num_kv_heads=2, positions="rope", norm="rmsnorm",
                            mlp="swiglu", tie_embeddings=False, qkv_bias=False,
                            out_bias=False, mlp_bias=False),
    "mqa-window": GPTConfig(vocab_size=40, context_length=48, d_model=32, num_layers=2,
                            num_heads=4, num_kv_heads=1, positions="rope", window=6),
}


def make(name: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(CONFIGS[name]).eval()
    # Random init gives near-uniform logits; sharpen so greedy choices are not ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_and_uncached_greedy_identical(name):
    model = make(name)
    ids = torch.randint(0, 40, (3, 6), generator=torch.Generator().manual_seed(1))
    cached = model.generate(ids, 20, temperature=0)
    uncached = model.generate(ids, 20, temperature=0, use_cache=False)
    assert torch.equal(cached, uncached)
    assert cached.shape == (3, 26) and torch.equal(cached[:, :6], ids)
    # and the cached logits equal a full forward at every step
    full = model(cached[:, :-1])
    caches = model.new_cache(3, 26)
    step_logits = [model(cached[:, :6], caches=caches)[:, -1]]
    for t in range(6, 25):
        step_logits.append(model(cached[:, t:t + 1], caches=caches)[:, -1])
    torch.testing.assert_close(torch.stack(step_logits, 1), full[:, 5:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_left_padded_batch_equals_each_prompt_alone(name):
    model = make(name)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [5, 5, 5, 5]]
    batched = model.generate(prompts, 10, temperature=0)
    for i, p in enumerate(prompts):
        alone = model.generate([p], 10, temperature=0)
        assert torch.equal(batched[i, -10:], alone[0, -10:]), i


def test_numpy_ids_generate_as_a_tensor_of_them_does():
    # Helper-found: a tokenizer's numpy ids (return_tensors="np") were refused as ndarray.
    import numpy as np

    model = make("gpt2-like")
    ids = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32)
    assert torch.equal(model.generate(ids, 5, temperature=0),
                       model.generate(torch.from_numpy(ids).long(), 5, temperature=0))
    assert torch.equal(model.generate(ids[0], 5, temperature=0),
                       model.generate([[1, 2, 3]], 5, temperature=0))
    assert torch.equal(model.generate([ids[0], ids[1][:2]], 5, temperature=0),
                       model.generate([[1, 2, 3], [4, 5]], 5, temperature=0))
    with pytest.raises(TypeError, match="got ndarray"):
        model.generate(np.array([[1.0, 2.0]]), 5)


def test_sampling_options():
    model = make("gpt2-like")
    ids = torch.tensor([[1, 2, 3]])
    greedy = model.generate(ids, 12, temperature=0)
    assert torch.equal(model.generate(ids, 12, top_k=1), greedy)
    assert torch.equal(model.generate(ids, 12, top_p=1e-6), greedy)
    a = model.generate(ids, 12, generator=torch.Generator().manual_seed(5))
    b = model.generate(ids, 12, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    seen = {tuple(model.generate(ids, 12, temperature=5.0,
                                 generator=torch.Generator().manual_seed(s))[0].tolist())
            for s in range(5)}
    assert len(seen) > 1
    eos = int(greedy[0, 5])  # the 3rd generated token, or an earlier one
    first = 3 + greedy[0, 3:].tolist().index(eos)
    stopped = model.generate(ids, 12, temperature=0, eos_id=eos)
    assert stopped.shape[1] == first + 1 and int(stopped[0, -1]) == eos
    assert torch.equal(stopped[0], greedy[0, :first + 1])
    # several end-of-text ids (transformers' eos_token_id list, Gemma 3's [1, 106]): the
    # first produced stops the sequence; a batch's finished rows repeat the first id
    later = int(greedy[0, 8])
    both = model.generate(ids, 12, temperature=0, eos_id=[later, eos])
    assert torch.equal(both[0], greedy[0, :min(first, 3 + greedy[0, 3:].tolist().index(
        later)) + 1])
    with pytest.raises(TypeError, match="eos_id must be an int token id, a list"):
        model.generate(ids, 2, eos_id=[eos, 2.5])
    with pytest.raises(ValueError, match=r"eos_id must be a token id in \[0, 40\)"):
        model.generate(ids, 2, eos_id=[eos, 40])


def test_output_attentions_rows_sum_to_one_and_are_causal():
    model = make("llama-like")
    logits, attentions = model(torch.randint(0, 40, (2, 9)), output_attentions=True)
    assert len(attentions) == 2
    for w in attentions:
        assert w.shape == (2, 4, 9, 9)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 9))
        assert torch.equal(w.triu(1), torch.zeros_like(w))


@pytest.mark.parametrize("model", [
    make("gpt2-like"), make("llama-like"),
    ToyAttnLM(ToyConfig(vocab_size=12, context_length=8, d_model=8)),
    Encoder(EncoderConfig(vocab_size=30, context_length=16, d_model=16, num_layers=1,
                          num_heads=2, d_ff=32)),
])
def test_checkpoint_round_trip_is_bit_identical(model, tmp_path):
    save_checkpoint(model, tmp_path / "ck", note="hello")
    loaded = load_checkpoint(tmp_path / "ck")
    assert type(loaded) is type(model) and same_weights(loaded, model)
    if isinstance(model, GPT) and model.config.tie_embeddings:
        assert loaded.lm_head.weight is loaded.tok_emb.weight


def test_encoder_ignores_padding():
    torch.manual_seed(0)
    enc = Encoder(EncoderConfig(vocab_size=30, context_length=16, d_model=16, num_layers=2,
                                num_heads=2, d_ff=32)).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    alone = enc(ids)
    padded = enc(torch.tensor([[5, 6, 7, 8, 0, 0, 0]]),
                 attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0, 0]]))
    torch.testing.assert_close(padded[:, :4], alone, atol=1e-5, rtol=1e-5)


def test_the_cache_serves_the_last_token_that_no_model_call_sees():
    """The last new token is never fed back, so a prompt and new tokens one past the
    context fit; the cache refused it (15 + 2 over 16) while use_cache=False served it."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, context_length=16, d_model=32, num_layers=1,
                          num_heads=2)).eval()
    prompt = torch.randint(0, 50, (1, 15), generator=torch.Generator().manual_seed(1))
    want = model.generate(prompt, 2, temperature=0, use_cache=False)
    assert torch.equal(model.generate(prompt, 2, temperature=0), want)
    with pytest.raises(ValueError, match="needs 17 positions"):
        model.generate(prompt, 3, temperature=0)
    # no new token: the prompt back, with or without the cache
    for cache in (True, False):
        assert torch.equal(model.generate([[5]], 0, use_cache=cache), torch.tensor([[5]]))


@pytest.mark.parametrize("call, words", [
    (lambda m: m.generate(torch.tensor([[1] * 40]), 20), ["context_length=48", "59 positions"]),
    (lambda m: m.generate(torch.tensor([[1]]), 5, temperature=-1), ["temperature"]),
    (lambda m: m.generate(torch.tensor([[1]]), 5, top_p=0), ["top_p"]),
    (lambda m: m.generate(torch.tensor([[1]]), 5, temperature=float("nan")), ["temperature"]),
    (lambda m: m.generate(torch.tensor([[1]]), 5, temperature=float("inf")), ["temperature"]),
    (lambda m: m.generate(torch.tensor([[1]]), 5, top_p=float("nan")), ["top_p"]),
    (lambda m: m.generate(torch.tensor([[1]]), 5, top_p=float("inf")), ["top_p"]),
    (lambda m: m.generate(torch.tensor([[1]]), 5, top_k=0), ["top_k"]),
    (lambda m: m(torch.zeros(2, 3)), ["ids", "integer"]),
    (lambda m: m(torch.zeros(1, 49, dtype=torch.long)), ["49", "context_length=48"]),
    (lambda m: GPTConfig(mlp="relu"), ["mlp", "relu"]),
])
def test_bad_input(call, words):
    with pytest.raises(ValueError) as info:
        call(make("gpt2-like"))
    for w in words:
        assert w in str(info.value)


def _first_tokens(model, prompt, n, **sampling):
    """The first sampled token of ``n`` copies of ``prompt``, as a set."""
    out = model.generate(prompt.expand(n, -1), 1, generator=torch.Generator().manual_seed(0),
                         **sampling)
    return set(out[:, -1].tolist())


def test_top_k_samples_only_the_k_most_likely_tokens():
    torch.manual_seed(0)
    model = GPT(CONFIGS["gpt2-like"]).eval()  # unsharpened: many tokens are likely
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        logits = model(prompt)[0, -1]
    order = logits.argsort(descending=True).tolist()
    assert logits[order[2]] > logits[order[3]]  # no tie at the edge of the top 3
    allowed = set(order[:3])
    assert _first_tokens(model, prompt, 600, temperature=1.0, top_k=3) == allowed


def test_top_p_samples_only_the_nucleus():
    torch.manual_seed(0)
    model = GPT(CONFIGS["gpt2-like"]).eval()
    prompt = torch.tensor([[1, 2, 3]])
    temperature, p = 0.7, 0.5
    with torch.no_grad():
        probs = torch.softmax(model(prompt)[0, -1].double() / temperature, dim=-1)
    # By hand: most likely first, keep tokens while the mass before them is < p.
    allowed, mass = set(), 0.0
    for i in probs.argsort(descending=True).tolist():
        if mass >= p:
            break
        assert abs(mass - p) > 1e-4  # not on the edge, where float32 could decide otherwise
        allowed.add(i)
        mass += float(probs[i])
    assert 1 < len(allowed) < 40
    seen = _first_tokens(model, prompt, 600, temperature=temperature, top_p=p)
    assert seen == allowed, (seen, allowed)  # each kept token is ~5% of 600 draws


def _tiny_models():
    torch.manual_seed(0)
    return {
        "toy": ToyAttnLM(ToyConfig(vocab_size=40, context_length=48, d_model=16)),
        "gpt-learned": GPT(CONFIGS["gpt2-like"]),
        "gpt-rope": GPT(CONFIGS["llama-like"]),
        "encoder": Encoder(EncoderConfig(vocab_size=40, context_length=16, d_model=16,
                                         num_layers=1, num_heads=2)),
    }


@pytest.mark.parametrize("name", ["toy", "gpt-learned", "gpt-rope", "encoder"])
def test_embed_turns_ids_into_hidden_states_and_starts_forward(name):
    """embed(ids) -> (batch, seq, d_model), read off the embedding tables by hand."""
    model = _tiny_models()[name].eval()
    ids = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(3))
    tok = model.tok_emb.weight[ids]
    if name == "encoder":
        types = torch.tensor([[0, 0, 1, 1, 1]] * 2)
        raw = tok + model.pos_emb.weight[:5] + model.type_emb.weight[types]
        want = torch.nn.functional.layer_norm(raw, (16,), model.emb_norm.weight,
                                              model.emb_norm.bias, model.emb_norm.eps)
        got = model.embed(ids, token_type_ids=types)
    else:
        want = tok if name == "gpt-rope" else tok + model.pos_emb.weight[3:8]
        got = model.embed(ids, past=3)  # positions continue after 3 cached tokens
    assert got.shape == (2, 5, model.config.d_model)
    torch.testing.assert_close(got, want)
    # forward starts from embed: with it replaced, the output no longer depends on ids
    model.embed = lambda ids, **kw: torch.zeros(*ids.shape, model.config.d_model)
    other = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(4))
    out = model(ids)
    torch.testing.assert_close(out, model(other))


@pytest.mark.parametrize("tie", [True, False])
def test_decoding_output_layer_copy_follows_the_weights(tie):
    """Decoding one sequence, the output layer runs from its packed block (the only
    copy); it must give F.linear's logits and follow in-place updates (tied or not)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, d_model=16, num_layers=1, num_heads=2,
                          positions="rope", norm="rmsnorm", mlp="swiglu",
                          tie_embeddings=tie)).eval()
    ids = torch.randint(0, 50, (1, 1))  # one row, as each step of generate(batch 1)
    with torch.no_grad():
        copied = model(ids)
    torch.testing.assert_close(copied, model(ids), rtol=0, atol=1e-5)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # an optimizer step, as training between samples
        updated = model(ids)
    torch.testing.assert_close(updated, model(ids), rtol=0, atol=1e-5)
    assert not torch.allclose(updated, copied)


def test_greedy_picks_the_first_maximum_and_ranks_nan_lowest():
    """As torch's argmax: the first of equal maxima; NaN logits (overflowing weights) never
    win, and a row of nothing but NaN falls back to token 0."""
    from attnlab.models.generation import sample_next

    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    logits[0, [7, 500]] = 9.0  # a tie: 7 first
    logits[1, 3] = float("nan")
    logits[1, 42] = 8.0
    logits[2] = float("nan")
    picked = sample_next(logits, 0, None, None, None)
    assert picked.dtype == torch.int64 and picked.tolist()[:3] == [7, 42, 0]
    assert picked[3] == logits[3].argmax()
    assert torch.equal(sample_next(logits[3:], 0, None, None, None), logits[3:].argmax(-1))
    # bf16 logits (a model under autocast), a negated view, one row: as torch's argmax
    assert sample_next(logits.bfloat16(), 0, None, None, None).tolist()[:3] == [7, 42, 0]
    assert torch.equal(sample_next(-logits[3:], 0, None, None, None), (-logits[3:]).argmax(-1))
    assert sample_next(logits[0], 0, None, None, None).item() == 7
    toy = ToyAttnLM(ToyConfig(vocab_size=50, d_model=16, context_length=32)).to(torch.bfloat16)
    assert toy.generate(torch.tensor([[1, 2, 3]]), 3, temperature=0).shape == (1, 6)


@pytest.mark.parametrize("bad", [-1, 40])
@pytest.mark.parametrize("seq", [1, 3])
def test_an_id_outside_the_vocabulary_is_named_for_a_prompt_and_a_decoded_token(bad, seq):
    """One ValueError naming the id and the vocabulary, not an IndexError from the lookup:
    for a prompt, and for one token decoded with a cache (the check's fast case)."""
    model = GPT(GPTConfig(vocab_size=40, d_model=16, num_heads=2, num_layers=1)).eval()
    ids = torch.zeros(1, seq, dtype=torch.long)
    ids[0, -1] = bad
    caches = model.new_cache(1, 8)
    with pytest.raises(ValueError, match=rf"ids holds token id {bad}; expected ids in \[0, 40\)"):
        model(ids, caches=caches)
    assert caches[0].seq_len == 0
    model(torch.ones(1, seq, dtype=torch.long), caches=caches)  # a good id passes
