"""Lesson 8: a one-head language model trained in seconds, and what its head learned."""

from .cells import Lesson, code, md

TRAIN = '''
from attnlab.models import ToyAttnLM, ToyConfig
from attnlab.text import CharTokenizer
from attnlab.text.corpus import pattern_corpus
from attnlab.training import TrainConfig, train

# A model this small trains faster on one thread: splitting its tiny matrices between
# threads costs more than it saves (and on a busy machine, far more).
torch.set_num_threads(1)
text = pattern_corpus(n_runs=800, seed=0)  # "abababab acacac xyzxyz ..."
tokenizer = CharTokenizer.from_text(text)  # one token per character
ids = torch.tensor(tokenizer.encode(text))
cfg = TrainConfig(steps=300, batch_size=32, context=24, lr=1e-2, warmup=20, eval_every=300,
                  seed=0)


def new_model(causal=True):
    torch.manual_seed(0)  # the same starting weights every time
    model = ToyAttnLM(ToyConfig(vocab_size=tokenizer.vocab_size, context_length=24, d_model=32))
    model.attn.causal = causal
    return model
'''
# TRAIN's comments in Chinese (lessons 9 and 10 run the same cell).
TRAIN_ZH = {
    "A model this small trains faster on one thread: splitting its tiny matrices between":
        "这么小的模型在单线程上训练更快：把它的小矩阵分给多个线程，",
    "threads costs more than it saves (and on a busy machine, far more).":
        "花的比省的多（机器忙的时候更是如此）。",
    '"abababab acacac xyzxyz ..."': '"abababab acacac xyzxyz ..."',
    "one token per character": "每个字符一个词元",
    "the same starting weights every time": "每次都用同样的初始权重",
}

LESSON = Lesson(8, "toy-language-model", {"en": "A one-head language model",
                                          "zh": "只有一个注意力头的语言模型"}, cells=[
    md(en="""
Time to train. `attnlab.ToyAttnLM` is the smallest language model in which attention
can learn a rule: token embedding + position embedding, **one causal attention head**,
and an output layer. No MLP, no normalisation: whatever it learns, it learns in the
attention weights.

The text is made of repeating patterns such as `ababab`, `acacac`, `xyzxyz`. After an
`a` the next letter is whichever letter came *before* the `a`, so the current token
alone cannot tell: the head has to look back at the previous token. 300 steps take a
few seconds on a CPU.
""", zh="""
开始训练。
`attnlab.ToyAttnLM` 是能让注意力学会一条规则的最小语言模型：词嵌入 + 位置嵌入，**一个因果注意力头**，再加一个输出层。
没有 MLP，也没有归一化：它学到的东西全都体现在注意力权重里。

训练文本由重复的模式组成，比如 `ababab`、`acacac`、`xyzxyz`。
`a` 后面接什么，取决于 `a` *前面*是哪个字母，只看当前这个词是判断不出来的：注意力头必须回头看前一个词。
在 CPU 上训练 300 步只要几秒钟。
"""),
    code(TRAIN, TRAIN_ZH),
    code("""
model = new_model()
summary = train(model, ids, cfg, progress=False, log=None)
guess = math.log(tokenizer.vocab_size)  # the loss of a uniform guess over the characters
print(kit.T(f"loss after {summary['steps']} steps: train {summary['final_loss']:.3f}, "
            f"held-out {summary['eval_loss']:.3f} (a uniform guess: {guess:.2f})",
            f"训练 {summary['steps']} 步后的损失：训练集 {summary['final_loss']:.3f}，"
            f"留出集 {summary['eval_loss']:.3f}（均匀乱猜是 {guess:.2f}）"))
for prompt in ("abab", "acac", "xyz"):
    out = model.generate(torch.tensor([tokenizer.encode(prompt)]), 16, temperature=0)
    print(f"{prompt!r} -> {tokenizer.decode(out[0].tolist())!r}")
""", zh={
    'the loss of a uniform guess over the characters': '在所有字符上均匀乱猜的损失',
}),
    md(en="""
What did the head learn? `output_attentions=True` returns its weights. In the picture,
row i is where the model looks while predicting the token after position i: mostly
the token itself and the one before it, the rule the text needs.
""", zh="""
这个注意力头学到了什么？
`output_attentions=True` 会返回它的权重。
图中第 i 行表示模型在预测第 i 个位置之后的词时看向哪里：大部分落在当前词和前一个词上，这正是这段文本需要的规则。
"""),
    code("""
sample = "ababab acacac xyzxyz"
sample_ids = torch.tensor([tokenizer.encode(sample)])
model.eval()
with torch.no_grad():
    _, (weights,) = model(sample_ids, output_attentions=True)  # (1, 1 head, T, T)
kit.show(kit.heatmap(weights[0, 0], list(sample), title=kit.T("the trained head",
                                                             "训练好的注意力头")), "head")
""", zh={
    '(1, 1 head, T, T)': '(1, 1 个头, T, T)',
}),
    md(en="""
The check: rebuild the head's queries, keys and values from its own weights
(`W_query`, `W_key`, `W_value` applied to the embeddings) and hand them to the NumPy
oracle with `causal=True`: the weights equal what the model returned, and so does the
head's output after `out_proj`.
""", zh="""
检查：用模型自己的 `W_query`、`W_key`、`W_value` 作用在嵌入上，重新算出查询、键、值，交给 NumPy 参考实现（`causal=True`）：
得到的权重要和模型返回的一致，经过 `out_proj` 之后的输出也要一致。
"""),
    code("""
with torch.no_grad():
    h = model.embed(sample_ids)  # token + position embedding, (1, T, 32)
    q, k, v = (proj(h)[:, None] for proj in (model.attn.W_query, model.attn.W_key,
                                             model.attn.W_value))
    head_out = model.attn(h)
ctx, oracle_w = attnlab.reference.attention(*(t.double().numpy() for t in (q, k, v)),
                                            causal=True, return_weights=True)
with torch.no_grad():
    oracle_out = model.attn.out_proj(torch.tensor(ctx[:, 0], dtype=torch.float32))
kit.check(kit.T("the model's weights = attnlab.reference", "模型的权重 = attnlab.reference"),
          weights, oracle_w, atol=1e-5)
kit.check(kit.T("the head's output = attnlab.reference", "注意力头的输出 = attnlab.reference"),
          head_out, oracle_out, atol=1e-5)
""", zh={
    'token + position embedding, (1, T, 32)': '词元嵌入 + 位置嵌入，(1, T, 32)',
}),
])
