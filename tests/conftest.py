from __future__ import annotations

import os
from pathlib import Path

import pytest

# setuptools first, while the import system is clean: inductor's C++ builder imports it
# on the first compile, and after the integration tests have run in this process its
# distutils shim no longer finds setuptools._distutils (AssertionError naming the stdlib
# distutils), which turned every compiled step of a full run into an eager fallback
import setuptools  # noqa: E402, F401, I001

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny deterministic models of each architecture, made once per test session."""
    from engine.tiny_model import make_model

    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, "tiny", arch) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def tiny_model(model_dirs) -> Path:
    return model_dirs["llama"]
