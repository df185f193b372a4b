"""Issue 37, item 3: an engine is built, warmed up and compiled on the thread that steps
it. Runners were built on the actor's (or main) thread and stepped on the WorkerLoop
thread; a CUDA-graph step on a thread that did not record the graphs asserts in torch's
cudagraph trees (torch 2.11, the GPU image's: the compiled step then turns itself off for
good) or records every graph again on newer torch. `WorkerLoop(build=...)` builds on the
loop thread; the worker actors (runtime/worker.py), the colocated pool, the in-server
colocated backend and the GPU check's in-process service all use it."""

from __future__ import annotations

import threading

import pytest

from engine import LLM
from runtime.loop import WorkerLoop
from runtime.messages import WorkerEvent


class _Engine:
    worker_id = "w-0"
    has_work = False
    last_step_ran = False

    def __init__(self) -> None:
        self.built_on = threading.get_ident()
        self.stepped_on: set[int] = set()

    def step(self) -> list[WorkerEvent]:
        self.stepped_on.add(threading.get_ident())
        return []

    def fail_all(self, message: str) -> list[WorkerEvent]:
        return []


def test_a_built_engine_is_built_and_stepped_on_the_loop_thread():
    loop = WorkerLoop(build=_Engine, on_events=lambda events: None)
    try:
        eng = loop.engine
        assert isinstance(eng, _Engine)  # built before the constructor returned
        assert eng.built_on == loop._thread.ident != threading.get_ident()
        assert loop.call(threading.get_ident) == eng.built_on
        assert loop._thread.name == "worker-loop:w-0"
        assert eng.stepped_on <= {eng.built_on}
    finally:
        loop.stop()
    assert not loop._thread.is_alive()


def test_a_failed_build_raises_from_the_constructor_and_leaves_no_thread():
    def broken() -> _Engine:
        raise RuntimeError("no GPU memory left")

    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="no GPU memory left"):
        WorkerLoop(build=broken, on_events=lambda events: None)
    assert not [t for t in set(threading.enumerate()) - before if t.is_alive()]
    with pytest.raises(ValueError, match="an engine or a build function"):
        WorkerLoop(on_events=lambda events: None)


def test_the_colocated_backend_builds_its_engine_on_its_loop_thread(tiny_model):
    from cluster.launch.local_backend import LocalBackend

    backend = LocalBackend(lambda: LLM(str(tiny_model), max_num_seqs=4))
    try:
        runner = backend.llm.runner
        assert runner.thread == backend._loop._thread.ident != threading.get_ident()
        assert backend.engine.llm is backend.llm and backend.vocab_size > 0
    finally:
        backend._loop.stop()
    assert not backend._loop._thread.is_alive()


def test_the_gpu_checks_in_process_service_builds_each_engine_on_its_loop(tiny_model,
                                                                          monkeypatch):
    """tools/gpu_check_service.py's 1P+1D without Ray, on the CPU: each runner belongs to
    its loop's thread, and the greedy outputs equal the colocated engine's."""
    from runtime import loop as loop_mod
    from tools import gpu_check_service as svc

    built: list[tuple[int, int]] = []  # (runner's thread, its loop's thread)
    real_init = loop_mod.WorkerLoop.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        built.append((self.engine.runner.thread, self._thread.ident))

    monkeypatch.setattr(loop_mod.WorkerLoop, "__init__", init)
    wl = svc.workload(vocab=LLM(str(tiny_model)).config.model.vocab_size, n=3, lo=5, hi=40,
                      max_tokens=4)
    pd = svc.run_inprocess_pd(str(tiny_model), "cpu", "float32", wl)
    assert len(built) == 2 and all(r == t for r, t in built)
    assert pd["failures"] == [] and pd["kv_blocks_used_at_end"] == {"prefill": 0, "decode": 0}
    co = svc.run_colocated(str(tiny_model), "cpu", "float32", wl)
    assert pd["tokens"] == co["tokens"]
