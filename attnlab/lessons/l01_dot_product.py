"""Lesson 1: the dot product and cosine similarity, the first step of attention."""

from .cells import Lesson, code, md

LESSON = Lesson(1, "dot-product", {"en": "The dot product and cosine similarity",
                                   "zh": "点积与余弦相似度"}, sentence=True, cells=[
    md(en="""
Attention starts with one question: how much does one word have to do with another?
Each word is a vector of numbers (an *embedding*), and the simplest measure of how
much two vectors agree is their **dot product**: multiply them feature by feature and
add up, `a · b = a₁b₁ + a₂b₂ + a₃b₃`. Vectors that point the same way give a large
dot product; unrelated ones give a small one.

Here the five words of `SENTENCE` get three-number vectors (hand-made for
"I like the blue sky", so that *blue* and *sky* point the same way; any other word
gets a fixed random vector). Change `SENTENCE` to try your own.
""", zh="""
注意力要回答的第一个问题是：一个词和另一个词有多大关系？
每个词都是一串数字，也就是一个向量（词嵌入）。
衡量两个向量有多"像"，最简单的办法是**点积**：逐个特征相乘，再全部加起来，`a · b = a₁b₁ + a₂b₂ + a₃b₃`。
方向一致的两个向量点积大，不相干的两个向量点积小。

下面给 `SENTENCE` 里的每个词配一个三维向量。
"我 / 喜欢 / 蓝色 / 的 / 天空"这五个词的向量是手工设定的，让"蓝色"和"天空"方向相近；其他词会得到一个固定的随机向量。
把 `SENTENCE` 换成你自己的句子试试。
"""),
    code("""
tokens = kit.words(SENTENCE)
x = kit.embed(tokens)  # (number of words, 3): one row per word
for word, row in zip(tokens, x):
    print(f"{word:>6}", row)
""", zh={
    '(number of words, 3): one row per word': '(词数, 3)：每个词一行',
}),
    md(en="""
The dot product by hand, with a plain loop, and then all pairs at once: the matrix
product `x @ x.T` holds the dot product of word i with word j in row i, column j.
""", zh="""
先用最朴素的循环手算一个点积，再一次算出所有词两两之间的点积：
矩阵乘法 `x @ x.T` 的第 i 行第 j 列，就是第 i 个词和第 j 个词的点积。
"""),
    code("""
a, b = x[0], x[-1]
by_hand = 0.0
for ai, bi in zip(a, b):  # multiply feature by feature, add up
    by_hand += ai * bi
print(f"{tokens[0]} · {tokens[-1]} = {by_hand:.4f}   (numpy a @ b = {a @ b:.4f})")

dots = x @ x.T  # (n, n): every pair at once
print(np.round(dots, 3))
""", zh={
    'multiply feature by feature, add up': '逐个特征相乘，再相加',
    '(n, n): every pair at once': '(n, n)：一次算出所有词对',
}),
    md(en="""
The dot product also grows with the length of the vectors. **Cosine similarity** keeps
only the direction: divide by both lengths, `cos(a, b) = a · b / (|a| |b|)`. It lies
between -1 (opposite) and 1 (same direction), and it is the dot product of the two
vectors after each has been scaled to length 1.
""", zh="""
点积还会随着向量变长而变大。
**余弦相似度**只看方向：除以两个向量的长度，`cos(a, b) = a · b / (|a| |b|)`。
它在 -1（方向相反）和 1（方向相同）之间，等于把两个向量都缩放到长度 1 之后再做点积。
"""),
    code("""
unit = x / np.linalg.norm(x, axis=1, keepdims=True)  # every row scaled to length 1
cos = unit @ unit.T
i, j = np.unravel_index(np.argmax(cos - 2 * np.eye(len(tokens))), cos.shape)
print(kit.T(f"most similar pair: {tokens[i]!r} and {tokens[j]!r}, cos = {cos[i, j]:.3f}",
            f"最相似的一对：{tokens[i]!r} 和 {tokens[j]!r}，cos = {cos[i, j]:.3f}"))
kit.show(kit.matrix(cos, tokens, tokens, title=kit.T("cosine similarity", "余弦相似度"),
                    label="cos"), "cosine")
""", zh={
    'every row scaled to length 1': '每一行缩放到长度 1',
}),
    md(en="""
**From similarity to attention.** Attention turns each row of dot products into weights
with a softmax: `softmax(s)ᵢ = exp(sᵢ) / Σⱼ exp(sⱼ)`, all positive, summing to 1.
With the words themselves as queries, keys and values and no scaling (`scale=1.0`),
that is exactly `attnlab.attention(x, x, x, scale=1.0)`. The check below computes
the softmax of our dot products and holds it to the weights attnlab returns.
""", zh="""
**从相似度到注意力。**
注意力用 softmax 把每一行点积变成权重：`softmax(s)ᵢ = exp(sᵢ) / Σⱼ exp(sⱼ)`，全是正数，加起来等于 1。
如果查询、键、值都用词向量本身，并且不缩放（`scale=1.0`），这正是 `attnlab.attention(x, x, x, scale=1.0)`。
下面的检查把我们自己算的点积做 softmax，再和 attnlab 返回的注意力权重逐个比较。
"""),
    code("""
weights = np.exp(dots) / np.exp(dots).sum(axis=1, keepdims=True)  # softmax of each row
print(np.round(weights, 3))

xt = torch.tensor(x)[None]  # (1, n, 3): one "head"
_, lib_weights = attnlab.attention(xt, xt, xt, scale=1.0, return_weights=True)
kit.check(kit.T("softmax of the dot products = attnlab.attention weights",
                "点积的 softmax = attnlab.attention 的权重"), weights, lib_weights[0], atol=1e-9)
""", zh={
    'softmax of each row': '对每一行做 softmax',
    '(1, n, 3): one "head"': '(1, n, 3)：一个“头”',
}),
])
