"""Lesson 2: scaled dot-product attention on two tokens, small enough to do by hand."""

from .cells import Lesson, code, md

LESSON = Lesson(2, "by-hand", {"en": "A 2x2 example, worked by hand",
                               "zh": "手算一个 2x2 的例子"}, cells=[
    md(en="""
Attention gives every token three vectors. The **query** q says what the token is
looking for, the **key** k what it offers to be found by, the **value** v what it
passes on. Scaled dot-product attention is four steps:

1. scores: `sᵢⱼ = qᵢ · kⱼ` (lesson 1's dot product);
2. scale: divide by `√d`, where d is the length of one key;
3. softmax of each row: the weights `αᵢⱼ`, positive, summing to 1;
4. context: `zᵢ = Σⱼ αᵢⱼ vⱼ`, the weighted sum of the values.

Two tokens with two features each:
`q₁ = [1, 0]`, `q₂ = [0, 1]`, `k₁ = [1, 1]`, `k₂ = [0, 2]`, `v₁ = [1, 2]`, `v₂ = [3, 4]`.
By hand: `q₁·k₁ = 1`, `q₁·k₂ = 0`, `q₂·k₁ = 1`, `q₂·k₂ = 2`; divided by `√2` that is
`[0.7071, 0]` and `[0.7071, 1.4142]`; `e^0.7071 = 2.028`, `e^0 = 1`, so row 1 is
`[2.028, 1] / 3.028 = [0.670, 0.330]`, and row 2 is `[0.330, 0.670]`;
`z₁ = 0.670·[1, 2] + 0.330·[3, 4] = [1.660, 2.660]`.
The code does the same steps one number at a time.
""", zh="""
注意力给每个词三个向量。
**查询**（query）q 表示这个词要找什么，**键**（key）k 表示它能被怎样找到，**值**（value）v 是它要传递出去的内容。
缩放点积注意力一共四步：

1. 打分：`sᵢⱼ = qᵢ · kⱼ`（就是第 1 课的点积）；
2. 缩放：除以 `√d`，d 是一个键向量的长度；
3. 对每一行做 softmax，得到注意力权重 `αᵢⱼ`，都是正数，每行加起来等于 1；
4. 加权求和：`zᵢ = Σⱼ αᵢⱼ vⱼ`，得到上下文向量。

两个词，每个词两个特征：
`q₁ = [1, 0]`，`q₂ = [0, 1]`，`k₁ = [1, 1]`，`k₂ = [0, 2]`，`v₁ = [1, 2]`，`v₂ = [3, 4]`。
手算一遍：`q₁·k₁ = 1`，`q₁·k₂ = 0`，`q₂·k₁ = 1`，`q₂·k₂ = 2`；
除以 `√2` 得到 `[0.7071, 0]` 和 `[0.7071, 1.4142]`；
`e^0.7071 = 2.028`，`e^0 = 1`，所以第一行是 `[2.028, 1] / 3.028 = [0.670, 0.330]`，第二行是 `[0.330, 0.670]`；
`z₁ = 0.670·[1, 2] + 0.330·[3, 4] = [1.660, 2.660]`。
下面的代码一个数一个数地重复这几步。
"""),
    code("""
q = [[1.0, 0.0], [0.0, 1.0]]
k = [[1.0, 1.0], [0.0, 2.0]]
v = [[1.0, 2.0], [3.0, 4.0]]
d = len(k[0])

scores = [[sum(a * b for a, b in zip(qi, kj)) for kj in k] for qi in q]  # 1. q · k
scaled = [[s / math.sqrt(d) for s in row] for row in scores]               # 2. / sqrt(d)
weights = []
for row in scaled:                                                         # 3. softmax
    e = [math.exp(s) for s in row]
    weights.append([x / sum(e) for x in e])
context = [[sum(w * vj[c] for w, vj in zip(row, v)) for c in range(len(v[0]))]
           for row in weights]                                             # 4. sum of w * v
for name, m in (("scores", scores), ("scaled", scaled), ("weights", weights),
                ("context", context)):
    print(f"{name:>8}:", [[round(x, 4) for x in row] for row in m])
""", zh={
    '1. q · k': '1. q · k',
    '2. / sqrt(d)': '2. 除以 sqrt(d)',
    '3. softmax': '3. softmax',
    '4. sum of w * v': '4. 对 w * v 求和',
}),
    md(en="""
Each row of the weights says where one query looks: query 1 prefers key 1 (its
direction), query 2 prefers key 2. The picture shows the same two rows.
""", zh="""
权重的每一行说明一个查询把注意力放在哪里：查询 1 更偏向键 1（方向一致），查询 2 更偏向键 2。
下图画的就是这两行。
"""),
    code("""
labels = [kit.T("token 1", "词 1"), kit.T("token 2", "词 2")]
kit.show(kit.heatmap(np.array(weights), labels, title=kit.T("2x2 attention weights",
                                                              "2x2 注意力权重")), "weights")
"""),
    md(en="""
The check: the hand-computed context vectors equal the NumPy oracle
`attnlab.reference.attention` and `attnlab.attention` on the same q, k and v.
""", zh="""
检查：手算的上下文向量，要和 NumPy 参考实现 `attnlab.reference.attention` 以及 `attnlab.attention` 在同样的 q、k、v 上的结果一致。
"""),
    code("""
oracle = attnlab.reference.attention(np.array([q]), np.array([k]), np.array([v]))[0]
library = attnlab.attention(torch.tensor([q]), torch.tensor([k]), torch.tensor([v]))[0]
kit.check(kit.T("by hand = attnlab.reference", "手算 = attnlab.reference"), context, oracle,
          atol=1e-12)
kit.check(kit.T("by hand = attnlab.attention", "手算 = attnlab.attention"), context, library,
          atol=1e-6)
"""),
])
