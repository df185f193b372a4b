"""The committed gRPC stubs are exactly what `python -m proto.generate` writes today."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

from proto import generate as gen  # noqa: E402

# Lines that only record the generator's version; a patch release of grpcio-tools must not
# fail the check when the generated code itself is the same.
_VERSION_STAMPS = [
    (re.compile(r"^# Protobuf Python Version: .*$", re.M), "# Protobuf Python Version: X"),
    (re.compile(r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)"
                r"\s*\d+,\s*\d+,\s*\d+,"), r"\1 X, Y, Z,"),
    (re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M), "GRPC_GENERATED_VERSION = X"),
]


def _normalized(path: Path) -> str:
    text = path.read_text()
    for pattern, repl in _VERSION_STAMPS:
        text = pattern.sub(repl, text)
    return text


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    fresh = gen.generate(tmp_path)
    committed = gen.stub_paths(gen.PROTO_ROOT)
    assert len(fresh) == len(committed) == 3
    for new, old in zip(fresh, committed, strict=True):
        assert old.exists(), f"{old} is missing; run `python -m proto.generate`"
        assert _normalized(new) == _normalized(old), (
            f"{old.name} is out of date with pdserve.proto; run `python -m proto.generate`"
        )


def test_stubs_import_by_package_path():
    from proto.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

    assert hasattr(pdserve_pb2_grpc, "GenerationStub")
    service = pdserve_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert {m.name for m in service.methods} == {"Generate", "Abort", "GetStats", "GetModelInfo"}


def test_unset_optional_fields_differ_from_zero():
    from proto.pdserve.v1 import pdserve_pb2

    unset = pdserve_pb2.GenerateRequest(text="hi")
    zero = pdserve_pb2.GenerateRequest(text="hi", temperature=0.0, max_tokens=0, seed=0)
    for name in ("temperature", "max_tokens", "seed", "top_p", "top_k", "ignore_eos"):
        assert not unset.HasField(name)
    for name in ("temperature", "max_tokens", "seed"):
        assert zero.HasField(name)
    assert unset.WhichOneof("prompt") == "text"
