"""OpenVINO as a peer of the generate suite: the suite's model, converted once to an
OpenVINO IR with a stateful KV cache, run by its CPU plugin.

Export (cached beside the suite's safetensors folder): transformers loads the folder;
``openvino.convert_model`` traces a wrapper that takes ``input_ids``, ``attention_mask``,
``position_ids`` and the past keys/values and returns the last position's logits and the
new keys/values; the past is then made internal state, read through a ``beam_idx``
gather and started from zeros, batch 1. That is the shape of Optimum Intel's export,
which the CPU plugin needs to fuse the KV cache into its attention kernel (without the
gather and the initial state, attention ran as plain MatMuls and a copy of the cache
each token). Optimum Intel itself is not used: installing its current release (2.2)
replaced torch 2.13 by a CUDA build of 2.15 and transformers 5.24 by 5.5. The ``int8`` IR is
the float32 one with every matrix compressed by NNCF to int8, symmetric, one scale per
output channel (``CompressWeightsMode.INT8_SYM``), what OpenVINO calls int8 weights.

Precisions (compile-time settings; everything else is the CPU plugin's default, at the
bench's thread count, latency hint):

- ``f32``: the float32 IR, ``INFERENCE_PRECISION_HINT=f32`` and a float32 KV cache;
- ``bf16``: the float32 IR, ``INFERENCE_PRECISION_HINT=bf16`` (the plugin converts the
  weights to bf16 once, at compile time, where the CPU has bf16 products), the plugin's
  KV cache (u8 here);
- ``int8``: the int8 IR with the plugin's defaults (here: bf16 activations, a u8 KV
  cache, activations quantized in groups of 32 for the int8 products).

Decoding is greedy, batch 1: the prompt in one call, then one call per token, each new
token the argmax of the logits.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import openvino as ov

PRECISIONS = ("f32", "bf16", "int8")
# Bumped whenever the export changes: the cached IRs carry it in their folder names.
FORMAT = 2


def ir_folder(model_folder: Path, weights: str) -> Path:
    """Where the ``weights`` ("f32" or "int8") IR of ``model_folder``'s model is cached."""
    version = ov.__version__.split("-")[0]  # "2026.4.1-22982-...-releases/2026/4"
    return Path(model_folder) / "peers" / f"openvino-{weights}-v{FORMAT}-ov{version}"


def ensure(model_folder: Path, weights: str) -> Path:
    """The ``model.xml`` of the ``weights`` IR, exported on first use (into a temporary
    folder renamed into place, so a half-written IR is never read)."""
    if weights not in ("f32", "int8"):
        raise ValueError(f"weights must be 'f32' or 'int8', got {weights!r}")
    target = ir_folder(model_folder, weights)
    if (target / "model.xml").is_file():
        return target / "model.xml"
    if weights == "f32":
        model = export(model_folder)
    else:
        import nncf

        model = nncf.compress_weights(ov.Core().read_model(ensure(model_folder, "f32")),
                                      mode=nncf.CompressWeightsMode.INT8_SYM)
    target.parent.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=target.name + "-", dir=target.parent))
    try:
        ov.save_model(model, part / "model.xml", compress_to_fp16=False)
        with contextlib.suppress(OSError):  # written meanwhile by another process: keep it
            part.rename(target)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return target / "model.xml"


def export(model_folder: Path) -> ov.Model:
    """The stateful float32 OpenVINO model of a ``save_pretrained`` folder."""
    import torch
    import transformers as T
    from openvino._offline_transformations import apply_make_stateful_transformation

    hf = T.AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32,
                                                attn_implementation="sdpa").eval()
    cfg = hf.config
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    past_names = [f"past.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    names = ["input_ids", "attention_mask", "position_ids", *past_names]
    past, new = 3, 2  # traced with a past and more than one new token: the general case
    example = (torch.ones(1, new, dtype=torch.long), torch.ones(1, past + new, dtype=torch.long),
               torch.arange(past, past + new)[None],
               *(torch.randn(1, kv_heads, past, head_dim) for _ in past_names))
    with torch.no_grad():
        model = ov.convert_model(_with_past(hf), example_input=example)
    for port, name in zip(model.inputs, names):
        port.get_tensor().set_names({name})
    outs = ["logits", *(n.replace("past.", "present.") for n in past_names)]
    for port, name in zip(model.outputs, outs):
        port.get_tensor().set_names({name})
    model.reshape({name: ov.PartialShape([1, -1]) if i < 3 else
                   ov.PartialShape([1, kv_heads, -1, head_dim]) for i, name in enumerate(names)})
    _add_beam_gather(model, past_names)
    apply_make_stateful_transformation(
        model, {n: n.replace("past.", "present.") for n in past_names})
    _zero_initial_state(model)
    return model


def _zero_initial_state(model) -> None:
    """Give every state (``ReadValue``) an explicit initial value, zeros of shape
    ``(1, kv_heads, 0, head_dim)``, as Optimum Intel's export does; the CPU plugin's fused
    KV cache wants one (without it, compiling failed)."""
    from openvino import opset13

    for op in model.get_ops():
        if op.get_type_name() != "ReadValue":
            continue
        dims = [d.get_min_length() for d in op.get_output_partial_shape(0)]
        zeros = opset13.broadcast(opset13.constant(0.0, dtype=op.get_output_element_type(0)),
                                  opset13.constant(np.array(dims, dtype=np.int64)))
        op.set_arguments([zeros])
    model.validate_nodes_and_infer_types()


def _add_beam_gather(model, past_names: list[str]) -> None:
    """Read every past tensor through a ``Gather`` by a ``beam_idx`` input, as Optimum
    Intel's export does: the CPU plugin fuses the KV cache into its attention kernel
    only where it finds that pattern (without it, attention ran as plain MatMuls)."""
    from openvino import opset13

    beam_idx = opset13.parameter(ov.PartialShape([1]), ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
    model.add_parameters([beam_idx])
    for name in past_names:
        port = model.input(name)
        consumers = port.get_target_inputs()
        gather = opset13.gather(port, beam_idx, opset13.constant(0))
        for consumer in consumers:
            consumer.replace_source_output(gather.output(0))
    model.validate_nodes_and_infer_types()


def _with_past(model):
    """A transformers decoder as a function of tensors only: the KV cache comes in and
    goes out as one ``(1, kv_heads, seq, head_dim)`` tensor per layer and role."""
    import torch
    from transformers import DynamicCache

    class WithPast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(config=self.model.config)
            for i, layer in enumerate(cache.layers):
                # Filled as a layer that has seen ``past`` (an empty first update
                # would trace a concatenation with a 1-D tensor).
                layer.device = past[2 * i].device
                layer.keys, layer.values = past[2 * i], past[2 * i + 1]
                layer.is_initialized = True
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids, past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
            kv = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
            return (out.logits, *kv)

    return WithPast()


def compile_config(precision: str, threads: int) -> dict:
    """The CPU plugin's settings for ``precision`` (see the module docstring)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads}
    if precision == "f32":
        config.update(INFERENCE_PRECISION_HINT="f32", KV_CACHE_PRECISION="f32")
    elif precision == "bf16":
        config.update(INFERENCE_PRECISION_HINT="bf16")
    return config


def make_step(folder: str, precision: str, prompt: Sequence[int], new_tokens: int,
              threads: int, **_):
    """A step decoding ``new_tokens`` greedily after ``prompt`` (token ids) with the
    model in ``folder`` at ``precision``; it returns the new tokens."""
    xml = ensure(Path(folder), "int8" if precision == "int8" else "f32")
    compiled = ov.Core().compile_model(xml, "CPU", compile_config(precision, threads))
    request = compiled.create_infer_request()
    logits = compiled.output("logits")
    total = len(prompt) + new_tokens
    prompt = np.asarray([prompt], dtype=np.int64)
    ones = np.ones((1, total), dtype=np.int64)
    positions = np.arange(total, dtype=np.int64)[None]
    beam = np.zeros(1, dtype=np.int32)

    def step() -> list[int]:
        request.reset_state()
        ids, seen, out = prompt, 0, []
        for _ in range(new_tokens):
            n = ids.shape[1]
            result = request.infer({"input_ids": ids, "attention_mask": ones[:, :seen + n],
                                    "position_ids": positions[:, seen:seen + n],
                                    "beam_idx": beam})
            out.append(int(np.argmax(result[logits][0, -1])))
            seen += n
            ids = np.array([out[-1:]], dtype=np.int64)
        return out
    step.compiled = compiled
    return step
