"""transfer.early_kv_* (ServeConfig): the bounds of the KV a decode worker holds for a
leg whose reserve has not come yet reach that worker's EarlyKV, from YAML or flags; bad
values are refused naming the key; the defaults are EarlyKVConfig's own."""

from __future__ import annotations

import argparse
from unittest import mock

import pytest

from cluster.config.flags import add_cli_flags, config_from_args
from cluster.config.serve import ServeConfig
from cluster.launch.placement import plan_pools
from cluster.launch.worker_specs import early_kv_config, worker_specs
from decode_worker.early_kv import EarlyKVConfig

EARLY = {"early_kv_leg_mb": 1.5, "early_kv_leg_chunks": 8, "early_kv_total_mb": 4,
         "early_kv_total_chunks": 32, "early_kv_ttl_s": 2.5}
WANT = EarlyKVConfig(max_leg_bytes=3 << 19, max_leg_chunks=8, max_total_bytes=4 << 20,
                     max_total_chunks=32, ttl_s=2.5)


def test_the_defaults_are_early_kv_configs_own():
    assert early_kv_config(ServeConfig()) == EarlyKVConfig()


def test_flags_set_the_keys():
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    cfg = config_from_args(parser.parse_args([
        "--early-kv-leg-mb", "1.5", "--early-kv-leg-chunks", "8", "--early-kv-total-mb", "4",
        "--early-kv-total-chunks", "32", "--early-kv-ttl-s", "2.5"]))
    assert cfg == ServeConfig.from_dict({"transfer": EARLY})
    assert early_kv_config(cfg) == WANT


def test_a_config_value_reaches_the_decode_workers_early_kv(tiny_model):
    from decode_worker.worker import DecodeWorker

    cfg = ServeConfig.from_dict({"model": {"path": str(tiny_model)}, "transfer": EARLY,
                                 "cache": {"num_blocks": 32}})
    plan = plan_pools(1, 1, device="cpu", gpus_per_worker=0, cpus_per_worker=1,
                      available={"CPU": 2})
    with mock.patch("ray.get_gpu_ids", lambda: []):
        spec = next(s for s in worker_specs(cfg, plan, str(tiny_model), "pdserve-ekv")
                    if s.role == "decode")
        assert spec.scheduler.early_kv == WANT
        worker = DecodeWorker(spec)
    try:
        assert worker.engine.early.config == WANT
    finally:
        worker.shutdown()


@pytest.mark.parametrize(("values", "message"), [
    ({"early_kv_leg_mb": 0}, "transfer.early_kv_leg_mb must be > 0, got 0"),
    ({"early_kv_total_chunks": 0}, "transfer.early_kv_total_chunks must be >= 1, got 0"),
    ({"early_kv_leg_chunks": 2.5}, "transfer.early_kv_leg_chunks must be an integer"),
    ({"early_kv_ttl_s": -1}, "transfer.early_kv_ttl_s must be > 0"),
    ({"early_kv_leg_mb": 512}, "transfer.early_kv_leg_mb must be <= "
                               "transfer.early_kv_total_mb (256.0), got 512.0"),
    ({"early_kv_leg_chunks": 9, "early_kv_total_chunks": 8},
     "transfer.early_kv_leg_chunks must be <= transfer.early_kv_total_chunks (8), got 9"),
    ({"early_kv_ttl": 5}, "unknown key 'transfer.early_kv_ttl'"),
])
def test_bad_values_are_refused_naming_the_key(values, message):
    with pytest.raises(ValueError) as e:
        ServeConfig.from_dict({"transfer": values})
    assert message in str(e.value)
