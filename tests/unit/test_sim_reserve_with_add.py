"""The simulator's reserve sent with the add (sim/router_reserve.py, sim/decode_kv.py), as
cluster/router/router.py dispatches: with nobody waiting for admission the decode reserve and the
prefill add go out at the same simulated instant; with a waiter, reserve first, then add;
a refused reserve ends the prefill leg and a new leg queues with the refusal counted; KV
that overtakes its reserve is held and written when it lands (or dropped on refusal).
Every state is made on purpose (a tiny decode pool, a reserve held back), never timed."""

from __future__ import annotations

from bench.workload import WorkloadRequest
from engine.costs.loader import load_costs
from sim.adapters import ServeConfig
from sim.cluster import Simulation
from sim.options import SimOptions
from sim.synthetic import synthetic_calibration

RPC_S = 0.001


def _sim(num_blocks: int = 256, reserve_with_add: bool | None = None,
         hold: tuple[str, float] = ("", 0.0), timeout_s: float = 600.0,
         pipelined: bool | None = None) -> tuple[Simulation, list]:
    """1P/1D, every call RPC_S one way. Records (time, worker role, command, request,
    leg no.) of every add / reserve / abort as it reaches its worker, and every reserve's
    answer as ("answer", ok). ``hold`` (request, seconds): that request's first reserve
    reaches decode that much later (its KV then overtakes it)."""
    cal = synthetic_calibration(prefill=lambda c, p: 0.002, decode=lambda b, L: 0.001,
                                rpc_s=RPC_S)
    cfg = ServeConfig().with_values({
        "transfer.connector": "inproc", "cache.enable_prefix_caching": False,
        "cache.num_blocks": num_blocks, "cache.block_size": 16, "model.max_model_len": 2048,
        "limits.request_timeout_s": timeout_s,
        **({} if pipelined is None else {"pools.pipelined_reserves": pipelined}),
        **({} if reserve_with_add is None else {"pools.reserve_with_add": reserve_with_add})})
    sim = Simulation(cfg, load_costs(cal), SimOptions())
    log: list = []
    for w in sim.prefill + sim.decode:
        command = w.command

        def record(fn, *args, w=w, command=command) -> None:
            name = fn.__name__
            if name in ("add", "reserve"):
                leg = args[0] if isinstance(args[0], str) else args[0].leg_id
                rid, _, no = leg.split("#")
                log.append((sim.loop.now, w.role, name, rid, int(no)))
                if name == "reserve":
                    task, reply = args

                    def answer(ok, error, rid=rid, no=int(no), reply=reply) -> None:
                        log.append((sim.loop.now, "decode", "answer", rid, no, ok))
                        reply(ok, error)

                    args = (task, answer)
                    if (rid, int(no)) == (hold[0], 1):
                        return sim.loop.at(sim.loop.now + hold[1], command, fn, *args)
            command(fn, *args)

        w.command = record
        abort = w.abort

        def aborted(leg: str, w=w, abort=abort) -> None:  # (runs on the worker)
            rid, _, no = leg.split("#")
            log.append((sim.loop.now, w.role, "abort", rid, int(no)))
            abort(leg)

        w.abort = aborted
    return sim, log


def _req(rid: str, prompt_len: int, at: float = 0.0, max_tokens: int = 4) -> WorkloadRequest:
    return WorkloadRequest(rid, at, list(range(1, prompt_len + 1)), max_tokens=max_tokens)


def _at(log: list, rid: str, name: str, leg: int = 1) -> float:
    return next(e[0] for e in log if e[2] == name and e[3] == rid and e[4] == leg)


def _check_all_done(sim: Simulation, result, max_tokens: dict[str, int]) -> None:
    sim.check_quiescent()  # zero used blocks everywhere, empty queues, no early KV held
    recs = {r.request_id: r for r in result.records()}
    assert {k: len(recs[k].token_times) for k in max_tokens} == max_tokens
    assert not any(r.error for r in recs.values())


def test_the_flag_follows_the_routers_default() -> None:
    sim, _ = _sim()
    assert sim.plan.router.reserve_with_add  # RouterConfig's default
    assert not _sim(reserve_with_add=False)[0].plan.router.reserve_with_add


def test_with_nobody_waiting_reserve_and_add_go_out_at_the_same_instant() -> None:
    sim, log = _sim()
    result = sim.run([_req("a", 40, max_tokens=8)])
    _check_all_done(sim, result, {"a": 8})
    assert _at(log, "a", "reserve") == _at(log, "a", "add") == RPC_S


def test_with_the_flag_off_the_add_waits_for_the_reserves_answer() -> None:
    sim, log = _sim(reserve_with_add=False)
    result = sim.run([_req("a", 40, max_tokens=8)])
    _check_all_done(sim, result, {"a": 8})
    assert _at(log, "a", "reserve") == RPC_S
    assert _at(log, "a", "add") >= _at(log, "a", "reserve") + 2 * RPC_S  # answer, then add


def test_with_a_waiter_a_later_request_reserves_first_then_adds() -> None:
    """10 blocks of 16: 'h' (96 + 60 tokens) takes every block; 'head' cannot fit, so it
    waits (queued admission), and 'next', arriving while it waits, queues too."""
    sim, log = _sim(num_blocks=10)
    result = sim.run([_req("h", 96, 0.0, max_tokens=60), _req("head", 100, 0.010),
                      _req("next", 8, 0.011)])
    _check_all_done(sim, result, {"h": 60, "head": 4, "next": 4})
    assert _at(log, "h", "reserve") == _at(log, "h", "add")
    for rid in ("head", "next"):
        granted = next(e[0] for e in log if e[2] == "answer" and e[3] == rid and e[5])
        assert _at(log, rid, "add") >= granted + RPC_S, rid  # the add after the grant
    assert not any(e[2] == "abort" for e in log)  # no reserve went with an add: none refused


def test_pipelined_reserves_send_a_bursts_reserves_at_once_until_the_room_runs_out() -> None:
    """12 blocks of 16; seven 20-token prompts arrive together. Each reserve in flight
    counts 20 // 16 + 1 = 2 blocks against the 12 of the last load (cluster/router/router.py
    _least_promised): six go with their adds at once; the seventh finds 0 blocks, goes to
    admission, whose reserve goes out too, and is added only once it is granted. Without
    the flag one reserve goes with an add; the others wait for admission's turn."""
    burst = [_req(f"r{i}", 20) for i in range(7)]
    sim, log = _sim(num_blocks=12)
    _check_all_done(sim, sim.run(burst), {f"r{i}": 4 for i in range(7)})
    assert sim.plan.router.pipelined_reserves  # the default, as the router's
    for i in range(6):
        assert _at(log, f"r{i}", "reserve") == _at(log, f"r{i}", "add") == RPC_S, i
    granted = next(e[0] for e in log if e[2] == "answer" and e[3] == "r6" and e[5])
    assert _at(log, "r6", "add") >= granted + RPC_S  # admitted first, then added
    sim, log = _sim(num_blocks=12, pipelined=False)
    _check_all_done(sim, sim.run(burst), {f"r{i}": 4 for i in range(7)})
    assert _at(log, "r0", "reserve") == _at(log, "r0", "add") == RPC_S
    assert all(_at(log, f"r{i}", "add") > RPC_S for i in range(1, 7))


def _refused_run(hold: tuple[str, float] = ("", 0.0)) -> tuple[Simulation, list, object]:
    """10 blocks of 16: 'x' (40 + 40 tokens) is promised 5; 'y' (64 tokens) fits the 5
    left by the load 'x' published, so its reserve goes with its add, but 64 + 40 tokens
    need 7 blocks: refused."""
    sim, log = _sim(num_blocks=10, hold=hold)
    result = sim.run([_req("x", 40, 0.0, max_tokens=40), _req("y", 64, 0.005, max_tokens=40)])
    _check_all_done(sim, result, {"x": 40, "y": 40})
    return sim, log, result


def test_a_refused_reserve_ends_the_prefill_leg_and_a_new_leg_queues() -> None:
    sim, log, _ = _refused_run()
    y = [e for e in log if e[3] == "y"]
    assert _at(log, "y", "reserve") == _at(log, "y", "add")  # sent together
    assert [e[5] for e in y if e[2] == "answer" and e[4] == 1] == [False]
    assert [e[5] for e in y if e[2] == "answer" and e[4] == 2][-1]  # granted at last
    assert _at(log, "y", "abort") > _at(log, "y", "reserve")  # the first leg's prefill ends
    assert [e[1] for e in y if e[2] == "abort"] == ["prefill"]  # decode held nothing of it
    # the new leg queued with the refusal counted in its round: it asks decode again only
    # in a new round (the prefill abort's answer wakes the queue, as the router's
    # abort_on does), and its add waits for the grant
    assert _at(log, "y", "reserve", leg=2) > _at(log, "y", "abort")
    granted = next(e[0] for e in y if e[2] == "answer" and e[4] == 2 and e[5])
    assert _at(log, "y", "add", leg=2) >= granted + RPC_S
    f = next(f for f in sim.router.finished if f.req.request_id == "y")
    assert (f.leg, f.failures, f.preemptions) == (2, 0, 0)


def test_kv_that_overtakes_its_reserve_is_held_and_written_when_it_lands() -> None:
    sim, log = _sim(hold=("a", 0.050))  # the prefill (2 ms) and its KV are long done
    d = sim.decode[0]
    held: list[int] = []
    reserved = d.early_reserved

    def spy(leg: str, ok: bool) -> None:
        held.append(len(d.early.get(leg, ())))
        reserved(leg, ok)

    d.early_reserved = spy
    result = sim.run([_req("a", 40, max_tokens=8)])
    _check_all_done(sim, result, {"a": 8})
    assert held and held[0] > 0  # its pieces waited for it
    rec = result.records()[0]
    assert rec.token_times[1] > _at(log, "a", "reserve")  # decode ran once it landed


def test_kv_held_for_a_refused_reserve_is_dropped_and_the_request_still_completes() -> None:
    sim, log, _ = _refused_run(hold=("y", 0.020))
    y = [e for e in log if e[3] == "y"]
    assert [e[5] for e in y if e[2] == "answer" and e[4] == 1] == [False]
    assert [e[5] for e in y if e[2] == "answer"][-1]
    assert all(not link._outstanding for link in sim.links)


def test_kv_held_when_its_legs_abort_overtakes_the_reserve_is_dropped() -> None:
    """The request's deadline (20 ms) ends it while its reserve is held back (50 ms): the
    abort reaches decode first and drops the held KV; the late reserve is refused."""
    sim, log = _sim(hold=("a", 0.050), timeout_s=0.020)
    d = sim.decode[0]
    dropped: list[int] = []
    closed = d.early_closed

    def spy(leg: str) -> None:
        dropped.append(len(d.early.get(leg, ())))
        closed(leg)

    d.early_closed = spy
    result = sim.run([_req("a", 40, max_tokens=8)])
    sim.check_quiescent()  # no block, promise, held piece or unacked frame left
    assert result.records()[0].error.startswith("DEADLINE_EXCEEDED")
    assert dropped and dropped[0] > 0
    assert [e[5] for e in log if e[2] == "answer"] == [False]  # its abort overtook it
    decode_abort = next(e[0] for e in log if e[1:3] == ("decode", "abort"))
    assert decode_abort < _at(log, "a", "answer")  # (the reserve ran after the abort)
