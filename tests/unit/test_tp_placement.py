"""Tensor-parallel workers in the plan and the config: one actor (bundle) per rank, whole
GPUs per rank, the --prefill-tp / --decode-tp flags and YAML keys, the engine configs."""

from __future__ import annotations

import argparse

import pytest
import yaml

from cluster.config.flags import add_cli_flags, config_from_args
from cluster.config.serve import ServeConfig
from cluster.launch.placement import plan_pools
from cluster.launch.worker_specs import engine_config


def test_a_tp_worker_asks_for_one_bundle_per_rank_and_the_plan_counts_them():
    plan = plan_pools(1, 2, device="cpu", gpus_per_worker=0, cpus_per_worker=0.5,
                      available={"CPU": 4}, prefill_tp=3, decode_tp=1)
    p = plan.role("prefill")[0]
    assert p.tp == 3 and p.bundles() == [{"CPU": 0.5}] * 3
    assert [w.tp for w in plan.role("decode")] == [1, 1]
    assert plan.total_cpus == 0.5 * 3 + 0.5 * 2
    assert "prefill-0: TP group of 3 actors (0.5 CPU each), one STRICT_PACK" in plan.report()
    assert "decode-1: 1 actor (0.5 CPU)" in plan.report()


def test_gpu_ranks_get_whole_gpus_and_sharing_is_refused():
    plan = plan_pools(1, 1, device="cuda", gpus_per_worker=1.0, cpus_per_worker=1.0,
                      available={"CPU": 8, "GPU": 4}, prefill_tp=2, decode_tp=2)
    assert [w.bundles() for w in plan.workers] == [[{"CPU": 1.0, "GPU": 1.0}] * 2] * 2
    assert plan.total_gpus == 4
    with pytest.raises(ValueError, match="tensor-parallel size 2 need a whole GPU per rank"):
        plan_pools(1, 1, device="cuda", gpus_per_worker=1.0, cpus_per_worker=1.0,
                   available={"CPU": 8, "GPU": 2}, prefill_tp=2, decode_tp=1)


def test_tp_flags_and_yaml_keys_reach_each_roles_engine(tmp_path, tiny_model):
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    cfg = config_from_args(parser.parse_args(
        ["--model", str(tiny_model), "--prefill-tp", "2", "--decode-tp", "1"]))
    assert (cfg.pools.prefill_tp, cfg.pools.decode_tp) == (2, 1)
    f = tmp_path / "serve.yaml"
    f.write_text(yaml.safe_dump({"pools": {"decode_tp": 2}}))
    from_file = ServeConfig.from_yaml(f)
    assert (from_file.pools.prefill_tp, from_file.pools.decode_tp) == (1, 2)
    d = str(tiny_model)
    assert engine_config(cfg, d, "prefill").tensor_parallel_size == 2
    assert engine_config(cfg, d, "decode").tensor_parallel_size == 1
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's "
                                         "num_attention_heads=4"):
        engine_config(cfg.with_values({"pools.prefill_tp": 3}), d, "prefill")
    with pytest.raises(ValueError, match="prefill_tp"):
        ServeConfig.from_dict({"pools": {"prefill_tp": 0}})
