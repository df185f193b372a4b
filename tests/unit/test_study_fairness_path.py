"""The fairness study along the whole P/D path (bench/studies/fairness.py): each tenant's
share of contended service at prefill compute, link bytes, decode admission and end to
end, from records and trace events made up here (no service)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.records import RequestRecord
from bench.studies import fairness
from bench.studies.results import StudyResult
from bench.studies.service import RunOutput
from engine.tracing import TraceEvent


def rec(rid: str, tenant: str, send: float, ttft: float, end: float, *, adm: float = 0.0,
        prompt: int = 100, n_out: int = 4) -> RequestRecord:
    times = tuple(send + ttft + i * (end - send - ttft) / max(1, n_out - 1)
                  for i in range(n_out))
    return RequestRecord(rid, prompt, send, times, end_time=end, tenant=tenant,
                         admission_s=adm)


def run_of(records, events=(), admitted=None):
    return SimpleNamespace(records=list(records), events=list(events),
                           output=RunOutput(list(records), list(events),
                                            admission_tokens=dict(admitted or {})))


def test_only_service_while_every_tenant_waits_counts() -> None:
    spans = {"gold": [(0.0, 10.0)], "free": [(0.0, 4.0)]}
    items = [("gold", 1.0, 20), ("free", 2.0, 10), ("gold", 3.0, 20), ("gold", 6.0, 99)]
    assert fairness.contended_split(spans, items) == pytest.approx(
        {"gold": 40 / 50, "free": 10 / 50})
    assert fairness.contended_split({"gold": [(0.0, 1.0)]}, items) is None  # one tenant
    assert fairness.contended_split(spans, [("gold", 7.0, 5)]) is None  # none contended


def test_prefill_counts_from_dispatch_not_from_arrival() -> None:
    """A prompt waiting for decode KV (admission) does not contend for prefill compute."""
    recs = [rec("g", "gold", 0.0, 1.0, 2.0), rec("f", "free", 0.0, 1.0, 2.0, adm=0.6)]
    chunks = [TraceEvent("g", "prefill_chunk", "prefill-0", 0.1, 0.3, scheduled_tokens=64,
                         tenant="gold"),
              TraceEvent("g", "prefill_chunk", "prefill-0", 0.6, 0.8, scheduled_tokens=64,
                         tenant="gold"),
              TraceEvent("f", "prefill_chunk", "prefill-0", 0.8, 1.0, scheduled_tokens=32,
                         tenant="free")]
    shares = fairness.contended_shares(run_of(recs, chunks))
    assert shares == pytest.approx({"gold": 64 / 96, "free": 32 / 96})  # gold's first: alone


def test_link_bytes_count_while_both_tenants_have_kv_computed_and_unsent() -> None:
    recs = [rec("g", "gold", 0.0, 0.2, 3.0), rec("f", "free", 0.0, 0.2, 3.0)]
    ev = [TraceEvent("g", "prefill_chunk", "prefill-0", 0.0, 0.1, scheduled_tokens=8),
          TraceEvent("f", "prefill_chunk", "prefill-0", 0.1, 0.5, scheduled_tokens=8),
          TraceEvent("g", "kv_send", "link:p->d", 0.1, 0.4, bytes=100),  # free: no KV yet
          TraceEvent("g", "kv_send", "link:p->d", 0.5, 0.7, bytes=200),
          TraceEvent("f", "kv_send", "link:p->d", 0.7, 0.9, bytes=100),
          TraceEvent("g", "kv_send", "link:p->d", 0.9, 1.1, bytes=200),
          TraceEvent("f", "kv_send", "link:p->d", 1.1, 1.3, bytes=100)]  # gold done
    assert fairness.link_shares(run_of(recs, ev)) == pytest.approx(
        {"gold": 400 / 500, "free": 100 / 500})


def backlog(order: str, delay: float, prompt: int = 100):
    """A path that delivers one prompt's KV every 0.1 s in two frames, `delay` after both
    backlogs arrived at t=0, in `order` (g: gold, f: free); each request then streams one
    token 0.01 s after its KV is in. Records and the trace's kv_send spans."""
    recs, events = [], []
    for k, who in enumerate(order):
        t, rid = delay + 0.1 * k, f"{who}{k}"
        events += [TraceEvent(f"{rid}#1", "kv_send", "link:p->d", t - 0.1, t - 0.05,
                              bytes=300),
                   TraceEvent(f"{rid}#1", "kv_send", "link:p->d", t - 0.05, t, bytes=100)]
        recs.append(RequestRecord(rid, prompt, 0.0, (t + 0.01,), end_time=t + 0.01,
                                  tenant={"g": "gold", "f": "free"}[who]))
    return recs, events


def test_end_to_end_counts_the_work_delivered_while_both_tenants_had_kv_to_deliver() -> None:
    # wfq's 2:1 order; the window runs from free's first frame (k=2's, at 1.15 s) to
    # gold's last (k=7's, 1.7 s): gold's prompts k=3,4,6,7 and the tokens of k=3,4,6
    # (k=7's streams after the window), free's prompts k=2,5 and their tokens: 2:1
    order = "ggfggfggffff"
    want = {"gold": 403 / 605, "free": 202 / 605}
    assert fairness.e2e_shares(run_of(*backlog(order, 1.0))) == pytest.approx(want)
    assert fairness.e2e_shares(run_of(*backlog(order, 3.0))) == pytest.approx(want)  # (the
    # path's delay, however long, is no tenant's: a share of the whole run charged it to
    # the first tenant done)
    assert fairness.e2e_shares(run_of(*backlog("gfgfgfgf", 0.5))) == pytest.approx(
        {"gold": 0.5, "free": 0.5}, abs=0.03)
    assert fairness.e2e_shares(run_of(*backlog("gggg", 0.5))) is None  # one tenant
    assert fairness.e2e_shares(run_of(*backlog("ggggff", 0.5))) is None  # never both
    recs, events = backlog(order, 1.0)
    assert fairness.path_shares(run_of(recs, events, admitted={"gold": 1}))["e2e"] is None
    # (not a backlog: not measured)


def test_share_columns_give_jain_and_the_worst_gap_to_the_weights() -> None:
    w = {"gold": 2.0, "free": 1.0}
    shares = {"prefill": {"gold": 0.66, "free": 0.34}, "link": None,
              "decode": {"gold": 0.5, "free": 0.5}, "e2e": {"gold": 0.7, "free": 0.3}}
    cols = fairness.share_columns(shares, w)
    assert cols["gold_prefill_share"] == 0.66 and cols["gold_link_share"] is None
    assert cols["jain_link"] is None and cols["jain_prefill"] == pytest.approx(1.0, abs=1e-3)
    assert cols["jain_decode"] < 0.95
    assert cols["worst_dev"] == pytest.approx(0.5)  # free got 0.5 of decode for 1/3
    judged = fairness.judged_resources("prefill-bound/wfq")
    assert judged == ("prefill", "e2e")  # decode was contended in passing: not judged
    assert fairness.share_columns(shares, w, judged=judged)["worst_dev"] == \
        pytest.approx(0.1)  # free's 0.3 of end to end for 1/3
    fair = {k: ({"gold": 2 / 3, "free": 1 / 3} if v else None) for k, v in shares.items()}
    assert fairness.share_columns(fair, w)["worst_dev"] == pytest.approx(0.0)


def test_the_path_configurations_contend_where_they_say() -> None:
    from cluster.config.serve import ServeConfig

    base = ServeConfig.from_dict({"scheduler": {"tenant_weights": {"gold": 2, "free": 1}}})
    names = fairness.config_names(True, emulated=True)
    assert names == fairness.path_names() and len(names) == 6
    assert fairness.config_names(True) == list(fairness.QUICK)
    link = fairness.scenario_config(base, "link-bound/wfq")
    assert link.transfer.link_gbps == 10.0 and link.transfer.send_queue == "wfq"
    assert link.scheduler.fairness_policy == link.scheduler.decode_admission == "wfq"
    fcfs = fairness.scenario_config(base, "decode-bound/fcfs")
    assert fcfs.cache.kv_cache_memory_gb == 0.25 and fcfs.scheduler.decode_admission == "fcfs"
    assert dict(fcfs.scheduler.tenant_weights) == {"gold": 2.0, "free": 1.0}  # one mapping


def test_findings_say_whether_every_share_came_within_ten_percent() -> None:
    rows = [{"config": "link-bound/wfq", "gold_prefill_share": 0.67, "gold_link_share": 0.65,
             "gold_e2e_share": 0.69, "jain_prefill": 1.0, "jain_link": 0.999, "jain_e2e": 0.998,
             "worst_dev": 0.07},
            {"config": "link-bound/fcfs", "gold_link_share": 0.5, "jain_link": 0.9,
             "worst_dev": 0.5}]
    res = StudyResult("fairness", "F", "d", fairness.COLUMNS, rows,
                      extra={"tenant_weights": {"gold": 2.0, "free": 1.0}})
    said = fairness.findings(res)
    assert said[0] == ("link-bound/wfq: gold got 0.67 of the prefill compute, 0.65 of the "
                       "link bytes and 0.69 end to end (its weight's share: 0.67); at the "
                       "link bytes and end to end every share within 10% of its weight's "
                       "(worst 7%), Jain 0.998-0.999.")
    assert "not within 10%" in said[1]


def test_end_to_end_credits_kv_as_it_moves_not_as_requests_complete() -> None:
    """The wfq send queue shares a tenant's bytes among its requests, so the
    lower-weight tenant's requests complete late, all together; its KV still moved at
    its weight's rate all along, and that is what the path gave it."""
    gold = [f"g{i}" for i in range(8)]
    free = [f"f{i}" for i in range(6)]
    # one 100-byte frame every 0.05 s, 2:1 while both have KV; gold's requests one after
    # another (two frames each), free's six interleaved (each done at its second frame)
    free_frames = iter(free + free)
    gold_frames = iter(g for g in gold for _ in range(2))
    order = [next(free_frames) if k % 3 == 2 else next(gold_frames) for k in range(24)]
    order += list(free_frames)  # free alone after gold is done
    events, last = [], {}
    for k, rid in enumerate(order):
        events.append(TraceEvent(f"{rid}#1", "kv_send", "link:p->d", 0.05 * k,
                                 0.05 * k + 0.05, bytes=100))
        last[rid] = 0.05 * k + 0.05
    recs = [RequestRecord(rid, 200, 0.0, (t + 0.01,), end_time=t + 0.01,
                          tenant="gold" if rid[0] == "g" else "free")
            for rid, t in last.items()]
    shares = fairness.e2e_shares(run_of(recs, events))
    assert shares["gold"] == pytest.approx(2 / 3, abs=0.05)
    done = [r for r in recs if r.token_times[0] <= max(last[g] for g in gold) + 0.01]
    assert [r.tenant for r in done].count("free") == 1  # by completions: gold's
    # eight against free's one
