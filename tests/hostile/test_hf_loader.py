"""Hostile Hugging Face folders: a damaged config.json or a tensor of the wrong shape is
refused in one line naming what is wrong (the config key; the tensor, the shape found and
the shape expected) before anything is allocated; never another exception, never a
model that quietly ignores part of a tensor."""

from __future__ import annotations

import json
import math
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from attnlab.io import CheckpointError  # noqa: E402
from attnlab.models import GPT  # noqa: E402

# The sizes of each layout's config: a positive int each (those with a default may be
# null). transformers reads Llama's head_dim 0 as "hidden_size // heads".
SIZES = {"gpt2": ["n_embd", "n_head", "n_layer", "n_positions", "vocab_size", "n_inner"],
         "llama": ["hidden_size", "num_attention_heads", "num_hidden_layers",
                   "max_position_embeddings", "vocab_size", "intermediate_size",
                   "num_key_value_heads", "head_dim"]}
NOT_A_SIZE = st.one_of(st.integers(-5, 0), st.integers(-(2 ** 70), -6),
                       st.sampled_from([1.5, 48.0, math.nan, math.inf, -math.inf, True, False,
                                        "4", "", [], [4], {}, {"a": 1}]))
HOSTILE = st.one_of(NOT_A_SIZE, st.none(), st.integers(1, 2 ** 70), st.text(max_size=8),
                    st.floats(allow_nan=True), st.sampled_from(["gpt2", "llama", "bert"]))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    import transformers as T

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    T.GPT2LMHeadModel(T.GPT2Config(vocab_size=40, n_positions=16, n_embd=24, n_layer=2,
                                   n_head=4)).save_pretrained(root / "gpt2")
    T.LlamaForCausalLM(T.LlamaConfig(vocab_size=40, hidden_size=24, intermediate_size=40,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=16,
                                     tie_word_embeddings=False)).save_pretrained(root / "llama")
    return root


def _copy(folders, kind: str, tmp) -> tuple:
    folder = tmp / kind
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(folders / kind, folder)
    return folder, json.loads((folder / "config.json").read_text())


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert message and "\n" not in message, message
    return message


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(sorted(SIZES)), data=st.data(), value=NOT_A_SIZE)
def test_a_size_that_is_not_a_positive_int_is_one_line_naming_the_key(
        folders, tmp_path_factory, kind, data, value):
    key = data.draw(st.sampled_from(SIZES[kind]))
    if key == "head_dim" and value == 0 and not isinstance(value, bool):
        value = -1  # 0 means "the default" to transformers
    folder, cfg = _copy(folders, kind, tmp_path_factory.mktemp("c"))
    cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as info:
        GPT.from_hf(folder)
    assert _one_line(info.value).startswith(f"config {key}="), info.value


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(sorted(SIZES)), data=st.data(), value=HOSTILE,
       delete=st.booleans())
def test_any_damaged_config_field_loads_or_is_one_line(folders, tmp_path_factory, kind, data,
                                                       value, delete):
    """Whatever a field holds (or its absence): a model that works, or one ValueError /
    TypeError line, never an exception of another kind (ZeroDivisionError, KeyError,
    IndexError ...)."""
    folder, cfg = _copy(folders, kind, tmp_path_factory.mktemp("c"))
    key = data.draw(st.sampled_from(sorted(cfg)))
    if delete:
        del cfg[key]
    else:
        cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    try:
        model = GPT.from_hf(folder)
    except (ValueError, TypeError) as exc:
        _one_line(exc)
        return
    with torch.no_grad():  # one token: a config may make the context or the vocabulary 1
        assert torch.isfinite(model(torch.tensor([[0]]))).all()


def _damage(shape: tuple[int, ...], how: str, by: int) -> tuple[int, ...]:
    if how == "grow" or not shape:
        return (*shape[:-1], shape[-1] + by) if shape else (by,)
    if how == "shrink":
        return (*shape[:-1], max(shape[-1] - by, 1)) if shape[-1] > 1 else (*shape[:-1], 2)
    if how == "transpose" and len(shape) == 2 and shape[0] != shape[1]:
        return shape[::-1]
    if how == "extra axis":
        return (*shape, 1)
    return shape[:-1] if len(shape) > 1 else (shape[0] + by,)  # one axis fewer


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(sorted(SIZES)), data=st.data(),
       how=st.sampled_from(["grow", "shrink", "transpose", "extra axis", "fewer axes"]),
       by=st.integers(1, 30))
def test_a_tensor_of_the_wrong_shape_is_refused_naming_it(folders, tmp_path_factory, kind,
                                                          data, how, by):
    """Any tensor of the file given another shape: one CheckpointError naming the folder,
    the tensor, the shape found and the shape the config makes."""
    folder, _ = _copy(folders, kind, tmp_path_factory.mktemp("w"))
    state = load_file(folder / "model.safetensors")
    name = data.draw(st.sampled_from(sorted(state)))
    want = tuple(state[name].shape)
    bad = _damage(want, how, by)
    if bad == want:
        bad = (*want[:-1], want[-1] + by)
    state[name] = torch.zeros(bad)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        GPT.from_hf(folder)
    message = _one_line(info.value)
    assert message.startswith(f"{str(folder)!r} does not fit the GPT: "), message
    assert f"{name!r} has shape {bad}, expected {want}" in message, message


def test_cli_generate_with_a_zero_head_count_is_one_line(folders, tmp_path, cli,
                                                         one_line_error):
    folder, cfg = _copy(folders, "gpt2", tmp_path)
    cfg["n_head"] = 0
    (folder / "config.json").write_text(json.dumps(cfg))
    proc = cli(["generate", "--model", str(folder), "--prompt", "hi"], cwd=tmp_path)
    one_line_error(proc, "config n_head=0 is not valid (expected a positive int)")


@pytest.mark.parametrize("kind,key", [("gpt2", "n_layer"), ("llama", "num_hidden_layers")])
@pytest.mark.parametrize("layers", [1, 3, 3000, 10 ** 12])
def test_a_layer_count_the_weights_do_not_hold_is_refused_before_building(
        folders, tmp_path, kind, key, layers):
    """The file's tensor names alone refuse it: no model of 10**12 layers (or a table of
    their shapes) is built first to find the missing tensors."""
    folder, cfg = _copy(folders, kind, tmp_path)
    cfg[key] = layers
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as info:
        GPT.from_hf(folder)
    message = _one_line(info.value)
    assert f"config {key}={layers}, but the weights hold layers 0 .. 1" in message, message


def test_a_folder_without_config_json_says_so(tmp_path, cli, one_line_error):
    """An empty folder (or one with only weights) said "model_type None is not supported"."""
    (tmp_path / "weights_only").mkdir()
    (tmp_path / "weights_only" / "model.safetensors").write_bytes(b"")
    for folder in ("empty", "weights_only"):
        (tmp_path / folder).mkdir(exist_ok=True)
        proc = cli(["generate", "--model", str(tmp_path / folder), "--prompt", "hi"],
                   cwd=tmp_path)
        one_line_error(proc, "has no config.json", "save_pretrained")
