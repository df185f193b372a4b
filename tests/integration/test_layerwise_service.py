"""The disaggregated service with layer-wise final chunks (``transfer.layerwise``, issue
40) on local Ray: greedy tokens equal engine.LLM's over tcp and nixl with chunks and
blocks misaligned both ways, and the emulated service's equal the offline emulated
engine's; every run ends with the leak check. (The cheap checks of the producer, in
process: tests/unit/test_prefill_layerwise.py.)"""

from __future__ import annotations

import copy
import importlib.util

import pytest

from cluster.config.serve import ServeConfig
from cluster.grpc.client import PdserveClient
from cluster.launch.launcher import build_disaggregated_router
from cluster.serve.server import BackgroundServer
from engine.emulate.offline import emulated_engine_config
from engine.llm import LLM
from engine.request import SamplingParams
from tests.integration.test_nixl_service import CONFIGS as NIXL_CONFIGS
from tests.integration.test_nixl_service import assert_greedy_matches
from tests.integration.test_pd_router import reference as reference  # noqa: F401 - fixture

pytestmark = pytest.mark.slow
HAS_NIXL = importlib.util.find_spec("nixl_cu12") is not None


def _layerwise(cfg: dict, connector: str, groups: int) -> dict:
    out = copy.deepcopy(cfg)
    out["transfer"] = {**out["transfer"], "connector": connector, "layerwise": True,
                       "layerwise_groups": groups}
    return out


CASES = {f"{c}-{name}-g{g}": (c, name, g) for c in ("tcp", "nixl")
         for name, g in zip(NIXL_CONFIGS, (2, 8), strict=True)}


@pytest.mark.parametrize("case", [pytest.param(k, marks=pytest.mark.skipif(
    k.startswith("nixl") and not HAS_NIXL, reason="no nixl")) for k in CASES])
def test_greedy_tokens_with_layer_wise_final_chunks_match_colocated(start_router, reference,  # noqa: F811
                                                                    case):
    connector, name, groups = CASES[case]
    assert_greedy_matches(start_router(_layerwise(NIXL_CONFIGS[name], connector, groups)),
                          reference, case)


def test_the_emulated_service_with_layer_wise_sends_equals_the_offline_engine(ray_session):
    cfg = ServeConfig.from_dict({
        "model": {"emulate": "h200", "model_shape": "tiny", "dtype": "bfloat16",
                  "device": "cpu", "max_model_len": 1024},
        "pools": {"cpus_per_worker": 0.5},
        "cache": {"num_blocks": 256},
        "scheduler": {"max_prefill_chunk": 64, "max_num_batched_tokens": 256},
        "transfer": {"connector": "tcp", "layerwise": True, "layerwise_groups": 2},
        "limits": {"request_timeout_s": 120, "kv_wait_timeout_s": 40},
        "server": {"port": 0},
    })
    router = build_disaggregated_router(cfg)
    srv = BackgroundServer(router, cfg, health_poll_s=0.2)
    srv.start()
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        llm = LLM.from_config(emulated_engine_config("h200", "tiny", max_model_len=1024))
        with PdserveClient(srv.address, timeout=120) as client:
            for prompt in (list(range(5, 90)), list(range(300, 333)), [7] * 200):
                got = client.complete(prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
                want = llm.generate([prompt], sp)[0]
                assert list(got.token_ids) == want.token_ids and got.finish_reason == "length"
    finally:
        srv.stop(drain_timeout_s=0)
