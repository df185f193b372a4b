"""Attention backends chosen by name: "torch" (reference, any device), "triton" (GPU
kernels; on CPU only under TRITON_INTERPRET=1), "auto" (triton on CUDA, torch elsewhere)."""

from __future__ import annotations

import os

import torch

from engine.attention.base import AttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton")


def _torch_backend() -> AttentionBackend:
    from engine.attention import torch_ref

    return AttentionBackend(
        "torch",
        torch_ref.paged_prefill_attention,
        torch_ref.paged_decode_attention,
        torch_ref.write_kv,
    )


def _triton_backend(device: torch.device) -> AttentionBackend:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention_backend='triton' needs a CUDA device (got {device}); on CPU set "
            "TRITON_INTERPRET=1 to run the kernels in Triton's interpreter, or use 'torch'"
        )
    from engine.attention import triton_ops  # lazy: a CPU install never imports triton

    return AttentionBackend(
        "triton",
        triton_ops.paged_prefill_attention,
        triton_ops.paged_decode_attention,
        triton_ops.write_kv,
    )


def get_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Resolve a backend name for tensors living on `device`."""
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention_backend {name!r}; choose one of {BACKEND_NAMES}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    return _torch_backend() if name == "torch" else _triton_backend(device)


__all__ = ["AttentionBackend", "BACKEND_NAMES", "get_backend"]
