from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module's tests (`pytestmark =
    pytest.mark.usefixtures("one_torch_thread")`): with tiny tensors a second OpenMP
    thread only adds barrier waits on a busy 2-core box."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def triton_interpreter():
    """Triton's interpreter (and single-threaded OpenBLAS) for a module's tests; the module
    imports its kernels from tests/triton_interp.py."""
    from tests.triton_interp import interpreter_session

    with interpreter_session():
        yield


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny deterministic models of each architecture, made once per test session."""
    from engine.tiny_model import make_model

    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, "tiny", arch) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def tiny_model(model_dirs) -> Path:
    return model_dirs["llama"]
