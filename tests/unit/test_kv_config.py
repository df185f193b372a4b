"""TransferConfig validation: every bad field is rejected with a message naming it."""

from __future__ import annotations

import dataclasses

import pytest

from kv_transfer import (
    CONNECTORS,
    TransferConfig,
    make_receiver,
    make_sender,
    register_connector,
)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"send_policy": "bursty"}, "send_policy"),
        ({"send_policy": "paced"}, "rate_bytes_per_s"),
        ({"rate_bytes_per_s": -1.0}, "rate_bytes_per_s"),
        ({"burst_bytes": 0}, "burst_bytes"),
        ({"send_queue": "lifo"}, "send_queue"),
        ({"connector": "carrier-pigeon"}, "connector"),
        ({"bind_host": ""}, "bind_host"),
        ({"tenant_weights": {"a": 0}}, "tenant_weights"),
        ({"default_tenant_weight": 0}, "default_tenant_weight"),
        ({"max_frame_bytes": 100}, "max_frame_bytes"),
        ({"credit_window_bytes": 1 << 20, "max_frame_bytes": 2 << 20}, "credit_window_bytes"),
        ({"coalesce_bytes": -1}, "coalesce_bytes"),
        ({"failure_timeout_s": 0}, "failure_timeout_s"),
        ({"tcp_port": 70000}, "tcp_port"),
        ({"connector": "tcp", "secret": b"short"}, "secret"),
        ({"checksum": "md5"}, "checksum"),
        ({"connector": ""}, "connector"),
    ],
)
def test_bad_fields_are_named(kwargs, field):
    with pytest.raises(ValueError, match=rf"TransferConfig\.{field}"):
        TransferConfig(**kwargs)


def test_secret_never_appears_in_repr_and_config_is_immutable():
    cfg = TransferConfig(connector="tcp", secret=b"s3cr3t-s3cr3t-s3cr3t", tenant_weights={"a": 2})
    assert b"s3cr3t".decode() not in repr(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.secret = b""  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.tenant_weights["a"] = 5  # type: ignore[index]
    assert cfg.tenant_weight("a") == 2 and cfg.tenant_weight("other") == 1.0
    assert hash(cfg) == hash(dataclasses.replace(cfg))


def test_unknown_connector_is_rejected_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown connector 'carrier-pigeon'; known: \['tcp', 'nixl', "
                       r"'ray', 'torchdist', 'inproc'\]"):
        TransferConfig(connector="carrier-pigeon")
    register_connector("gone", "kv_transfer.inproc:make_inproc_sender",
                       "kv_transfer.inproc:make_inproc_receiver")
    cfg = TransferConfig(connector="gone")
    CONNECTORS.unregister("gone")  # a config made before its connector went away
    with pytest.raises(ValueError, match="unknown connector 'gone'"):
        make_sender(cfg)
    with pytest.raises(ValueError, match="known: "):
        make_receiver(cfg)


def test_one_name_per_knob_the_old_spellings_are_gone():
    for old in ("queue_discipline", "tcp_host"):
        with pytest.raises(TypeError):
            TransferConfig(**{old: "wfq"})
    cfg = TransferConfig(send_queue="wfq")
    assert dataclasses.replace(cfg, burst_bytes=1 << 20).send_queue == "wfq"


def test_config_pickles_for_ray_and_multiprocessing():
    import pickle

    cfg = TransferConfig(connector="tcp", secret=b"0123456789abcdef", tenant_weights={"a": 3})
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and again.tenant_weight("a") == 3
    with pytest.raises(TypeError):
        again.tenant_weights.update(a=1)
