"""``attnlab bench --suite generate``: tokens per second, with and without the KV cache,
and against ``transformers`` ``generate`` on the same random-init weights.

Greedy decoding of ``new_tokens`` (128) after a ``prompt_len`` (32) token prompt.
Models: a tiny Llama (hidden 256, 4 layers, 8 heads, 2 kv heads, vocab 1024),
a GPT-2-small-shaped GPT (~124M) and a SmolLM-135M-shaped Llama (hidden 576,
30 layers, 9 heads, 3 kv heads, vocab 49152, tied). A copy of 512 MB measures
the memory bandwidth in the same run, for the bandwidth bound of decoding.
"""

from __future__ import annotations

import os

import torch

from .runner import Case, Impl

MOD = __name__
# The peer whose time the Markdown table divides by.
BASELINE = "transformers"
PROMPT_LEN = 32
NEW_TOKENS = 128

SHAPES = {
    "tiny-llama": dict(kind="llama", vocab_size=1024, hidden_size=256, intermediate_size=688,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                       tie_word_embeddings=False),
    "smollm-135m": dict(kind="llama", vocab_size=49152, hidden_size=576,
                        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3, tie_word_embeddings=True),
    "gpt2-124m": dict(kind="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12),
}


def hf_model(shape: str):
    """A randomly initialised transformers model of the named shape (no download)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers as T

    spec = dict(SHAPES[shape])
    kind = spec.pop("kind")
    torch.manual_seed(0)
    if kind == "llama":
        cfg = T.LlamaConfig(max_position_embeddings=1024, bos_token_id=0, eos_token_id=0,
                            pad_token_id=0, **spec)
        model = T.LlamaForCausalLM(cfg)
    else:
        cfg = T.GPT2Config(n_positions=1024, bos_token_id=0, eos_token_id=0, **spec)
        model = T.GPT2LMHeadModel(cfg)
    return model.eval()


def make_step(impl: str, shape: str, batch: int, new_tokens: int = NEW_TOKENS,
              prompt_len: int = PROMPT_LEN):
    """A step generating ``new_tokens`` greedily for a batch of random prompts."""
    from ..models import GPT

    hf = hf_model(shape)
    prompt = torch.randint(1, 1000, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    if impl.startswith("attnlab"):
        model = GPT.from_hf(hf)
        del hf
        use_cache = impl == "attnlab"

        def step():
            return model.generate(prompt, new_tokens, temperature=0, use_cache=use_cache)
        return step
    if impl == "transformers":
        mask = torch.ones_like(prompt)

        def step():
            with torch.inference_mode():
                return hf.generate(prompt, attention_mask=mask, max_new_tokens=new_tokens,
                                   min_new_tokens=new_tokens, do_sample=False,
                                   pad_token_id=0, eos_token_id=None)
        return step
    raise ValueError(f"unknown impl {impl!r}")


def make_copy(megabytes: int = 512):
    """Copy ``megabytes`` of float32: the machine's memory bandwidth (read + write)."""
    n = megabytes * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    return lambda: dst.copy_(src)


def _case(shape, batch, impls, repeats, new_tokens):
    return Case("generate", f"{shape} B={batch} +{new_tokens} tokens",
                [Impl(i, (MOD, "make_step", {"impl": i, "shape": shape, "batch": batch,
                                              "new_tokens": new_tokens})) for i in impls],
                repeats=repeats,
                extra={"batch": batch, "new_tokens": new_tokens, "shape": shape})


def cases(quick: bool = False) -> list[Case]:
    out = [Case("generate", "copy 512 MB", [Impl("torch copy_", (MOD, "make_copy", {}))],
                repeats=9, memory=False, always=True, extra={"bytes_moved": 2 * 512 * 2**20})]
    if quick:
        return [*out, _case("tiny-llama", 1, ["attnlab", "attnlab-nocache", "transformers"],
                            3, 32)]
    for batch in (1, 8):  # a second each: nine repeats steady the median on a busy machine
        out.append(_case("tiny-llama", batch, ["attnlab", "attnlab-nocache", "transformers"],
                         9, NEW_TOKENS))
    out.append(_case("gpt2-124m", 1, ["attnlab", "attnlab-nocache", "transformers"], 2,
                     NEW_TOKENS))
    out.append(_case("gpt2-124m", 8, ["attnlab", "transformers"], 2, NEW_TOKENS))
    for batch in (1, 8):
        out.append(_case("smollm-135m", batch, ["attnlab", "transformers"], 2, NEW_TOKENS))
    return out


def weight_bytes(shape: str) -> int:
    """Bytes of float32 weights read per decoding step (embedding rows aside)."""
    model = hf_model(shape)
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        # An embedding lookup reads one row, but a tied output layer reads all of it.
        embedding = "embed_tokens" in name or "wte" in name or "wpe" in name
        if embedding and not model.config.tie_word_embeddings:
            continue
        total += p.numel() * p.element_size()
    return total


def annotate(records: list[dict], log=print) -> None:
    """Add ``tokens_per_s`` to every generation record and, for the decoding of one
    sequence, the memory-bandwidth bound: a step must read every weight once, so
    tokens/s cannot exceed copy bandwidth / weight bytes (``bound_tokens_per_s``;
    ``of_bound`` is the measured share of it). Bandwidth comes from the copy case
    of the same run."""
    copy = next((r for r in records if "bytes_moved" in r and r.get("median_ms")), None)
    bandwidth = copy["bytes_moved"] / (copy["median_ms"] / 1000.0) if copy else None
    if copy:
        copy["gb_per_s"] = bandwidth / 1e9
        log(f"    memory bandwidth (copy, read + write): {bandwidth / 1e9:.1f} GB/s")
    weights: dict[str, int] = {}
    for r in records:
        if "new_tokens" not in r or not r.get("median_ms"):
            continue
        r["tokens_per_s"] = r["batch"] * r["new_tokens"] / (r["median_ms"] / 1000.0)
        line = f"    {r['case']:<34s} {r['impl']:<16s} {r['tokens_per_s']:9.1f} tokens/s"
        if bandwidth and r["batch"] == 1:
            if r["shape"] not in weights:
                weights[r["shape"]] = weight_bytes(r["shape"])
            r["weight_mb"] = weights[r["shape"]] / 2**20
            r["bound_tokens_per_s"] = bandwidth / weights[r["shape"]]
            r["of_bound"] = r["tokens_per_s"] / r["bound_tokens_per_s"]
            line += f"  ({r['of_bound']:.0%} of the bandwidth bound)"
        log(line)
