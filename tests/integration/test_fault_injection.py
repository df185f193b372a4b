"""Every injected fault kind through the disaggregated service on local Ray (1 prefill +
2 decode workers, tcp KV link): each ends in a clear per-request outcome and nothing
leaks. One service carries the whole fault plan; request-id filters aim each fault at
one test's requests (router legs are "<id>#<n>", so "#1$" hits the first attempt only).

  drop (first leg)   KV never completes -> kv_wait_timeout -> FAILED -> re-dispatch, exact
  drop (every leg)   every attempt times out -> UNAVAILABLE ("gave up after N attempts")
  corrupt            checksum failure on decode -> FAILED -> re-dispatch, exact
  duplicate/reorder  idempotent: exact tokens, no re-dispatch
  delay, short stall slower: exact tokens, no re-dispatch
  long stall         > failure_timeout_s: the link fails -> re-dispatch, exact
  refuse (all)       no decode worker admits -> RESOURCE_EXHAUSTED after admission_timeout_s
  refuse (decode-0)  the request goes to decode-1, exact
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import pytest

from bench.soak_report import idle_problems
from cluster.launch.launcher import LaunchOptions
from cluster.router.types import ErrorCode, GenerateSpec, RouterError
from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
KV_WAIT_S = 8.0
PLAN = {"seed": 3, "faults": [
    {"kind": "drop", "request_filter": r"^drop-.*#1$"},
    {"kind": "drop", "request_filter": r"^dropall-"},
    {"kind": "corrupt", "request_filter": r"^corrupt-.*#1$", "every_nth": 2},
    {"kind": "duplicate", "request_filter": r"^dup-"},
    {"kind": "reorder", "request_filter": r"^reorder-"},
    {"kind": "delay", "request_filter": r"^delay-", "delay_s": 0.1},
    {"kind": "stall", "request_filter": r"^stall-", "stall_s": 1.0, "max_count": 1},
    {"kind": "stall", "request_filter": r"^stalldead-.*#1$", "every_nth": 2, "stall_s": 15.0,
     "max_count": 1},
    {"kind": "refuse_admission", "request_filter": r"^refuse-"},
    {"kind": "refuse_admission", "request_filter": r"^refuse0-", "worker_filter": r"^decode-0$"},
]}


@pytest.fixture(scope="module")
def runner(start_module_router):
    r = start_module_router({
        # half a CPU each: modules before this one may still hold CPUs of the session's Ray
        "pools": {"prefill_workers": 1, "decode_workers": 2, "cpus_per_worker": 0.5},
        "transfer": {"connector": "tcp", "failure_timeout_s": 4.0},
        "scheduler": {"max_prefill_chunk": 32, "max_num_batched_tokens": 64},
        "limits": {"kv_wait_timeout_s": KV_WAIT_S, "request_timeout_s": 150},
    }, LaunchOptions(fault_injection=PLAN))
    yield r
    r.close()


@pytest.fixture(scope="module")
def reference(tiny_model):
    llm = LLM(str(tiny_model))
    return lambda prompts, sp=GREEDY: [o.token_ids for o in llm.generate(prompts, sp)]


@pytest.fixture
def redispatches(caplog):
    """The router's re-dispatch log lines: request id -> reasons."""
    caplog.set_level(logging.INFO, logger="cluster.router.events")

    def get() -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for rec in caplog.records:
            if rec.getMessage().startswith("re-dispatching "):
                rid, _, why = rec.getMessage()[len("re-dispatching "):].partition(": ")
                out.setdefault(rid, []).append(why)
        return out

    return get


def prompts(n: int, seed: int) -> list[list[int]]:
    return [[(seed * 131 + i * 17 + j * 7) % 1999 + 1 for j in range(70 + 23 * i)]
            for i in range(n)]


def run(runner, name: str, n: int = 2, sp: SamplingParams = GREEDY):
    ps = prompts(n, seed=len(name))
    results = runner.generate_many([GenerateSpec(f"{name}-{i}", tuple(p), sp)
                                    for i, p in enumerate(ps)], timeout=200)
    return ps, results


def extras(runner, timeout: float = 60.0) -> dict[str, dict[str, float]]:
    """Every worker's stats counters; retried while one is missing (a stats call that
    timed out under load reports an empty dict, which must not read as zero)."""
    end = time.monotonic() + timeout
    while True:
        out = {w.worker_id: w.extra for w in runner.stats().workers}
        if all(out.values()) or time.monotonic() > end:
            return out
        time.sleep(0.5)


def fired(runner, kind: str) -> dict[str, float]:
    return {w: extra.get(f"fault_{kind}", 0.0) for w, extra in extras(runner).items()}


def counter(runner, name: str) -> float:
    return sum(extra.get(name, 0.0) for extra in extras(runner).values())


def assert_clean(runner, timeout: float = 60.0) -> None:
    """Leak check: every worker idle (blocks, queues, send queue, in-flight KV bytes,
    receiver state) and the router empty."""
    end = time.monotonic() + timeout
    while (problems := idle_problems(runner.stats())) and time.monotonic() < end:
        time.sleep(0.2)
    assert not problems, problems


def assert_exact(results, want) -> None:
    for (toks, last), ref in zip(results, want, strict=True):
        assert not isinstance(last, RouterError), last
        assert toks == ref and last.finish_reason == "length"


def test_dropped_kv_times_out_on_decode_and_the_request_is_redispatched(runner, reference,
                                                                        redispatches):
    ps, results = run(runner, "drop")
    assert_exact(results, reference(ps))
    for i in range(2):
        assert any("timed out waiting for KV" in w for w in redispatches()[f"drop-{i}"])
    assert fired(runner, "drop")["prefill-0"] > 0
    assert_clean(runner)


def test_kv_dropped_on_every_attempt_ends_unavailable(runner, reference, redispatches):
    config = runner.router.config
    runner.router.config = replace(config, max_legs=2)
    try:
        ps, [(toks, last)] = run(runner, "dropall", n=1)
    finally:
        runner.router.config = config
    assert isinstance(last, RouterError) and last.code == ErrorCode.UNAVAILABLE, last
    assert "gave up after 2 attempts" in last.message
    # each attempt's prefill streamed its first token before the KV was lost
    assert len(toks) == 2 and toks == reference(ps)[0][:2]
    assert len(redispatches()["dropall-0"]) == 2
    assert_clean(runner)


def test_corrupt_kv_is_caught_by_the_checksum_and_redispatched(runner, reference,
                                                               redispatches):
    ps, results = run(runner, "corrupt")
    assert_exact(results, reference(ps))
    for i in range(2):
        assert any("checksum mismatch" in w for w in redispatches()[f"corrupt-{i}"])
    assert sum(fired(runner, "corrupt").values()) >= 2
    assert counter(runner, "kv_checksum_failures") >= 2
    assert_clean(runner)


@pytest.mark.parametrize(("kind", "name"), [("duplicate", "dup"), ("reorder", "reorder"),
                                            ("delay", "delay"), ("stall", "stall")])
def test_duplicated_reordered_delayed_or_briefly_stalled_kv_gives_the_same_tokens(
        runner, reference, redispatches, kind, name):
    ps, results = run(runner, name, n=3)
    assert_exact(results, reference(ps))
    assert not any(rid.startswith(f"{name}-") for rid in redispatches())
    assert fired(runner, kind)["prefill-0"] > 0
    if kind == "duplicate":
        assert counter(runner, "kv_duplicate_frames") > 0
    assert_clean(runner)


@pytest.mark.slow  # flaky under load in the lead's CI dry run (maybe a stats call timing
# out: fired() now retries those); 5/5 passes here since, left in test-slow for now
def test_link_stalled_past_the_failure_timeout_fails_and_the_request_is_redispatched(
        runner, reference, redispatches):
    before = fired(runner, "stall")["prefill-0"]
    ps, results = run(runner, "stalldead", n=1)
    assert_exact(results, reference(ps))
    assert "stalldead-0" in redispatches(), redispatches()
    assert fired(runner, "stall")["prefill-0"] == before + 1
    assert_clean(runner)


def test_admission_refused_everywhere_ends_resource_exhausted(runner):
    config = runner.router.config
    runner.router.config = replace(config, admission_timeout_s=2.0)
    try:
        _, [(toks, last)] = run(runner, "refuse", n=1)
    finally:
        runner.router.config = config
    assert isinstance(last, RouterError) and last.code == ErrorCode.RESOURCE_EXHAUSTED, last
    # the reserve went with the prefill's add: the prefill's first token may have streamed
    # before the refusals came back (a race the router does not hold the token for)
    assert len(toks) <= 1 and "admit" in last.message
    refused = fired(runner, "refuse_admission")
    assert refused["decode-0"] > 0 and refused["decode-1"] > 0
    assert_clean(runner)


def test_admission_refused_by_one_decode_worker_goes_to_the_other(runner, reference):
    before = fired(runner, "refuse_admission")["decode-0"]
    ps, results = run(runner, "refuse0", n=1)
    assert_exact(results, reference(ps))
    assert fired(runner, "refuse_admission")["decode-0"] > before
    assert_clean(runner)


class _AddFailsOnce:
    """A prefill actor handle whose next `add` fails as if the actor died under it
    (before the event pump noticed); everything else goes to the real actor."""

    def __init__(self, real):
        self._real, self.failed = real, False

    def __getattr__(self, name):
        return getattr(self._real, name)

    @property
    def add(self):
        outer = self

        class _Method:
            def remote(self, task):
                if outer.failed:
                    return outer._real.add.remote(task)
                outer.failed = True

                async def died():
                    raise RuntimeError("simulated: the prefill actor died under add()")

                return died()

        return _Method()


def test_prefill_dying_under_add_is_redispatched_once(runner, reference):
    router = runner.router
    runner.run(router.start())  # wrap the started router's actor (its channel is up)
    handle = router.prefill[0]
    real, dispatched = handle.actor, []
    orig = router.dispatch

    async def spy(flight):
        dispatched.append(flight.leg + 1)
        return await orig(flight)

    handle.actor, router.dispatch = _AddFailsOnce(real), spy
    try:
        ps, results = run(runner, "addfail", n=1)
    finally:
        handle.actor, router.dispatch = real, orig
    assert_exact(results, reference(ps))
    assert_clean(runner)
    assert dispatched == [1, 2], dispatched
    assert all(not w.legs for w in router.workers), [(w.worker_id, w.legs) for w in router.workers]
    assert handle.outstanding_tokens == 0
