"""NIXL connector: KV payloads written one-sided into the receiver's registered staging
memory (UCX underneath); control over the tcp connector's authenticated connection.

    sender (prefill)                                    receiver (decode)
    TCP connect + HMAC handshake (tcp_auth) ---------->
    {"k": "nixl_hello", agent}                -------->  registers a staging region for
                                              <--------  this link; {"k": "nixl_grant",
    loads the receiver's agent metadata                  md, agent, addr, len, tok}
    per batch (link thread): headers and
      checksums, free extents; then (the link's
      writer thread, overlapping the next batch's
      checksums) one NIXL WRITE of the payloads ======>  the payloads land in the region
      there, notification = msgpack                      poller: notification -> strict
      {tok, f: [[offset, frame header], ...]}            header check, bounds check,
                                                         checksum -> inbox
    extent free again                         <--------  owner copies, ``release`` -> ack
                                                         (the release is the credit)

Only an authenticated peer ever sees the receiver's agent metadata, so only it can
address the region; NIXL itself trusts its fabric (any process that has an agent's
metadata can write what that agent registered), see docs/design-nixl.md. Everything above
the transport is the shared sender core (``sender.ThreadedSender``: send queue, pacer,
credit window, emulated link) and receiver core (``receiver.InboxReceiver``: validation,
dedup, completion, head ranges), as for tcp.

Faults: the receiver acks a frame only after its write's notification arrived (the write
completed), and the sender gives an extent back only on that ack, so an aborted
request's extents are never rewritten while its write may still land. A dead link's
region is never reused: the receiver drops it ``failure_timeout_s`` after the link ended
(a prefill that died leaves nothing reserved), the sender forgets it at once. Each write
batch has a lease (``failure_timeout_s``): not done by then, or failed, fails the link and
its requests only. Peer death is told by the control connection (EOF, heartbeats), not
by UCX (``ucx_error_handling_mode: none`` for its shared-memory transports, the default;
``TransferConfig.nixl_ucx_error_handling = "peer"`` for UCX's own peer-failure checks).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

import msgpack
import torch

from kv_transfer.config import TransferConfig
from kv_transfer.nixl_memory import ALIGN, Extents, SourceRegistrations, align_up, new_agent
from kv_transfer.receiver import RxLink
from kv_transfer.sender import ThreadedSender
from kv_transfer.tcp_connector import TcpTransport
from kv_transfer.tcp_receiver import TcpReceiver, TcpRxLink
from kv_transfer.transport import LinkEvents
from kv_transfer.wire import Ack, FrameHeader, Piece, WireError, encode_control, header_for

log = logging.getLogger(__name__)
TOKEN_BYTES = 16
PIECES_PER_WRITE = 64  # frames per NIXL request (one notification carries their headers)
_NOTIF_LIMIT = 1 << 20  # bytes of one notification (64 headers need ~20 KiB)
_POLL_IDLE_S = (20e-6, 1e-3)  # the poller's sleep right after a notification, and at most

__all__ = ["NixlReceiver", "NixlSender", "NixlTransport", "make_nixl_receiver",
           "make_nixl_sender", "parse_nixl_endpoint"]


def parse_nixl_endpoint(dest: str) -> str:
    """``nixl://host:port`` -> the ``tcp://host:port`` of its control connection."""
    if not dest.startswith("nixl://"):
        raise ValueError(f"nixl dest must look like nixl://HOST:PORT, got {dest!r}")
    return "tcp://" + dest[len("nixl://"):]


class _SenderAgent:
    """One sender's NIXL agent (made on its first link), source registrations and the
    receivers' metadata it loaded (refcounted: a reconnect may overlap the old link)."""

    def __init__(self, cfg: TransferConfig) -> None:
        self._cfg = cfg
        self._lock = threading.Lock()
        self.agent: Any = None
        self.regs: SourceRegistrations | None = None
        self._remotes: dict[str, int] = {}
        self._closed = False
        self.leaked_handles: list[Any] = []  # writes that could not be released yet
        self.stranded: list[int] = []  # sources of failed writes: released at close

    def get(self) -> tuple[Any, SourceRegistrations]:
        with self._lock:
            if self._closed:
                raise ConnectionAbortedError("sender closed")
            if self.agent is None:
                self.agent = new_agent("pdkv-tx", self._cfg.nixl_ucx_error_handling)
                self.regs = SourceRegistrations(self.agent, self._cfg.credit_window_bytes)
            assert self.regs is not None
            return self.agent, self.regs

    def add_remote(self, md: bytes) -> str:
        agent, _ = self.get()
        with self._lock:
            name = agent.add_remote_agent(md)
            name = name.decode() if isinstance(name, bytes) else name
            self._remotes[name] = self._remotes.get(name, 0) + 1
            return name

    def drop_remote(self, name: str) -> None:
        with self._lock:
            n = self._remotes.get(name, 0) - 1
            if n > 0:
                self._remotes[name] = n
                return
            self._remotes.pop(name, None)
            if self.agent is not None and n == 0:
                try:
                    self.agent.remove_remote_agent(name)
                except Exception as e:  # already gone with its connection
                    log.debug("nixl: remove_remote_agent(%s): %s", name, e)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = self.regs.stats() if self.regs is not None else {}
            out["remote_agents"] = len(self._remotes)
            out["unreleased_writes"] = len(self.leaked_handles)
            out["stranded_sources"] = len(self.stranded)
            return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            regs, agent = self.regs, self.agent
        if agent is not None:
            for h in self.leaked_handles:
                try:
                    agent.release_xfer_handle(h)
                except Exception:
                    pass
            self.leaked_handles.clear()
        self.stranded.clear()
        if regs is not None:
            regs.close()


class NixlTransport(TcpTransport):
    """Sender side of one link: the tcp transport's authenticated control connection
    (acks, heartbeats) plus NIXL writes into the receiver's staging region."""

    def __init__(self, dest: str, events: LinkEvents, cfg: TransferConfig, sender_id: str,
                 shared: _SenderAgent) -> None:
        super().__init__(parse_nixl_endpoint(dest), events, cfg, sender_id)
        self._dest = dest
        self._shared = shared
        self._remote: str | None = None
        self._addr = 0
        self._token = b""
        self._extents: Extents | None = None
        self._slots_lock = threading.Lock()
        self._slots: dict[int, list[int]] = {}  # tx -> [offset, nbytes, acks still due]
        self.writes = 0
        # the writer thread and its one pending job (framed, not yet written)
        self._jobs_cond = threading.Condition()
        self._job: tuple | None = None
        self._error: BaseException | None = None
        self._writer: threading.Thread | None = None

    def _authenticated(self, sock: socket.socket, reader) -> None:
        agent, _ = self._shared.get()
        sock.sendall(encode_control({"k": "nixl_hello", "agent": agent.name}))
        msg = reader.read()
        if msg is None or msg.kind != "nixl_grant" or msg.control is None:
            raise WireError(f"expected a nixl_grant from {self._dest}, got "
                            f"{None if msg is None else msg.kind!r}")
        g = msg.control
        md, addr, size, tok, name = (g.get(k) for k in ("md", "addr", "len", "tok", "agent"))
        if not (isinstance(md, bytes) and type(addr) is int and addr > 0 and type(size) is int
                and size >= self._cfg.max_frame_bytes and isinstance(tok, bytes)
                and len(tok) == TOKEN_BYTES and isinstance(name, str)):
            raise WireError(f"malformed nixl_grant from {self._dest}")
        remote = self._shared.add_remote(md)
        self._remote = remote  # before the check: release() drops what was added
        if remote != name:
            raise WireError(f"nixl_grant names agent {name!r} but its metadata is {remote!r}")
        self._addr, self._token, self._extents = addr, tok, Extents(size)

    def _on_acks(self, acks: list[Ack]) -> None:
        ext = self._extents
        with self._slots_lock:
            for a in acks:
                s = self._slots.get(a.tx)
                if s is None:
                    continue
                s[2] -= 1  # every transmission of a tx gets one ack (a copy: DUPLICATE)
                if s[2] == 0:
                    del self._slots[a.tx]
                    if ext is not None and s[1]:
                        ext.free(s[0], s[1])
        super()._on_acks(acks)

    def transmit(self, pieces: list[Piece]) -> None:
        """Frame the batch (headers, checksums, extents) here and hand its writes to the
        link's writer thread, so the next batch's checksums overlap this one's write;
        waits while one write runs and another is ready (raises what failed the writer)."""
        for i in range(0, len(pieces), PIECES_PER_WRITE):
            self._hand_over(self._frame(pieces[i : i + PIECES_PER_WRITE]))

    def _hand_over(self, job: tuple) -> None:
        deadline = time.monotonic() + self._cfg.failure_timeout_s
        with self._jobs_cond:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                                name=f"kv-nixl-write->{self._dest}")
                self._writer.start()
            while self._job is not None and self._error is None and not self._closed:
                if not self._jobs_cond.wait(max(0.0, deadline - time.monotonic())):
                    self._error = TimeoutError(f"NIXL write to {self._dest} not done within "
                                               f"{self._cfg.failure_timeout_s:g}s (its lease)")
            if self._error is not None or self._closed:
                self._shared.stranded.extend(job[4])
                raise self._error or ConnectionAbortedError("link closed")
            self._job = job
            self._jobs_cond.notify_all()

    def _write_loop(self) -> None:
        agent, regs = self._shared.get()
        while True:
            with self._jobs_cond:
                while self._job is None and not self._closed:
                    self._jobs_cond.wait()
                if self._job is None:
                    return
                job = self._job
            local, remote, notif, zero, held = job
            try:
                if local:
                    self._post(agent, local, remote, notif)
                else:
                    agent.send_notif(self._remote, notif)
            except Exception as e:  # the write's sources stay registered: see _frame
                self._shared.stranded.extend(held)
                with self._jobs_cond:
                    self._error, self._job = e, None
                    self._jobs_cond.notify_all()
                if not self._closed:
                    self._events.on_failure(f"send to {self._dest} failed: "
                                            f"{type(e).__name__}: {e}")
                return
            for ptr in held:
                regs.release(ptr)
            with self._jobs_cond:
                self._job = None
                self._jobs_cond.notify_all()

    def _frame(self, pieces: list[Piece]) -> tuple:
        """(local descs, remote descs, notification, zero-byte only, held sources) of one
        NIXL request: the batch's payloads, their headers in the notification."""
        agent, regs = self._shared.get()
        ext, cfg = self._extents, self._cfg
        assert ext is not None and self._remote is not None
        frames: list[list] = []
        local: list[tuple[int, int, int]] = []
        remote: list[tuple[int, int, int]] = []
        held: list[int] = []
        try:
            for p in pieces:
                header = header_for(p, cfg.checksum_algo)
                src = p.chunk.payload
                if self.wire_tamper is not None:  # fault injection: bytes != checksum
                    bad = self.wire_tamper(p)
                    src = src if bad is None else bad.contiguous()
                n = header.payload_nbytes
                with self._slots_lock:  # one step: its ack must not free it in between
                    slot = self._slots.get(p.tx)
                    if slot is not None:  # a copy of a frame in flight: point at its bytes
                        slot[2] += 1
                if slot is not None:
                    off = slot[0]
                elif n == 0:
                    off = 0
                else:
                    off = ext.take(n, cfg.failure_timeout_s)
                    with self._slots_lock:
                        self._slots[p.tx] = [off, n, 1]
                    held.append(regs.acquire(src))
                    local.append((src.data_ptr(), n, 0))
                    remote.append((self._addr + off, n, 0))
                frames.append([off, header.to_wire()])
            notif = msgpack.packb({"tok": self._token, "f": frames}, use_bin_type=True)
        except BaseException:
            # sources of a failed batch stay registered (and alive) until the sender
            # closes (a write may still read them); the link fails: no extent is reused
            self._shared.stranded.extend(held)
            raise
        return local, remote, notif, not local, held

    def _post(self, agent: Any, local: list, remote: list, notif: bytes) -> None:
        h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"),
                                  agent.get_xfer_descs(remote, "DRAM"), self._remote, notif)
        done = False
        try:
            state = agent.transfer(h)
            deadline = time.monotonic() + self._cfg.failure_timeout_s
            spins = 0
            while state == "PROC":
                if self._closed:
                    raise ConnectionAbortedError("link closed during a write")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NIXL write to {self._dest} not done within "
                                       f"{self._cfg.failure_timeout_s:g}s (its lease)")
                spins += 1
                if spins > 64:  # progress is driven here: yield the GIL, then sleep a bit
                    time.sleep(0 if spins < 4096 else 1e-4)
                state = agent.check_xfer_state(h)
            if state != "DONE":
                raise ConnectionError(f"NIXL write to {self._dest} failed ({state})")
            done = True
            self.writes += 1
        finally:
            try:
                agent.release_xfer_handle(h)
            except Exception:  # still in flight (it cannot be cancelled): release at close
                if not done:
                    self._shared.leaked_handles.append(h)

    def close(self) -> None:
        super().close()
        if self._extents is not None:
            self._extents.close()
        with self._jobs_cond:
            self._jobs_cond.notify_all()

    def release(self) -> None:
        super().release()
        if self._writer is not None:  # a write in progress ends within its lease
            self._writer.join(timeout=self._cfg.failure_timeout_s + 1.0)
        with self._jobs_cond:
            if self._job is not None:  # framed but never written
                self._shared.stranded.extend(self._job[4])
                self._job = None
        if self._remote is not None:
            self._shared.drop_remote(self._remote)
            self._remote = None


class NixlSender(ThreadedSender):
    """The shared sender core over ``NixlTransport`` links, with the agent they share."""

    def __init__(self, cfg: TransferConfig, *, sender_id: str | None = None, **kwargs: Any) -> None:
        sid = sender_id or f"kv-tx-{uuid.uuid4().hex[:12]}"
        self._nixl = _SenderAgent(cfg)
        super().__init__(cfg, lambda dest, events: NixlTransport(dest, events, cfg, sid, self._nixl),
                         **kwargs)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["nixl"] = self._nixl.stats()
        return out

    def close(self) -> None:
        super().close()
        self._nixl.close()


class _NixlRxLink(TcpRxLink):
    def __init__(self, sock: socket.socket, name: str, heartbeat_s: float, region: torch.Tensor,
                 descs: Any, token: bytes, peer_agent: str) -> None:
        super().__init__(sock, name, heartbeat_s, start=False)
        self.region = region  # [bytes] uint8, registered
        self.descs = descs
        self.token = token
        self.peer_agent = peer_agent
        self.last_heard = time.monotonic()


class NixlReceiver(TcpReceiver):
    """Decode side: a staging region per sender link, a poller for write notifications."""

    def __init__(self, cfg: TransferConfig) -> None:
        # before the listener starts (TcpReceiver.__init__): a peer may connect at once
        self._agent = new_agent("pdkv-rx", cfg.nixl_ucx_error_handling)
        self._by_token: dict[bytes, _NixlRxLink] = {}
        self._retired: list[tuple[float, _NixlRxLink]] = []  # (drop at, link): quarantine
        self._region_bytes = align_up(cfg.credit_window_bytes + cfg.max_frame_bytes)
        super().__init__(cfg)
        for k in ("staging_regions_made", "notifications", "stale_notifications",
                  "bad_notifications"):
            self._counters[k] = 0
        self._poller = threading.Thread(target=self._poll_loop, daemon=True,
                                        name=f"kv-rx-nixl:{self._port}")
        self._poller.start()

    @property
    def endpoint(self) -> str:
        return "nixl://" + super().endpoint[len("tcp://"):]

    # ---- control connection ----
    def _open_link(self, conn: socket.socket, name: str, reader) -> _NixlRxLink | None:
        try:
            msg = reader.read()
            agent = msg.control.get("agent") if msg is not None and msg.kind == "nixl_hello" else None
            if not isinstance(agent, str) or not agent:
                raise WireError("expected nixl_hello with the sender's agent name")
            region = torch.empty(self._region_bytes, dtype=torch.uint8)
            descs = self._agent.register_memory(region)
        except Exception as e:  # a bad hello, a broken connection, a registration refused
            log.warning("kv receiver %s: nixl setup with %s failed: %s", self.endpoint, name, e)
            return None
        token = os.urandom(TOKEN_BYTES)
        link = _NixlRxLink(conn, name, self.cfg.failure_timeout_s / 3, region, descs, token,
                           agent)
        with self._lock:  # known before the grant: the first write may follow it at once
            self._by_token[token] = link
            self._counters["staging_regions_made"] += 1
        try:
            md = self._agent.get_partial_agent_metadata(descs, True)
            conn.sendall(encode_control({
                "k": "nixl_grant", "md": md, "agent": self._agent.name,
                "addr": region.data_ptr(), "len": region.numel(), "tok": token}))
        except OSError as e:
            log.warning("kv receiver %s: nixl grant to %s failed: %s", self.endpoint, name, e)
            with self._lock:
                self._by_token.pop(token, None)
            self._release_region(link)
            return None
        link.acks.start()  # only now: its heartbeats must not interleave with the grant
        return link

    def _silence_fails(self, link: RxLink) -> bool:
        # payloads do not come over the control connection: notifications count as heard
        heard = getattr(link, "last_heard", 0.0)
        quiet = time.monotonic() - heard >= self.cfg.failure_timeout_s
        return quiet and self._has_incomplete(link)

    def _link_closed(self, link: RxLink, reason: str) -> None:
        super()._link_closed(link, reason)
        if isinstance(link, _NixlRxLink):
            with self._lock:
                self._by_token.pop(link.token, None)
                # a write already posted may still land: the region stays registered and
                # unused for one failure timeout, then goes (its views keep the memory)
                self._retired.append((time.monotonic() + self.cfg.failure_timeout_s, link))

    # ---- notifications ----
    def _poll_loop(self) -> None:
        idle = _POLL_IDLE_S[0]
        while not self._closed:
            try:
                notifs = self._agent.get_new_notifs()
            except Exception as e:  # the agent is being torn down
                if not self._closed:
                    log.error("kv receiver %s: nixl notifications failed: %s", self.endpoint, e)
                return
            got = False
            for agent, msgs in notifs.items():
                for m in msgs:
                    got = True
                    self._on_notif(agent.decode() if isinstance(agent, bytes) else agent, m)
            self._drop_retired()
            if got:
                idle = _POLL_IDLE_S[0]
            else:
                time.sleep(idle)
                idle = min(idle * 2, _POLL_IDLE_S[1])

    def _on_notif(self, agent: str, raw: bytes) -> None:
        try:
            if len(raw) > _NOTIF_LIMIT:
                raise WireError(f"notification of {len(raw)} bytes")
            msg = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=64,
                                  max_str_len=4096, max_array_len=PIECES_PER_WRITE + 1,
                                  max_map_len=64)
            if not isinstance(msg, dict) or not isinstance(msg.get("tok"), bytes):
                raise WireError("notification without a link token")
        except (WireError, ValueError, msgpack.ExtraData, msgpack.FormatError,
                msgpack.StackError) as e:
            with self._lock:
                self._counters["bad_notifications"] += 1
            log.warning("kv receiver %s: bad notification from agent %s: %s", self.endpoint, agent, e)
            return
        with self._lock:
            link = self._by_token.get(msg["tok"])
            if link is None or link.peer_agent != agent:
                self._counters["stale_notifications"] += 1  # a link that ended: dropped
                return
            self._counters["notifications"] += 1
            link.last_heard = time.monotonic()
        try:
            frames = self._frames(link, msg.get("f"))
        except WireError as e:  # an authenticated peer broke the protocol: end its link
            log.warning("kv receiver %s: link %s: %s", self.endpoint, link.name, e)
            link.close()
            return
        for header, payload in frames:
            self._accept(link, header, payload)

    def _frames(self, link: _NixlRxLink, items: Any) -> list[tuple[FrameHeader, torch.Tensor]]:
        """Strictly checked (header, payload view in the region) of a notification."""
        if not isinstance(items, list) or not items:
            raise WireError("notification without frames")
        out = []
        size = link.region.numel()
        for it in items:
            if not (isinstance(it, list) and len(it) == 2 and type(it[0]) is int
                    and isinstance(it[1], dict) and it[1].get("k") == "kv"):
                raise WireError(f"malformed frame entry in a notification: {it!r:.200}")
            off, h = it[0], FrameHeader.from_wire(it[1])
            n = h.payload_nbytes
            if n > self.cfg.max_frame_bytes:
                raise WireError(f"frame payload of {n} bytes exceeds max_frame_bytes")
            if off < 0 or off % ALIGN or off + n > size:
                raise WireError(f"frame at [{off}, {off + n}) is outside the staging region")
            out.append((h, h.tensor_from(link.region[off : off + n])))
        return out

    def _drop_retired(self) -> None:
        if not self._retired:
            return
        now = time.monotonic()
        with self._lock:
            due = [lk for t, lk in self._retired if t <= now]
            self._retired = [(t, lk) for t, lk in self._retired if t > now]
        for lk in due:
            self._release_region(lk)

    def _release_region(self, link: _NixlRxLink) -> None:
        if link.descs is None:
            return
        try:
            self._agent.deregister_memory(link.descs)
        except Exception as e:
            log.debug("nixl: deregister: %s", e)
        link.descs = None
        link.region = torch.empty(0, dtype=torch.uint8)  # chunks not yet released keep theirs

    def stats(self) -> dict:
        out = super().stats()
        with self._lock:
            live = list(self._by_token.values())
            retired = [lk for _, lk in self._retired]
        out["staging_regions"] = len(live) + len(retired)  # registered now
        out["staging_regions_retired"] = len(retired)
        out["staging_bytes"] = sum(lk.region.numel() for lk in (*live, *retired))
        return out

    def close(self) -> None:
        super().close()
        self._poller.join(timeout=5.0)
        with self._lock:
            links = [*self._by_token.values(), *(lk for _, lk in self._retired)]
            self._by_token.clear()
            self._retired.clear()
        for lk in links:
            self._release_region(lk)


def make_nixl_sender(cfg: TransferConfig, **kwargs: Any) -> NixlSender:
    return NixlSender(cfg, **kwargs)


def make_nixl_receiver(cfg: TransferConfig, **kwargs: Any) -> NixlReceiver:
    return NixlReceiver(cfg, **kwargs)

