"""Lesson 12: the KV cache: decoding one token at a time equals the full recompute."""

from .cells import Lesson, code, md

LESSON = Lesson(12, "kv-cache", {"en": "The KV cache", "zh": "键值缓存"}, cells=[
    md(en="""
A model generates text one token at a time. With a causal mask, the keys and values
of the earlier tokens never change when a new token arrives, so recomputing them at
every step is wasted work. A **KV cache** keeps them: at each step only the new
token is projected, its key and value are appended, and its query attends over
everything in the cache. Generating T tokens then projects T tokens instead of
`1 + 2 + ... + T`.

`attnlab.KVCache(batch, max_seq_len, num_kv_heads, head_dim)` is preallocated;
`MultiHeadAttention(x, cache=cache)` appends and attends. Because the new query is the
*last* row, causal attention with a cache aligns to the end: a query at position p
sees keys `j ≤ p`.
""", zh="""
模型生成文本是一个词一个词来的。
有因果掩码时，新词到来不会改变前面各词的键和值，每一步都重新计算它们是白费功夫。
**键值缓存**（KV cache）把它们存下来：每一步只投影新来的词，把它的键和值追加进缓存，再让它的查询关注缓存里的全部内容。
这样生成 T 个词只需要投影 T 次，而不是 `1 + 2 + ... + T` 次。

`attnlab.KVCache(batch, max_seq_len, num_kv_heads, head_dim)` 事先分配好空间；`MultiHeadAttention(x, cache=cache)` 负责追加和关注。
新的查询是*最后*一行，所以带缓存的因果注意力按末尾对齐：位置 p 上的查询看得到键 `j ≤ p`。
"""),
    code("""
torch.manual_seed(0)
T = 10
mha = attnlab.MultiHeadAttention(d_in=16, d_out=16, num_heads=4, causal=True).eval()
x = torch.randn(1, T, 16)

with torch.no_grad():
    full, full_w = mha(x, return_weights=True)  # all T tokens at once

    cache = mha.new_cache(batch_size=1, max_seq_len=T)  # = attnlab.KVCache(1, T, 4, 4)
    steps, rows = [], []
    for t in range(T):  # one token at a time, as generation does
        out_t, w_t = mha(x[:, t:t + 1], cache=cache, return_weights=True)
        steps.append(out_t)
        rows.append(torch.nn.functional.pad(w_t[0, 0, 0], (0, T - 1 - t)))
decoded = torch.cat(steps, dim=1)
print(kit.T("tokens in the cache:", "缓存里的词数："), cache.seq_len)
print(kit.T("projections with the cache:", "用缓存时的投影次数："), T,
      kit.T("| without:", "| 不用缓存："), T * (T + 1) // 2)
""", zh={
    'all T tokens at once': '一次处理全部 T 个词元',
    '= attnlab.KVCache(1, T, 4, 4)': '= attnlab.KVCache(1, T, 4, 4)',
    'one token at a time, as generation does': '一次一个词元，和生成时一样',
}),
    md(en="""
Each decoding step gave one row of weights (the new token looking back). Stacked,
the rows form the same triangle as the full computation.
""", zh="""
每一步解码得到一行权重（新词回头看）。
把这些行叠起来，就是完整计算时的同一个三角形。
"""),
    code("""
labels = [f"t{i}" for i in range(T)]
kit.show(kit.heatmap(torch.stack(rows), labels,
                     title=kit.T("head 0, one row per decoding step", "头 0：每步解码一行")),
         "decode-rows")
"""),
    md(en="""
The check: the token-by-token outputs with the cache equal the full recompute, and
the stacked rows equal the full weights of head 0.
""", zh="""
检查：用缓存逐词解码的输出要等于一次性完整计算的结果，叠起来的各行也要等于头 0 的完整权重。
"""),
    code("""
kit.check(kit.T("KV-cache decoding = full recompute", "键值缓存解码 = 完整重算"), decoded, full,
          atol=1e-5)
kit.check(kit.T("decoding rows = full weights", "逐步的权重行 = 完整权重"), torch.stack(rows),
          full_w[0, 0], atol=1e-6)
"""),
])
