"""Ray receiver links, message by message (no Ray runtime: ``deliver`` is what the actor's
``kv_deliver`` runs): a reconnected sender's old "bye", run after the first frames of its
new link (the actor runs several calls at once), closes only the old link."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ray")

from kv_transfer import KVChunk, TransferConfig  # noqa: E402
from kv_transfer.ray_connector import RayReceiver  # noqa: E402
from kv_transfer.wire import (  # noqa: E402
    Ack,
    AckStatus,
    Piece,
    header_for,  # noqa: E402
)


def _kv(sender: str, link: int, rid: str, seq: int, tx: int, final: bool = False):
    payload = torch.full((1, 2, 4, 1, 2), float(seq))
    chunk = KVChunk(rid, seq, seq * 4, seq * 4 + 4, payload, is_final=final,
                    first_token=3 if final else None)
    header = header_for(Piece(chunk, 0, 1, tx=tx)).to_wire()
    msg = {"k": "kv", "h": header, "sender": sender, "link": link}
    return msg, payload.reshape(-1).view(torch.uint8).numpy()


def _bye(sender: str, link: int) -> dict:
    return {"k": "bye", "sender": sender, "link": link}


def test_an_old_links_bye_after_the_new_links_first_frames_closes_only_the_old_link():
    rx = RayReceiver(TransferConfig(connector="ray"), endpoint="decode-0")
    rx.deliver(*_kv("s", 1, "old", 0, tx=1))  # link 1 fails on the sender mid-request
    rx.deliver(*_kv("s", 2, "new", 0, tx=2))  # the sender reconnects: link 2, same id
    rx.deliver(_bye("s", 1))  # link 1's bye runs only now
    rx.deliver(*_kv("s", 1, "old", 1, tx=3))  # and a late call of link 1 after it
    acks = [Ack(*a) for a in rx.deliver(*_kv("s", 2, "new", 1, tx=4, final=True))]
    ev = rx.poll()
    assert ev.failed == [("old", "link dropped before final chunk: sender closed")]
    assert ev.completed == ["new"]
    assert sorted((c.request_id, c.seq_no) for c in ev.chunks) == [("new", 0), ("new", 1)]
    for c in ev.chunks:
        rx.release(c)
    acks += [Ack(*a) for a in rx.deliver({"k": "poll", "sender": "s", "link": 2})]
    assert sorted((a.request_id, a.tx, a.status) for a in acks) == [
        ("new", 2, AckStatus.OK), ("new", 4, AckStatus.OK)]
    st = rx.stats()
    assert st["active_requests"] == 0 and st["inflight_bytes"] == 0 and st["link_drops"] == 1
    assert st["frames_discarded"] == 1  # the late frame of the closed link
    rx.close()
