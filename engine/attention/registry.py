"""Attention backends by name: `ATTENTION_BACKENDS` maps a name to a factory
`(torch.device) -> AttentionBackend` (or a `"module:function"` reference to one).

- "torch": the reference kernels (torch_ref.py), any device
- "cpu": compiled CPU ops (cpu_kernels.cpp, built once by cpu_build.py): decode attention
  straight from the paged cache and the KV write; prefill on the torch reference. Falls
  back to "torch", with the reason logged, where the ops cannot be built
- "triton": GPU kernels (triton_ops.py); on CPU only under TRITON_INTERPRET=1
- "auto": triton on CUDA, cpu on CPU, torch elsewhere

A new backend is its module (a factory returning `AttentionBackend(name, prefill, decode,
write_kv)`) plus one `ATTENTION_BACKENDS.register(...)`. Nothing here imports torch or
triton until a backend is built, so the config's choices and `--help` stay light.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.registry import Registry, load_ref

if TYPE_CHECKING:
    import torch

    from engine.attention.base import AttentionBackend

    BackendFactory = Callable[[torch.device], AttentionBackend]

ATTENTION_BACKENDS: Registry[BackendFactory | str] = Registry("attention_backend")


def get_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Build backend `name` for tensors living on `device` (ValueError names the choices)."""
    import torch

    return load_ref(ATTENTION_BACKENDS.get(name))(torch.device(device))


def _auto(device: torch.device) -> AttentionBackend:
    name = {"cuda": "triton", "cpu": "cpu"}.get(device.type, "torch")
    return get_backend(name, device)


def _torch(device: torch.device) -> AttentionBackend:
    from engine.attention import torch_ref
    from engine.attention.base import AttentionBackend

    return AttentionBackend("torch", torch_ref.paged_prefill_attention,
                            torch_ref.paged_decode_attention, torch_ref.write_kv)


def _cpu(device: torch.device) -> AttentionBackend:
    if device.type != "cpu":
        raise ValueError(f"attention_backend='cpu' runs on the CPU (got {device}); use 'auto'")
    from engine.attention import cpu_build

    if cpu_build.load() is not None:  # the reason is logged once
        return _torch(device)
    import torch

    from engine.attention import torch_ref
    from engine.attention.base import AttentionBackend

    ops = torch.ops.pdserve_cpu
    return AttentionBackend("cpu", torch_ref.paged_prefill_attention, ops.paged_decode,
                            ops.write_kv)


def _triton(device: torch.device) -> AttentionBackend:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention_backend='triton' needs a CUDA device (got {device}); on CPU set "
            "TRITON_INTERPRET=1 to run the kernels in Triton's interpreter, or use 'torch'"
        )
    from engine.attention import triton_ops  # lazy: a CPU install never imports triton
    from engine.attention.base import AttentionBackend

    return AttentionBackend("triton", triton_ops.paged_prefill_attention,
                            triton_ops.paged_decode_attention, triton_ops.write_kv)


ATTENTION_BACKENDS.register("auto", _auto, help="triton on CUDA, cpu on CPU")
ATTENTION_BACKENDS.register("torch", _torch, help="reference kernels, any device")
ATTENTION_BACKENDS.register("cpu", _cpu, help="compiled CPU decode attention and KV write "
                            "(built once; falls back to torch where the build fails)")
ATTENTION_BACKENDS.register("triton", _triton, help="GPU kernels; on CPU only under "
                            "TRITON_INTERPRET=1")
