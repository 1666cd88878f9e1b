"""The tokenizer a GGUF file describes in its metadata, as a ``tokenizers`` tokenizer.

A GGUF file has no ``tokenizer.json``: llama.cpp stores the vocabulary
(``tokenizer.ggml.tokens``), its kind (``tokenizer.ggml.model``: ``gpt2`` for byte-level
BPE, ``llama`` for SentencePiece-style BPE with byte fallback), the merges or the token
scores they are recovered from, each token's type (control tokens are special), the
special ids and the chat template. :class:`GGUFTokenizer` builds from those keys a
``tokenizers.Tokenizer`` that gives llama.cpp's ids: the text split before byte-level BPE
as llama.cpp splits it for the file's ``tokenizer.ggml.pre`` (:data:`PRE_TOKENIZERS`,
checked against llama.cpp itself), the same added tokens, BOS added where the file says
so; where transformers' GGUF loader reads the file alike (Llama 3, Qwen2, GPT-2 splits,
SentencePiece) its ids agree too. It keeps the chat template and the special ids beside it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from .chat import as_messages, render_chat
from .hf_tokenizer import HFTokenizer
from .tokenizers import PathLike

__all__ = ["GGUFTokenizer", "build_gguf_tokenizer"]

CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's enum)

# tokenizer.ggml.pre -> the regexes that split text before byte-level BPE, each splitting
# the pieces of the one before; whether a piece that is a whole token skips the merges;
# whether BOS is added where the file has no add_bos_token. llama.cpp's table and regexes
# (llama-vocab.cpp, as of ggml-org/llama.cpp 00ad355, checked against llama-cpp-python
# 0.3.36), where the ids of a GGUF file are llama.cpp's: its contractions spelt case by case
# ('[sS], not (?i:'s), which also matches the long s), and Tekken's and GPT-4o's letter runs
# as it rewrites them (no combining marks in a run: there Hugging Face's tokenizer.json
# differs). A missing key is llama.cpp's "default"; any other name attnlab does not have is
# refused, as llama.cpp refuses a name it does not know.
_S = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _S + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _TAIL
_QWEN2 = _S + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL
_UPPER, _LOWER = r"(?:(?=\p{L})[^a-z])", r"(?:(?=\p{L})[^A-Z])"
_SLASH_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _cased(suffix: str) -> str:
    """A run of capitals then lower case, or of capitals: Tekken's and GPT-4o's words."""
    lead = r"[^\r\n\p{L}\p{N}]?"
    return f"{lead}{_UPPER}*{_LOWER}+{suffix}|{lead}{_UPPER}+{_LOWER}*{suffix}"


_TEKKEN = _cased("") + r"|\p{N}" + _SLASH_TAIL
_GPT4O = _cased(_S + "?") + r"|\p{N}{1,3}" + _SLASH_TAIL
_KINDS = {
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"), False, False),
    "llama3": ((_LLAMA3,), True, True), "llama3-merged": ((_LLAMA3,), False, False),
    "falcon": ((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"), False, False),
    "digits": ((r"\p{N}", _GPT2), False, False), "gpt2": ((_GPT2,), False, False),
    "qwen2": ((_QWEN2,), False, False), "tekken": ((_TEKKEN,), True, True),
    "gpt-4o": ((_GPT4O,), False, False),
}
PRE_TOKENIZERS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano"), "llama3"),
    **dict.fromkeys(("dbrx", "smaug-bpe"), "llama3-merged"), "falcon": "falcon",
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b", "mellum2"), "digits"),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                     "jina-v2-de", "a.x-4.0", "mellum", "jina-v1-en", "jina-v2-code",
                     "roberta-bpe", "exaone4", "mpt", "olmo", "jais", "trillion",
                     "granite-docling", "modern-bert"), "gpt2"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan",
                     "f2llmv2", "solar-open"), "qwen2"),
    "tekken": "tekken",
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2", "kanana2", "talkie"), "gpt-4o"),
    "default": "default",
}


def pre_tokenizer(pre: object, where: str) -> tuple[tuple[str, ...], bool, bool]:
    """``(regexes, whole tokens skip the merges, BOS by default)`` of
    ``tokenizer.ggml.pre`` (see :data:`PRE_TOKENIZERS`)."""
    if pre is None or pre == "":
        return _KINDS["default"]
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{where}: tokenizer.ggml.pre={pre!r} is not a split attnlab has (it "
                         f"has {', '.join(sorted(PRE_TOKENIZERS))}); its ids would differ "
                         "from llama.cpp's")
    return _KINDS[PRE_TOKENIZERS[pre]]


# The tokens llama.cpp ends a generation at (llama-vocab.cpp, special_eog_ids, as of
# ggml-org/llama.cpp 00ad355): a chat model's end of turn where the file names only its end
# of text as EOS (Gemma's <end_of_turn>, an older Llama 3 file's <|eot_id|>), gpt-oss's
# <|return|>, and a code model's fill-in-the-middle padding, repository and file tokens.
END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>",
                     "<|flush|>", "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>",
                     "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
                     "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                     "<｜end▁of▁sentence｜>", "[e~[")
# Fill-in-the-middle tokens, one of each kind: the file's own id (tokenizer.ggml.KIND_token_id)
# or the first token spelled as one of these.
FILL_IN_THE_MIDDLE = {"fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
                      "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
                                  "<reponame>"),
                      "fim_sep": ("<|file_sep|>",)}


def _stop_ids(meta: Mapping[str, Any], eos: int | None, where: str) -> tuple[int, ...]:
    """The ids llama.cpp ends a generation at: the fill-in-the-middle tokens, every token
    spelled as one of :data:`END_OF_GENERATION`, EOS and the file's end-of-turn and
    end-of-message ids (ids past the vocabulary ignored, as llama.cpp skips them); less
    <|end|> where <|return|> and <|call|> (or <|calls|> and <|flush|>) are among them
    (gpt-oss: <|end|> closes a message inside a reply), and less </s> beside
    <|tool_response> (there </s> is not an end)."""
    tokens = meta["tokenizer.ggml.tokens"]
    n = len(tokens)

    def named(kind: str) -> int | None:
        i = _field(meta, f"tokenizer.ggml.{kind}_token_id", int, where)
        return i if i is not None and 0 <= i < n else None

    fill = set().union(*FILL_IN_THE_MIDDLE.values())
    first: dict[str, int] = {}  # each fill-in-the-middle spelling's first id
    spelled = []  # every id spelled as an end (a spelling twice in a vocabulary: both)
    for i, t in enumerate(tokens):  # one pass: vocabularies run to 150,000 tokens
        if t in END_OF_GENERATION:
            spelled.append(i)
        elif t in fill:
            first.setdefault(t, i)
    fim = [i if (i := named(kind)) is not None
           else min((first[t] for t in spellings if t in first), default=None)
           for kind, spellings in FILL_IN_THE_MIDDLE.items()]
    ids = [i for i in (eos if eos is not None and 0 <= eos < n else None, named("eot"),
                       named("eom"), *fim, *spelled) if i is not None]  # EOS first
    texts = {tokens[i] for i in ids}
    calls = bool(texts & {"<|call|>", "<|calls|>"})
    if "<|end|>" in texts and calls and texts & {"<|return|>", "<|flush|>"}:
        ids = [i for i in ids if tokens[i] != "<|end|>"]
    if "<|tool_response>" in texts:
        ids = [i for i in ids if tokens[i] != "</s>"]
    return tuple(dict.fromkeys(ids))


@functools.cache
def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character map, in which byte-level vocabularies are spelled:
    printable bytes stand for themselves, the others for characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable},
            **{b: chr(256 + n) for n, b in enumerate(others)}}


def _field(meta: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = meta.get(key)
    fits = isinstance(value, bool) if kind is bool else (isinstance(value, kind)
                                                         and not isinstance(value, bool))
    if value is not None and not fits:
        raise ValueError(f"{where}: metadata {key} is a {type(value).__name__}, expected "
                         f"{kind.__name__}")
    return value


def _merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a token into two
    tokens of the vocabulary, best score first (transformers' ``generate_merges``)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in dict(zip(tokens, scores)).items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def build_gguf_tokenizer(meta: Mapping[str, Any], where: str = "the GGUF file") -> Any:
    """The ``tokenizers.Tokenizer`` that GGUF metadata ``meta`` describes (see the module)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"{where}: tokenizer.ggml.model={kind!r} is not supported (expected "
                         "'gpt2' (byte-level BPE) or 'llama' (SentencePiece-style BPE))")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{where}: metadata tokenizer.ggml.tokens is missing or not a list "
                         "of strings")
    types = meta.get("tokenizer.ggml.token_type") or []
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        pairs = [m.split(" ") for m in merges] if isinstance(merges, list) else [None]
        if any(not isinstance(p, list) or len(p) != 2 for p in pairs):
            raise ValueError(f"{where}: metadata tokenizer.ggml.merges holds an entry that is "
                             "not two tokens separated by one space")
        merges = [tuple(p) for p in pairs]
    try:
        if kind == "gpt2":
            tok = _byte_level(tokens, merges or [],
                              pre_tokenizer(meta.get("tokenizer.ggml.pre"), where),
                              Tokenizer, models, pre_tokenizers, decoders, Regex)
        else:
            scores = meta.get("tokenizer.ggml.scores")
            if merges is None and (not isinstance(scores, list) or len(scores) != len(tokens)):
                raise ValueError(f"{where}: tokenizer.ggml.scores (one per token) is needed "
                                 "to recover the merges, which the file does not list")
            tok = _sentencepiece(tokens, merges or _merges_from_scores(tokens, scores),
                                 meta.get("tokenizer.ggml.add_space_prefix", True),
                                 Tokenizer, models, pre_tokenizers, decoders)
    except ValueError:
        raise
    except Exception as exc:  # tokenizers' own errors (an unknown token in a merge...)
        raise ValueError(f"{where}: the tokenizer cannot be built: {exc}") from None
    spelled = set(_byte_spelling().values()) if kind == "gpt2" else None
    # Control tokens are special (kept whole, dropped by decode), and so are the ones the
    # file names BOS, EOS, unknown and padding, as transformers makes them. A byte-level
    # "control" token spelled outside the byte alphabet is a llama.cpp mislabel: skipped.
    named = {meta.get(f"tokenizer.ggml.{k}_token_id")
             for k in ("bos", "eos", "unknown", "padding")}
    control = [AddedToken(t, normalized=False, special=True)
               for i, (t, k) in enumerate(zip(tokens, types))
               if (k == CONTROL or i in named) and (spelled is None or set(t) <= spelled)]
    if control:
        tok.add_special_tokens(control)
    known = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, k in zip(tokens, types) if k == USER_DEFINED and t in known]
    if user:
        tok.add_tokens(user)
    return tok


def _byte_level(tokens, merges, pre, Tokenizer, models, pre_tokenizers, decoders, Regex):
    splits, whole_tokens, _ = pre
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    # A token spelled outside the byte alphabet (a raw special token) is respelled in it.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                               continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, ignore_merges=whole_tokens))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(tokens, merges, space_prefix, Tokenizer, models, pre_tokenizers, decoders):
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                               dropout=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if space_prefix is not False else "never",
        split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix is not False:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


class GGUFTokenizer(HFTokenizer):
    """The tokenizer of a GGUF file: an :class:`HFTokenizer` (``encode``, ``decode``,
    ``vocab_size``, ``save``/``load``) that also keeps the file's chat template
    (:attr:`chat_template`, :meth:`apply_chat`) and special ids (:attr:`bos_id`,
    :attr:`eos_id`), and :attr:`stop_ids`, the ids llama.cpp ends a generation at
    (``attnlab generate`` stops there). ``GGUFTokenizer.from_gguf(path)`` reads it from a
    file."""

    type_name: ClassVar[str] = "gguf"

    def __init__(self, source: Any, *, chat_template: str | None = None,
                 bos_id: int | None = None, eos_id: int | None = None,
                 pad_id: int | None = None) -> None:
        super().__init__(source)
        self.chat_template, self.bos_id, self.eos_id = chat_template, bos_id, eos_id
        if pad_id is not None:
            self._pad_id = pad_id

    @classmethod
    def from_gguf(cls, source: PathLike | Any) -> GGUFTokenizer:
        """The tokenizer of GGUF file ``source`` (a path or an open ``GGUFFile``)."""
        from ..io.gguf import GGUFFile

        file = source if isinstance(source, GGUFFile) else GGUFFile(source)
        return cls.from_metadata(file.metadata, file.name)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], where: str = "the GGUF file"
                      ) -> GGUFTokenizer:
        """The tokenizer GGUF metadata ``meta`` (key -> value) describes."""
        from tokenizers import processors

        tok = build_gguf_tokenizer(meta, where)
        n = len(meta["tokenizer.ggml.tokens"])
        ids = {}
        for name in ("bos", "eos", "padding"):
            value = _field(meta, f"tokenizer.ggml.{name}_token_id", int, where)
            if value is not None and not 0 <= value < n:
                raise ValueError(f"{where}: tokenizer.ggml.{name}_token_id={value} is not a "
                                 f"token id (the vocabulary has {n})")
            ids[name] = value
        # llama.cpp's default where the file says nothing: SentencePiece adds BOS, and so
        # do byte-level files of the Llama 3 and Tekken splits.
        default_bos = meta.get("tokenizer.ggml.model") == "llama" or (
            meta.get("tokenizer.ggml.model") == "gpt2"
            and pre_tokenizer(meta.get("tokenizer.ggml.pre"), where)[2])
        add = {"bos": _field(meta, "tokenizer.ggml.add_bos_token", bool, where),
               "eos": _field(meta, "tokenizer.ggml.add_eos_token", bool, where)}
        add["bos"] = default_bos if add["bos"] is None else add["bos"]
        specials = [(name, ids[name]) for name in ("bos", "eos")
                    if add[name] and ids[name] is not None]
        if specials:
            names = {name: tok.id_to_token(i) for name, i in specials}
            def sequence(seq: str, type_id: int) -> str:
                return " ".join(([f"{names['bos']}:{type_id}"] if "bos" in names else [])
                                + [f"${seq}:{type_id}"]
                                + ([f"{names['eos']}:{type_id}"] if "eos" in names else []))

            tok.post_processor = processors.TemplateProcessing(
                single=sequence("A", 0), pair=f"{sequence('A', 0)} {sequence('B', 1)}",
                special_tokens=[(names[name], i) for name, i in specials])
        template = _field(meta, "tokenizer.chat_template", str, where)
        made = cls(tok, chat_template=template, bos_id=ids["bos"], eos_id=ids["eos"],
                   pad_id=ids["padding"])
        made.stop_ids = _stop_ids(meta, ids["eos"], where)
        return made

    def apply_chat(self, chat: str | Sequence[Mapping[str, str]], *,
                   add_generation_prompt: bool = True) -> str:
        """The text the file's chat template makes of ``chat`` (one user turn as text, or
        ``[{"role", "content"}, ...]``), the assistant's turn opened at the end. Encode
        it with ``add_special_tokens=False``: the template writes the special tokens."""
        if not self.chat_template:
            raise ValueError("this model file has no chat template (tokenizer.chat_template)")
        token = {name: (self._tok.id_to_token(i) if i is not None else None)
                 for name, i in (("bos_token", self.bos_id), ("eos_token", self.eos_id))}
        return render_chat(self.chat_template, as_messages(chat),
                           add_generation_prompt=add_generation_prompt, **token)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "chat_template": self.chat_template,
                "bos_id": self.bos_id, "eos_id": self.eos_id, "pad_id": self.pad_id}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GGUFTokenizer:
        plain = HFTokenizer.from_str(data["tokenizer"])
        return cls(plain.backend, chat_template=data.get("chat_template"),
                   bos_id=data.get("bos_id"), eos_id=data.get("eos_id"),
                   pad_id=data.get("pad_id"))._with_stop_ids(data)

    def __repr__(self) -> str:
        return (f"GGUFTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}, chat_template={self.chat_template is not None})")
