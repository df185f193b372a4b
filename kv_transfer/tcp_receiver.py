"""TCP receiver: listener thread + per-connection reader and ack-writer threads.

A connection is served only after the HMAC handshake (``tcp_auth``); a peer that fails
it is disconnected and none of its bytes is ever parsed as a KV frame. Before it, a
connection costs little and not for long: at most ``max_pending_connections`` are in
their handshake at once (the listener accepts no more until one ends; the rest wait in
the kernel's backlog), each must finish within ``handshake_timeout_s`` in total, and each
has a 1 KiB read buffer; the socket buffer size, the 256 KiB read buffer, the payload
pool and the ack writer come only after authentication. The reader receives payloads
straight into pooled tensors and hands frames to the inbox; the writer batches the
owner's acks and sends heartbeats, so the sender can detect a dead or hung receiver
within ``failure_timeout_s``.
"""

from __future__ import annotations

import logging
import socket
import threading

from kv_transfer.ack_writer import AckWriter
from kv_transfer.buffers import BufferPool
from kv_transfer.config import TransferConfig
from kv_transfer.receiver import InboxReceiver, RxLink
from kv_transfer.tcp_auth import AuthError, DeadlineSocket, handshake_reader, server_handshake
from kv_transfer.wire import MAX_HEADER_BYTES, Ack, WireError

log = logging.getLogger(__name__)
_READ_BUFFER_BYTES = 256 << 10  # an authenticated link's read buffer


class TcpRxLink(RxLink):
    def __init__(self, sock: socket.socket, name: str, heartbeat_s: float, *,
                 start: bool = True) -> None:
        self.name = name
        self._sock = sock
        # a failed ack write closes the link, which wakes the reader too; not started:
        # the caller still writes its own setup messages first (``acks.start()`` after)
        self.acks = AckWriter(name, heartbeat_s, sock.sendall, errors=(OSError,),
                              on_error=self.close)
        if start:
            self.acks.start()

    def send_acks(self, acks: list[Ack]) -> None:
        self.acks.send(acks)

    def close(self) -> None:
        self.acks.stop(flush=False)  # the connection goes: nothing more is sent
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader
        except OSError:
            pass


class TcpReceiver(InboxReceiver):
    def __init__(self, cfg: TransferConfig) -> None:
        super().__init__(cfg)
        self._listener = socket.create_server((cfg.bind_host, cfg.tcp_port), backlog=64)
        self._listener.settimeout(0.5)  # accept() wakes up to notice close()
        self._host, self._port = self._listener.getsockname()[:2]
        self._links: set[TcpRxLink] = set()
        self._threads: list[threading.Thread] = []
        self._counters["auth_failures"] = 0
        self._pending = 0  # accepted connections still in their handshake
        self._pending_peak = 0
        self._slot_free = threading.Condition(self._lock)
        self._pool = BufferPool(max_idle_bytes=min(cfg.credit_window_bytes, 256 << 20))
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"kv-rx-accept:{self._port}")
        self._acceptor.start()

    @property
    def endpoint(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"tcp://{host}:{self._port}"

    def _accept_loop(self) -> None:
        while not self._closed:
            with self._lock:  # a free handshake slot first: until then peers wait in the backlog
                while self._pending >= self.cfg.max_pending_connections and not self._closed:
                    self._slot_free.wait(0.5)
            try:
                conn, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # listener closed
            t = threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                                 name=f"kv-rx-conn:{addr}")
            with self._lock:
                self._pending += 1
                self._pending_peak = max(self._pending_peak, self._pending)
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _authenticate(self, conn: socket.socket, addr: tuple):
        """(peer id, reader) once the peer proved it knows the secret, else None (and the
        connection is closed). Either way its handshake slot is free on return."""
        me = threading.current_thread()
        try:
            timed = DeadlineSocket(conn, self.cfg.handshake_timeout_s)
            reader = handshake_reader(timed)
            peer = server_handshake(timed, reader, self.cfg.secret)
            me.name = f"kv-rx-link:{peer}@{addr}"
            return peer, reader
        except (AuthError, OSError) as e:  # OSError includes the deadline's TimeoutError
            with self._lock:
                self._counters["auth_failures"] += 1
            log.warning("kv receiver %s: rejected connection from %s: %s", self.endpoint, addr, e)
            conn.close()
            me.name = f"kv-rx-rejected:{addr}"
            return None
        finally:
            with self._lock:
                self._pending -= 1
                self._slot_free.notify()

    def _serve(self, conn: socket.socket, addr: tuple) -> None:
        cfg = self.cfg
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        authed = self._authenticate(conn, addr)
        if authed is None:
            return
        peer, reader = authed
        conn.settimeout(cfg.failure_timeout_s)
        if cfg.socket_buffer_bytes:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, cfg.socket_buffer_bytes)
        # only now: no big buffers and no pooled memory for strangers
        reader.rebind(conn.recv_into, buffer_bytes=_READ_BUFFER_BYTES)
        reader.max_frame_bytes = cfg.max_frame_bytes
        reader.max_header_bytes = MAX_HEADER_BYTES
        reader.set_alloc(self._pool.get)
        link = self._open_link(conn, f"{peer}@{addr[0]}:{addr[1]}", reader)
        if link is None:
            conn.close()
            return
        with self._lock:
            if self._closed:
                link.close()
            self._links.add(link)
        reason = "sender closed the connection"
        try:
            while True:
                try:
                    msg = reader.read()
                except TimeoutError:
                    # at a frame boundary with nothing incomplete, silence is fine
                    if reader.in_frame or self._silence_fails(link):
                        raise
                    continue
                if msg is None:
                    break
                if msg.kind == "kv":
                    self._accept(link, msg.header, msg.payload, msg.digest)
                elif msg.kind != "hb":
                    raise WireError(f"unexpected message {msg.kind!r} from sender")
        except TimeoutError:
            reason = f"sender silent for {cfg.failure_timeout_s:g}s"
        except (OSError, WireError) as e:
            reason = "receiver closed" if self._closed else f"{type(e).__name__}: {e}"
        finally:
            link.close()
            link.acks.join(timeout=5.0)
            conn.close()
            with self._lock:
                self._links.discard(link)
            self._link_closed(link, reason)
            log.info("kv receiver %s: link %s closed: %s", self.endpoint, link.name, reason)

    def stats(self) -> dict:
        out = super().stats()
        out["buffers_reused"], out["buffers_allocated"] = self._pool.reused, self._pool.allocated
        with self._lock:
            out["pending_handshakes"], out["pending_handshakes_peak"] = (
                self._pending, self._pending_peak)
        return out

    def _open_link(self, conn: socket.socket, name: str, reader) -> TcpRxLink | None:
        """The link of an authenticated connection (None: refused, the connection closes);
        a subclass may first exchange its own setup messages on ``conn``."""
        return TcpRxLink(conn, name, self.cfg.failure_timeout_s / 3)

    def _silence_fails(self, link: RxLink) -> bool:
        """Whether ``failure_timeout_s`` of silence on ``link``'s connection fails it."""
        return self._has_incomplete(link)

    def _has_incomplete(self, link: RxLink) -> bool:
        with self._lock:
            return any(st.on_link(link) for st in self._requests.values())

    def close(self) -> None:
        self._close_inbox()
        with self._lock:
            self._slot_free.notify_all()
        try:  # shutdown wakes a thread blocked in accept() at once (close alone does not)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            links, threads = list(self._links), list(self._threads)
        for link in links:
            link.close()
        self._acceptor.join(timeout=2.0)
        for t in threads:
            t.join(timeout=2.0)
