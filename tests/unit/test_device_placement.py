"""Devices and placement without a GPU: which torch device a worker resolves (in and out
of Ray actors), that every thread driving a runner binds its device, and pool plans on
fake GPUs (fractional shares when workers outnumber GPUs, pinned pools, the colocated
baseline)."""

from __future__ import annotations

import threading

import pytest
import torch

from cluster.launch.placement import plan_colocated, plan_pools
from engine.device import ThreadBinder, resolve_device

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


# ---- resolve_device --------------------------------------------------------------------
@pytest.mark.parametrize(("requested", "count", "ray_ids", "current", "want"), [
    ("cpu", 2, None, 0, torch.device("cpu")),
    ("auto", 0, None, 0, torch.device("cpu")),
    ("auto", 2, None, 1, CUDA1),  # one process: the current device
    ("cuda", 2, None, 1, CUDA1),
    ("cuda:1", 2, None, 0, CUDA1),
    # inside a Ray actor: Ray made its GPU visible as cuda:0, whatever the cluster index
    ("cuda:1", 1, ["1"], 0, CUDA0),
    ("cuda", 1, ["3"], 0, CUDA0),
    ("auto", 1, ["0"], 0, CUDA0),
    # an actor Ray gave no GPU runs on the CPU under 'auto' (visible GPUs are not its own)
    ("auto", 4, [], 0, torch.device("cpu")),
    ("cpu", 4, [], 0, torch.device("cpu")),
])
def test_resolve_device(requested, count, ray_ids, current, want):
    assert resolve_device(requested, count, ray_ids, current) == want


@pytest.mark.parametrize(("requested", "count", "ray_ids", "match"), [
    ("cuda:2", 2, None, r"only 2 CUDA device\(s\) are visible"),
    ("cuda", 0, None, "no CUDA device is visible"),
    ("cuda:0", 0, ["0"], "no CUDA device is visible"),
    ("cuda", 4, [], "Ray assigned this worker no GPU"),
    ("gpu", 1, None, "device must be"),
])
def test_resolve_device_errors_name_the_problem(requested, count, ray_ids, match):
    with pytest.raises(ValueError, match=match):
        resolve_device(requested, count, ray_ids)


def test_every_thread_binds_the_device_once():
    calls: list[tuple[str, torch.device]] = []
    bind = ThreadBinder(CUDA1, set_device=lambda d: calls.append(
        (threading.current_thread().name, d)))
    bind()
    bind()  # same thread: once
    threads = [threading.Thread(target=lambda: (bind(), bind()), name=f"loop-{i}")
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    names = [n for n, _ in calls]
    assert sorted(names) == sorted(["MainThread", "loop-0", "loop-1", "loop-2"])
    assert {d for _, d in calls} == {CUDA1}
    cpu = ThreadBinder(torch.device("cpu"), set_device=lambda d: calls.append(("cpu", d)))
    cpu()
    assert ("cpu", torch.device("cpu")) not in calls


def test_the_runner_binds_the_thread_that_executes_it(tiny_model, monkeypatch):
    # the runner calls its binder on every execute: a loop thread it never saw binds too
    from engine import LLM, SamplingParams

    llm = LLM(str(tiny_model), num_blocks=16)
    seen: list[str] = []
    real = llm.runner.bind
    llm.runner.bind = lambda: (seen.append(threading.current_thread().name), real())[1]
    t = threading.Thread(target=lambda: llm.generate([[5, 6, 7]], SamplingParams(
        temperature=0, max_tokens=2)), name="engine-loop")
    t.start()
    t.join()
    assert seen and set(seen) == {"engine-loop"}


# ---- pool plans on fake GPUs -------------------------------------------------------------
def test_defaults_on_one_gpu_share_it_and_say_so():
    plan = plan_pools(1, 1, device="auto", gpus_per_worker=1.0, cpus_per_worker=1.0,
                      available={"CPU": 2, "GPU": 1})
    assert plan.use_gpus and [w.num_gpus for w in plan.workers] == [0.5, 0.5]
    assert all(w.gpu_share == 0.5 for w in plan.workers)
    assert "share 1 GPU(s): 0.5 GPU each" in plan.note and "gpus_per_worker=1" in plan.note


def test_whole_gpus_when_they_suffice_and_no_note():
    plan = plan_pools(2, 2, device="cuda", gpus_per_worker=1.0, cpus_per_worker=1.0,
                      available={"GPU": 4}, nodes=[{"GPU": 2}, {"GPU": 2}])
    assert [w.num_gpus for w in plan.workers] == [1.0] * 4 and plan.note == ""
    assert all(w.gpu_share == 1.0 for w in plan.workers)


@pytest.mark.parametrize(("workers", "nodes", "share"), [
    ((3, 1), [{"GPU": 2}], 0.5),  # 4 workers, 2 GPUs: 2 per GPU
    ((2, 1), [{"GPU": 1}, {"GPU": 1}], 0.5),  # 3 workers over two 1-GPU nodes
    ((4, 3), [{"GPU": 2}], 0.25),  # 7 workers on 2 GPUs: 4 per GPU (3 would not fit 7)
])
def test_fractional_shares_are_the_largest_that_place_every_worker(workers, nodes, share):
    gpus = sum(n["GPU"] for n in nodes)
    plan = plan_pools(*workers, device="cuda", gpus_per_worker=1.0, cpus_per_worker=1.0,
                      available={"GPU": gpus}, nodes=nodes)
    assert {w.num_gpus for w in plan.workers} == {share}
    assert plan.total_gpus <= gpus


def test_an_explicit_share_that_fits_is_kept():
    plan = plan_pools(1, 1, device="cuda", gpus_per_worker=0.25, cpus_per_worker=1.0,
                      available={"GPU": 1})
    assert [w.num_gpus for w in plan.workers] == [0.25, 0.25] and plan.note == ""


def test_pinned_pools_are_planned_on_their_own_nodes():
    nodes = [{"GPU": 1, "prefill_node": 1}, {"GPU": 1, "decode_node": 1}]
    plan = plan_pools(3, 1, device="cuda", gpus_per_worker=1.0, cpus_per_worker=1.0,
                      available={"GPU": 2}, nodes=nodes,
                      prefill_resources={"prefill_node": 0.01},
                      decode_resources={"decode_node": 0.01})
    assert [w.num_gpus for w in plan.role("prefill")] == [0.3333] * 3  # 3 on one GPU
    assert [w.num_gpus for w in plan.role("decode")] == [1.0]  # alone on its node
    assert plan.role("prefill")[0].resources == {"prefill_node": 0.01}
    assert "3 prefill workers share 1 GPU(s)" in plan.note and "decode" not in plan.note


def test_a_pinned_pool_without_gpu_nodes_is_an_error():
    with pytest.raises(ValueError, match="offer no GPU"):
        plan_pools(1, 1, device="cuda", gpus_per_worker=1.0, cpus_per_worker=1.0,
                   available={"GPU": 1}, nodes=[{"GPU": 1}, {"decode_node": 1}],
                   decode_resources={"decode_node": 0.01})


def test_cuda_without_gpus_and_zero_gpus_per_worker_are_errors():
    with pytest.raises(ValueError, match="needs GPUs; the cluster has none"):
        plan_pools(1, 1, device="cuda", gpus_per_worker=1.0, cpus_per_worker=1.0,
                   available={"CPU": 4})
    with pytest.raises(ValueError, match="gpus_per_worker must be > 0"):
        plan_pools(1, 1, device="auto", gpus_per_worker=0, cpus_per_worker=1.0,
                   available={"GPU": 1})


def test_cpu_clusters_ask_for_no_gpus():
    plan = plan_pools(2, 2, device="auto", gpus_per_worker=1.0, cpus_per_worker=2.0,
                      available={"CPU": 8})
    assert not plan.use_gpus and plan.total_gpus == 0 and plan.total_cpus == 8
    assert all(w.torch_threads == 2 for w in plan.workers)


def test_the_colocated_baseline_is_placed_on_gpus_like_the_pools():
    plan = plan_colocated(2, device="auto", gpus_per_worker=1.0, cpus_per_worker=1.0,
                          available={"GPU": 2})
    assert [w.worker_id for w in plan.workers] == ["colocated-0", "colocated-1"]
    assert [w.num_gpus for w in plan.workers] == [1.0, 1.0]
    shared = plan_colocated(3, device="auto", gpus_per_worker=1.0, cpus_per_worker=1.0,
                            available={"GPU": 1})
    assert {w.num_gpus for w in shared.workers} == {0.3333} and "3 colocated" in shared.note
    cpu = plan_colocated(2, device="auto", gpus_per_worker=1.0, cpus_per_worker=1.0,
                         available={"CPU": 2})
    assert cpu.total_gpus == 0
