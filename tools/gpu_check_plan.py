"""The GPU check's plan: its steps in the order they run, each with its time limit, the
least time worth starting it with, and what it needs (tools/gpu_check.py runs it; the
step functions are in tools/gpu_check_steps.py). Imports nothing heavy: `--dry-run`
prints this plan on any machine.

The lease it is sized for: one H200, 15 minutes of device time in all (its start-up
included), at most 10 minutes a command, a working tree of at most 64 MiB, nothing
fetched there, cold Triton and inductor caches, the image's torch 2.11 and Triton 3.6,
and no Ray. The check ends within BUDGET_S (7.5 minutes): with the machine's start that
is one command of under 10 minutes, and leaves time in the lease to rerun a part.
"""

from __future__ import annotations

from dataclasses import dataclass

BUDGET_S = 450.0  # the whole run, start to end (the parent's own overhead included)
END_RESERVE_S = 5.0  # kept back at the end: the last JSON write and the summary


@dataclass(frozen=True)
class Ctx:
    """What a step function gets: the model directory, the device ('cuda:0', or 'cpu' for
    the CPU-safe parts), the dtype, `quick`, its own time limit and the run's work
    directory (shared by its steps: the eager engine's tokens, process groups to end)."""

    model_dir: str
    device: str
    dtype: str
    quick: bool
    timeout_s: float
    work_dir: str = ""

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


@dataclass(frozen=True)
class Step:
    """One step: `fn` "module:function" (ctx) -> dict, run in its own process group."""

    name: str
    fn: str
    limit_s: float  # killed (its whole process group) once over it
    min_s: float  # with less time left than this it is skipped for the budget
    needs_cuda: bool
    needs_model: bool  # skipped when the model step failed
    what: str


_S = "tools.gpu_check_steps:"
# Limits from the first run on a lent H200 (2026-12-04, cold caches): env 12 s, model 26 s,
# kernels_bf16 13 s, the compiled engine's start-up 136 s (9 CUDA graphs, inductor cold),
# the overlap step 159 s at 64 streams on a cold machine, decode_sweep over 90 s, the eager
# engine over 75 s (cut off without a word: it prints its stages now). Most valuable first. The first CORE steps' limits add up to no more than BUDGET_S less
# END_RESERVE_S: they always get their full limits. The steps after them run on the time
# the core left (steps mostly end well before their limits), each only with at least its
# min_s left: the plan can never run past the budget.
PLAN: tuple[Step, ...] = (
    Step("env", _S + "step_env", 15, 10, False, False,
         "versions, GPU, free memory, the modules the steps import"),
    Step("model", _S + "step_model", 45, 30, False, False,
         "write the model (random weights of the preset's shape)"),
    Step("kernels_bf16", _S + "step_kernels_bf16", 30, 20, True, False,
         "Triton decode/prefill in bf16 vs the fp32 torch reference"),
    Step("engine_compiled", _S + "step_engine_compiled", 180, 90, True, True,
         "compile=decode (CUDA graphs): tok/s vs eager, no retrace"),
    Step("overlap", _S + "step_overlap", 150, 60, True, True,
         "decode host one step ahead on/off: tok/s, device busy (CUPTI), 64/256 streams"),
    # ---- extras: on the time the core left
    Step("engine", _S + "step_engine", 90, 40, False, True,
         "engine.LLM eager: start-up, greedy and sampled tok/s"),
    Step("kv_export", _S + "step_kv_export", 30, 15, False, False,
         "KV export/import, 8B-shaped cache, pinned receive buffer"),
    Step("decode_sweep", "tools.gpu_decode_step:gpu_check_step", 90, 60, True, True,
         "CUDA-graph vs eager decode step, batch 1..256, vs HBM"),
    Step("attention_bw", _S + "step_attention_bw", 60, 30, True, False,
         "decode attention bandwidth vs the measured copy rate"),
    Step("pytest", _S + "step_pytest", 150, 60, True, False,
         "tests/gpu, 60 s a test; killed: output kept"),
    Step("service", _S + "step_service", 90, 45, False, True,
         "1P+1D in process (no Ray) vs colocated, greedy equality"),
    Step("tp_one_gpu", _S + "step_tp_one_gpu", 60, 30, True, False,
         "TP=2 on one GPU over gloo: rank 0's warm-up, exactness"),
)
CORE = 5  # the first CORE steps of PLAN
# what the lease carries beyond the working tree: nothing (the image has every module
# the steps import: tools/gpu_check_steps.py NEEDED_MODULES); not there and not needed
CARRIED_WHEELS: tuple[str, ...] = ()
NOT_NEEDED = ("ray (the in-process P/D path runs instead)",
              "starlette, uvicorn, pydantic, openai (the HTTP door is not checked)",
              "gguf (the real model's fetch; the steps use preset shapes)")
