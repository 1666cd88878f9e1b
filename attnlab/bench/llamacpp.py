"""llama.cpp (``llama-cpp-python``) as a peer of the generate suite.

It decodes the GGUF files :mod:`.gguf_files` writes from the suite's safetensors folder
(f32, bf16, f16, q8_0), greedily, batch 1, at the bench's thread count, from the same
prompt as every engine: the prompt in one ``eval`` (one batch of up to 512 tokens), then
one ``eval`` per token, each new token the argmax of the last logits (as attnlab's greedy
decoding picks it). The float32 file runs with a float32 KV cache, so it is float32
throughout like attnlab's; the others with llama.cpp's default (f16). Everything else is
llama-cpp-python's default (no flash attention, the file mapped).

This module imports no torch: the suite runs it in a worker process of its own
(:mod:`.worker`), where llama.cpp's OpenMP threads have the runtime to themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import llama_cpp
import numpy as np

from . import gguf_files


def make_step(folder: str, precision: str, prompt: Sequence[int], new_tokens: int,
              threads: int, **_):
    """A step decoding ``new_tokens`` greedily after ``prompt`` (token ids) with the
    ``precision`` GGUF of the model in ``folder``; it returns the new tokens."""
    path = gguf_files.ensure(Path(folder), precision)
    kv = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} \
        if precision == "f32" else {}
    batch = max(512, len(prompt))
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + new_tokens, n_batch=batch,
                          n_ubatch=batch, n_threads=threads, n_threads_batch=threads,
                          verbose=False, **kv)
    prompt = [int(t) for t in prompt]
    vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                     shape=(vocab,))

    def step() -> list[int]:
        llm.reset()
        llm.eval(prompt)
        out = []
        for i in range(new_tokens):
            out.append(int(np.argmax(last_logits())))
            if i + 1 < new_tokens:
                llm.eval(out[-1:])
        return out
    step.llm = llm  # the model lives as long as the step
    return step
