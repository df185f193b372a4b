"""torchdist connector faults: a receiver process killed or hung mid-stream, a transfer
cancelled on the receiver, and a peer that breaks the message format."""

from __future__ import annotations

import time

import torch
from torch.distributed import TCPStore

from kv_transfer import KVChunk, TransferConfig, make_receiver, make_sender
from kv_transfer.torchdist_link import DATA_TAG, LINKS_KEY, Channel, link_prefix, new_group, seconds
from tests.kv_peer import check_hung_then_killed, wait_failed


def _cfg(**kw) -> TransferConfig:
    kw.setdefault("failure_timeout_s", 1.0)
    return TransferConfig(connector="torchdist", **kw)


def _chunk(rid: str, seq: int, final: bool, tokens: int = 32) -> KVChunk:
    return KVChunk(rid, seq, seq * tokens, (seq + 1) * tokens, torch.randn(2, 2, tokens, 2, 16),
                   is_final=final, first_token=1 if final else None)


def test_receiver_process_hung_then_killed_mid_stream_is_detected_within_the_timeout():
    check_hung_then_killed(_cfg(send_policy="paced", rate_bytes_per_s=4e6,
                                burst_bytes=256 << 10), _chunk)


def test_a_transfer_cancelled_by_the_receiver_fails_on_the_sender_and_frees_everything():
    cfg = _cfg(send_policy="paced", rate_bytes_per_s=2e6, burst_bytes=64 << 10)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    try:
        for i in range(100):
            tx.send(_chunk("r", i, i == 99), dest=rx.endpoint)
        got = []
        while len(got) < 3:
            got += rx.poll().chunks
            time.sleep(0.005)
        rx.abort("r")  # e.g. the client went away: what the decode worker does
        why, _ = wait_failed(tx, "r", 10)
        assert "discarded" in why and "aborted by receiver" in why
        for c in got:
            rx.release(c)  # late releases of an aborted request are harmless
        deadline = time.monotonic() + 10
        while tx.stats()["inflight_bytes"] or tx.stats()["queued_bytes"]:
            assert time.monotonic() < deadline, tx.stats()
            time.sleep(0.01)
        r = rx.stats()
        assert r["inflight_bytes"] == 0 and r["active_requests"] == 0 and r["inbox_chunks"] == 0
        tx.send(_chunk("next", 0, True), dest=rx.endpoint)  # the link still serves
        deadline = time.monotonic() + 10
        while "next" not in tx.poll().finished:
            for c in rx.poll().chunks:
                rx.release(c)
            assert time.monotonic() < deadline
            time.sleep(0.005)
    finally:
        tx.close()
        rx.close()


def test_a_peer_announcing_an_oversized_message_loses_its_link_not_the_receiver():
    cfg = _cfg(max_frame_bytes=1 << 20, credit_window_bytes=1 << 20)
    rx = make_receiver(cfg)
    host, port = rx.endpoint[len("torchdist://"):].rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, timeout=seconds(5))
    n = store.add(LINKS_KEY, 1)
    store.set(link_prefix(n) + "hello", "mallory")
    chan = Channel(new_group(store, n, 0, 5.0), 0, 5.0)
    try:
        # sizes announce a 1 GiB payload: refused before anything is allocated
        chan.pg.send([torch.tensor([40, 1 << 30], dtype=torch.int64)], 1, DATA_TAG).wait()
        deadline = time.monotonic() + 10
        while rx.stats()["link_drops"] == 0:
            assert time.monotonic() < deadline, "the bad link was not dropped"
            time.sleep(0.01)
        assert rx.stats()["frames_received"] == 0
        ok_tx = make_sender(cfg)
        try:  # the receiver goes on serving other links
            ok_tx.send(_chunk("ok", 0, True), dest=rx.endpoint)
            deadline = time.monotonic() + 10
            while "ok" not in ok_tx.poll().finished:
                for c in rx.poll().chunks:
                    rx.release(c)
                assert time.monotonic() < deadline
                time.sleep(0.005)
        finally:
            ok_tx.close()
    finally:
        chan.abort()
        rx.close()
