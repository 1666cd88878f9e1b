"""Lesson 13: grouped-query and multi-query attention: fewer K/V heads."""

from .cells import Lesson, code, md

LESSON = Lesson(13, "gqa-mqa", {"en": "GQA and MQA: fewer key/value heads",
                                "zh": "GQA 与 MQA：更少的键值头"}, cells=[
    md(en="""
The KV cache of lesson 12 grows with every layer, every token and every key/value
head; for long texts it, not the weights, fills the memory. **Multi-query attention**
(MQA) keeps one key/value head shared by all query heads; **grouped-query attention**
(GQA, Llama 2/3, Mistral, Qwen) keeps a few: with 8 query heads and 2 key/value heads,
query heads 0-3 read key/value head 0 and heads 4-7 read head 1.

The result is exactly ordinary multi-head attention with each key/value head repeated
for its group; attnlab computes it without making those copies.
""", zh="""
第 12 课的键值缓存随着层数、词数和键值头的个数一起增长；文本一长，占满内存的是它，而不是模型权重。
**多查询注意力**（MQA）只保留一个键值头，所有查询头共用；**分组查询注意力**（GQA，Llama 2/3、Mistral、Qwen 都在用）保留少数几个：
8 个查询头、2 个键值头时，查询头 0-3 读键值头 0，查询头 4-7 读键值头 1。

它的结果和普通多头注意力完全一样，只要把每个键值头按组复制就行；attnlab 计算时不会真的去复制。
"""),
    code("""
torch.manual_seed(0)
T, D = 12, 16
q = torch.randn(1, 8, T, D)      # 8 query heads
k = torch.randn(1, 2, T, D)      # 2 key/value heads (GQA)
v = torch.randn(1, 2, T, D)
gqa = attnlab.attention(q, k, v, causal=True)
repeated = attnlab.attention(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1),
                             causal=True)
print(kit.T("GQA = repeated K/V:", "GQA = 复制后的 K/V："),
      torch.allclose(gqa, repeated, atol=1e-6))

group = q.shape[1] // k.shape[1]
reads = np.array([[1.0 if h // group == g else 0.0 for g in range(2)] for h in range(8)])
kit.show(kit.matrix(reads, [f"q{h}" for h in range(8)], ["kv0", "kv1"],
                    title=kit.T("which K/V head each query head reads",
                                "每个查询头读哪个键值头")), "groups")
""", zh={
    '8 query heads': '8 个查询头',
    '2 key/value heads (GQA)': '2 个键/值头（GQA）',
}),
    md(en="""
What it saves: the cache of a 7B-sized model (32 layers, head size 128) holding
4,096 tokens in 16-bit numbers, with 32, 8 or 1 key/value heads. The module takes
`num_kv_heads`: `MultiHeadAttention(d_in, d_out, num_heads=8, num_kv_heads=2)` has
smaller `W_key` and `W_value`.
""", zh="""
能省多少：一个 7B 规模的模型（32 层，每个头 128 维），用 16 位数存 4,096 个词的缓存，键值头分别是 32、8、1 个。
模块通过 `num_kv_heads` 指定：`MultiHeadAttention(d_in, d_out, num_heads=8, num_kv_heads=2)` 的 `W_key` 和 `W_value` 更小。
"""),
    code("""
layers, head_dim, tokens, bytes_per_number = 32, 128, 4096, 2
sizes = {}
for name, kv_heads in (("MHA 32", 32), ("GQA 8", 8), ("MQA 1", 1)):
    sizes[name] = 2 * layers * kv_heads * head_dim * tokens * bytes_per_number / 2**30  # K and V
    print(f"{name:>7}: {sizes[name]:.2f} GiB")
kit.show(kit.bars(list(sizes), list(sizes.values()),
                  title=kit.T("KV cache, 4,096 tokens", "4,096 个词的键值缓存"),
                  ylabel="GiB"), "cache-size")

m = attnlab.MultiHeadAttention(d_in=64, d_out=64, num_heads=8, num_kv_heads=2)
print("W_query", tuple(m.W_query.weight.shape), "W_key", tuple(m.W_key.weight.shape))
""", zh={
    'K and V': 'K 和 V',
}),
    md(en="""
The check: GQA and MQA equal the NumPy oracle, which repeats each key/value head for
its group.
""", zh="""
检查：GQA 和 MQA 的结果，要等于 NumPy 参考实现（它把每个键值头按组复制）。
"""),
    code("""
mqa = attnlab.attention(q, k[:, :1], v[:, :1], causal=True)  # one key/value head
as_np = [t.double().numpy() for t in (q, k, v)]
kit.check(kit.T("GQA = attnlab.reference", "GQA = attnlab.reference"), gqa,
          attnlab.reference.attention(*as_np, causal=True), atol=1e-5)
kit.check(kit.T("MQA = attnlab.reference", "MQA = attnlab.reference"), mqa,
          attnlab.reference.attention(as_np[0], as_np[1][:, :1], as_np[2][:, :1], causal=True),
          atol=1e-5)
""", zh={
    'one key/value head': '一个键/值头',
}),
])
