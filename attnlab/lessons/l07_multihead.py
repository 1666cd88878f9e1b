"""Lesson 7: multi-head attention, and the scale that tutorials get wrong."""

from .cells import Lesson, code, md

LESSON = Lesson(7, "multi-head", {"en": "Multi-head attention",
                                  "zh": "多头注意力"}, sentence=True, cells=[
    md(en="""
One head computes one set of weights, one way of looking. **Multi-head attention** runs
several heads side by side: project `x` to queries, keys and values of size `d_out`,
split each into `num_heads` pieces of `head_dim = d_out / num_heads`, attend in every
head separately, put the heads back together, and mix them with one more matrix
(`out_proj`).

Each head's scores are divided by `√head_dim`, **the size of one head's key, not
`√d_out`** (`√d_model`). Several tutorials divide by `√embed_dim`; with 8 heads that
makes every score √8 ≈ 2.8 times too small and the weights much flatter than the
model intends. The code shows both,
with 64-d random word vectors and 8 heads of 8.
""", zh="""
一个头只算一组权重，只有一种"看"法。
**多头注意力**让几个头并排工作：把 `x` 投影成长度为 `d_out` 的查询、键、值，每个切成 `num_heads` 份，每份长 `head_dim = d_out / num_heads`；
每个头各自做注意力，再把各头的结果拼回去，最后用一个矩阵（`out_proj`）混合。

每个头的分数要除以 `√head_dim`，也就是**单个头的键向量长度，而不是 `√d_out`**（`√d_model`）。
不少教程除的是 `√embed_dim`：如果有 8 个头，每个分数就小了 √8 ≈ 2.8 倍，权重比模型本来应有的平坦得多。
下面用 64 维的随机词向量、8 个 8 维的头，把两种都算一遍。
"""),
    code("""
tokens = kit.words(SENTENCE)
T = len(tokens)
torch.manual_seed(123)
x = 2 * torch.randn(1, T, 64)  # (batch=1, T, d_in=64): one random 64-d vector per word
B = 1

mha = attnlab.MultiHeadAttention(d_in=64, d_out=64, num_heads=8, causal=True)
H, D = mha.num_heads, mha.head_dim
print(f"num_heads = {H}, head_dim = {D}, d_out = {mha.d_out}")
with torch.no_grad():
    out, weights = mha(x, return_weights=True)  # weights: (batch, heads, T, T)
print(out.shape, weights.shape)
""", zh={
    '(batch=1, T, d_in=64): one random 64-d vector per word': '(batch=1, T, d_in=64)：每个词一个随机的 64 维向量',
    'weights: (batch, heads, T, T)': '权重：(batch, heads, T, T)',
}),
    md(en="""
The same thing spelled out: project, split into heads (`view` then `transpose`, so the
head axis comes before the sequence), attend per head, merge, `out_proj`.
""", zh="""
把同样的计算一步步写出来：投影，拆成多个头（先 `view` 再 `transpose`，让"头"这一维排在序列前面），每个头做注意力，合并，再过 `out_proj`。
"""),
    code("""
def split_heads(t):  # (B, T, H * D) -> (B, H, T, D)
    return t.view(B, T, H, D).transpose(1, 2)


q, k, v = (split_heads(proj(x)) for proj in (mha.W_query, mha.W_key, mha.W_value))
future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)


def heads_by_hand(scale):
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, T)
    w = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    merged = (w @ v).transpose(1, 2).reshape(B, T, H * D)  # heads back side by side
    return mha.out_proj(merged), w


with torch.no_grad():
    right, w_right = heads_by_hand(1 / math.sqrt(D))          # the size of one head
    wrong, w_wrong = heads_by_hand(1 / math.sqrt(mha.d_out))  # the tutorials' sqrt(d_model)
# the last word's weights in head 0: flatter with the wrong scale
print(kit.T("last row, head 0, 1/sqrt(head_dim):", "最后一行，头 0，除以 √head_dim："),
      w_right[0, 0, -1].numpy().round(3))
print(kit.T("last row, head 0, 1/sqrt(d_out):   ", "最后一行，头 0，除以 √d_out：   "),
      w_wrong[0, 0, -1].numpy().round(3))
print(kit.T("outputs differ by", "两种输出相差"), float((right - wrong).abs().max()))
""", zh={
    '(B, T, H * D) -> (B, H, T, D)': '(B, T, H * D) -> (B, H, T, D)',
    '(B, H, T, T)': '(B, H, T, T)',
    'heads back side by side': '把各个头重新并排拼回去',
    'the size of one head': '一个头的维度',
    "the tutorials' sqrt(d_model)": '教程里常见的 sqrt(d_model)',
    "the last word's weights in head 0: flatter with the wrong scale": '最后一个词在 0 号头上的权重：缩放错了就更平',
}),
    md(en="""
Every head has its own picture: one row of heatmaps, one per head.
""", zh="""
每个头都有自己的一张图：下面一行热力图，每个头一张。
"""),
    code("""
from attnlab.viz import heatmap_grid

kit.show(heatmap_grid(tokens, [weights[0]]), "heads")  # one layer, eight heads
""", zh={
    'one layer, eight heads': '一层，八个头',
}),
    md(en="""
The check: the spelled-out heads with `1/√head_dim` equal `MultiHeadAttention` and the
NumPy oracle head by head; the `√d_out` version does not.
""", zh="""
检查：按 `1/√head_dim` 一步步算出的结果，要等于 `MultiHeadAttention` 的输出，每个头的权重也要等于 NumPy 参考实现；而除以 `√d_out` 的版本对不上。
"""),
    code("""
_, oracle_w = attnlab.reference.attention(*(t.detach().double().numpy() for t in (q, k, v)),
                                          causal=True, return_weights=True)
assert float((wrong - out).abs().max()) > 1e-4, "the wrong scale should not match"
kit.check(kit.T("heads by hand = MultiHeadAttention", "手写多头 = MultiHeadAttention"),
          right, out)
kit.check(kit.T("weights of every head = attnlab.reference", "每个头的权重 = attnlab.reference"),
          w_right, oracle_w)
"""),
])
