"""Weights on huge pages (attnlab._pages): tensors cut from an arena behave as
torch.empty's (each its own storage, no overlap, freed with the last of them); a loaded
model's linear weights, and only those, really lie on 2 MiB pages where the kernel gives
them, and quantising the model frees them."""

from __future__ import annotations

import contextlib
import gc
import re
from pathlib import Path

import pytest
import torch
import transformers as T
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from attnlab import _pages
from attnlab.models import GPT

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int16, torch.uint8, torch.int64,
          torch.bool]


@contextlib.contextmanager
def any_size():
    """Arenas of any size (MIN_ARENA keeps small models off huge pages)."""
    before, _pages.MIN_ARENA = _pages.MIN_ARENA, 0
    try:
        yield
    finally:
        _pages.MIN_ARENA = before


def _cut(t: torch.Tensor) -> bool:
    """Whether ``t`` was cut from an arena (a storage that does not resize)."""
    return not t.untyped_storage().resizable()


def _thp_on() -> bool:
    try:
        mode = re.search(r"\[(\w+)\]", Path("/sys/kernel/mm/transparent_hugepage/enabled")
                         .read_text()).group(1)
        status = Path("/proc/self/status").read_text()
    except (OSError, AttributeError):
        return False
    return mode in ("always", "madvise") and "THP_enabled:\t0" not in status


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


def _huge_kb(spans: list[tuple[int, int]]) -> int:
    """kB on huge pages in the mappings (smaps' areas) that hold any of ``spans``."""
    total, area = 0, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            area = (int(head.group(1), 16), int(head.group(2), 16))
        elif line.startswith("AnonHugePages:") and any(
                start < area[1] and area[0] < end for start, end in spans):
            total += int(line.split()[1])
    return total


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 70), min_size=1, max_size=3),
                          st.sampled_from(DTYPES)), min_size=1, max_size=12))
def test_tensors_cut_from_an_arena_are_separate_aligned_and_keep_their_values(specs):
    sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
    with any_size(), _pages.arena(sizes):
        made = [_pages.empty(tuple(shape), dtype) for shape, dtype in specs]
    for i, (t, (shape, dtype)) in enumerate(zip(made, specs)):
        assert t.shape == tuple(shape) and t.dtype == dtype and t.is_contiguous()
        assert _cut(t) == (t.numel() > 0)
        assert t.data_ptr() % _pages.ALIGN == 0 or t.numel() == 0
        t.fill_(i % 2 if dtype == torch.bool else i % 100)
    for i, t in enumerate(made):  # nothing written later reached an earlier tensor
        assert bool((t == (i % 2 if t.dtype == torch.bool else i % 100)).all())
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in made if t.numel())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_each_tensor_is_a_storage_of_its_own_that_safetensors_saves(tmp_path):
    with any_size(), _pages.arena([600 * 7 * 2, 20]):
        a = _pages.empty((600, 7), torch.bfloat16).normal_()
        b = _pages.empty((5,), torch.float32).fill_(3.0)
    assert _cut(a) and _cut(b)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert a.untyped_storage().nbytes() == a.numel() * 2
    save_file({"a": a, "b": b}, tmp_path / "w.safetensors")  # refuses shared storages
    back = load_file(tmp_path / "w.safetensors")
    assert torch.equal(back["a"], a) and torch.equal(back["b"], b)


def test_torch_empty_outside_an_arena_past_its_room_under_its_minimum_and_fake_mode():
    assert not _cut(_pages.empty((4 << 20,), torch.float32))  # no arena
    with _pages.arena([1 << 20]):  # under MIN_ARENA: no mapping made
        assert not _cut(_pages.empty((1 << 18,), torch.float32))
    with _pages.arena([16 << 20]):
        assert _cut(_pages.empty((1 << 20,), torch.float32))
        assert not _cut(_pages.empty((4 << 20,), torch.float32))  # past the room left
        assert _pages.empty((1 << 20, 8), torch.float32, "meta").is_meta
        with FakeTensorMode():
            assert isinstance(_pages.empty((1 << 10,), torch.float32), FakeTensor)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's /proc/self/smaps")
def test_an_arenas_mapping_goes_when_its_last_tensor_goes():
    with any_size(), _pages.arena([4096, 4096]):
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


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A Llama of about 9M parameters (36 MB float32): past MIN_ARENA at every precision."""
    folder = tmp_path_factory.mktemp("pages") / "m"
    torch.manual_seed(0)
    T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=8000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
        tie_word_embeddings=False,
    )).save_pretrained(folder)
    return folder


@pytest.mark.skipif(not _thp_on(), reason="transparent huge pages are off for this process")
@pytest.mark.parametrize("kwargs", [{}, {"dtype": torch.bfloat16}, {"quantize": "int8"}])
def test_a_loaded_models_linear_weights_and_only_they_lie_on_huge_pages(llama_folder, kwargs):
    model = GPT.from_hf(llama_folder, **kwargs)
    linears = {id(t) for m in model.modules() if "Linear" in type(m).__name__
               for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
               if t.numel() > 1024}
    streamed = [t for t in [*model.parameters(), *model.buffers()] if id(t) in linears]
    others = [t for t in [*model.parameters(), *model.buffers()] if id(t) not in linears]
    assert streamed and others  # (norms, the untied embedding)
    assert all(_cut(t) for t in streamed) and not any(_cut(t) for t in others)
    spans = list({(s.data_ptr(), s.data_ptr() + s.nbytes())
                  for s in (t.untyped_storage() for t in streamed)})
    held = sum(end - start for start, end in spans) // 1024
    # All but the two partly used huge pages at the mapping's ends (before Linux 6.7 a
    # mapping need not start on one).
    assert _huge_kb(spans) >= held - 4096 > 0, (_huge_kb(spans), held)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's /proc/self/smaps")
def test_quantising_a_loaded_model_frees_its_float_weights(llama_folder):
    model = GPT.from_hf(llama_folder)
    address = model.blocks[0].mlp.proj.weight.data_ptr()
    assert _cut(model.blocks[0].mlp.proj.weight) and _mapping_of(address) is not None
    model.quantize()
    gc.collect()
    assert _mapping_of(address) is None
    assert _cut(model.blocks[0].mlp.proj.data)  # the int8 weights: an arena of their own


@pytest.mark.parametrize("kwargs", [{}, {"dtype": torch.bfloat16}, {"quantize": "int8"}])
def test_a_loaded_models_matrices_lie_in_the_order_decoding_reads_them(llama_folder, kwargs):
    """Layer after layer, q|k|v, the output projection, gate|up, down (int8: each one's
    data, then its scales): each starts where the one read before it ends (up to the
    64-byte alignment), so that a token streams one region front to back (bf16:
    1.02-1.07x tokens/s, interleaved)."""
    model = GPT.from_hf(llama_folder, **kwargs)
    int8 = "quantize" in kwargs
    tensors = [t for block in model.blocks
               for group in (block.attn.W_query, block.attn.out_proj, block.mlp.gate,
                             block.mlp.proj)
               for t in ((group.data, group.scales) if int8 else (group.weight,))]
    if not _cut(tensors[0]):
        pytest.skip("no arena here (the OS gave no mapping)")
    spans = [(s.data_ptr(), s.data_ptr() + s.nbytes())
             for s in (t.untyped_storage() for t in tensors)]
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert 0 <= start - end < 64, (hex(end), hex(start))
