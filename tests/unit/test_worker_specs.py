"""ServeConfig -> WorkerSpec (cluster/launch/worker_specs.py): every worker gets typed configs,
built once, with one name per knob; the secret stays out of every repr; specs pickle (Ray
sends them to the actors). And the typed stats a worker answers, as the API sees them."""

from __future__ import annotations

import pickle

from cluster.config.serve import ServeConfig
from cluster.launch.placement import plan_pools
from cluster.launch.worker_specs import worker_specs
from cluster.router.pool import WorkerHandle
from decode_worker.scheduler import DecodeSchedulerConfig
from kv_transfer.config import TransferConfig
from prefill_worker.scheduler import PrefillSchedulerConfig
from runtime.stats import DecodeStats, PrefillStats


def _specs(tiny_model, **sections):
    cfg = ServeConfig.from_dict({"model": {"path": str(tiny_model)}, **sections})
    plan = plan_pools(1, 1, device="cpu", gpus_per_worker=0, cpus_per_worker=1,
                      available={"CPU": 2})
    return worker_specs(cfg, plan, str(tiny_model), "pdserve-abc123",
                        fault_injection={"faults": [{"kind": "drop", "max_count": 1}]})


def test_each_worker_gets_its_typed_configs_translated_once(tiny_model):
    prefill, decode = _specs(tiny_model, scheduler={
        "fairness_policy": "wfq", "max_prefill_chunk": 64, "tenant_weights": {"a": 2.0}},
        transfer={"send_queue": "wfq", "connector": "tcp"},
        cache={"decode_block_size": 8}, limits={"kv_wait_timeout_s": 7.0})
    assert isinstance(prefill.scheduler, PrefillSchedulerConfig)
    assert (prefill.scheduler.fairness_policy, prefill.scheduler.max_prefill_chunk) == ("wfq", 64)
    assert dict(prefill.scheduler.tenant_weights) == {"a": 2.0}
    assert isinstance(decode.scheduler, DecodeSchedulerConfig)
    assert decode.scheduler.kv_wait_timeout_s == 7.0
    assert decode.scheduler.max_model_len == decode.engine.scheduler.max_model_len
    assert isinstance(prefill.transfer, TransferConfig) and prefill.transfer is decode.transfer
    assert prefill.transfer.send_queue == "wfq"
    assert prefill.engine.cache.enable_prefix_caching and not decode.engine.cache.enable_prefix_caching
    assert (prefill.engine.cache.block_size, decode.engine.cache.block_size) == (16, 8)
    assert decode.actor_name == "pdserve-abc123-decode-0"
    assert [f.kind for f in decode.faults.faults] == ["drop"]
    assert prefill.connector_kwargs() == {"name": "prefill-0"} and decode.connector_kwargs() == {}


def test_the_secret_stays_out_of_reprs_and_specs_pickle(tiny_model):
    specs = _specs(tiny_model, transfer={"connector": "tcp"})
    secret = specs[0].transfer.secret
    assert len(secret) == 32
    for text in (repr(specs), str(specs), repr(specs[0].transfer)):
        assert secret.hex() not in text and repr(secret) not in text
    back = pickle.loads(pickle.dumps(specs))
    assert back == specs and back[0].transfer.secret == secret


def test_typed_stats_become_the_apis_worker_stats():
    p = WorkerHandle("prefill-0", "prefill", actor=None)
    p.stats = PrefillStats(role="prefill", num_waiting=1, jobs=3, send_queue_depth=2,
                           kv_bytes_sent=10.0, chunk_sizes={16: 4}, faults={"fault_drop": 1})
    s = p.to_stats()
    assert (s.queue_depth, s.send_queue_depth) == (3, 2)  # prefill: legs held, not waiting
    assert s.extra["jobs"] == 3 and s.extra["kv_bytes_sent"] == 10 and s.extra["fault_drop"] == 1
    assert "chunk_sizes" not in s.extra and "role" not in s.extra and p.chunk_sizes == {16: 4}
    d = WorkerHandle("decode-0", "decode", actor=None, num_blocks=10)
    d.stats = DecodeStats(role="decode", num_waiting=2, kv_blocks_used=5)
    assert d.to_stats().queue_depth == 2 and d.kv_usage == 0.5 and d.chunk_sizes == {}
    assert WorkerHandle("x", "decode", actor=None).to_stats().num_running == 0  # no stats yet
