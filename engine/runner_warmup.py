"""Start-up work of a ModelRunner, off the serving path: the steps that make every kernel
and compiled shape serving will launch exist before the first request arrives.

- `warm_kernels`: every Triton attention variant (prefill, write_kv, decode with and
  without split-K and its reduce), run on block 0, which is cleared afterwards.
- `run_padding`: one compiled step of padding tokens of a given shape, which compiles it
  or records its CUDA graph (engine.compile's warm-up calls it per bucket).
"""

from __future__ import annotations

from typing import Any

import torch

# `runner` below is an engine.model_runner.ModelRunner, which imports this module: it is
# not imported back (the layering contract forbids the cycle), only named.


def warms_kernels(runner: Any) -> bool:
    """Whether start-up runs `warm_kernels`: the Triton kernels on CUDA (a tensor-parallel
    group's every rank warms up at once, each on its own: their all-reduces pair up)."""
    return runner.backend.name == "triton" and runner.device.type == "cuda"


def warm_kernels(runner: Any, chunk: type) -> None:
    """Run one batch of each kind the attention kernels specialise on, on block 0, then
    clear block 0: the first requests do not wait for the compiler. `chunk`: SeqChunk."""
    SeqChunk = chunk  # noqa: N806 - the class itself

    long = (0,) * (2 * 512 // runner.block_size + 1)  # > 2 split-K partitions of context
    warm = [
        [SeqChunk("warm-p", (1, 2), 0, (0,), sample=True)],
        [SeqChunk("warm-d", (1,), 1, (0,), sample=True),
         SeqChunk("warm-p", (1, 2), 0, (0,), sample=False)],
        [SeqChunk("warm-s", (1,), len(long) * runner.block_size - 1, long, sample=True)],
    ]
    for batch in warm:
        runner.execute(batch)
    runner.kv.data[:, :, 0].zero_()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def run_padding(runner: Any, decode_only: bool, rows: int) -> None:
    """One compiled step of `rows` padding tokens (slot -1: no KV is written; they read
    block 0), as `rows` decodes or one prefill chunk: compiles or records that shape."""
    fn = runner.compiled.forward_for(decode_only)
    zeros = [0] * rows
    if decode_only and runner.compiled.padded:  # the tables serving's graphs will read
        runner._forward(fn, runner._graph_buf, zeros, zeros, [-1] * rows, [], [], [], [],
                        [], [0], runner._graph_tables.table[:rows])
    elif decode_only:
        runner._forward(fn, runner._buf, zeros, zeros, [-1] * rows, [(0,)] * rows, [], [],
                        [], [], [0])
    else:
        runner._forward(fn, runner._buf, zeros, list(range(rows)), [-1] * rows, [], [],
                        [(0,) * rows], [rows], [rows], [rows - 1])
