"""Lesson 9: take the causal mask away and watch the model cheat."""

from .cells import Lesson, code, md
from .l08_toy_model import TRAIN, TRAIN_ZH

LESSON = Lesson(9, "mask-cheat", {"en": "Take the mask away and watch it cheat",
                                  "zh": "去掉掩码，看模型怎样作弊"}, cells=[
    md(en="""
Why does a language model need the causal mask? The training target at position i is
the token at position i + 1. Without the mask, position i can *see* that token
through attention, so the model learns to copy the answer instead of predicting it.
Its training loss falls to almost zero, which looks wonderful, and then it cannot
write a single sensible line: when it generates, the next token is not there yet.

Below, the same model is trained twice from the same starting weights on the same
text, once with the causal mask and once without (`model.attn.causal = False`).
""", zh="""
语言模型为什么需要因果掩码？
位置 i 的训练目标是位置 i + 1 上的词。
没有掩码的话，位置 i 通过注意力就能*看见*这个词，模型学会的是抄答案，而不是预测。
它的训练损失会降到接近 0，看上去好得很；可一到生成文本就一句也写不对：生成的时候，下一个词根本还不存在。

下面用同样的初始权重、同样的文本把同一个模型训练两次，一次带因果掩码，一次不带（`model.attn.causal = False`）。
"""),
    code(TRAIN, TRAIN_ZH),
    code("""
results = {}
for causal in (True, False):
    model = new_model(causal=causal)
    summary = train(model, ids, cfg, progress=False, log=None)
    prompt = torch.tensor([tokenizer.encode("abab")])
    text_out = tokenizer.decode(model.generate(prompt, 20, temperature=0)[0].tolist())
    results[causal] = (model, summary["final_loss"], text_out)
    name = kit.T("with the mask   ", "带掩码  ") if causal else kit.T("without the mask",
                                                                       "不带掩码")
    print(f"{name}: {kit.T('train loss', '训练损失')} {summary['final_loss']:.3f}   "
          f"{kit.T('generates', '生成')} {text_out!r}")
"""),
    md(en="""
The loss without the mask is far lower, and its text falls apart. The picture shows
how it cheats: its weights sit just *above* the diagonal, on the next token, the one
it is asked to predict.
""", zh="""
不带掩码的损失低得多，生成的文本却乱了套。
图里可以看出它怎样作弊：它的权重集中在对角线*上方*，也就是下一个词，正是它被要求预测的那个词。
"""),
    code("""
cheater = results[False][0].eval()
sample = "ababab acacac"
sample_ids = torch.tensor([tokenizer.encode(sample)])
with torch.no_grad():
    _, (w_cheat,) = cheater(sample_ids, output_attentions=True)
next_token = w_cheat[0, 0].diagonal(offset=1).mean()
print(kit.T(f"average weight on the next token: {next_token:.2f}",
            f"放在下一个词上的平均权重：{next_token:.2f}"))
kit.show(kit.heatmap(w_cheat[0, 0], list(sample), title=kit.T("no mask: it looks ahead",
                                                              "没有掩码：它在偷看后面")),
         "cheat")
"""),
    md(en="""
The check: both models' weights equal the NumPy oracle on their own queries and keys,
with `causal=True` for the masked one (nothing above the diagonal) and `causal=False`
for the cheater; and the cheater's training loss is less than half the honest one's.
""", zh="""
检查：两个模型的权重，都要等于 NumPy 参考实现在它们自己的查询和键上的结果：带掩码的用 `causal=True`（对角线以上全为 0），作弊的用 `causal=False`；
并且作弊模型的训练损失不到诚实模型的一半。
"""),
    code("""
def oracle_weights(model, causal):
    with torch.no_grad():
        h = model.embed(sample_ids)
        q, k, v = (p(h)[:, None].double().numpy() for p in (model.attn.W_query,
                                                              model.attn.W_key,
                                                              model.attn.W_value))
    return attnlab.reference.attention(q, k, v, causal=causal, return_weights=True)[1]


honest = results[True][0].eval()
with torch.no_grad():
    _, (w_honest,) = honest(sample_ids, output_attentions=True)
assert results[False][1] < results[True][1] / 2, "the unmasked model should cheat"
kit.check(kit.T("masked model = attnlab.reference(causal=True)",
                "带掩码的模型 = attnlab.reference(causal=True)"),
          w_honest, oracle_weights(honest, True), atol=1e-5)
kit.check(kit.T("unmasked model = attnlab.reference(causal=False)",
                "不带掩码的模型 = attnlab.reference(causal=False)"),
          w_cheat, oracle_weights(cheater, False), atol=1e-5)
"""),
])
