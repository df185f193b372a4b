"""KV transfer between prefill and decode workers (docs/design.md §4, §6).

    from kv_transfer import TransferConfig, make_sender, make_receiver, KVChunk

    rx = make_receiver(TransferConfig(connector="tcp", secret=SECRET))   # decode side
    tx = make_sender(TransferConfig(connector="tcp", secret=SECRET))     # prefill side
    tx.send(KVChunk(...), dest=rx.endpoint)
    ev = rx.poll(); ...copy ev.chunks into the cache...; rx.release(chunk)

Importing this package never imports Ray; the "ray" connector is loaded on first use.
Exports are lazy, so the registries (kv_transfer.registry, .pacing, .send_queue) can be
read for config choices without importing torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    **dict.fromkeys(("FrameRecord", "KVChunk", "KVReceiver", "KVSender", "ReceiveEvents",
                     "SendEvents"), "kv_transfer.base"),
    "TransferConfig": "kv_transfer.config",
    **dict.fromkeys(("CONNECTORS", "connector_names", "make_connector", "make_receiver",
                     "make_sender", "register_connector"), "kv_transfer.registry"),
    "WireError": "kv_transfer.wire",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
