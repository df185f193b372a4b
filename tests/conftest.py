from __future__ import annotations

import os
from pathlib import Path

import pytest

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
