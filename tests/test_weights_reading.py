"""Reading weights from a safetensors file into a model's parameters
(``io.weights.read_into``): views of a mapped tensor (a transpose, a slice of
columns, GPT-2's Conv1D split into q/k/v) are read from disk in chunks of rows and
give exactly what ``copy_`` gives; and a GPT-2 folder loads without a second copy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from attnlab.io.weights import SafetensorsState, read_into

VIEWS = {  # name -> the view of a (rows, cols) tensor, given a column range a:b
    "whole": lambda t, a, b: t,
    "transpose": lambda t, a, b: t.t(),
    "columns": lambda t, a, b: t[:, a:b],
    "columns transposed": lambda t, a, b: t[:, a:b].t(),  # GPT-2's q, k, v
    "rows": lambda t, a, b: t[a % t.shape[0]:],
    "every other row": lambda t, a, b: t[::2],
    "one column": lambda t, a, b: t[:, a],
    "a row's slice": lambda t, a, b: t.reshape(-1)[a:b],  # a bias of a joint vector
    "every third value": lambda t, a, b: t.reshape(-1)[::3],
    "3-d": lambda t, a, b: t.reshape(t.shape[0], 1, -1)[:, :, a:b],
}


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), view=st.sampled_from(sorted(VIEWS)),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
       chunk=st.integers(1, 300), edits=st.integers(0, 3), data=st.data())
def test_read_into_reads_views_of_a_mapped_tensor_exactly(tmp_path_factory, rows, cols, view,
                                                           dtype, chunk, edits, data):
    """What ``copy_`` gives, edits made in memory to the mapped tensor included (the
    file then no longer holds what the tensor holds)."""
    path = tmp_path_factory.mktemp("w") / "w.safetensors"
    full = torch.randn(rows, cols, dtype=torch.float64).to(dtype)
    save_file({"w": full, "pad": torch.zeros(3, dtype=dtype)}, str(path))
    mapped = SafetensorsState([path])["w"]
    for _ in range(edits):
        i, j = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, cols - 1))
        for t in (mapped, full):
            t[i, j] = 1000.0 + i + j
    a = data.draw(st.integers(0, cols - 1))
    b = data.draw(st.integers(a + 1, cols))
    src, want = VIEWS[view](mapped, a, b), VIEWS[view](full, a, b)
    # The destination as the packed blocks hold it: a view inside a wider tensor, so
    # a write beside it would show.
    if want.ndim == 2:
        outer = torch.full((want.shape[1] + 2, want.shape[0]), float("nan"), dtype=dtype)
        dst = outer[1:-1].t()
    elif want.ndim == 1:  # every other value of a longer vector
        outer = torch.full((want.numel() * 2 + 2,), float("nan"), dtype=dtype)
        dst = outer[1:-1:2]
    else:
        outer = torch.full((want.numel() + 2,), float("nan"), dtype=dtype)
        dst = outer[1:-1].view(want.shape)
    read_into(dst, src, torch.empty(chunk * 4, dtype=torch.uint8))
    assert torch.equal(dst, want)
    assert outer.isnan().sum() == outer.numel() - want.numel()  # nothing beside it written


def test_read_into_takes_a_mapped_tensor_as_it_is_in_memory(tmp_path):
    """A mapped tensor edited in memory (copy on write: the file is unchanged) is read
    as the process sees it, not from the file, whichever view is read."""
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.arange(12.0).reshape(3, 4)}, str(path))
    mapped = SafetensorsState([path])["w"]
    mapped.mul_(-1)
    for view in (mapped, mapped.t(), mapped[:, 1:3].t()):
        dst = torch.empty(view.shape)
        read_into(dst, view)
        assert torch.equal(dst, view)
    assert torch.equal(SafetensorsState([path])["w"], torch.arange(12.0).reshape(3, 4))


_PEAK = """
import sys
from attnlab.models import GPT
def status(key):
    line = [x for x in open("/proc/self/status") if x.startswith(key)][0]
    return int(line.split()[1]) / 1024
before = status("VmRSS")
model = GPT.from_hf(sys.argv[1])
weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
print(weights, status("VmHWM") - before - weights)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
def test_a_gpt2_folder_loads_without_a_second_copy_of_its_projections(tmp_path):
    """GPT-2 stores its projections transposed (Conv1D); they are read from the file
    straight into their blocks: the process never holds them twice, not even for a
    moment (the peak, not only what is left after loading)."""
    import transformers as T

    torch.manual_seed(0)
    T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_positions=32, n_embd=512, n_layer=6,
                                   n_head=8)).save_pretrained(tmp_path / "m")
    out = subprocess.run([sys.executable, "-c", _PEAK, str(tmp_path / "m")],
                         capture_output=True, text=True, check=True)
    weights, extra = map(float, out.stdout.split())
    assert weights > 70 and extra < 15, out.stdout


def test_a_file_too_large_to_map_says_so_rather_than_corrupt(tmp_path, monkeypatch):
    # A valid 31 GiB file on a 23 GiB machine: safetensors cannot map it, which was
    # reported as "not a valid safetensors file (truncated or corrupt?)".
    import safetensors

    from attnlab.io import CheckpointError

    save_file({"w": torch.zeros(4)}, tmp_path / "model.safetensors")

    def refused(path, **kwargs):
        raise OSError(f"unable to mmap 33429975568 bytes from file <{path}>: Cannot allocate "
                      "memory (12)")

    monkeypatch.setattr(safetensors, "safe_open", refused)
    with pytest.raises(CheckpointError, match=r"model.safetensors' \(0.0 GiB\) cannot be "
                                              r"mapped into memory .* too large for this machine"):
        SafetensorsState([tmp_path / "model.safetensors"])


def test_float8_and_unsigned_tensors_are_read_as_their_own_dtype(tmp_path):
    # They were read as uint8, and a model that met one named "torch.uint8" for a float8.
    want = {"f8": torch.randn(3, 4).to(torch.float8_e4m3fn),
            "f8b": torch.randn(5).to(torch.float8_e5m2),
            "u16": torch.arange(6).to(torch.uint16), "u32": torch.arange(7).to(torch.uint32)}
    save_file(want, tmp_path / "w.safetensors")
    state = SafetensorsState([tmp_path / "w.safetensors"])
    for name, t in want.items():
        assert state.shapes()[name] == (tuple(t.shape), t.dtype)
        assert state[name].dtype == t.dtype and torch.equal(state[name].view(torch.uint8),
                                                            t.view(torch.uint8))
