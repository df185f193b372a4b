"""Listener: where a worker's control channel (runtime/channel.py) takes connections.

It listens on one port, authenticates each connecting front door with the cluster secret
(kv_transfer.tcp_auth, the KV links' HMAC handshake) in a thread of its own, so a silent
or wrong peer holds nothing but that thread for HANDSHAKE_TIMEOUT_S, and hands every
authenticated socket (blocking, TCP_NODELAY) to `on_link(sock, peer_name)`.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from kv_transfer.tcp_auth import AuthError, DeadlineSocket, handshake_reader, server_handshake

log = logging.getLogger(__name__)
HANDSHAKE_TIMEOUT_S = 10.0


class Listener:
    def __init__(self, name: str, secret: bytes, host: str,
                 on_link: Callable[[socket.socket, str], None]):
        if len(secret) < 16:
            raise ValueError("the channel needs a cluster secret of at least 16 bytes")
        self.secret = secret
        self._on_link = on_link
        self._sock = socket.create_server((host, 0))
        self.host, self.port = self._sock.getsockname()[:2]
        self._closed = False
        threading.Thread(target=self._accept, name=f"channel-accept:{name}",
                         daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(sock, addr), daemon=True).start()

    def _admit(self, sock: socket.socket, addr) -> None:
        try:
            dl = DeadlineSocket(sock, HANDSHAKE_TIMEOUT_S)
            peer = server_handshake(dl, handshake_reader(dl), self.secret)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (AuthError, OSError, TimeoutError) as e:
            log.warning("channel: refused %s: %s", addr, e)
            sock.close()
            return
        self._on_link(sock, f"{peer}@{addr[0]}:{addr[1]}")

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass
