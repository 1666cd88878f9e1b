"""Lesson 11: where dropout goes in attention, and that it is off in eval mode."""

from .cells import Lesson, code, md

LESSON = Lesson(11, "dropout", {"en": "Dropout placement", "zh": "dropout 放在哪里"}, cells=[
    md(en="""
Dropout fights overfitting: during training it zeroes random entries and scales the
rest by `1/(1-p)`, so the expected value stays the same. In attention it can go in
two places: on the **attention weights** (each query randomly loses some of the keys
it looks at; the book's `CausalAttention` does this), or on the **output** of the
attention block after `out_proj` (GPT-2's `resid_pdrop`). In `model.eval()` both are
off, and the module must give exactly the attention of lesson 6.
""", zh="""
dropout 用来抑制过拟合：训练时它随机把一些元素置 0，其余的乘以 `1/(1-p)`，使期望值不变。
在注意力里它可以放在两个地方：放在**注意力权重**上（每个查询随机丢掉一部分它要看的键，书里的 `CausalAttention` 就是这样做的），
或者放在注意力模块经过 `out_proj` 之后的**输出**上（GPT-2 的 `resid_pdrop`）。
在 `model.eval()` 模式下两者都关闭，模块的结果必须和第 6 课的注意力完全一样。
"""),
    code("""
torch.manual_seed(123)
x = torch.rand(6, 3)  # six tokens, three features
ca = attnlab.CausalAttention(d_in=3, d_out=2, context_length=6, dropout=0.5)
steps = ca.steps(x)
weights = steps["weights"].detach()
torch.manual_seed(0)
dropped = torch.nn.functional.dropout(weights, p=0.5, training=True)
print(kit.T("weights:", "权重："))
print(weights.numpy().round(2))
print(kit.T("after dropout (p = 0.5): zeros, the rest doubled",
            "dropout 之后（p = 0.5）：有的变成 0，其余翻倍"))
print(dropped.numpy().round(2))

ca.train()
a, b = ca(x), ca(x)
print(kit.T("train mode, two calls equal:", "训练模式下两次调用相同："), torch.allclose(a, b))
ca.eval()
print(kit.T("eval mode, two calls equal: ", "评估模式下两次调用相同："),
      torch.allclose(ca(x), ca(x)))
""", zh={
    'six tokens, three features': '六个词元，三个特征',
}),
    md(en="""
Does the place matter? `attnlab.experiments.dropout_placement` trains lesson 8's
model three times from the same seed: without dropout, with dropout on the weights,
and with dropout on the output, and reports the held-out loss of each. On a text this
small and regular, expect dropout to cost a little rather than help: it pays on larger
models that would otherwise memorise their data.
""", zh="""
放的位置有区别吗？
`attnlab.experiments.dropout_placement` 用同一个随机种子把第 8 课的模型训练三次：不用 dropout、dropout 放在权重上、dropout 放在输出上，并报告各自的留出集损失。
这段文本又小又规整，dropout 多半会让结果稍差一点，而不是更好：它在那些否则会死记训练数据的大模型上才有用。
"""),
    code("""
from attnlab import experiments

torch.set_num_threads(1)  # three tiny models: faster on one thread (lesson 8)
placement = experiments.dropout_placement(p=0.2, steps=150, seed=0)
for where, entry in placement.items():
    print(f"{where:>8}: train {entry['train_loss']:.3f}, held-out {entry['eval_loss']:.3f}")
kit.show(kit.bars(list(placement), [e["eval_loss"] for e in placement.values()],
                  title=kit.T("held-out loss by dropout placement",
                              "不同 dropout 位置的留出集损失"),
                  ylabel=kit.T("loss", "损失")), "placement")
""", zh={
    'three tiny models: faster on one thread (lesson 8)': '三个小模型：单线程更快（见第 8 课）',
}),
    md(en="""
The check: in eval mode `CausalAttention(dropout=0.5)` equals the NumPy oracle with
`causal=True` and no dropout, and in train mode it does not.
""", zh="""
检查：评估模式下，`CausalAttention(dropout=0.5)` 要等于 NumPy 参考实现（`causal=True`，没有 dropout）；训练模式下则不相等。
"""),
    code("""
q, k, v = (steps[n].detach().double().numpy()[None] for n in ("queries", "keys", "values"))
oracle = attnlab.reference.attention(q, k, v, causal=True)[0]
ca.train()
assert float((ca(x).detach() - torch.tensor(oracle)).abs().max()) > 1e-3, "dropout should be on"
ca.eval()
kit.check(kit.T("eval mode = attnlab.reference (no dropout)",
                "评估模式 = attnlab.reference（没有 dropout）"), ca(x), oracle, atol=1e-6)
"""),
])
