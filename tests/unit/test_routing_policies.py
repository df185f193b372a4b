"""cluster/router/policies.py: the placement registry, today's router decisions reproduced
exactly (differentially against cluster/router/pool.py's PrefixAffinity), and length buckets."""

from __future__ import annotations

import random

import pytest

from cluster.router.flight import RouterConfig
from cluster.router.policies import (
    DECODE_ORDERS,
    PREFILL_PLACEMENTS,
    DecodeLoad,
    LengthBuckets,
    PrefillLoad,
    decode_order,
    default_placement,
    make_placement,
)
from cluster.router.pool import WorkerHandle
from cluster.router.router import Router


def test_registry_names_and_unknown_name_is_an_error_naming_the_choices() -> None:
    assert set(PREFILL_PLACEMENTS) == {"least-outstanding", "prefix-affinity", "length-buckets"}
    assert set(DECODE_ORDERS) == {"least-kv-usage", "least-legs"}
    for name in PREFILL_PLACEMENTS:
        assert make_placement(name).name == name
    with pytest.raises(ValueError, match="unknown prefill placement 'nope'.*length-buckets"):
        make_placement("nope")
    with pytest.raises(ValueError, match="least-outstanding"):
        make_placement("least-outstanding", slack_tokens=3)
    with pytest.raises(ValueError, match="unknown decode order"):
        decode_order("random", [])


def test_default_placement_follows_prefix_caching_like_the_router() -> None:
    assert default_placement(True) == "prefix-affinity"
    assert default_placement(False) == "least-outstanding"


def test_least_outstanding_takes_the_first_of_equals() -> None:
    p = make_placement("least-outstanding")
    loads = [PrefillLoad("a", 5), PrefillLoad("b", 3), PrefillLoad("c", 3)]
    assert p.pick(loads, [1, 2, 3]) == "b"
    with pytest.raises(ValueError, match="no prefill worker"):
        p.pick([], [1])


def test_prefix_affinity_decides_exactly_as_the_router_over_a_random_history() -> None:
    rng = random.Random(7)
    prefixes = [[rng.randrange(1, 500) for _ in range(40)] for _ in range(6)]
    ours = make_placement("prefix-affinity", block_size=16, slack_tokens=300, capacity=4)
    handles = {f"p{i}": WorkerHandle(f"p{i}", "prefill", None) for i in range(4)}
    router = Router(list(handles.values()), [], RouterConfig(affinity_slack_tokens=300),
                    None, 1000, 2048)
    router._placement.capacity = 4
    theirs = router._placement
    loads = {f"p{i}": 0 for i in range(4)}
    sticky_kept = 0
    for _ in range(600):
        alive = [w for w in loads if rng.random() > 0.15] or ["p0"]
        prompt = rng.choice(prefixes)[: rng.randrange(8, 40)] + [rng.randrange(1, 500)]
        for w, h in handles.items():
            h.alive, h.outstanding_tokens = w in alive, loads[w]
        want = router._pick_prefill(tuple(prompt)).worker_id
        got = ours.pick([PrefillLoad(w, loads[w]) for w in alive], prompt)
        assert got == want
        least = min(loads[w] for w in alive)
        sticky_kept += loads[got] > least  # affinity overrode least-outstanding
        loads[got] += 100  # coarse loads: ties and the slack's edge come up often
        for w in loads:  # some prefills finish
            if rng.random() < 0.3:
                loads[w] = max(0, loads[w] - 100 * rng.randrange(0, 3))
    assert len(ours) == len(theirs) <= 4
    assert sticky_kept > 20  # the history exercised affinity, not only least-outstanding


def test_length_buckets_send_each_length_class_to_its_own_slice() -> None:
    p = LengthBuckets(thresholds=(100, 1000, 5000))
    assert [p.bucket(n) for n in (1, 100, 101, 1000, 5000, 5001)] == [0, 0, 1, 1, 2, 3]
    loads = [PrefillLoad(f"p{i}", 0) for i in range(8)]
    picks = {n: {p.pick(loads, [1] * n)} for n in (50, 500, 4000, 9000)}
    assert picks == {50: {"p0"}, 500: {"p2"}, 4000: {"p4"}, 9000: {"p6"}}
    # inside a slice, least outstanding wins; other slices' loads do not matter
    loads[6], loads[0] = PrefillLoad("p6", 10_000), PrefillLoad("p0", 99_999)
    assert p.pick(loads, [1] * 9000) == "p7"
    assert p.pick(loads, [1] * 10) == "p1"


def test_length_buckets_share_workers_when_there_are_fewer_than_buckets() -> None:
    p = LengthBuckets()
    two = [PrefillLoad("a", 0), PrefillLoad("b", 0)]
    assert [p.pick(two, [1] * n) for n in (10, 500, 2000, 9000)] == ["a", "a", "b", "b"]
    one = [PrefillLoad("only", 7)]
    assert {p.pick(one, [1] * n) for n in (10, 500, 2000, 9000)} == {"only"}


@pytest.mark.parametrize("bad", [(), (0, 10), (10, 10), (5, 1), (1, 2, 3, 4)])
def test_length_buckets_reject_bad_thresholds(bad: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="thresholds"):
        make_placement("length-buckets", thresholds=bad)


def test_decode_order_is_least_kv_usage_first_and_stable() -> None:
    loads = [DecodeLoad("d0", 0.5), DecodeLoad("d1", 0.0), DecodeLoad("d2", 0.0),
             DecodeLoad("d3", 0.2)]
    assert decode_order("least-kv-usage", loads) == ["d1", "d2", "d3", "d0"]


def test_decode_order_least_legs_uses_the_routers_own_counts() -> None:
    loads = [DecodeLoad("d0", 0.0, legs=3), DecodeLoad("d1", 0.9, legs=1),
             DecodeLoad("d2", 0.0, legs=1)]
    assert decode_order("least-legs", loads) == ["d1", "d2", "d0"]
