"""ServeConfig: YAML round trip, unknown keys, flag overrides, value checks, --help."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest
import yaml

from cluster.cli import main
from cluster.config.flags import add_cli_flags, config_from_args, flag_name, iter_keys
from cluster.config.serve import SECTIONS, ServeConfig


def _parse(argv: list[str]) -> ServeConfig:
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    return config_from_args(parser.parse_args(argv))


def test_yaml_round_trip_preserves_every_value(tmp_path):
    cfg = ServeConfig().with_values({
        "pools.prefill_workers": 3, "pools.address": "auto", "cache.num_blocks": 500,
        "scheduler.fairness_policy": "wfq", "scheduler.tenant_weights": {"gold": 4, "free": 1},
        "transfer.send_policy": "paced", "transfer.rate_gbps": 12.5,
        "limits.max_prompt_tokens": 1000, "server.port": 6000,
    })
    path = tmp_path / "serve.yaml"
    path.write_text(cfg.to_yaml())
    again = ServeConfig.from_yaml(path)
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()
    assert dict(again.scheduler.tenant_weights) == {"gold": 4.0, "free": 1.0}
    assert ServeConfig.from_dict(yaml.safe_load(ServeConfig().to_yaml())) == ServeConfig()


def test_defaults_match_the_documented_ones():
    cfg = ServeConfig()
    assert (cfg.model.path, cfg.model.dtype, cfg.model.device) == ("tiny", "float32", "auto")
    assert (cfg.pools.prefill_workers, cfg.pools.decode_workers, cfg.pools.colocated) == (1, 1, False)
    assert cfg.cache.block_size == 16 and cfg.cache.effective_prefill_block_size == 16
    assert cfg.cache.kv_cache_memory_bytes == 1 << 30
    assert (cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_prefill_chunk) == (512, 256)
    assert (cfg.limits.max_queue_len, cfg.limits.drain_timeout_s) == (256, 30.0)
    assert (cfg.server.host, cfg.server.port, cfg.server.metrics_port) == ("127.0.0.1", 50051, None)


@pytest.mark.parametrize("data, message", [
    ({"pools": {"prefil_workers": 2}},
     "unknown key 'pools.prefil_workers' in cfg.yaml; did you mean 'prefill_workers'?"),
    ({"pool": {"prefill_workers": 2}}, "unknown section 'pool' in cfg.yaml; did you mean 'pools'?"),
    ({"scheduler": {"max_prefil_chunk": 8}}, "did you mean 'max_prefill_chunk'?"),
])
def test_unknown_keys_are_rejected_naming_them(tmp_path, data, message):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError) as e:
        ServeConfig.from_yaml(path)
    assert message in str(e.value)


@pytest.mark.parametrize("key, value", [
    ("limits.max_queue_len", 0), ("scheduler.max_prefill_chunk", -1), ("server.port", 70000),
    ("model.dtype", "float8"), ("model.device", "tpu"), ("transfer.connector", "carrier-pigeon"),
    ("scheduler.fairness_policy", "lottery"), ("cache.kv_cache_memory_gb", 0),
    ("pools.prefill_workers", "2"), ("cache.enable_prefix_caching", "yes"),
    ("scheduler.tenant_weights", {"a": -1}), ("server.log_level", "loud"),
    ("transfer.rate_gbps", -5.0), ("model.max_model_len", 1),
])
def test_invalid_values_are_rejected_naming_the_key(key, value):
    with pytest.raises(ValueError) as e:
        ServeConfig().with_values({key: value})
    assert key in str(e.value)


def test_cross_field_checks_name_the_key():
    with pytest.raises(ValueError, match="transfer.rate_gbps"):
        ServeConfig().with_values({"transfer.send_policy": "paced"})
    with pytest.raises(ValueError, match="transfer.rate_gbps.*link_gbps"):  # silently unused
        ServeConfig().with_values({"transfer.send_policy": "at_end", "transfer.rate_gbps": 1.0})
    with pytest.raises(ValueError, match="server.tls_key"):
        ServeConfig().with_values({"server.tls_cert": "cert.pem"})


def test_flags_override_the_file(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({
        "pools": {"prefill_workers": 2, "decode_workers": 3},
        "scheduler": {"max_prefill_chunk": 128, "fairness_policy": "srpt"},
        "cache": {"enable_prefix_caching": True},
    }))
    cfg = _parse(["--config", str(path), "--prefill-workers", "4", "--max-prefill-chunk", "64",
                  "--no-enable-prefix-caching", "--send-policy", "at_end",
                  "--tenant-weights", "gold=3,free=1", "--rate-gbps", "none"])
    assert cfg.pools.prefill_workers == 4  # flag wins
    assert cfg.pools.decode_workers == 3  # file kept where no flag was given
    assert cfg.scheduler.max_prefill_chunk == 64
    assert cfg.scheduler.fairness_policy == "srpt"
    assert cfg.cache.enable_prefix_caching is False
    assert cfg.transfer.send_policy == "at_end"
    assert dict(cfg.scheduler.tenant_weights) == {"gold": 3.0, "free": 1.0}
    assert cfg.transfer.rate_gbps is None
    assert _parse([]) == ServeConfig()  # no flags, no file: the defaults


def test_every_key_has_a_flag_and_help():
    keys = list(iter_keys())
    assert len(keys) == sum(len(fields(s)) for s in SECTIONS.values()) >= 40
    for dotted, f in keys:
        assert f.metadata["help"], dotted
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    for dotted, _ in keys:
        assert flag_name(dotted) in parser._option_string_actions, dotted


def test_help_mentions_every_key(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    top = capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    serve = capsys.readouterr().out
    for dotted, _ in iter_keys():
        section, _, key = dotted.partition(".")
        assert key in top, dotted
        assert flag_name(dotted) in serve and dotted in serve, dotted
    assert "--prefill-workers" in serve and "--send-policy" in serve


def test_serve_with_a_bad_config_exits_with_the_message(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text("pools:\n  prefil_workers: 2\n")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--config", str(path)])
    assert e.value.code == 2
    assert "unknown key 'pools.prefil_workers' in cfg.yaml" in capsys.readouterr().err


def test_choices_and_their_help_come_from_the_registries(capsys):
    from engine.attention.registry import ATTENTION_BACKENDS
    from kv_transfer.pacing import SEND_POLICIES
    from kv_transfer.registry import CONNECTORS
    from kv_transfer.send_queue import SEND_QUEUES
    from prefill_worker.policies import CHUNK_POLICIES, FAIRNESS_POLICIES

    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    actions = parser._option_string_actions
    for flag, registry in (("--fairness-policy", FAIRNESS_POLICIES),
                           ("--chunk-policy", CHUNK_POLICIES), ("--connector", CONNECTORS),
                           ("--send-policy", SEND_POLICIES), ("--send-queue", SEND_QUEUES),
                           ("--attention-backend", ATTENTION_BACKENDS)):
        assert tuple(actions[flag].choices) == registry.names(), flag
        for name in registry:
            assert f"{name} ({registry.help(name)})" in actions[flag].help, (flag, name)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "priority (lowest request priority first" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(ValueError, match=r"scheduler.fairness_policy must be one of \[.*'priority'"
                       r"\], got 'priorty'; did you mean 'priority'\?"):
        ServeConfig().with_values({"scheduler.fairness_policy": "priorty"})


def test_the_worker_configs_use_the_serving_configs_names():
    """One name per knob from YAML to the scheduler and the connector (no translation
    table: `scheduler.fairness_policy` is PrefillSchedulerConfig.fairness_policy)."""
    from kv_transfer.config import TransferConfig
    from prefill_worker.scheduler import PrefillSchedulerConfig

    def names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    assert {"max_num_batched_tokens", "max_prefill_chunk", "fairness_policy", "chunk_policy",
            "aging_s", "tenant_weights", "max_num_seqs"} <= names(SECTIONS["scheduler"]) & names(
        PrefillSchedulerConfig)
    assert {"connector", "send_policy", "send_queue", "bind_host", "failure_timeout_s"} <= names(
        SECTIONS["transfer"]) & names(TransferConfig)
    with pytest.raises(TypeError):  # one name per knob: the old spelling is gone
        PrefillSchedulerConfig(fairness="srpt")


def test_field_types_come_from_the_annotations():
    from collections.abc import Mapping

    from cluster.config.fields import field_type

    kinds = {f.name: field_type(SECTIONS["cache"], f) for f in fields(SECTIONS["cache"])}
    assert (kinds["block_size"].base, kinds["block_size"].optional) == (int, False)
    assert (kinds["num_blocks"].base, kinds["num_blocks"].optional) == (int, True)
    assert kinds["enable_prefix_caching"].base is bool
    assert field_type(SECTIONS["scheduler"], next(
        f for f in fields(SECTIONS["scheduler"]) if f.name == "tenant_weights")).base is Mapping
    with pytest.raises(ValueError, match="scheduler.aging_s must be > 0"):
        ServeConfig().with_values({"scheduler.aging_s": 0})  # the prefill scheduler's rule too
