"""Lesson 5: self-attention with trainable weights, the book's SelfAttention_v1 and _v2."""

from .cells import Lesson, code, md

LESSON = Lesson(5, "self-attention", {"en": "Self-attention with trainable weights (v1, v2)",
                                      "zh": "带可训练权重的自注意力（v1、v2）"},
                sentence=True, cells=[
    md(en="""
Now the three matrices `W_query`, `W_key`, `W_value` of lesson 3 become parameters a
model can learn. The book writes this twice: `SelfAttention_v1` holds them as
`nn.Parameter` matrices and computes `x @ W`; `SelfAttention_v2` uses `nn.Linear`
layers (better initialisation, optional bias). attnlab has both, with the book's
constructors: `attnlab.SelfAttentionV1(d_in, d_out)` and
`attnlab.SelfAttentionV2(d_in, d_out, qkv_bias=False)`. The scores are now divided by
`√d_out`, the size of one key: without it, long vectors give large scores and a
softmax that puts almost all weight on one word (and tiny gradients).
""", zh="""
现在把第 3 课里的三个矩阵 `W_query`、`W_key`、`W_value` 变成模型可以学习的参数。
书里写了两个版本：`SelfAttention_v1` 把它们存成 `nn.Parameter` 矩阵，计算 `x @ W`；`SelfAttention_v2` 改用 `nn.Linear` 层（初始化更好，还可以加偏置）。
attnlab 两个都有，构造参数和书里一样：`attnlab.SelfAttentionV1(d_in, d_out)` 和 `attnlab.SelfAttentionV2(d_in, d_out, qkv_bias=False)`。
现在分数要除以 `√d_out`，即一个键向量的长度。
不缩放的话，向量越长分数越大，softmax 会把几乎全部权重压到一个词上（梯度也会变得很小）。
"""),
    code("""
tokens = kit.words(SENTENCE)
x = torch.tensor(kit.embed(tokens), dtype=torch.float32)  # (T, d_in=3)

torch.manual_seed(123)
v1 = attnlab.SelfAttentionV1(d_in=3, d_out=2)
torch.manual_seed(789)
v2 = attnlab.SelfAttentionV2(d_in=3, d_out=2)
print("v1:", v1(x))
print("v2:", v2(x))
""", zh={
    '(T, d_in=3)': '(T, d_in=3)',
}),
    md(en="""
The two differ only in their starting weights. `nn.Linear` stores its matrix
transposed (`x @ W.T`), so copying v2's weights into v1, transposed, makes them equal.
""", zh="""
两者的区别只是初始权重不同。
`nn.Linear` 存的是转置后的矩阵（计算 `x @ W.T`），所以把 v2 的权重转置后复制给 v1，两者的输出就完全一样。
"""),
    code("""
with torch.no_grad():
    v1.W_query.copy_(v2.W_query.weight.T)
    v1.W_key.copy_(v2.W_key.weight.T)
    v1.W_value.copy_(v2.W_value.weight.T)
print(kit.T("v1 == v2 now:", "现在 v1 == v2："), torch.allclose(v1(x), v2(x)))

steps = v2.steps(x)  # every intermediate tensor, by name
for name in ("queries", "keys", "scores", "weights"):
    print(f"{name:>8}:", steps[name].shape)
kit.show(kit.heatmap(steps["weights"], tokens, title="SelfAttentionV2"), "weights")
""", zh={
    'every intermediate tensor, by name': '每个中间张量，按名字取',
}),
    md(en="""
The check: the module's output equals the NumPy oracle `attnlab.reference.attention`
on the module's own queries, keys and values, with the scale `1/√d_out`.
""", zh="""
检查：模块的输出，要等于 NumPy 参考实现 `attnlab.reference.attention` 在模块自己的查询、键、值上的结果，缩放系数是 `1/√d_out`。
"""),
    code("""
q, k, v = (steps[n].detach().double().numpy()[None] for n in ("queries", "keys", "values"))
oracle = attnlab.reference.attention(q, k, v, scale=1 / math.sqrt(2))[0]
kit.check(kit.T("SelfAttentionV2 = attnlab.reference", "SelfAttentionV2 = attnlab.reference"),
          v2(x), oracle, atol=1e-6)
kit.check(kit.T("SelfAttentionV1 = attnlab.reference", "SelfAttentionV1 = attnlab.reference"),
          v1(x), oracle, atol=1e-6)
"""),
])
