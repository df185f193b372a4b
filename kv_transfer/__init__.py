"""KV transfer between prefill and decode workers (DESIGN §2.4, §4).

    from kv_transfer import TransferConfig, make_sender, make_receiver, KVChunk

    rx = make_receiver(TransferConfig(connector="tcp", secret=SECRET))   # decode side
    tx = make_sender(TransferConfig(connector="tcp", secret=SECRET))     # prefill side
    tx.send(KVChunk(...), dest=rx.endpoint)
    ev = rx.poll(); ...copy ev.chunks into the cache...; rx.release(chunk)

Importing this package never imports Ray; the "ray" connector is loaded on first use.
"""

from __future__ import annotations

from kv_transfer.base import FrameRecord, KVChunk, KVReceiver, KVSender, ReceiveEvents, SendEvents
from kv_transfer.config import TransferConfig
from kv_transfer.registry import (
    connector_names,
    make_connector,
    make_receiver,
    make_sender,
    register_connector,
)
from kv_transfer.wire import WireError

__all__ = [
    "FrameRecord", "KVChunk", "KVReceiver", "KVSender", "ReceiveEvents", "SendEvents",
    "TransferConfig", "WireError", "connector_names", "make_connector", "make_receiver",
    "make_sender", "register_connector",
]
