"""Lesson 3: attention in about 30 lines of NumPy, on five tokens and on your own sentence."""

from .cells import Lesson, code, md

LESSON = Lesson(3, "numpy-attention", {"en": "Attention in 30 lines of NumPy",
                                       "zh": "30 行 NumPy 写出注意力"}, sentence=True, cells=[
    md(en="""
Now for real sentences. Where do queries, keys and values come from? Each is the word
vector times a matrix: `q = x W_q`, `k = x W_k`, `v = x W_v`. In a trained model these
matrices are learned; here they are random, which is enough to see the machinery work.
The whole of attention fits in one short function. The optional `causal` switch (lesson 6)
hides later words from earlier ones.
""", zh="""
现在换成真正的句子。
查询、键、值从哪里来？每一个都是词向量乘以一个矩阵：`q = x W_q`，`k = x W_k`，`v = x W_v`。
在训练好的模型里这些矩阵是学出来的；这里先用随机矩阵，足够看清整个流程。
整个注意力就是下面这一个短短的函数。
可选的 `causal` 开关（第 6 课会讲）让前面的词看不到后面的词。
"""),
    code("""
def softmax(s):
    s = s - s.max(axis=-1, keepdims=True)  # subtract each row's max: same result, no overflow
    e = np.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


def numpy_attention(x, W_q, W_k, W_v, causal=False):
    q, k, v = x @ W_q, x @ W_k, x @ W_v          # (T, d) each
    scores = q @ k.T / np.sqrt(k.shape[-1])      # (T, T), scaled by the size of one key
    if causal:                                   # word i may not look at words j > i
        future = np.triu(np.ones(scores.shape, dtype=bool), k=1)
        scores = np.where(future, -np.inf, scores)
    weights = softmax(scores)                    # each row sums to 1
    return weights @ v, weights, (q, k, v)


rng = np.random.default_rng(0)
W_q, W_k, W_v = (rng.normal(size=(3, 4)) for _ in range(3))  # 3 features in, 4 out
""", zh={
    "subtract each row's max: same result, no overflow": '每行减去它的最大值：结果不变，也不会溢出',
    '(T, d) each': '各为 (T, d)',
    '(T, T), scaled by the size of one key': '(T, T)，按一个键的维度缩放',
    'word i may not look at words j > i': '第 i 个词不能看 j > i 的词',
    'each row sums to 1': '每一行之和为 1',
    '3 features in, 4 out': '输入 3 个特征，输出 4 个',
}),
    md(en="""
First the five tokens of the tutorials, *I like the blue sky*. Row i of the weights is
where word i looks.
""", zh="""
先用教程里常见的五个词 *I like the blue sky*。
权重的第 i 行表示第 i 个词把注意力放在哪些词上。
"""),
    code("""
five = ["I", "like", "the", "blue", "sky"]
out5, w5, qkv5 = numpy_attention(kit.embed(five), W_q, W_k, W_v)
print("       " + " ".join(f"{t:>6}" for t in five))
for t, row in zip(five, w5):
    print(f"{t:>6} " + " ".join(f"{x:6.3f}" for x in row))
"""),
    md(en="""
Then your own sentence (`SENTENCE`; Chinese works too: without spaces each known word
or each character is a token).
""", zh="""
再换成你自己的句子（`SENTENCE`）。
中文不用空格也可以：认识的词（我、喜欢、蓝色、的、天空）作为一个词，其余每个汉字算一个词。
"""),
    code("""
tokens = kit.words(SENTENCE)
out, weights, (q, k, v) = numpy_attention(kit.embed(tokens), W_q, W_k, W_v)
print(tokens)
print(np.round(weights, 3))
kit.show(kit.heatmap(weights, tokens, title=kit.T("NumPy attention", "NumPy 注意力")),
         "weights")
"""),
    md(en="""
The check: on the same q, k, v (made into `(heads=1, T, d)` tensors) `attnlab.attention`
returns the same context vectors and the same weights, for both sentences, and the
causal version equals `causal=True`.
""", zh="""
检查：把同样的 q、k、v 变成 `(heads=1, T, d)` 的张量交给 `attnlab.attention`，两个句子得到的上下文向量和权重都要和我们的一样；
因果版本要和 `causal=True` 一样。
"""),
    code("""
def library(qkv, causal=False):
    q, k, v = (torch.tensor(a)[None] for a in qkv)
    out, w = attnlab.attention(q, k, v, causal=causal, return_weights=True)
    return out[0], w[0]


kit.check(kit.T("five tokens: context", "五个词：上下文向量"), out5, library(qkv5)[0])
kit.check(kit.T("your sentence: weights", "你的句子：权重"), weights, library((q, k, v))[1])
causal_out, _, _ = numpy_attention(kit.embed(tokens), W_q, W_k, W_v, causal=True)
kit.check(kit.T("your sentence, causal: context", "你的句子（因果）：上下文向量"),
          causal_out, library((q, k, v), causal=True)[0])
"""),
])
