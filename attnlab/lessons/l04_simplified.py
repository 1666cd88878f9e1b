"""Lesson 4: self-attention without trainable weights (SimplifiedSelfAttention)."""

from .cells import Lesson, code, md

LESSON = Lesson(4, "simplified-self-attention",
                {"en": "Simplified self-attention, without weights",
                 "zh": "不带可训练权重的简化自注意力"}, sentence=True, cells=[
    md(en="""
Before any matrices are learned, self-attention can already be written with the word
vectors alone, as chapter 3 of *Build a Large Language Model (From Scratch)* starts:
every word is its own query, key and value. For one word (the query) the scores are
its dot products with every word, the weights their softmax, and its new vector (the
*context vector*) the weighted sum of all the word vectors. No scaling yet.
""", zh="""
在学习任何矩阵之前，只用词向量本身就能写出自注意力，《从零构建大模型》（Build a Large Language Model From Scratch）第 3 章就是从这里开始的：
每个词同时充当自己的查询、键和值。
对一个词（查询）来说，分数是它和每个词的点积，权重是这些分数的 softmax，它的新向量（上下文向量）是所有词向量的加权和。
这里还没有缩放。
"""),
    code("""
tokens = kit.words(SENTENCE)
x = torch.tensor(kit.embed(tokens), dtype=torch.float32)  # (T, 3)

query = x[1]                                  # the second word asks
scores = torch.stack([query @ xj for xj in x])  # its dot product with every word
weights = torch.softmax(scores, dim=0)
context = sum(w * xj for w, xj in zip(weights, x))
print(kit.T("query:", "查询："), tokens[1])
print(kit.T("weights:", "权重："), [round(float(w), 3) for w in weights],
      kit.T("sum =", "总和 ="), round(float(weights.sum()), 6))
print(kit.T("context vector:", "上下文向量："), context)
""", zh={
    '(T, 3)': '(T, 3)',
    'the second word asks': '由第二个词来提问',
    'its dot product with every word': '它与每个词的点积',
}),
    md(en="""
All words at once is three matrix operations: `x @ x.T`, a softmax over each row
(`dim=-1`: over the keys, so that each *query's* weights sum to 1), and `weights @ x`.
`attnlab.SimplifiedSelfAttention` does the same, and its `steps(x)` returns each
intermediate tensor so you can compare.
""", zh="""
一次算出所有词，只需要三次矩阵运算：`x @ x.T`，对每一行做 softmax（`dim=-1`：在键的方向上归一化，使每个*查询*的权重加起来为 1），再算 `weights @ x`。
`attnlab.SimplifiedSelfAttention` 做的是同样的事，它的 `steps(x)` 会返回每一步的中间张量，方便对照。
"""),
    code("""
all_scores = x @ x.T
all_weights = torch.softmax(all_scores, dim=-1)  # dim=-1: each row (one query) sums to 1
all_context = all_weights @ x

module = attnlab.SimplifiedSelfAttention()
steps = module.steps(x)
print(sorted(steps))
print(kit.T("row 2 equals the loop above:", "第 2 行和上面的循环结果一致："),
      torch.allclose(all_context[1], context))
kit.show(kit.heatmap(all_weights, tokens, title=kit.T("simplified self-attention",
                                                     "简化自注意力")), "weights")
""", zh={
    'dim=-1: each row (one query) sums to 1': 'dim=-1：每一行（一个查询）之和为 1',
}),
    md(en="""
The check: our three lines equal the module's output and `attnlab.attention(x, x, x,
scale=1.0)` (no scaling), the weights included.
""", zh="""
检查：我们的三行代码，要和模块的输出以及 `attnlab.attention(x, x, x, scale=1.0)`（不缩放）一致，权重也一样。
"""),
    code("""
out, w = module(x, return_weights=True)
lib_out, lib_w = attnlab.attention(x[None], x[None], x[None], scale=1.0, return_weights=True)
kit.check(kit.T("context = SimplifiedSelfAttention", "上下文向量 = SimplifiedSelfAttention"),
          all_context, out)
kit.check(kit.T("weights = attnlab.attention(scale=1.0)", "权重 = attnlab.attention(scale=1.0)"),
          all_weights, lib_w[0])
kit.check(kit.T("context = attnlab.attention(scale=1.0)",
                "上下文向量 = attnlab.attention(scale=1.0)"), all_context, lib_out[0])
"""),
])
