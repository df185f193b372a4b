"""Attention backend registry: names resolve per device; bad choices fail with a clear fix.

Nothing here imports triton: the triton path is checked up to its device guard, and
"auto" on CUDA is checked with the triton registration swapped for a stub.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention import ATTENTION_BACKENDS, get_backend, torch_ref


def test_auto_on_cpu_resolves_to_the_cpu_ops_or_the_torch_reference():
    be = get_backend("auto", "cpu")  # "cpu" (tests/unit/test_cpu_attention.py), or its
    assert be.name in ("cpu", "torch")  # fallback where the ops cannot be built
    assert be.paged_prefill_attention is torch_ref.paged_prefill_attention
    if be.name == "torch":
        assert be.paged_decode_attention is torch_ref.paged_decode_attention
        assert be.write_kv is torch_ref.write_kv


def test_torch_by_name_on_any_device_string():
    assert get_backend("torch", torch.device("cpu")).name == "torch"
    assert get_backend("torch", "cuda:0").name == "torch"  # no CUDA needed to resolve


def test_triton_on_cpu_without_interpreter_names_the_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1") as err:
        get_backend("triton", "cpu")
    assert "'torch'" in str(err.value) and "CUDA" in str(err.value)


def test_triton_interpreter_flag_must_be_exactly_one(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_backend("triton", "cpu")


@pytest.mark.parametrize("name", ["cuda", "Triton", "flash", ""])
def test_unknown_name_lists_the_choices(name):
    with pytest.raises(ValueError, match="unknown attention_backend") as err:
        get_backend(name, "cpu")
    for choice in ("auto", "torch", "triton"):
        assert choice in str(err.value)


def test_auto_on_cuda_picks_triton():
    seen = []

    def fake_triton(device):
        seen.append(device)
        return "triton-backend"

    real, text = ATTENTION_BACKENDS.get("triton"), ATTENTION_BACKENDS.help("triton")
    ATTENTION_BACKENDS.register("triton", fake_triton, replace=True)
    try:
        assert get_backend("auto", "cuda:0") == "triton-backend"
    finally:
        ATTENTION_BACKENDS.register("triton", real, help=text, replace=True)
    assert seen == [torch.device("cuda:0")]
