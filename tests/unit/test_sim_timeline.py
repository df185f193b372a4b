"""One request through a simulated 1P1D cluster with costs given by hand: every time the
client sees equals the arithmetic of the request's path (router -> decode reserve ->
prefill -> link -> decode worker's nap tick -> decode steps -> router -> client)."""

from __future__ import annotations

import math

import pytest

from bench.workload import WorkloadRequest
from engine.costs.loader import load_costs
from sim.adapters import ServeConfig
from sim.cluster import Simulation
from sim.options import SimOptions
from sim.synthetic import synthetic_calibration

PREFILL_S, DECODE_S, RPC_S, LINK_LAT_S, IDLE_S = 0.010, 0.005, 0.001, 0.0005, 0.002
PROMPT = 32
KV_BYTES = PROMPT * 2 * 2 * 2 * 16 * 4  # tiny shape: layers x K,V x kv heads x dim x fp32


def one_request_sim(stepping: str, reserve_with_add: bool = False, **transfer) -> Simulation:
    """The reserve-then-add path (pools.reserve_with_add off) unless asked."""
    cal = synthetic_calibration(prefill=lambda c, p: PREFILL_S, decode=lambda b, L: DECODE_S,
                                rpc_s=RPC_S, link_latency_s=LINK_LAT_S,
                                link_bytes_per_s=KV_BYTES / 0.001, idle_wait_s=IDLE_S)
    cfg = ServeConfig().with_values({
        "transfer.connector": "inproc", "cache.enable_prefix_caching": False,
        "cache.num_blocks": 256, "model.max_model_len": 2048,
        "pools.reserve_with_add": reserve_with_add,
        **{f"transfer.{k}": v for k, v in transfer.items()}})
    return Simulation(cfg, load_costs(cal), SimOptions(decode_stepping=stepping))


@pytest.mark.parametrize("stepping", ["fast", "exact"])
def test_with_the_reserve_sent_with_the_add_the_first_token_waits_for_the_prefill_alone(
        stepping: str) -> None:
    """Reserve and add leave the router together: the prefill task arrives at 1 ms (not
    after the reserve's round trip, at 3 ms), so every time is 2 ms earlier."""
    sim = one_request_sim(stepping, reserve_with_add=True)
    rec = sim.run([WorkloadRequest("r0", 0.0, list(range(1, PROMPT + 1)), max_tokens=4)]
                  ).records()[0]
    sim.check_quiescent()
    prefill_end = RPC_S + PREFILL_S
    tick = prefill_end + LINK_LAT_S + 0.001  # the KV is in; its reserve landed long ago
    assert rec.token_times == pytest.approx(
        (prefill_end + RPC_S, *(tick + k * DECODE_S + RPC_S for k in (1, 2, 3))), abs=1e-12)
    assert rec.ttft == pytest.approx(0.012, abs=1e-12)


@pytest.mark.parametrize("stepping", ["fast", "exact"])
def test_one_request_times_equal_the_arithmetic_of_its_path(stepping: str) -> None:
    sim = one_request_sim(stepping)
    req = WorkloadRequest("r0", 0.0, list(range(1, PROMPT + 1)), max_tokens=4)
    rec = sim.run([req]).records()[0]
    # reserve reaches decode at 1 ms, its answer the router at 2 ms; the prefill task
    # arrives at 3 ms and its one chunk runs 10 ms; the first token is at the router
    # (= client, client_s = 0) at 14 ms
    prefill_end = 3 * RPC_S + PREFILL_S
    first = prefill_end + RPC_S
    # the KV write holds the link 0.5 ms latency + 1 ms of bytes: in at 14.5 ms; the
    # decode worker naps (legs waiting on KV) but its KV doorbell wakes it: takes it then
    tick = prefill_end + LINK_LAT_S + 0.001
    assert tick == pytest.approx(0.0145)
    decode_tokens = [tick + k * DECODE_S + RPC_S for k in (1, 2, 3)]
    assert rec.success and rec.finish_reason == "length"
    assert rec.token_times == pytest.approx((first, *decode_tokens), abs=1e-12)
    assert rec.ttft == pytest.approx(0.014, abs=1e-12)
    assert rec.itls == pytest.approx([0.0065, 0.005, 0.005], abs=1e-12)
    assert rec.tpot == pytest.approx((0.0305 - 0.014) / 3, abs=1e-12)
    # server phases as the engines time them: no queue, 10 ms prefill, the sends done
    # (the ack 0.5 ms after the take) at the prefill worker's next nap tick, decode 15 ms
    ack = tick + LINK_LAT_S
    done_tick = prefill_end + IDLE_S * math.ceil((ack - prefill_end) / IDLE_S - 1e-9)
    assert rec.queue_s == pytest.approx(0.0, abs=1e-12)
    assert rec.prefill_s == pytest.approx(PREFILL_S, abs=1e-12)
    assert rec.transfer_s == pytest.approx(done_tick - prefill_end, abs=1e-12)
    assert rec.decode_s == pytest.approx(3 * DECODE_S, abs=1e-12)
    sim.check_quiescent()


@pytest.mark.parametrize("policy", ["eager", "at_end"])
def test_an_emulated_link_holds_the_wire_then_delays_frames_and_acks_by_its_latency(
        policy: str) -> None:
    """kv_transfer/emulated_link.py's arithmetic beneath an unchanged send policy: the
    KV holds the emulated wire 4 ms, reaches the transport 2 ms later and takes its
    1.5 ms write; the ack comes back the transport's 0.5 ms plus the 2 ms latency."""
    wire_s, latency_s = 0.004, 0.002
    sim = one_request_sim("fast", send_policy=policy,
                          link_gbps=KV_BYTES * 8 / wire_s / 1e9, link_latency_us=latency_s * 1e6)
    req = WorkloadRequest("r0", 0.0, list(range(1, PROMPT + 1)), max_tokens=3)
    rec = sim.run([req]).records()[0]
    prefill_end = 3 * RPC_S + PREFILL_S
    tick = prefill_end + wire_s + latency_s + LINK_LAT_S + 0.001  # 20.5 ms: the doorbell
    assert tick == pytest.approx(0.0205)
    assert rec.token_times == pytest.approx(
        (prefill_end + RPC_S, tick + DECODE_S + RPC_S, tick + 2 * DECODE_S + RPC_S), abs=1e-12)
    ack = tick + LINK_LAT_S + latency_s
    done_tick = prefill_end + IDLE_S * math.ceil((ack - prefill_end) / IDLE_S - 1e-9)
    assert rec.transfer_s == pytest.approx(done_tick - prefill_end, abs=1e-12)
    link = sim.links[0]
    assert link.sched.hold_until_final == (policy == "at_end")  # the policy, unchanged
    sim.check_quiescent()


def test_a_request_that_ends_at_its_first_token_releases_its_decode_reservation() -> None:
    sim = one_request_sim("fast")
    req = WorkloadRequest("r0", 0.0, list(range(1, PROMPT + 1)), max_tokens=1)
    rec = sim.run([req]).records()[0]
    assert rec.token_times == pytest.approx((3 * RPC_S + PREFILL_S + RPC_S,), abs=1e-12)
    sim.check_quiescent()  # the router aborted the decode promise; the link sent nothing
    assert sum(link.frames_sent for link in sim.links) == 0


def test_max_concurrency_holds_later_requests_until_one_ends_as_the_bench_client_does() -> None:
    cal = synthetic_calibration(prefill=lambda c, p: PREFILL_S, decode=lambda b, L: DECODE_S,
                                rpc_s=RPC_S, idle_wait_s=IDLE_S)
    cfg = ServeConfig().with_values({"transfer.connector": "inproc", "cache.num_blocks": 256,
                                     "model.max_model_len": 2048,
                                     "pools.reserve_with_add": False})
    sim = Simulation(cfg, load_costs(cal), SimOptions(max_concurrency=1))
    reqs = [WorkloadRequest(f"r{i}", 0.0, list(range(1, PROMPT + 1)), max_tokens=3)
            for i in range(3)]
    recs = sim.run(reqs).records()
    assert recs[0].send_time == 0.0
    # each one is sent when the previous one's last token reached the client
    assert [r.send_time for r in recs[1:]] == [recs[0].end_time, recs[1].end_time]
    assert len({round(r.ttft, 12) for r in recs}) == 1  # each alone on an idle cluster
    sim.check_quiescent()
