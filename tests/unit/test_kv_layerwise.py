"""Layer-wise sends (``KVChunk.layers_ready``, issue 40): the final chunk's KV leaves group
by group of layers while its later layers are still being computed, on every connector
(the shared sender core), and arrives as pieces split by layer under the same contract."""

from __future__ import annotations

import dataclasses
import importlib.util
import threading
import time

import pytest
import torch

from kv_transfer import KVChunk, TransferConfig, make_receiver, make_sender
from kv_transfer.registry import CONNECTORS as REGISTRY

SECRET = b"layerwise-tests-secret-0123456789"
LAYERS, TOKENS, HEADS, DIM = 4, 32, 2, 16  # 8 KiB of KV per layer
HAS_NIXL = importlib.util.find_spec("nixl_cu12") is not None


def _cfg(connector: str, **kw) -> TransferConfig:
    if REGISTRY.get(connector).requires_secret:
        kw["secret"] = SECRET
    return TransferConfig(connector=connector, failure_timeout_s=5.0, **kw)


class Forward:
    """The prefill forward of one chunk, by layer: ``compute(n)`` writes layers up to
    ``n`` into the payload and lets ``wait_layers(n)`` return (``fail_at``: that group's
    computation fails)."""

    def __init__(self, payload: torch.Tensor, boundaries: tuple[int, ...],
                 fail_at: int | None = None) -> None:
        self.payload = payload
        self.boundaries = boundaries
        self.fail_at = fail_at
        self._done = {b: threading.Event() for b in boundaries}
        self.waited: list[int] = []

    def compute(self, n: int) -> None:
        lo = max([b for b in self.boundaries if b < n], default=0)
        self.payload[lo:n] = torch.arange(lo, n, dtype=self.payload.dtype).view(-1, 1, 1, 1, 1) + 1
        self._done[n].set()

    def wait_layers(self, n: int) -> None:
        assert self._done[n].wait(10.0), f"layers up to {n} never computed"
        self.waited.append(n)
        if n == self.fail_at:
            raise RuntimeError(f"forward failed at layer group {n}")


def _chunk(rid: str, seq: int, final: bool, fwd: Forward | None = None) -> KVChunk:
    p = fwd.payload if fwd else torch.randn(LAYERS, 2, TOKENS, HEADS, DIM)
    return KVChunk(rid, seq, seq * TOKENS, (seq + 1) * TOKENS, p, is_final=final,
                   first_token=9 if final else None, layers_ready=fwd)


def _poll(rx, got: list[KVChunk], events: dict[str, list]) -> None:
    ev = rx.poll()
    for c in ev.chunks:  # the owner copies, then releases (the buffer may be reused)
        got.append(dataclasses.replace(c, payload=c.payload.clone()))
        rx.release(c)
    events["completed"] += ev.completed
    events["failed"] += ev.failed


def _wait(cond, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached in time"
        time.sleep(0.005)


CONNECTORS = ["inproc", "tcp", pytest.param("nixl", marks=pytest.mark.skipif(
    not HAS_NIXL, reason="no nixl"))]


@pytest.mark.parametrize("connector", CONNECTORS)
def test_the_final_chunk_leaves_layer_group_by_group_while_later_layers_compute(connector):
    cfg = _cfg(connector)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    fwd = Forward(torch.zeros(LAYERS, 2, TOKENS, HEADS, DIM), (1, 2, 4))
    got: list[KVChunk] = []
    events: dict[str, list] = {"completed": [], "failed": []}
    try:
        first = _chunk("r", 0, False)
        tx.send(first, dest=rx.endpoint)
        tx.send(_chunk("r", 1, True, fwd), dest=rx.endpoint)
        for n, want_layers in ((1, {0}), (2, {0, 1}), (4, {0, 1, 2})):
            fwd.compute(n)
            # this group's frames arrive before the next group is computed
            def arrived(want=want_layers):
                _poll(rx, got, events)
                return {c.layer_start for c in got if c.seq_no == 1} >= want

            _wait(arrived, f"layers below {n}")
            assert events["completed"] == [] or n == 4
        _wait(lambda: _poll(rx, got, events) or events["completed"] == ["r"], "completion")
        assert fwd.waited == [1, 2, 4, 4]  # group by group, then the whole payload once
        final = sorted((c for c in got if c.seq_no == 1), key=lambda c: c.layer_start)
        assert [(c.layer_start, c.layer_end) for c in final] == [(0, 1), (1, 2), (2, 4)]
        assert [c.is_final for c in final] == [False, False, True] and final[-1].first_token == 9
        assert torch.equal(torch.cat([c.payload for c in final]), fwd.payload)
        assert torch.equal(next(c for c in got if c.seq_no == 0).payload, first.payload)
        _wait(lambda: "r" in tx.poll().finished, "finished on the sender")
        s, r = tx.stats(), rx.stats()
        assert s["inflight_bytes"] == 0 and s["queued_bytes"] == 0 and s["active_requests"] == 0
        assert r["inflight_bytes"] == 0 and r["active_requests"] == 0 and events["failed"] == []
    finally:
        tx.close()
        rx.close()


def test_a_layer_group_that_fails_fails_its_request_alone():
    cfg = _cfg("inproc")
    rx, tx = make_receiver(cfg), make_sender(cfg)
    fwd = Forward(torch.zeros(LAYERS, 2, TOKENS, HEADS, DIM), (1, 2, 3, 4), fail_at=3)
    got: list[KVChunk] = []
    events: dict[str, list] = {"completed": [], "failed": []}
    try:
        tx.send(_chunk("bad", 0, True, fwd), dest=rx.endpoint)
        tx.send(_chunk("good", 0, True), dest=rx.endpoint)
        for n in (1, 2, 3):
            fwd.compute(n)
        failed: dict[str, str] = {}
        _wait(lambda: failed.update(tx.poll().failed) or "bad" in failed, "bad failed")
        assert "forward failed at layer group 3" in failed["bad"]
        _wait(lambda: _poll(rx, got, events) or "good" in events["completed"], "good completes")
        assert {c.layer_start for c in got if c.request_id == "bad"} <= {0, 1}
        rx.abort("bad")  # the decode side drops the half-received request (the router's abort)
        s, r = tx.stats(), rx.stats()
        assert s["inflight_bytes"] == 0 and s["active_requests"] == 0 and r["active_requests"] == 0
        assert r["inflight_bytes"] == 0
    finally:
        tx.close()
        rx.close()


def test_a_layer_bigger_than_a_frame_waits_for_the_whole_chunk():
    # 128 KiB per layer against 64 KiB frames: token splits copy, so nothing leaves early
    cfg = _cfg("inproc", max_frame_bytes=64 << 10, credit_window_bytes=1 << 20)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    fwd = Forward(torch.zeros(LAYERS, 2, 512, HEADS, DIM), (1, 2, 4))
    got: list[KVChunk] = []
    events: dict[str, list] = {"completed": [], "failed": []}
    try:
        tx.send(KVChunk("r", 0, 0, 512, fwd.payload, is_final=True, first_token=1,
                        layers_ready=fwd), dest=rx.endpoint)
        fwd.compute(1)
        fwd.compute(2)
        time.sleep(0.2)
        _poll(rx, got, events)
        assert got == [] and fwd.waited == []
        fwd.compute(4)
        _wait(lambda: _poll(rx, got, events) or events["completed"] == ["r"], "completion")
        assert fwd.waited == [4] and len(got) > 4  # split by layer and token as usual
        assert tx.stats()["inflight_bytes"] == 0
    finally:
        tx.close()
        rx.close()


def test_layers_ready_boundaries_are_checked():
    p = torch.zeros(LAYERS, 2, 4, HEADS, DIM)
    for bad in ((), (2, 1, 4), (1, 3), (1, 4, 4)):
        with pytest.raises(ValueError, match="boundaries"):
            KVChunk("r", 0, 0, 4, p, layers_ready=Forward(p, bad))
