"""Ray connector on a local Ray: object-store delivery into an actor, credits, dead actors."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from kv_transfer import KVChunk, TransferConfig, make_sender  # noqa: E402
from kv_transfer.ray_connector import KVDeliverMixin, RayReceiver  # noqa: E402
from kv_transfer.testing import PagedKV, make_chunks, random_bounds  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHAPE = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 32}


RX_CFG = TransferConfig(connector="ray", failure_timeout_s=2.0)  # what the receivers use


@pytest.fixture(scope="module")
def actors(ray_session):
    """Two receiving actors on the session's Ray (which this module must not shut down)."""
    shared = DecodeStub.options(name="decode-shared").remote(RX_CFG, "decode-shared", 32)
    doomed = DecodeStub.options(name="decode-dies").remote(RX_CFG, "decode-dies", 16)
    ray.get([shared.allocate.remote({}), doomed.allocate.remote({})])
    yield shared, doomed
    for actor in (shared, doomed):
        ray.kill(actor)


@ray.remote(num_cpus=0, max_concurrency=4)
class DecodeStub(KVDeliverMixin):
    """A decode worker reduced to its KV inbox: kv_deliver runs on Ray's threads while
    ``drain`` plays the worker loop (poll, copy into the paged cache, release)."""

    def __init__(self, cfg: TransferConfig, name: str, block_size: int) -> None:
        self.kv_receiver = RayReceiver(cfg, endpoint=name)
        self.cache = PagedKV(**SHAPE, block_size=block_size, num_blocks=4096 // block_size)
        self.held: list[KVChunk] = []

    def allocate(self, lens: dict[str, int]) -> None:
        for rid, n in lens.items():
            self.cache.allocate(rid, n)

    def drain(self, rids: list[str], timeout_s: float, release: bool = True) -> dict:
        done: set[str] = set()
        failed: dict[str, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(done) + len(failed) < len(rids) and time.monotonic() < deadline:
            ev = self.kv_receiver.poll()
            for c in ev.chunks:
                self.cache.import_chunk(c)
                if release:
                    self.kv_receiver.release(c)
                else:
                    self.held.append(c)
            done.update(ev.completed)
            failed.update(ev.failed)
            time.sleep(0.002)
        return {"done": sorted(done), "failed": failed}

    def release_held(self) -> int:
        n = len(self.held)
        for c in self.held:
            self.kv_receiver.release(c)
        self.held.clear()
        return n

    def export(self, rid: str, n: int) -> torch.Tensor:
        return self.cache.export(rid, 0, n)

    def receiver_stats(self) -> dict:
        return self.kv_receiver.stats()

    def fail_next_deliver(self) -> None:
        self._fail_next = True

    def kv_deliver(self, msg, payload=None):
        if getattr(self, "_fail_next", False) and msg.get("k") == "kv":
            self._fail_next = False
            raise RuntimeError("kv_deliver failed on purpose")
        return super().kv_deliver(msg, payload)


def _wait_sender(tx, rids, timeout_s=30.0) -> tuple[set[str], dict[str, str]]:
    finished: set[str] = set()
    failed: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(finished) + len(failed) < len(rids) and time.monotonic() < deadline:
        ev = tx.poll()
        finished.update(ev.finished)
        failed.update(ev.failed)
        time.sleep(0.005)
    return finished, failed


def test_round_trip_into_an_actor_across_block_sizes_is_byte_exact(actors):
    cfg = TransferConfig(connector="ray", max_frame_bytes=64 << 10, credit_window_bytes=256 << 10)
    src = PagedKV(**SHAPE, block_size=16, num_blocks=256)
    dst = actors[0]  # pages its cache with 32-token blocks
    tx = make_sender(cfg)
    rng = random.Random(3)
    try:
        lens = {f"r{i}": rng.randint(2, 300) for i in range(4)}
        ray.get(dst.allocate.remote(lens))
        drained = dst.drain.remote(list(lens), 60.0)
        for i, (rid, n) in enumerate(lens.items()):
            src.allocate(rid, n)
            src.fill_random(rid, n, seed=i)
            for c in make_chunks(src, rid, random_bounds(rng, n)):
                tx.send(c, dest="decode-shared")
        result = ray.get(drained)
        assert result == {"done": sorted(lens), "failed": {}}
        assert _wait_sender(tx, lens) == (set(lens), {})
        for rid, n in lens.items():
            assert torch.equal(ray.get(dst.export.remote(rid, n)), src.export(rid, 0, n)), rid
        link = tx.stats()["links"]["decode-shared"]
        assert link["peak_inflight_bytes"] <= cfg.credit_window_bytes and link["inflight_bytes"] == 0
    finally:
        tx.close()


def test_credits_come_back_only_when_the_owner_releases(actors):
    window = 128 << 10
    cfg = TransferConfig(connector="ray", max_frame_bytes=64 << 10, credit_window_bytes=window)
    dst = actors[0]
    tx = make_sender(cfg)
    try:
        ray.get(dst.allocate.remote({"credit": 256}))
        payload = torch.randn(4, 2, 32, 2, 32)  # 64 KiB: two frames per chunk, 512 KiB in all
        for i in range(8):
            tx.send(KVChunk("credit", i, 32 * i, 32 * (i + 1), payload, is_final=i == 7,
                            first_token=1 if i == 7 else None), dest="decode-shared")
        ray.get(dst.drain.remote(["credit"], 1.5, release=False))
        stats = tx.stats()["links"]["decode-shared"]
        assert stats["inflight_bytes"] <= window and stats["queued_bytes"] > 0
        assert stats["peak_inflight_bytes"] <= window
        released = 0
        deadline = time.monotonic() + 30
        while tx.poll().finished != ["credit"]:
            assert time.monotonic() < deadline, tx.stats()
            released += ray.get(dst.release_held.remote())
            ray.get(dst.drain.remote(["credit"], 0.05, release=False))
        assert released >= 8  # every frame came back through a release
        assert tx.stats()["links"]["decode-shared"]["peak_inflight_bytes"] <= window
    finally:
        tx.close()


def test_killed_receiving_actor_fails_its_requests_within_the_timeout(actors):
    cfg = TransferConfig(connector="ray", failure_timeout_s=2.0, send_policy="paced",
                         rate_bytes_per_s=2e6, burst_bytes=64 << 10)
    dst = actors[1]
    tx = make_sender(cfg)
    try:
        ray.get(dst.allocate.remote({"r": 100 * 16}))
        dst.drain.remote(["r"], 60.0)
        for i in range(100):
            tx.send(KVChunk("r", i, 16 * i, 16 * (i + 1), torch.randn(4, 2, 16, 2, 32),
                            is_final=i == 99, first_token=1 if i == 99 else None), dest="decode-dies")
        while tx.stats()["links"].get("decode-dies", {}).get("bytes_acked", 0) == 0:
            time.sleep(0.01)
        ray.kill(dst)
        t0 = time.monotonic()
        finished, failed = _wait_sender(tx, ["r"], timeout_s=20)
        assert "r" in failed and time.monotonic() - t0 <= cfg.failure_timeout_s + 2.0
        assert tx.stats()["queued_bytes"] == 0
    finally:
        tx.close()


def test_unknown_actor_fails_the_request(actors):
    tx = make_sender(TransferConfig(connector="ray"))
    try:
        tx.send(KVChunk("r", 0, 0, 1, torch.zeros(1, 2, 1, 1, 4), is_final=True, first_token=1),
                dest="no-such-actor")
        finished, failed = _wait_sender(tx, ["r"], timeout_s=20)
        assert "cannot reach" in failed["r"]
    finally:
        tx.close()


class _ByeHeldBack:
    """An actor handle whose "bye" calls wait in ``held`` until ``release``: the order a
    busy actor running several calls at once may execute them in."""

    def __init__(self, actor) -> None:
        self._actor = actor
        self.kv_deliver = self  # ``handle.kv_deliver.remote(...)``
        self.held: list[tuple[dict, object]] = []

    def remote(self, msg: dict, payload=None):
        if msg.get("k") == "bye":
            self.held.append((msg, payload))
            return None
        return self._actor.kv_deliver.remote(msg, payload)

    def release(self) -> None:
        for msg, payload in self.held:
            ray.get(self._actor.kv_deliver.remote(msg, payload))


def _wait_frames(actor, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ray.get(actor.receiver_stats.remote())["frames_received"] < n:
        assert time.monotonic() < deadline, "frames did not reach the actor"
        time.sleep(0.01)


def test_a_failed_links_late_bye_does_not_kill_the_reconnected_link(ray_session):
    actor = DecodeStub.options(name="decode-relink").remote(RX_CFG, "decode-relink", 16)
    proxy = _ByeHeldBack(actor)
    tx = make_sender(TransferConfig(connector="ray"), resolver=lambda dest: proxy)
    src = PagedKV(**SHAPE, block_size=16, num_blocks=64)
    lens = {"a": 64, "b": 64}
    try:
        ray.get(actor.allocate.remote(lens))
        for i, rid in enumerate(lens):
            src.allocate(rid, 64)
            src.fill_random(rid, 64, seed=i)
        a0, a1 = make_chunks(src, "a", [0, 32, 64])
        b0, b1 = make_chunks(src, "b", [0, 32, 64])
        tx.send(a0, dest="decode-relink")
        _wait_frames(actor, 1)
        ray.get(actor.fail_next_deliver.remote())
        tx.send(a1, dest="decode-relink")  # its kv_deliver raises: the link fails
        finished, failed = _wait_sender(tx, ["a"])
        assert "kv_deliver failed on purpose" in failed["a"] and len(proxy.held) == 1
        tx.send(b0, dest="decode-relink")  # a new link, same sender id
        _wait_frames(actor, 2)
        proxy.release()  # the old link's bye runs after the new link's first frame
        tx.send(b1, dest="decode-relink")
        result = ray.get(actor.drain.remote(["a", "b"], 30.0))
        assert result["done"] == ["b"] and list(result["failed"]) == ["a"], result
        assert _wait_sender(tx, ["b"]) == ({"b"}, {})
        assert torch.equal(ray.get(actor.export.remote("b", 64)), src.export("b", 0, 64))
        st = ray.get(actor.receiver_stats.remote())
        assert st["active_requests"] == 0 and st["inflight_bytes"] == 0
        assert tx.stats()["links"]["decode-relink"]["connects"] == 2
    finally:
        tx.close()
        ray.kill(actor)
