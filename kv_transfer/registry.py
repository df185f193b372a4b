"""Connectors by name: ``make_sender(cfg)`` / ``make_receiver(cfg)`` use ``cfg.connector``.

Built-ins are imported lazily, so importing ``kv_transfer`` never imports Ray (only the
"ray" connector does). Extra keyword arguments go to the connector's factory:

  inproc  sender: clock, name                  receiver: name
  tcp     sender: clock, name                  receiver: (none; bind from cfg)
  ray     sender: resolver(dest) -> actor      receiver: endpoint (actor name)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kv_transfer.base import KVReceiver, KVSender
from kv_transfer.config import TransferConfig

SenderFactory = Callable[..., KVSender]
ReceiverFactory = Callable[..., KVReceiver]

_BUILTIN = {  # name -> (module, sender factory, receiver factory)
    "inproc": ("kv_transfer.inproc", "make_inproc_sender", "make_inproc_receiver"),
    "tcp": ("kv_transfer.tcp_connector", "make_tcp_sender", "make_tcp_receiver"),
    "ray": ("kv_transfer.ray_connector", "make_ray_sender", "make_ray_receiver"),
}
_REGISTRY: dict[str, tuple[SenderFactory, ReceiverFactory]] = {}


def register_connector(name: str, sender: SenderFactory, receiver: ReceiverFactory) -> None:
    """Add (or replace) a connector; factories are called as ``f(cfg, **kwargs)``."""
    _REGISTRY[name] = (sender, receiver)


def connector_names() -> list[str]:
    return sorted(set(_BUILTIN) | set(_REGISTRY))


def _factories(name: str) -> tuple[SenderFactory, ReceiverFactory]:
    if name not in _REGISTRY:
        if name not in _BUILTIN:
            raise ValueError(f"unknown connector {name!r}; known: {connector_names()}")
        module, s, r = _BUILTIN[name]
        mod = importlib.import_module(module)
        _REGISTRY[name] = (getattr(mod, s), getattr(mod, r))
    return _REGISTRY[name]


def make_connector(cfg: TransferConfig) -> tuple[SenderFactory, ReceiverFactory]:
    """(sender factory, receiver factory) of ``cfg.connector``; call them with kwargs only."""
    s, r = _factories(cfg.connector)
    return (lambda **kw: s(cfg, **kw)), (lambda **kw: r(cfg, **kw))


def make_sender(cfg: TransferConfig, **kwargs: Any) -> KVSender:
    return _factories(cfg.connector)[0](cfg, **kwargs)


def make_receiver(cfg: TransferConfig, **kwargs: Any) -> KVReceiver:
    return _factories(cfg.connector)[1](cfg, **kwargs)
