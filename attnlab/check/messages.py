"""What ``attnlab check`` says, one sentence per finding, in English and Simplified Chinese.

Each diagnosis says what is wrong, where the tutorials go wrong the same way, and
the fix. The Chinese terms follow common usage: 注意力, 查询/键/值, 掩码, 因果注意力,
多头注意力, 键值缓存.
"""

from __future__ import annotations

import os

LANGS = ("en", "zh")

EN: dict[str, str] = {
    "scale_d_model": (
        "the scores are divided by sqrt(d_out) = sqrt({d_model}), the width of all heads together, "
        "instead of by the head size, as tutorials that write `/ math.sqrt(embed_dim)` do; fix: "
        "divide by sqrt(head_dim) = sqrt({head_dim}), i.e. `keys.shape[-1] ** 0.5` after the heads "
        "are split (head_dim = d_out // num_heads)"),
    "scale_d_in": (
        "the scores are divided by sqrt(d_in) = sqrt({d_in}), the input width, instead of by the "
        "size of the keys; fix: divide by sqrt(head_dim) = sqrt({head_dim}) "
        "(`keys.shape[-1] ** 0.5`)"),
    "no_scale": (
        "the scores are not scaled, as in tutorials that skip the 1/sqrt(d_k) step, so the "
        "softmax is too peaked; fix: divide them by sqrt(head_dim) = sqrt({head_dim}) before "
        "the softmax"),
    "scale_by_d": (
        "the scores are divided by head_dim = {head_dim} instead of by its square root, a slip "
        "some tutorials make; fix: divide by `keys.shape[-1] ** 0.5`"),
    "scale_times": (
        "the scores are multiplied by sqrt(head_dim) instead of divided by it; fix: "
        "`scores / keys.shape[-1] ** 0.5`"),
    "softmax_axis": (
        "the softmax runs over the queries (dim=-2; dim=0 or dim=1 in tutorials written for "
        "another number of dimensions) instead of over the keys, so the rows of weights do not "
        "sum to 1; fix: `torch.softmax(scores, dim=-1)`"),
    "k_not_transposed": (
        "K is not transposed: the scores are `queries @ keys`, which only runs when seq_len == "
        "head_dim and then gives wrong numbers (tutorials' `keys.T` does the same on batched "
        "input, where it reverses every axis); fix: `queries @ keys.transpose(-2, -1)`"),
    "mask_inverted": (
        "the mask is read the other way round: here True (or 1) means 'may attend', as in "
        "attnlab and PyTorch's scaled_dot_product_attention, but the code treats True as "
        "'masked', as tutorials that write `masked_fill(mask, -inf)` do; fix: "
        "`scores.masked_fill(~mask, float('-inf'))` (or convert with attnlab.masks)"),
    "mask_after_softmax": (
        "the mask is applied after the softmax, so each row's weights no longer add up to "
        "1 (the masked keys' share is lost, not given to the others); fix: mask the scores "
        "before the softmax (`scores.masked_fill(~mask, float('-inf'))`), or divide the "
        "masked weights by their row sum, as the book's chapter 3.5.1 does"),
    "causal_missing": (
        "no causal mask is applied, so each token sees the tokens after it (a model trained "
        "like this cheats); fix: `scores.masked_fill(t"
        "orch.triu(torch.ones(T, T, dtype=torch.bool), "
        "diagonal=1), float('-inf'))`"),
    "causal_excludes_self": (
        "the causal mask is off by one: it also hides each token from itself "
        "(`torch.triu(..., diagonal=0)`), and the first token then sees nothing; fix: hide "
        "`torch.triu(ones, diagonal=1)`"),
    "causal_sees_next": (
        "the causal mask is off by one: each token also sees the next one (`diagonal=2`, or "
        "`torch.tril(ones, diagonal=1)` as the allowed part); fix: hide "
        "`torch.triu(ones, diagonal=1)`"),
    "causal_top_left": (
        "with fewer queries than keys the causal mask is aligned to the top left (as PyTorch's "
        "`is_causal=True`), so the last query misses the last keys; attnlab aligns it to the "
        "end, as decoding with a KV cache needs: query i sees keys j <= i + k_len - q_len"),
    "heads_split_merge": (
        "the heads are split and merged in the wrong order: `view(b, num_heads, T, head_dim)` "
        "mixes the tokens of different positions in one head, a shortcut some tutorials take; "
        "fix: `view(b, T, num_heads, head_dim).transpose(1, 2)` and back with "
        "`transpose(1, 2).contiguous().view(b, T, d_out)`"),
    "heads_split": (
        "the heads are split in the wrong order: `view(b, num_heads, T, head_dim)` mixes the "
        "tokens of different positions in one head; fix: "
        "`view(b, T, num_heads, head_dim).transpose(1, 2)`"),
    "heads_merge": (
        "the heads are merged without moving them back: `out.view(b, T, d_out)` on "
        "(b, num_heads, T, head_dim) mixes heads and positions, as tutorials that forget the "
        "transpose do; fix: `out.transpose(1, 2).contiguous().view(b, T, d_out)`"),
    "gqa_tile": (
        "grouped-query heads are mapped wrongly: query head h must read key/value head "
        "h // (num_heads // num_kv_heads), but the code pairs it with h % num_kv_heads "
        "(`repeat`/`tile` instead of `repeat_interleave`, a common mix-up); fix: "
        "`keys.repeat_interleave(num_heads // num_kv_heads, dim=1)`"),
    "nan_masked_row": (
        "a query that may attend to no key gives NaN (the softmax of a row of -inf, which most "
        "tutorials never meet); attnlab gives zeros there: e.g. "
        "`torch.nan_to_num(weights)` after the softmax, or call attnlab.attention"),
    "masked_row_mean": (
        "note: a query that may attend to no key gives the mean of all values (a finite fill "
        "such as -1e9, as many tutorials use); attnlab and the oracle give zeros there"),
    "dropout_in_eval": (
        "the output changes from call to call in eval mode: dropout is active during "
        "evaluation, as with the functional `F.dropout(w, p)`, whose training=True is the "
        "default; fix: `nn.Dropout(p)` as a layer, or `F.dropout(w, p, training=self.training)`"),
    "gqa_skipped": (
        "note: raises on grouped-query inputs (fewer key/value heads than query heads), so "
        "those were not checked: {exc}"),
    "raises": "raises {exc} at ({case})",
    "differs": (
        "differs from the oracle by {diff:.3g} at ({case}); none of the known mistakes "
        "explains it"),
    "wrong_shape": "returns shape {got} where {expected} was expected at ({case})",
    "more": "... and {n} more case(s) like these",
    "ok": "OK: {name} agrees with the oracle on {n} cases ({what})",
    "bug": "bug",
    "note": "note",
    # What was given cannot be checked (attnlab check's one-line errors).
    "spec_form": "expected FILE:NAME (e.g. my_attention.py:SelfAttention), got {spec!r}",
    "not_a_file": "FILE {path!r} is not a file (in FILE:NAME {spec!r})",
    "not_python": "FILE {path!r} is not a Python file",
    "import_failed": "importing {path} failed: {error}",
    "import_exited": ("importing {path} ran sys.exit({status!r}) (or exit()): put the code that "
                      "runs a demo under `if __name__ == \"__main__\":`"),
    "not_defined": "{path} defines no {name!r}; it defines: {found}",
    "nothing": "nothing",
    "cannot_build": ("cannot build {cls}: no value known for its parameter {param!r}; pass an "
                     "instance instead: attnlab.check({cls}(...))"),
    "build_raised": "{cls}({call}) raised {error}",
    "rotary": ("{cls} uses rotary embeddings, which attnlab check does not model yet; check it "
               "with rope off"),
    "unknown_weights": ("{cls} has weights ({names}) that attnlab check cannot place as query, "
                        "key, value and output projections (it knows W_query, query, q_proj, "
                        "queries, qkv, c_attn and the like, not an nn.MultiheadAttention inside "
                        "a module), so it has nothing to compare with; name them so, or check "
                        "the function that attends from q, k and v"),
    "no_positional": ("{name} takes no positional argument; expected a function (x), (x, mask) "
                      "or (q, k, v[, mask]), or an nn.Module"),
    "not_callable": ("{name} is a {kind}; expected a function (x), (x, mask) or (q, k, v[, "
                     "mask]), an nn.Module class or an nn.Module"),
}

ZH: dict[str, str] = {
    "scale_d_model": (
        "注意力分数除以了 sqrt(d_out) = sqrt({d_model})（所有头加起来的宽度），而不是单个头的大小，"
        "写 `/ math.sqrt(embed_dim)` 的教程也犯同样的错；"
        "修正：除以 sqrt(head_dim) = sqrt({head_dim})，"
        "即分头之后的 `keys.shape[-1] ** 0.5`（head_dim = d_out // num_heads）"),
    "scale_d_in": (
        "注意力分数除以了 sqrt(d_in) = sqrt({d_in})（输入宽度），而不是键的维度；"
        "修正：除以 sqrt(head_dim) = sqrt({head_dim})（`keys.shape[-1] ** 0.5`）"),
    "no_scale": (
        "注意力分数没有缩放（跳过 1/sqrt(d_k) 的教程也是如此），softmax 过于尖锐；"
        "修正：在 softmax 之前除以 sqrt(head_dim) = sqrt({head_dim})"),
    "scale_by_d": (
        "注意力分数除以了 head_dim = {head_dim}，而不是它的平方根（一些教程的笔误）；"
        "修正：除以 `keys.shape[-1] ** 0.5`"),
    "scale_times": (
        "注意力分数乘以了 sqrt(head_dim)，而应该除以它；修正：`scores / keys.shape[-1] ** 0.5`"),
    "softmax_axis": (
        "softmax 沿查询的方向计算（dim=-2；按别的维数写"
        "的教程里是 dim=0 或 dim=1），而不是沿键的方向，"
        "权重的每一行加起来不等于 1；修正：`torch.softmax(scores, dim=-1)`"),
    "k_not_transposed": (
        "键 K 没有转置：分数算成了 `queries @ keys`，只有"
        " seq_len == head_dim 时才能运行，而且结果是错的"
        "（教程里的 `keys.T` 在批量输入上会把所有轴都反过来，同样出错）；"
        "修正：`queries @ keys.transpose(-2, -1)`"),
    "mask_inverted": (
        "掩码的含义反了：这里 True（或 1）表示“可以关注”，与 attnlab 和 PyTorch 的 "
        "scaled_dot_product_attention 一致，但代码把 True 当成“被遮住”，写 "
        "`masked_fill(mask, -inf)` 的教程也是这样；修正：`scores.masked_fill(~mask, float('-inf'))`"
        "（或用 attnlab.masks 转换）"),
    "mask_after_softmax": (
        "掩码用在了 softmax 之后，每一行的权重加起来不再是 1（被遮住的键分走的那部分丢掉了，"
        "没有分给其余的键）；修正：在 softmax 之前遮住分数（`scores.masked_fill(~mask, "
        "float('-inf'))`），或者像书中 3.5.1 节那样，把遮住后的权重除以每一行的和"),
    "causal_missing": (
        "没有因果掩码，每个词元都能看到后面的词元（这样"
        "训练的模型会作弊）；修正：`scores.masked_fill("
        "torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1), float('-inf'))`"),
    "causal_excludes_self": (
        "因果掩码差了一位：它把每个词元对自己也遮住了（`torch.triu(..., diagonal=0)`），"
        "第一个词元就什么也看不到；修正：遮住 `torch.triu(ones, diagonal=1)`"),
    "causal_sees_next": (
        "因果掩码差了一位：每个词元还能看到下一个词元（`d"
        "iagonal=2`，或把 `torch.tril(ones, diagonal=1)` "
        "当作允许的部分）；修正：遮住 `torch.triu(ones, diagonal=1)`"),
    "causal_top_left": (
        "查询比键少时，因果掩码按左上角对齐（如 PyTorch 的"
        " `is_causal=True`），最后一个查询看不到最后的键；"
        "attnlab 按末尾对齐，这是键值缓存解码所需要的"
        "：查询 i 可以看到 j <= i + k_len - q_len 的键"),
    "heads_split_merge": (
        "多头注意力的分头和合并顺序错了：`view(b, num_hea"
        "ds, T, head_dim)` 会把不同位置的词元混进同一个头"
        "（一些教程走了这条捷径）；修正：`view(b, T, nu"
        "m_heads, head_dim).transpose(1, 2)`，合并时用 "
        "`transpose(1, 2).contiguous().view(b, T, d_out)`"),
    "heads_split": (
        "多头注意力的分头顺序错了：`view(b, num_heads, "
        "T, head_dim)` 会把不同位置的词元混进同一个头；"
        "修正：`view(b, T, num_heads, head_dim).transpose(1, 2)`"),
    "heads_merge": (
        "多头注意力合并时没有把头移回去：对 (b, num_hea"
        "ds, T, head_dim) 直接 `out.view(b, T, d_out)` "
        "会把头和位置混在一起（忘了转置的教程也是如此）；修正："
        "`out.transpose(1, 2).contiguous().view(b, T, d_out)`"),
    "gqa_tile": (
        "分组查询注意力（GQA）的头对应错了：查询头 h 应"
        "读取键/值头 h // (num_heads // num_kv_heads)，"
        "代码却把它对应到 h % num_kv_heads（用了 `repeat`/"
        "`tile` 而不是 `repeat_interleave`，常见的混淆）；"
        "修正：`keys.repeat_interleave(num_heads // num_kv_heads, dim=1)`"),
    "nan_masked_row": (
        "一个不能关注任何键的查询给出了 NaN（对一整行 -inf 做 softmax，多数教程从未遇到）；"
        "attnlab 在这里给出零：例如在 softmax 之后 `torc"
        "h.nan_to_num(weights)`，或调用 attnlab.attention"),
    "masked_row_mean": (
        "注：一个不能关注任何键的查询给出了所有值的平均（用 -1e9 之类的有限数填充，很多教程如此）；"
        "attnlab 和参考实现在这里给出零"),
    "dropout_in_eval": (
        "在 eval 模式下每次调用的输出都不同：评估时 dropout 仍在起作用，函数式的 `F.dropout(w, p)` "
        "默认 training=True 就会这样；修正：用 `nn.Dropout(p)` 层，或 "
        "`F.dropout(w, p, training=self.training)`"),
    "gqa_skipped": (
        "注：分组查询输入（键/值头少于查询头）会报错，所以没有检查这部分：{exc}"),
    "raises": "在（{case}）时报错 {exc}",
    "differs": "在（{case}）时与参考实现相差 {diff:.3g}；已知的错误都解释不了",
    "wrong_shape": "在（{case}）时返回的形状是 {got}，应为 {expected}",
    "more": "……另有 {n} 个情形也是如此",
    "ok": "通过：{name} 在 {n} 个情形（{what}）上与参考实现一致",
    "bug": "错误",
    "note": "注",
    "spec_form": "应为 FILE:NAME（例如 my_attention.py:SelfAttention），得到 {spec!r}",
    "not_a_file": "FILE {path!r} 不是一个文件（FILE:NAME 为 {spec!r}）",
    "not_python": "FILE {path!r} 不是 Python 文件",
    "import_failed": "导入 {path} 失败：{error}",
    "import_exited": ("导入 {path} 时执行了 sys.exit({status!r})（或 exit()）："
                      "请把运行示例的代码放到 `if __name__ == \"__main__\":` 下面"),
    "not_defined": "{path} 里没有定义 {name!r}；它定义了：{found}",
    "nothing": "（无）",
    "cannot_build": ("无法构造 {cls}：不知道它的参数 {param!r} 该取什么值；请改为传入一个实例："
                     "attnlab.check({cls}(...))"),
    "build_raised": "{cls}({call}) 抛出了 {error}",
    "rotary": "{cls} 用了旋转位置编码（RoPE），attnlab check 还不能检查它；请关掉 rope 再检查",
    "unknown_weights": ("{cls} 有权重（{names}），但 attnlab check 认不出哪些是查询、键、值和输出"
                        "投影（它认得 W_query、query、q_proj、queries、qkv、c_attn 等名字，不认"
                        "模块里面的 nn.MultiheadAttention），因此没有可对照的结果；请按这些名字"
                        "命名，或者检查由 q、k、v 计算注意力的那个函数"),
    "no_positional": ("{name} 不接受位置参数；应为函数 (x)、(x, mask) 或 (q, k, v[, mask])，"
                      "或者一个 nn.Module"),
    "not_callable": ("{name} 是 {kind}；应为函数 (x)、(x, mask) 或 (q, k, v[, mask])、"
                     "nn.Module 类或 nn.Module 实例"),
}

TEXTS = {"en": EN, "zh": ZH}


def default_lang() -> str:
    """``zh`` when the locale (LANGUAGE, LC_ALL, LC_MESSAGES, LANG, first set) is Chinese."""
    for var in ("LANGUAGE", "LC_ALL", "LC_MESSAGES", "LANG"):
        value = os.environ.get(var, "")
        if value:
            return "zh" if value.lower().startswith("zh") else "en"
    return "en"


def text(code: str, lang: str, **params: object) -> str:
    return TEXTS[lang][code].format(**params)


class InputError(ValueError, TypeError):
    """What was given cannot be checked: a message of :data:`TEXTS` by ``code`` in
    ``lang``; :func:`attnlab.check.check` says it again in the report's language
    (:meth:`said_in`). A ValueError, and a TypeError where a wrong kind of object came."""

    def __init__(self, code: str, lang: str = "en", **params: object) -> None:
        self.code, self.params = code, params
        shown = {**params, **({"found": text("nothing", lang)} if params.get("found") == ""
                              else {})}  # (a file that defines no name: said in lang)
        super().__init__(text(code, lang, **shown))

    def said_in(self, lang: str) -> InputError:
        return InputError(self.code, lang, **self.params)
