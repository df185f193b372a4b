"""The disaggregated service over `--connector nixl` on local Ray: real NIXL agents in the
prefill and decode worker processes. Greedy tokens equal engine.LLM's across chunk and
block sizes (misaligned both ways), send policies, queues and the emulated link, and
transformers' under different TP on the two pools; every run ends with the leak check
(zero used blocks, empty queues on every worker)."""

from __future__ import annotations

import importlib.util

import pytest

from cluster.router.types import GenerateSpec, RouterError
from tests.integration.test_pd_router import GREEDY, assert_quiescent, prompts
from tests.integration.test_pd_router import reference as reference  # noqa: F401 - fixture
from tests.integration.test_tp_service import (
    test_different_tp_on_the_two_pools_matches_transformers as check_tp_service,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None,
                                reason="the nixl package is not installed")

CONFIGS = {
    # chunk 7 against blocks 16 -> 32: chunks and blocks misaligned on both sides
    "1P1D-eager-16to32-c7": {"transfer": {"connector": "nixl", "send_policy": "eager"},
                             "cache": {"prefill_block_size": 16, "decode_block_size": 32},
                             "scheduler": {"max_prefill_chunk": 7}},
    # smaller decode blocks, paced, the fair queue and the emulated link above the transport
    "1P1D-paced-wfq-32to8-c33": {"transfer": {"connector": "nixl", "send_policy": "paced",
                                              "rate_gbps": 2.0, "send_queue": "wfq",
                                              "link_gbps": 4.0},
                                 "cache": {"prefill_block_size": 32, "decode_block_size": 8},
                                 "scheduler": {"max_prefill_chunk": 33}},
}


def assert_greedy_matches(runner, reference, name: str) -> None:
    """12 prompts (seeded by ``name``) served greedily equal ``reference``'s tokens, in
    full; then the leak check, and the runner is closed."""
    ps = prompts(12, seed=len(name))
    results = runner.generate_many(
        [GenerateSpec(f"{name}-{i}", tuple(p), GREEDY) for i, p in enumerate(ps)])
    for (toks, last), ref, p in zip(results, reference(ps), ps, strict=True):
        assert not isinstance(last, RouterError), last
        assert toks == ref, f"prompt of {len(p)} tokens"
        assert last.finished and last.usage.completion_tokens == GREEDY.max_tokens
    assert_quiescent(runner)
    runner.close()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_tokens_over_nixl_match_colocated(start_router, reference, name):  # noqa: F811
    assert_greedy_matches(start_router(CONFIGS[name]), reference, name)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [
    (2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])  # (1, 2): test_kv_tp_transfer.py
def test_different_tp_on_the_two_pools_over_nixl_matches_transformers(ray_session, tiny_model,
                                                                      prefill_tp, decode_tp):
    check_tp_service(ray_session, tiny_model, prefill_tp, decode_tp, "nixl")
