"""Link emulation arithmetic (bench/studies/link.py): ratio <-> rate, burst, stretched spans."""

from __future__ import annotations

import pytest

from bench.studies.link import (
    LinkEmulation,
    Reference,
    burst_mb,
    emulate_link_spans,
    link_gbps_for_ratio,
    ratio_for_link,
    transfer_seconds,
)
from bench.trace import link_utilization, transfer_overlap
from cluster.config.serve import ServeConfig
from engine.tracing import TraceEvent
from kv_transfer.emulated_link import EmulatedLink
from kv_transfer.pacing import ManualClock

KIB = 1024
LINK = "link:prefill-0->decode-0"
# tiny preset: 2 layers x 2 (K, V) x 2 kv heads x 16 dims x 4 bytes = 512 B per token
REF = Reference(prompt_tokens=512, prefill_s=0.1, decode_step_s=0.005, kv_bytes_per_token=512)


def test_rate_for_a_ratio_makes_the_transfer_that_share_of_the_prefill() -> None:
    kv = 512 * 512  # 256 KiB
    gbps = link_gbps_for_ratio(kv, 0.1, 0.15)
    assert gbps == pytest.approx(kv * 8 / 0.015 / 1e9)  # 15 ms for 256 KiB: ~0.14 Gbit/s
    assert transfer_seconds(kv, gbps) == pytest.approx(0.015)
    assert ratio_for_link(kv, 0.1, gbps) == pytest.approx(0.15)
    assert ratio_for_link(kv, 0.1, 2 * gbps) == pytest.approx(0.075)  # twice as fast a link
    with pytest.raises(ValueError):
        link_gbps_for_ratio(kv, 0.0, 0.15)
    with pytest.raises(ValueError):
        transfer_seconds(kv, 0.0)


def test_emulation_from_ratio_or_rate_records_both_and_one_block_of_burst() -> None:
    a = LinkEmulation.from_ratio(REF, 0.15, block_size=16)
    assert REF.kv_bytes == 256 * KIB
    assert a.reference_transfer_s == pytest.approx(0.015)
    assert a.burst_mb == burst_mb(512, 16) == pytest.approx(8 * KIB / (1 << 20))
    b = LinkEmulation.from_gbps(REF, a.link_gbps, block_size=16)
    assert b.transfer_compute_ratio == pytest.approx(0.15) and b.source == "link-gbps"
    d = a.to_dict()
    assert d["transfer_compute_ratio"] == 0.15 and d["reference"]["prefill_s"] == 0.1
    cfg = ServeConfig().with_values(a.config_values())  # valid config keys and values
    assert cfg.transfer.link_gbps == a.link_gbps
    assert int(cfg.transfer.burst_mb * (1 << 20)) == 8 * KIB
    assert REF.prefill_estimate_s(1024) == pytest.approx(0.2)


def test_the_emulated_link_moves_the_reference_prompt_in_the_reference_transfer_time() -> None:
    """Frames of one 64-token chunk each (32 KiB) over the emulated link the launcher
    builds (kv_transfer/emulated_link.py): back to back on the wire, so the whole
    prompt's KV takes the reference transfer time whatever the send policy's pacer."""
    emu = LinkEmulation.from_ratio(REF, 0.15, block_size=16)
    rate = emu.link_gbps * 1e9 / 8
    clock = ManualClock()
    link = EmulatedLink(rate, 0.0, _NoEvents(), clock=clock, sleep=clock.advance)
    try:
        for _ in range(8):  # 256 KiB: the reference prompt
            link.wire_schedule(32 * KIB, clock())
            clock.advance(link.wire_free_at - clock())
        assert clock() == pytest.approx(emu.reference_transfer_s, rel=1e-6)
    finally:
        link.close()
        link.release()


class _NoEvents:
    def on_acks(self, acks) -> None: ...

    def on_failure(self, reason: str) -> None: ...

    def busy(self) -> tuple[int, int]:
        return (0, 0)


def send(start: float, end: float, nbytes: int, rid: str = "r") -> TraceEvent:
    return TraceEvent(rid, "kv_send", LINK, start, end, bytes=nbytes)


def test_stretched_sends_last_their_bytes_time_and_queue_behind_each_other() -> None:
    gbps = 8e-3  # 1 MB/s: 1000 bytes take 1 ms
    chunk = TraceEvent("r", "prefill_chunk", "prefill-0", 0.0, 0.010)
    events = [chunk, send(0.002, 0.0021, 1000), send(0.002, 0.0021, 1000),
              send(0.020, 0.0201, 3000)]
    out = emulate_link_spans(events, gbps)
    assert out[0] is chunk
    spans = [(e.start, e.end) for e in out[1:]]
    assert spans == [pytest.approx((0.002, 0.003)), pytest.approx((0.003, 0.004)),
                     pytest.approx((0.020, 0.023))]
    # 2 of the 5 ms of transfer overlap the prefill; the link is busy 5 of 23 ms
    assert transfer_overlap(out)["r"] == pytest.approx(0.4)
    assert link_utilization(out)[LINK] == pytest.approx(5 / 23)
    assert transfer_overlap(events)["r"] == pytest.approx(0.5)  # unstretched: misleading
