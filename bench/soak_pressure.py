"""What a ``--pressure`` soak reports besides the plain soak's table: how tight the pools
were, the Abort RPCs per phase, redispatches (preemptions), reused ids, client
deadlines and the drain. The pass criteria stay the plain soak's (bench/soak_report.py).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from bench.soak_plan import ABORT_PHASES

if TYPE_CHECKING:
    from bench.soak_plan import SoakRequest, SoakRun

HEADROOM_TOKENS = 64  # decode_worker.scheduler.DecodeSchedulerConfig.headroom_tokens


def pressure_summary(runner: SoakRun, plan: list[SoakRequest], pools: dict[str, int],
                     drained: str | None) -> dict[str, Any]:
    recs = runner.records
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    prompt = mean([len(r.prompt) for r in plan])
    promise = mean([len(r.prompt) + min(r.max_tokens, HEADROOM_TOKENS) for r in plan])
    aborts: dict[str, dict[str, int]] = {}
    for ph in ABORT_PHASES:
        planned = [recs[r.key] for r in plan if r.abort_phase == ph]
        aborts[ph] = {"planned": len(planned), "sent": sum(r.abort_sent for r in planned),
                      "aborted": sum(r.cancel_observed == ph and r.outcome == "aborted"
                                     and r.abort_sent for r in recs.values()),
                      "not_found": sum(r.abort_found is False for r in planned),
                      "missed": sum(not r.abort_sent for r in planned)}
    elsewhere = Counter(r.cancel_observed for r in recs.values()
                        if r.abort_sent and r.cancel_observed not in ABORT_PHASES)
    for ph, n in elsewhere.items():
        aborts[str(ph)] = {"planned": 0, "sent": n, "aborted": n, "not_found": 0, "missed": 0}
    legs = [r.max_leg for r in recs.values() if r.max_leg is not None]
    reused = [recs[r.key] for r in plan if r.reuses is not None]
    deadline = [recs[r.key] for r in plan if r.client_deadline_s is not None]
    late = [recs[r.key] for r in plan if r.after_drain]
    return {
        "pools_tokens": pools, "plan_pool_tokens": runner.cfg.pool_tokens,
        "mean_prompt_tokens": prompt, "mean_decode_promise_tokens": promise,
        "fit_prefill": pools.get("prefill", 0) / prompt if prompt else None,
        "fit_decode": pools.get("decode", 0) / promise if promise else None,
        "aborts": aborts,
        "legs_seen": bool(legs),
        "redispatched_requests": sum(n > 1 for n in legs),
        "redispatches": sum(n - 1 for n in legs),
        "reuses": {"planned": len(reused), "outcomes": dict(Counter(r.outcome for r in reused))},
        "client_deadlines": {"planned": len(deadline),
                             "outcomes": dict(Counter(r.outcome for r in deadline))},
        "drain": drained,
        "after_drain": {"planned": len(late), "outcomes": dict(Counter(r.outcome for r in late))},
        "aborted_by_drain": sum(r.outcome == "aborted" and not r.abort_sent
                                for r in recs.values()),
    }


def pressure_lines(p: dict[str, Any]) -> list[str]:
    pools = ", ".join(f"{k} {v} tokens" for k, v in sorted(p["pools_tokens"].items()))
    fit = lambda x: "?" if x is None else f"{x:.1f}"  # noqa: E731
    lines = [f"pressure: pools {pools or 'unknown'}; mean prompt {p['mean_prompt_tokens']:.0f} "
             f"tokens, mean decode promise {p['mean_decode_promise_tokens']:.0f} -> "
             f"{fit(p['fit_prefill'])} prompts fit a prefill pool, "
             f"{fit(p['fit_decode'])} promises a decode pool", "",
             f"{'abort phase':<14}{'planned':>9}{'sent':>6}{'aborted':>9}{'not found':>11}"
             f"{'missed':>8}"]
    for ph, row in p["aborts"].items():
        lines.append(f"{ph:<14}{row['planned']:>9}{row['sent']:>6}{row['aborted']:>9}"
                     f"{row['not_found']:>11}{row['missed']:>8}")
    lines.append("(aborted = the stream ended 'abort' with the router in that phase at the "
                 "Abort; not found = the Abort RPC answered found=false; missed = ended first)")
    redis = (f"{p['redispatched_requests']} requests redispatched ({p['redispatches']} extra "
             "legs: decode preemptions or failed workers)" if p["legs_seen"]
             else "n/a (seen only when the soak runs the service)")
    out = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-"  # noqa: E731
    lines += ["", f"preemptions: {redis}",
              f"reused ids: {p['reuses']['planned']} ({out(p['reuses']['outcomes'])})",
              f"client deadlines: {p['client_deadlines']['planned']} "
              f"({out(p['client_deadlines']['outcomes'])})",
              f"drain: {p['drain'] or 'off'}; {p['after_drain']['planned']} arrivals after it "
              f"({out(p['after_drain']['outcomes'])}), {p['aborted_by_drain']} in flight "
              "aborted by its deadline"]
    return lines
