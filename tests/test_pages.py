"""Weights on huge pages (attnlab._pages): tensors cut from shared mappings behave as
torch.empty's (each its own storage, no overlap, freed with the last of them), and a
loaded model's weights really lie on 2 MiB pages where the kernel gives them."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from attnlab import _pages

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int16, torch.uint8, torch.int64]
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        return re.search(r"\[(\w+)\]", THP.read_text()).group(1)
    except (OSError, AttributeError):
        return None


def _mapping_of(address: int) -> dict[str, int] | None:
    """The /proc/self/smaps fields (kB) of the mapping holding ``address``; None if none."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            if inside:
                return fields
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
            fields = {}
        elif inside and line.split()[-1] == "kB":
            name, value = line.split()[:2]
            fields[name.rstrip(":")] = int(value)
    return fields if inside else None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 70), min_size=1, max_size=3),
                          st.sampled_from(DTYPES)), min_size=1, max_size=12))
def test_tensors_cut_from_an_arena_are_separate_aligned_and_keep_their_values(specs):
    with _pages.arena():
        made = [_pages.empty(tuple(shape), dtype) for shape, dtype in specs]
    for i, (t, (shape, dtype)) in enumerate(zip(made, specs)):
        assert t.shape == tuple(shape) and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % _pages.ALIGN == 0 or t.numel() == 0
        t.fill_(i % 100)
    for i, t in enumerate(made):  # nothing written later reached an earlier tensor
        assert bool((t == i % 100).all())
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in made if t.numel())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_each_tensor_is_a_storage_of_its_own_that_safetensors_saves(tmp_path):
    with _pages.arena():
        a = _pages.empty((300, 7), torch.bfloat16).normal_()
        b = _pages.empty((5,), torch.float32).fill_(3.0)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert a.untyped_storage().nbytes() == a.numel() * 2
    save_file({"a": a, "b": b}, tmp_path / "w.safetensors")  # refuses shared storages
    back = load_file(tmp_path / "w.safetensors")
    assert torch.equal(back["a"], a) and torch.equal(back["b"], b)


def test_outside_an_arena_small_tensors_other_devices_and_dtypes_are_torch_empty():
    small = _pages.empty((10, 10), torch.float32)
    assert _mapping_of(small.data_ptr()) is None or small.untyped_storage().nbytes() == 400
    meta = _pages.empty((1 << 20, 8), torch.float32, "meta")
    assert meta.is_meta and meta.shape == (1 << 20, 8)
    with _pages.arena():
        flags = _pages.empty((4 << 20,), torch.bool)
        assert flags.dtype == torch.bool and flags.shape == (4 << 20,)
        nothing = _pages.empty((0, 5), torch.float32)
        assert nothing.shape == (0, 5)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's /proc/self/smaps")
def test_an_arenas_mapping_goes_when_its_last_tensor_goes():
    with _pages.arena():
        a = _pages.empty((1024,), torch.float32)
        b = _pages.empty((1024,), torch.float32)
    address = a.data_ptr()
    assert _mapping_of(address) is not None
    del a
    gc.collect()
    assert _mapping_of(address) is not None  # b still holds it
    del b
    gc.collect()
    assert _mapping_of(address) is None


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off on this kernel")
def test_a_loaded_models_weights_lie_on_huge_pages(tmp_path):
    import transformers as T

    from attnlab.models import GPT

    folder = tmp_path / "m"
    torch.manual_seed(0)
    T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=4000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )).save_pretrained(folder)
    for kwargs in ({}, {"dtype": torch.bfloat16}, {"quantize": "int8"}):
        model = GPT.from_hf(folder, **kwargs)
        weights = [t for t in [*model.parameters(), *model.buffers()] if t.numel() > 4096]
        assert weights
        for t in weights:
            fields = _mapping_of(t.data_ptr())
            assert fields is not None and fields.get("AnonHugePages", 0) > 0, kwargs
