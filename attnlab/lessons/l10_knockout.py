"""Lesson 10: knock out the queries, keys or values and measure what breaks."""

from .cells import Lesson, code, md
from .l08_toy_model import TRAIN, TRAIN_ZH

LESSON = Lesson(10, "knock-out-qkv", {"en": "Knocking out Q, K or V",
                                      "zh": "敲掉 Q、K 或 V"}, cells=[
    md(en="""
What does each of the three vectors do? Take the trained model of lesson 8 and break
one at a time, on text it never saw (`attnlab.experiments`):

- **constant Q**: every query replaced by the first one. A key then scores the same
  for every query, so no word can choose its own place to look.
- **constant K**: every key replaced by the first one. All scores of a row are equal,
  so each query spreads its weight evenly: attention becomes an average.
- **zero V**: the values set to zero. The weights are still there, but what they
  carry is nothing; only the residual path is left.

The hooks change q, k and v exactly as `attnlab.attention` receives them, so attention
itself still runs unchanged.
""", zh="""
三个向量各自起什么作用？
拿第 8 课训练好的模型，每次破坏一个，在它没见过的文本上测一测（`attnlab.experiments`）：

- **常数 Q**：所有查询都换成第一个查询。这样一个键对每个查询的分数都一样，没有哪个词还能自己决定看哪里。
- **常数 K**：所有键都换成第一个键。一行里的分数全都相等，每个查询只能平均分配权重：注意力变成了求平均。
- **零 V**：值全部设为 0。权重还在，但传过去的内容是空的，只剩下残差通路。

这些钩子修改的是 `attnlab.attention` 实际收到的 q、k、v，注意力本身照常运行。
"""),
    code(TRAIN, TRAIN_ZH),
    code("""
from attnlab import experiments

model = new_model()
train(model, ids, cfg, progress=False, log=None)
held_out = experiments.held_out_batch(tokenizer, batch=16, length=24, seed=0)
results = experiments.qkv_ablation(model, held_out)
results["uniform_attention"] = experiments.uniform_attention(model, held_out)
for name, entry in results.items():
    print(f"{name:>18}: loss {entry['loss']:.3f}")
names = list(results)
kit.show(kit.bars(names, [results[n]["loss"] for n in names],
                  title=kit.T("held-out loss with one part knocked out",
                              "敲掉一部分后的留出集损失"),
                  ylabel=kit.T("loss", "损失")), "losses")
"""),
    md(en="""
Each knockout costs the model; which costs most tells which part carries the rule.
Inside the block `experiments.ablated(model, "constant_k", record)` the model runs
with constant keys and `record` keeps the q and k that attention received.
""", zh="""
每敲掉一部分，模型都会变差；哪一个代价最大，就说明规则主要靠哪一部分承载。
在 `experiments.ablated(model, "constant_k", record)` 这个代码块里，模型用常数键运行，`record` 记下注意力实际收到的 q 和 k。
"""),
    code("""
sample = "ababab acacac"
sample_ids = torch.tensor([tokenizer.encode(sample)])
record = {}
model.eval()
with torch.no_grad(), experiments.ablated(model, "constant_k", record):
    _, (w_const_k,) = model(sample_ids, output_attentions=True)
print(w_const_k[0, 0, :5, :5].numpy().round(3))
kit.show(kit.heatmap(w_const_k[0, 0], list(sample), title=kit.T("constant keys: an average",
                                                                "常数键：变成了平均")),
         "constant-k")
"""),
    md(en="""
The check: with constant keys, the weights equal the NumPy oracle on the recorded
queries and keys, and that is exactly the uniform average `1/(i+1)` over the keys
each query may see.
""", zh="""
检查：键是常数时，模型的权重要等于 NumPy 参考实现在记录下来的查询和键上的结果，而且正好是每个查询在它能看到的键上的均匀平均 `1/(i+1)`。
"""),
    code("""
q, k = record["q"][0].double().numpy(), record["k"][0].double().numpy()
_, oracle_w = attnlab.reference.attention(q, k, k, causal=True, return_weights=True)
T = sample_ids.shape[1]
uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
kit.check(kit.T("constant K = attnlab.reference", "常数 K = attnlab.reference"),
          w_const_k[0], oracle_w[0], atol=1e-6)
kit.check(kit.T("constant K = uniform average", "常数 K = 均匀平均"), w_const_k[0, 0], uniform,
          atol=1e-6)
"""),
])
