"""pdserve engine: the Ray-free core shared by the prefill and decode pools.

Exports are lazy: importing a light module (engine.config, engine.registry) must not load
torch or the model stack, so `pdserve --help` stays instant.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "SamplingParams": "engine.request",
    "Request": "engine.request",
    "RequestStatus": "engine.request",
    "FinishReason": "engine.request",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
