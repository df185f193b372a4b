"""Attention backends chosen by name (engine.attention.registry): "torch" (reference, any
device), "triton" (GPU kernels; on CPU only under TRITON_INTERPRET=1), "auto" (triton on
CUDA, torch elsewhere).

Exports are lazy: the registry's names are read by the config without importing torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AttentionBackend": "engine.attention.base",
    "AttentionMetadata": "engine.attention.base",
    "ATTENTION_BACKENDS": "engine.attention.registry",
    "get_backend": "engine.attention.registry",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine.attention' has no attribute {name!r}")
