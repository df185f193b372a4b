"""Load one tensor-parallel rank's slice of an HF checkpoint.

Each sharded tensor is read with safetensors' `get_slice` (only the rows or columns this
rank holds leave the file); replicated ones whole. The model is built for the rank's
local config (engine.config.Shard.local_config), so its modules have the
local shapes and the unchanged model code runs on them; the all-reduce hooks
(engine.parallel.layers) make the row-parallel sums whole.

A row-parallel bias (o_proj, down_proj) is added once: rank 0 holds it, the others
hold zeros (the all-reduce sums the partial products and the one bias).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig, Shard
from engine.loader import ModelLoadError, load_model, weight_files
from engine.models.registry import model_class
from engine.parallel.layers import install_all_reduce

# suffix of a layer tensor's name -> (range of the shard, dim it is split along);
# range "bias0": the whole tensor on rank 0, zeros elsewhere
_SPLITS = {
    "self_attn.q_proj.weight": ("heads", 0), "self_attn.q_proj.bias": ("heads", 0),
    "self_attn.k_proj.weight": ("kv", 0), "self_attn.k_proj.bias": ("kv", 0),
    "self_attn.v_proj.weight": ("kv", 0), "self_attn.v_proj.bias": ("kv", 0),
    "self_attn.o_proj.weight": ("heads", 1), "self_attn.o_proj.bias": ("bias0", 0),
    "mlp.gate_proj.weight": ("mlp", 0), "mlp.gate_proj.bias": ("mlp", 0),
    "mlp.up_proj.weight": ("mlp", 0), "mlp.up_proj.bias": ("mlp", 0),
    "mlp.down_proj.weight": ("mlp", 1), "mlp.down_proj.bias": ("bias0", 0),
}


def _split(name: str) -> tuple[str, int] | None:
    for suffix, rule in _SPLITS.items():
        if name.endswith(suffix):
            return rule
    return None


def _range(shard: Shard, what: str, head_dim: int) -> tuple[int, int]:
    if what == "mlp":
        return shard.mlp
    start, end = shard.heads if what == "heads" else shard.kv_heads
    return start * head_dim, end * head_dim


def iter_shard(model: ModelConfig, model_dir: str | Path, shard: Shard,
               device: torch.device | str, dtype: torch.dtype
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's tensor) of every checkpoint tensor it holds, converted to
    `device` and `dtype` one at a time. Ranks > 0 skip an untied LM head."""
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if name == "lm_head.weight" and shard.rank > 0:
                    continue
                rule = _split(name)
                if rule is None:
                    t = f.get_tensor(name)
                elif rule[0] == "bias0":
                    t = f.get_tensor(name)
                    t = t if shard.rank == 0 else torch.zeros_like(t)
                else:
                    start, end = _range(shard, rule[0], model.head_dim)
                    sl = f.get_slice(name)
                    t = sl[start:end] if rule[1] == 0 else sl[:, start:end]
                    expect = end - start
                    if t.shape[rule[1]] != expect:
                        raise ModelLoadError(f"{path}: {name} has {t.shape[rule[1]]} rows "
                                             f"for rank {shard.rank}, expected {expect}")
                if t.is_floating_point():
                    t = t.to(device=device, dtype=dtype)
                yield name, t.contiguous().to(device=device)


def shard_weight_bytes(model: ModelConfig, model_dir: str | Path, shard: Shard,
                       dtype: torch.dtype) -> int:
    """Bytes this rank's tensors take in `dtype`, from the safetensors headers (what it
    will load: a GPU's KV budget is what is left of its memory after them)."""
    elem = torch.empty((), dtype=dtype).element_size()
    n = 0
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if name.endswith("rotary_emb.inv_freq") or (
                        name == "lm_head.weight" and shard.rank > 0):
                    continue
                shape = list(f.get_slice(name).get_shape())
                rule = _split(name)
                if rule is not None and rule[0] != "bias0":
                    start, end = _range(shard, rule[0], model.head_dim)
                    shape[rule[1]] = end - start
                n += int(torch.Size(shape).numel()) * elem
    return n


def load_shard(model: ModelConfig, model_dir: str | Path, shard: Shard,
               device: torch.device | str, dtype: torch.dtype) -> torch.nn.Module:
    """The model of rank `shard.rank` (the whole model when the group has one rank)."""
    if shard.size == 1:
        return load_model(model, model_dir, device, dtype)
    local = shard.local_config(model)
    with torch.device("meta"):
        m = model_class(local.architecture)(local)
    m.load_hf_weights(dict(iter_shard(model, model_dir, shard, device, dtype)))
    on_meta = [n for n, p in m.named_parameters() if p.is_meta]
    if on_meta:
        raise ModelLoadError(f"{model_dir}: no weights for {on_meta[:5]}")
    install_all_reduce(m)
    return m.eval()
