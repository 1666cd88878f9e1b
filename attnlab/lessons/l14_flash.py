"""Lesson 14: FlashAttention on a CPU: the online softmax, O(seq) memory, and timings."""

from .cells import Lesson, code, md

LESSON = Lesson(14, "flash-attention", {"en": "FlashAttention on a CPU",
                                        "zh": "在 CPU 上理解 FlashAttention"}, cells=[
    md(en="""
Textbook attention builds the whole `T x T` score matrix: at 32,000 tokens that is a
billion numbers per head. FlashAttention never builds it. It walks over the keys in
blocks and keeps, for each query, three running quantities: the largest score seen so
far `m`, the sum of `exp(score - m)` so far `l`, and the weighted sum of values so far
`acc`. When a block brings a larger maximum, what was summed so far is rescaled by
`exp(m_old - m_new)`. This is the **online softmax**: one pass, the same numbers, and
memory of `T x block` instead of `T x T`.

Here it is in 15 lines, on one head.
""", zh="""
教科书式的注意力要构造完整的 `T x T` 分数矩阵：32,000 个词时，每个头就是十亿个数。
FlashAttention 从不构造这个矩阵。
它把键分成一块一块地扫过去，为每个查询维护三个累计量：目前见过的最大分数 `m`，目前为止 `exp(分数 - m)` 的和 `l`，以及目前为止值向量的加权和 `acc`。
新的一块带来更大的最大值时，之前累加的部分乘以 `exp(m_old - m_new)` 重新缩放。
这就是**在线 softmax**：只扫一遍，结果完全一样，内存从 `T x T` 降到 `T x 块大小`。

下面是 15 行的实现，只算一个头。
"""),
    code("""
def online_softmax_attention(q, k, v, block=64):
    scale = 1 / math.sqrt(q.shape[-1])
    m = torch.full((q.shape[0], 1), -math.inf)    # running max of each query's scores
    l = torch.zeros(q.shape[0], 1)                # running sum of exp(score - m)
    acc = torch.zeros(q.shape[0], v.shape[-1])    # running sum of exp(score - m) * value
    for start in range(0, k.shape[0], block):
        s = q @ k[start:start + block].T * scale  # (T, block): one tile of scores
        m_new = torch.maximum(m, s.max(dim=-1, keepdim=True).values)
        p = torch.exp(s - m_new)
        rescale = torch.exp(m - m_new)            # what was summed under the old max
        l = l * rescale + p.sum(dim=-1, keepdim=True)
        acc = acc * rescale + p @ v[start:start + block]
        m = m_new
    return acc / l


torch.manual_seed(0)
T, D = 512, 64
q, k, v = (torch.randn(T, D) for _ in range(3))
ours = online_softmax_attention(q, k, v)
print(kit.T(f"largest tile: {T} x 64 numbers; the full score matrix: {T} x {T}",
            f"最大的一块：{T} x 64 个数；完整分数矩阵：{T} x {T}"))
""", zh={
    "running max of each query's scores": '每个查询的分数到目前为止的最大值',
    'running sum of exp(score - m)': 'exp(score - m) 的累加和',
    'running sum of exp(score - m) * value': 'exp(score - m) * value 的累加和',
    '(T, block): one tile of scores': '(T, block)：一块分数',
    'what was summed under the old max': '按旧的最大值累加的部分',
}),
    md(en="""
attnlab's `backend="tiled"` is the same algorithm in PyTorch, over query and key
blocks, with causal and window masks that skip whole blocks, and its own backward
pass. `backend="flash"` is the native C++ kernel of the same algorithm. How fast are
they next to textbook attention (`"eager"`) and PyTorch's fused
`scaled_dot_product_attention`? Medians of interleaved runs, 8 heads of 64, causal.
""", zh="""
attnlab 的 `backend="tiled"` 是同一个算法的 PyTorch 实现：在查询块和键块上分块计算，因果和滑动窗口掩码会整块跳过，还有自己的反向传播。
`backend="flash"` 是同一算法的原生 C++ 内核。
它们和教科书式注意力（`"eager"`）以及 PyTorch 融合好的 `scaled_dot_product_attention` 比起来有多快？
下面取交替运行的中位数，8 个 64 维的头，因果注意力。
"""),
    code("""
import statistics
import time

torch.manual_seed(0)
qb, kb, vb = (torch.randn(1, 8, 1024, 64) for _ in range(3))
runs = {
    "eager": lambda: attnlab.attention(qb, kb, vb, causal=True, backend="eager"),
    "tiled": lambda: attnlab.attention(qb, kb, vb, causal=True, backend="tiled"),
    "flash": lambda: attnlab.attention(qb, kb, vb, causal=True, backend="flash"),
    "torch SDPA": lambda: torch.nn.functional.scaled_dot_product_attention(qb, kb, vb,
                                                                           is_causal=True),
}
try:
    with torch.no_grad():
        runs["flash"]()
except ValueError as exc:  # no compiler, or switched off: say so and go on without it
    print(kit.T("skipped flash:", "跳过 flash："), exc)
    del runs["flash"]
times = {name: [] for name in runs}
with torch.no_grad():
    for _ in range(5):  # interleaved: every backend sees the same machine load
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
medians = {name: 1000 * statistics.median(t) for name, t in times.items()}
for name, ms in medians.items():
    print(f"{name:>11}: {ms:7.2f} ms   x{ms / medians['torch SDPA']:.2f} "
          + kit.T("of torch SDPA", "倍于 torch SDPA"))
kit.show(kit.bars(list(medians), list(medians.values()),
                  title=kit.T("causal attention, T = 1024, 8 heads (median)",
                              "因果注意力，T = 1024，8 个头（中位数）"), ylabel="ms"), "timings")
""", zh={
    'no compiler, or switched off: say so and go on without it': '没有编译器或已关闭：说明一句，然后不用它继续',
    'interleaved: every backend sees the same machine load': '交替运行：每个后端面对同样的机器负载',
}),
    md(en="""
The check: the 15-line online softmax equals the NumPy oracle and attnlab's tiled
path on the same q, k and v (and, where it is built, the flash kernel equals the
oracle too).
""", zh="""
检查：15 行的在线 softmax，要等于 NumPy 参考实现和 attnlab 的 tiled 路径在同样的 q、k、v 上的结果（如果原生内核可用，flash 的结果也要等于参考实现）。
"""),
    code("""
oracle = attnlab.reference.attention(*(t.double().numpy()[None] for t in (q, k, v)))[0]
tiled = attnlab.attention(q[None], k[None], v[None], backend="tiled")[0]
if "flash" in runs:
    with torch.no_grad():
        flash = attnlab.attention(q[None], k[None], v[None], backend="flash")[0]
    kit.check(kit.T("flash kernel = attnlab.reference", "flash 内核 = attnlab.reference"), flash,
              oracle, atol=1e-5)
kit.check(kit.T("online softmax = tiled backend", "在线 softmax = tiled 后端"), ours, tiled,
          atol=1e-5)
kit.check(kit.T("online softmax = attnlab.reference", "在线 softmax = attnlab.reference"), ours,
          oracle, atol=1e-5)
"""),
])
