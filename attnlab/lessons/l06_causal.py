"""Lesson 6: the causal mask, the two mask conventions, and CausalAttention."""

from .cells import Lesson, code, md

LESSON = Lesson(6, "causal-mask", {"en": "The causal mask and CausalAttention",
                                   "zh": "因果掩码与因果注意力"}, sentence=True, cells=[
    md(en="""
A language model predicts the next word, so while it reads word i it must not see
words after i. A **causal mask** says which keys each query may attend to: query i may
see keys `j ≤ i`, a lower triangle. Forbidden scores become `-inf` before the softmax,
so their weights are exactly 0 and each row still sums to 1.

In attnlab a boolean mask means **True = may attend** (`attnlab.masks.causal(T)`).
Tutorials bring two opposite conventions, and mixing them up is a classic bug:
the book (and PyTorch's `nn.MultiheadAttention`) build `torch.triu(..., diagonal=1)`,
where 1/True marks what is **masked**; tokenizers return padding masks where 1 means
a **real token**. `attnlab.masks.from_attention_mask` converts both.
""", zh="""
语言模型要预测下一个词，所以在读第 i 个词时，它不能看到 i 之后的词。
**因果掩码**规定每个查询可以关注哪些键：查询 i 只能看键 `j ≤ i`，是一个下三角。
被禁止的分数在 softmax 之前设成 `-inf`，它们的权重就正好是 0，每一行加起来仍然等于 1。

在 attnlab 里，布尔掩码的含义是 **True = 可以关注**（`attnlab.masks.causal(T)`）。
教程里有两种相反的约定，把它们弄混是一个经典错误：
书里（还有 PyTorch 的 `nn.MultiheadAttention`）用 `torch.triu(..., diagonal=1)`，1/True 表示**被遮住**；
分词器返回的填充掩码里，1 表示**真实的词**。
`attnlab.masks.from_attention_mask` 可以把这两种都转换过来。
"""),
    code("""
tokens = kit.words(SENTENCE)
T = len(tokens)
allowed = attnlab.masks.causal(T)  # True = may attend
print(kit.T("attnlab (True = may attend):", "attnlab（True = 可以关注）："))
print(allowed.int())

book = torch.triu(torch.ones(T, T), diagonal=1)  # the book's mask: 1 = masked (the future)
print(kit.T("the book (1 = masked):", "书里的掩码（1 = 遮住）："))
print(book.int())
# 4-D (batch, heads, q, k): a 2-D mask would be read as (batch, seq) padding
converted = attnlab.masks.from_attention_mask(book.bool()[None, None], masked_is_true=True)
print(kit.T("converted equals attnlab's:", "转换后与 attnlab 的一致："),
      torch.equal(converted[0, 0], allowed))

padding = torch.tensor([[1] * (T - 1) + [0]])  # a tokenizer's mask: the last token is padding
print(kit.T("padding mask as attnlab reads it:", "attnlab 读到的填充掩码："),
      attnlab.masks.from_attention_mask(padding).int().flatten().tolist())
""", zh={
    'True = may attend': 'True = 可以关注',
    "the book's mask: 1 = masked (the future)": '书中的掩码：1 = 被遮住（未来的词）',
    '4-D (batch, heads, q, k): a 2-D mask would be read as (batch, seq) padding': '四维 (batch, heads, q, k)：二维掩码会被当作 (batch, seq) 的填充掩码',
    "a tokenizer's mask: the last token is padding": '分词器给的掩码：最后一个词元是填充',
}),
    md(en="""
What goes wrong when the book's mask is passed as if it were attnlab's: every word
then sees only the *future*, and the last word sees nothing at all (attnlab gives such
a row zeros instead of NaN).
""", zh="""
如果把书里的掩码当成 attnlab 的掩码直接传进去，会出什么错：
每个词都只能看到*未来*的词，最后一个词什么也看不到（attnlab 给这样的行返回 0，而不是 NaN）。
"""),
    code("""
torch.manual_seed(123)
ca = attnlab.CausalAttention(d_in=3, d_out=2, context_length=T, dropout=0.0)
x = torch.tensor(kit.embed(tokens), dtype=torch.float32)
s = ca.steps(x)
q, k, v = s["queries"][None], s["keys"][None], s["values"][None]  # (1 head, T, 2)
_, wrong = attnlab.attention(q, k, v, mask=book.bool(), return_weights=True)
print(kit.T("weights with the mask inverted:", "掩码含义弄反后的权重："))
print(wrong[0].detach().numpy().round(2))
""", zh={
    '(1 head, T, 2)': '(1 个头, T, 2)',
}),
    md(en="""
`attnlab.CausalAttention(d_in, d_out, context_length, dropout)` is the book's class:
`SelfAttentionV2` plus the causal rule (and dropout, lesson 11). The picture shows the
triangle: nothing above the diagonal.
""", zh="""
`attnlab.CausalAttention(d_in, d_out, context_length, dropout)` 就是书里的那个类：`SelfAttentionV2` 加上因果规则（还有第 11 课的 dropout）。
图里可以看到这个三角形：对角线以上全是 0。
"""),
    code("""
out, weights = ca(x, return_weights=True)
print(weights.detach().numpy().round(3))
kit.show(kit.heatmap(weights, tokens, title=kit.T("causal attention", "因果注意力")),
         "causal")
"""),
    md(en="""
The check: `CausalAttention` equals `attnlab.attention` with the explicit mask, with
the book's mask after conversion, and the oracle's `causal=True`.
""", zh="""
检查：`CausalAttention` 的输出，要等于用显式掩码调用的 `attnlab.attention`、用转换后的书中掩码调用的结果，以及参考实现的 `causal=True`。
"""),
    code("""
with_mask = attnlab.attention(q, k, v, mask=allowed)[0]
with_book = attnlab.attention(q, k, v, mask=converted[0])[0]  # (1, T, T) for (heads, T, T)
oracle = attnlab.reference.attention(*(t.detach().double().numpy() for t in (q, k, v)),
                                     causal=True)[0]
kit.check(kit.T("CausalAttention = attention(mask=causal)", "CausalAttention = 带掩码的 attention"),
          out, with_mask)
kit.check(kit.T("the book's mask, converted", "转换后的书中掩码"), out, with_book)
kit.check(kit.T("CausalAttention = attnlab.reference(causal=True)",
                "CausalAttention = attnlab.reference(causal=True)"), out, oracle)
""", zh={
    '(1, T, T) for (heads, T, T)': '(1, T, T) 对应 (heads, T, T)',
}),
])
