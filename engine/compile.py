"""The compiled model step: `torch.compile` of the model forward, for ModelRunner.

Modes (`EngineConfig.compile`, `LLM(compile=...)`, `--compile`):
- `none`    every step runs the eager forward;
- `decode`  steps whose rows are all single-token decodes run the compiled forward;
- `all`     every step does (prefill chunks and mixed batches too);
- `prefill` every step does, without CUDA graphs: what a prefill worker runs for `all`
            (`role_mode`: its steps are chunks; graphs of decode batches it never runs
            would cost it start-up time and graph memory);
- `auto`    the default: `AUTO_MODE` of the device type, chosen from measurements
            (bench/engine_vs_hf.py --compile; see the README's figures).

The graph covers embedding, every layer and rotary; attention is one opaque op per layer
(engine/compile_ops.py) that reads the step's caches and metadata from a context, so the
graph's inputs are token ids and positions only: its shape is the token count T and
nothing else. It is compiled with dynamic shapes, once for T == 1 and once for T >= 2
(dynamo specialises size 1), so no batch or chunk size compiles again while serving.

- CPU: inductor's C++/OpenMP kernels; batches run unpadded (a padded row costs a GEMM row).
- CUDA: decode steps run as CUDA graphs (`mode="reduce-overhead"`), one per batch-size
  bucket: a decode batch is padded to its bucket (`DECODE_BUCKETS`, as vLLM's capture
  sizes) with rows that write nowhere (slot -1). The graphs read the step buffer and a
  device-resident block table `[bucket, longest sequence the cache holds / block_size]`
  at fixed addresses; the runner rewrites only the table entries that changed since the
  last step, so a long-context step pays for its new blocks, not for padding every table
  to the full width. Prefill (`all`) runs without graphs.

Every graph is built during start-up (`warmup`), timed and logged; inductor caches its
artefacts on disk (`$TORCHINDUCTOR_CACHE_DIR`, by default under the pdserve cache), so a
second start with the same model compiles nothing. Where compiling or a compiled step
fails, the runner logs why and goes on eagerly.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.config import COMPILE_MODES

log = logging.getLogger(__name__)

# CPU: "none". Measured on the 2-core development machine (SmolLM2 fp32, one thread,
# compiled and eager steps interleaved, CPU ms): batch 1 42.7 -> 40.4, batch 4 42.5 -> 40.9,
# batch 16 76.9 -> 73.7, a 512-token chunk 1367 -> 1331 (3-5%: the GEMMs dominate), for
# 20-70 s more start-up with a warm inductor cache and minutes cold. It does not pay there.
# Rechecked with every GEMV on the packed weights (SmolLM2, two threads, steps of both
# engines interleaved in one process, load ~2.4): batch 1 33.9 -> 31.3 ms, for a 65 s cold
# start; at batch 16 no gain was measurable (the attention op and GEMMs are the same calls).
# CUDA: decode steps as CUDA graphs (launch overhead is what bounds a small decode step).
AUTO_MODE = {"cpu": "none", "cuda": "decode"}
PADDED_DECODE = {"cuda"}  # devices whose decode steps pad to buckets (CUDA graphs need it)
DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
RECOMPILE_LIMIT = 64  # dynamo's cache entries per code object (engines of several models)


def resolve_mode(mode: str, device: torch.device) -> str:
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
    return AUTO_MODE.get(device.type, "none") if mode == "auto" else mode


def runner_mode(mode: str, tensor_parallel_size: int) -> str:
    """The mode a ModelRunner compiles: a TP forward runs eager unless compiling is asked
    for by name (its all-reduces in a compiled / CUDA-graph step are not yet checked on a
    multi-GPU machine)."""
    return "none" if tensor_parallel_size > 1 and mode == "auto" else mode


def graph_table_bytes(mode: str, device: torch.device, max_num_seqs: int,
                      max_model_len: int, block_size: int) -> int:
    """Device bytes of the block tables CUDA-graph decode steps read (ModelRunner's
    `[largest bucket, max_model_len / block_size]` int32, allocated once), 0 where the
    runner records no graphs: KV sizing keeps them inside its reserve."""
    mode = resolve_mode(mode, device)
    if device.type not in PADDED_DECODE or mode not in ("decode", "all"):
        return 0
    return decode_buckets(max_num_seqs)[-1] * -(-max_model_len // block_size) * 4


def role_mode(mode: str, role: str) -> str:
    """The mode a `role` worker compiles for the configured `mode`. A prefill worker runs
    chunks, not decode batches: it compiles no decode step ("auto" and "decode": "none")
    and records no CUDA graph ("all": "prefill"); other roles run `mode` itself."""
    if role != "prefill":
        return mode
    return "prefill" if mode in ("all", "prefill") else "none"


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The CUDA-graph batch sizes: DECODE_BUCKETS up to the first one >= max_num_seqs."""
    out = [b for b in DECODE_BUCKETS if b < max_num_seqs]
    return (*out, next((b for b in DECODE_BUCKETS if b >= max_num_seqs), max_num_seqs))


def default_cache_dir() -> str:
    from engine.model_fetch import cache_root

    return str(cache_root() / "inductor")


@dataclass
class CompileReport:
    """What start-up compiled and what it cost (`LLM.runner.compiled.report`)."""

    requested: str
    mode: str  # the mode in force: "none" after a fallback
    compile_s: float = 0.0
    graphs: list[str] = field(default_factory=list)  # "decode T=1", "mixed T=2", ...
    cache_hits: int = 0
    cache_misses: int = 0
    fallback_reason: str | None = None

    def line(self) -> str:
        if self.mode == "none":
            why = f": {self.fallback_reason}" if self.fallback_reason else ""
            return f"compiled step off (requested {self.requested}){why}"
        return (f"compiled step: mode {self.mode}, {len(self.graphs)} shapes warmed up in "
                f"{self.compile_s:.1f} s (inductor cache {self.cache_hits} hits, "
                f"{self.cache_misses} misses)")


def _short(e: BaseException) -> str:
    """One line naming the failure: inductor's first line ends in "raised:", and what
    it raised is on the next non-empty line."""
    lines = [ln.strip() for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else lines[0]
    return text[:300]


class CompiledStep:
    """The compiled forwards of one model on one device (see the module doc)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, mode: str,
                 max_num_seqs: int):
        self.device = device
        self.report = CompileReport(requested=mode, mode=resolve_mode(mode, device))
        # CUDA graphs for decode steps (none in "prefill" mode)
        self.graphs = device.type == "cuda" and self.report.mode != "prefill"
        # decode batches padded to buckets, tables to a fixed width: what graphs need
        self.padded = device.type in PADDED_DECODE and self.report.mode != "prefill"
        self.buckets = decode_buckets(max_num_seqs) if self.padded else ()
        self._decode: Callable | None = None
        self._mixed: Callable | None = None
        if self.report.mode == "none":
            return
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
        dyn = torch._dynamo.config
        dyn.recompile_limit = max(dyn.recompile_limit, RECOMPILE_LIMIT)

        # Two code objects: dynamo keeps compiled entries per code object, so the
        # CUDA-graph decode forward and the graph-free prefill one never meet.
        def decode_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids, positions)

        def mixed_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids, positions)

        if self.report.mode == "prefill":  # one graph-free forward for every step
            self._decode = self._mixed = torch.compile(mixed_forward, dynamic=True,
                                                       fullgraph=True)
            return
        mode_kw = {"mode": "reduce-overhead"} if self.graphs else {}
        self._decode = torch.compile(decode_forward, dynamic=True, fullgraph=True, **mode_kw)
        if self.report.mode == "all":
            # on CPU one graph serves both (its inputs are only ids and positions)
            self._mixed = (torch.compile(mixed_forward, dynamic=True, fullgraph=True)
                           if self.graphs else self._decode)

    @property
    def mode(self) -> str:
        return self.report.mode

    def forward_for(self, decode_only: bool) -> Callable | None:
        """The compiled forward for a step, or None: run it eagerly."""
        return self._decode if decode_only else self._mixed

    def bucket(self, num_decodes: int) -> int:
        """Rows a decode step of `num_decodes` runs with (its CUDA-graph bucket)."""
        if not self.buckets or num_decodes > self.buckets[-1]:
            return num_decodes
        return next(b for b in self.buckets if b >= num_decodes)

    def run(self, fn: Callable, input_ids: torch.Tensor, positions: torch.Tensor
            ) -> torch.Tensor:
        if self.graphs and fn is self._decode:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are done
        return fn(input_ids, positions)

    def warmup(self, run_padded: Callable[[bool, int], None]) -> None:
        """Build every graph serving will use, before the first request: `run_padded(
        decode_only, rows)` runs one step of padding rows (they write no KV). On failure
        the mode becomes "none" and the reason is logged."""
        if self.mode == "none":
            return
        rep = self.report
        from torch._dynamo.utils import counters

        hits0 = counters["inductor"]["fxgraph_cache_hit"]
        miss0 = counters["inductor"]["fxgraph_cache_miss"]
        t0 = time.perf_counter()
        shapes: list[tuple[bool, int]] = [(True, b) for b in self.buckets] or [(True, 1),
                                                                              (True, 2)]
        if rep.mode == "all" and self.graphs:
            shapes += [(False, 2), (False, 3)]
        if rep.mode == "prefill":  # T == 1 and T >= 2 of its one forward
            shapes = [(True, 1), (False, 2)]
        try:
            # under inference mode, as serving runs (ModelRunner.run): dynamo guards on
            # the grad mode, and graphs built with it on would be re-traced (and their CUDA
            # graphs re-recorded) by the first real step
            with torch.inference_mode():
                self._warm(run_padded, shapes)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - any compiler failure: serve eagerly
            self.disable(e)
            return
        if self.mode == "none":  # a step failed, was logged and ran eagerly
            return
        rep.compile_s = time.perf_counter() - t0
        rep.cache_hits = counters["inductor"]["fxgraph_cache_hit"] - hits0
        rep.cache_misses = counters["inductor"]["fxgraph_cache_miss"] - miss0
        log.info(rep.line())

    def _warm(self, run_padded: Callable[[bool, int], None],
              shapes: list[tuple[bool, int]]) -> None:
        for decode_only, rows in shapes:
            for _ in range(3 if self.graphs and decode_only else 1):  # warm, record, replay
                run_padded(decode_only, rows)
                if self.mode == "none":  # the step failed, was logged and ran eagerly
                    return
            self.report.graphs.append(f"{'decode' if decode_only else 'mixed'} T={rows}")

    def disable(self, error: BaseException) -> None:
        """Turn the compiled step off for good (the runner re-runs the step eagerly)."""
        self.report.mode = "none"
        self.report.fallback_reason = _short(error)
        self._decode = self._mixed = None
        log.warning("%s; running eagerly", self.report.line(), exc_info=error)
