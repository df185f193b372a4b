"""The one collective of a tensor-parallel forward: the all-reduce after each row-parallel
projection (o_proj, down_proj), installed as forward hooks on the model's attention and
MLP modules, so the model code stays the single-device one.

    x [T, hidden] (replicated) -> q/k/v, gate/up on this rank's heads / MLP rows
      -> o_proj, down_proj on those inputs: partial sums [T, hidden]
      -> all-reduce (sum over ranks) -> x + sum (replicated again)

The all-reduce is a custom op, so a compiled forward (torch.compile) treats it as one
opaque call instead of tracing into torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.parallel.state import current_group


@torch.library.custom_op("pdserve::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over this process's TP group (a new tensor)."""
    group = current_group()
    if group is None:
        raise RuntimeError("pdserve::tp_all_reduce called outside a tensor-parallel group")
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group.group)
    return out


@tp_all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _reduce_output(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    return tp_all_reduce(output)


def install_all_reduce(model: nn.Module) -> int:
    """Hook the all-reduce onto every decoder layer's `self_attn` and `mlp` (their outputs
    are the row-parallel projections'); returns how many were hooked."""
    n = 0
    for layer in model.model.layers:
        for part in (layer.self_attn, layer.mlp):
            part.register_forward_hook(_reduce_output)
            n += 1
    return n
