"""Connectors by name: ``make_sender(cfg)`` / ``make_receiver(cfg)`` use ``cfg.connector``.

``CONNECTORS`` is the one list of transports: TransferConfig, the serving config's
``transfer.connector`` choices and ``--help`` read it. A connector's factories are named
by ``"module:function"`` references, imported on first use, so importing ``kv_transfer``
never imports Ray (only the "ray" connector does). A new transport is its module plus one
``register_connector`` call. Extra keyword arguments go to the connector's factory:

  inproc  sender: clock, name                  receiver: name
  tcp     sender: clock, name                  receiver: (none; bind from cfg)
  nixl    sender: clock, name, sender_id       receiver: (none; bind from cfg)
  ray     sender: resolver(dest) -> actor      receiver: endpoint (actor name)
  torchdist sender: clock, name, sender_id     receiver: (none; bind from cfg)

``worker_kwargs(role, worker_id, actor_name)`` gives the kwargs a pool worker passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from engine.registry import Registry, load_ref

if TYPE_CHECKING:
    from kv_transfer.base import KVReceiver, KVSender

SenderFactory = Callable[..., "KVSender"]
ReceiverFactory = Callable[..., "KVReceiver"]
WorkerKwargs = Callable[[str, str, str], dict[str, Any]]


class ConnectorConfig(Protocol):
    """The part of kv_transfer.config.TransferConfig the registry reads."""

    connector: str


def _no_kwargs(role: str, worker_id: str, actor_name: str) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Connector:
    """A transport: factories called as ``f(cfg, **kwargs)`` (or references to them)."""

    sender: SenderFactory | str
    receiver: ReceiverFactory | str
    requires_secret: bool = False  # TransferConfig.secret must hold >= 16 bytes
    worker_kwargs: WorkerKwargs = _no_kwargs  # (role, worker_id, actor_name) -> kwargs


CONNECTORS: Registry[Connector] = Registry("connector")


def register_connector(name: str, sender: SenderFactory | str, receiver: ReceiverFactory | str,
                       *, help: str = "", requires_secret: bool = False,
                       worker_kwargs: WorkerKwargs = _no_kwargs) -> Connector:
    """Add (or replace) a connector; factories are called as ``f(cfg, **kwargs)``."""
    entry = Connector(sender, receiver, requires_secret, worker_kwargs)
    return CONNECTORS.register(name, entry, help=help, replace=True)


def connector_names() -> list[str]:
    return sorted(CONNECTORS)


def make_connector(cfg: ConnectorConfig) -> tuple[SenderFactory, ReceiverFactory]:
    """(sender factory, receiver factory) of ``cfg.connector``; call them with kwargs only."""
    c = CONNECTORS.get(cfg.connector)
    s, r = load_ref(c.sender), load_ref(c.receiver)
    return (lambda **kw: s(cfg, **kw)), (lambda **kw: r(cfg, **kw))


def make_sender(cfg: ConnectorConfig, **kwargs: Any) -> KVSender:
    return load_ref(CONNECTORS.get(cfg.connector).sender)(cfg, **kwargs)


def make_receiver(cfg: ConnectorConfig, **kwargs: Any) -> KVReceiver:
    return load_ref(CONNECTORS.get(cfg.connector).receiver)(cfg, **kwargs)


register_connector(
    "tcp", "kv_transfer.tcp_connector:make_tcp_sender", "kv_transfer.tcp_connector:make_tcp_receiver",
    help="HMAC-authenticated sockets", requires_secret=True,
    worker_kwargs=lambda role, wid, actor: {"name": wid} if role == "prefill" else {})
register_connector(
    "nixl", "kv_transfer.nixl_connector:make_nixl_sender",
    "kv_transfer.nixl_connector:make_nixl_receiver",
    help="NIXL one-sided writes (UCX)",
    requires_secret=True,
    worker_kwargs=lambda role, wid, actor: {"name": wid} if role == "prefill" else {})
register_connector(
    "ray", "kv_transfer.ray_connector:make_ray_sender", "kv_transfer.ray_connector:make_ray_receiver",
    help="Ray object store",
    worker_kwargs=lambda role, wid, actor: {"endpoint": actor} if role == "decode" else {})
register_connector(
    "torchdist", "kv_transfer.torchdist_connector:make_torchdist_sender",
    "kv_transfer.torchdist_connector:make_torchdist_receiver",
    help="torch.distributed send/recv")
register_connector(
    "inproc", "kv_transfer.inproc:make_inproc_sender", "kv_transfer.inproc:make_inproc_receiver",
    help="one process, for tests", worker_kwargs=lambda role, wid, actor: {"name": wid})
