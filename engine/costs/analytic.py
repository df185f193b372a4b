"""Analytic profiles for hardware not at hand: a roofline step model, labelled
"analytic, not measured" in every output.

Hardware figures are the vendors' published peak numbers (sources in ``PROFILES``); what
a real engine reaches of them (``mfu``, ``mbu``), its kernel launches, its per-step
Python overhead and its control-plane latency are assumptions, recorded as such in the
file (``sources``) and printed with every result.

Step time = max(FLOPs / (peak * mfu), bytes / (HBM bandwidth * mbu), launch floor):
FLOPs = 2 * tokens * dense params + 2 * sampled rows * hidden * vocab + attention
(4 * layers * heads * head_dim * query x key pairs, causal inside a chunk); bytes = dense
weights (+ the LM head when a row is sampled) + KV read (context + new) + KV written; the
attention is taken to be paged (cost by total context, as pdserve's Triton kernels).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from engine.costs.calibration import ANALYTIC_LABEL, FORMAT, Calibration, CalibrationError
from engine.costs.delivery import Delivery
from engine.costs.model import ROLES, SMALL_RUN, CostModel, Limits, LinkCost

GB, Gbit = 1e9, 1e9 / 8
PROFILES: dict[str, dict[str, Any]] = {
    "h200": {
        "name": "NVIDIA H200 SXM", "hbm_bytes": 141 * GB, "hbm_bytes_per_s": 4.8e12,
        "bf16_flops": 989e12, "fp32_flops": 67e12,
        "links": {"nvlink": {"bytes_per_s": 450 * GB, "latency_s": 2e-6},
                  "infiniband": {"bytes_per_s": 400 * Gbit, "latency_s": 5e-6}},
        "source": "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200): "
                  "141 GB HBM3e at 4.8 TB/s, 989 TFLOPS dense BF16 (1,979 with sparsity), "
                  "67 TFLOPS FP32, NVLink 900 GB/s (both directions: 450 GB/s each way); "
                  "DGX H200: one ConnectX-7 400 Gb/s InfiniBand NDR port per GPU",
    },
    "h100": {
        "name": "NVIDIA H100 SXM", "hbm_bytes": 80 * GB, "hbm_bytes_per_s": 3.35e12,
        "bf16_flops": 989e12, "fp32_flops": 67e12,
        "links": {"nvlink": {"bytes_per_s": 450 * GB, "latency_s": 2e-6},
                  "infiniband": {"bytes_per_s": 400 * Gbit, "latency_s": 5e-6}},
        "source": "NVIDIA H100 Tensor Core GPU datasheet: 80 GB HBM3 at 3.35 TB/s, 989 "
                  "TFLOPS dense BF16, 67 TFLOPS FP32, NVLink 900 GB/s; DGX H100: 400 Gb/s "
                  "InfiniBand NDR per GPU",
    },
    "a100": {
        "name": "NVIDIA A100 SXM 80GB", "hbm_bytes": 80 * GB, "hbm_bytes_per_s": 2.039e12,
        "bf16_flops": 312e12, "fp32_flops": 19.5e12,
        "links": {"nvlink": {"bytes_per_s": 300 * GB, "latency_s": 2e-6},
                  "infiniband": {"bytes_per_s": 200 * Gbit, "latency_s": 5e-6}},
        "source": "NVIDIA A100 Tensor Core GPU datasheet: 80 GB HBM2e at 2,039 GB/s, 312 "
                  "TFLOPS dense BF16, 19.5 TFLOPS FP32, NVLink 600 GB/s; DGX A100: 200 Gb/s "
                  "InfiniBand HDR per GPU",
    },
}
# Published config.json shapes (Hugging Face model cards).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, max_position_embeddings=8192, tie_word_embeddings=False),
    "qwen2.5-7b": dict(architecture="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
                       head_dim=128, max_position_embeddings=32768, tie_word_embeddings=False),
    "qwen2-0.5b": dict(architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896,
                       intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                       head_dim=64, max_position_embeddings=32768, tie_word_embeddings=True),
    # pdserve's embedded tiny model (engine/tiny_model.py PRESETS["tiny"], its 2,048-token
    # tokenizer): the emulated device's shape for fast tests, 256 bytes of KV per token
    "tiny": dict(architecture="LlamaForCausalLM", vocab_size=2048, hidden_size=64,
                 intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 max_position_embeddings=4096, tie_word_embeddings=False),
    "smollm2-135m": dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                         head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True),
}
# What an engine reaches of the peaks, and its fixed costs: assumptions, not measurements.
ASSUMPTIONS: dict[str, float] = {
    "mfu": 0.6,  # large BF16 GEMMs on Hopper typically reach 60-70% of dense peak
    "mbu": 0.8,  # memory-bound kernels typically reach ~80% of HBM bandwidth
    "launch_s": 4e-6,  # per kernel launch from Python (no CUDA graphs in pdserve)
    "kernels_per_layer": 12,
    "host_copy_bytes_per_s": 50 * GB,  # KV export/import over PCIe Gen5 x16 (64 GB/s peak)
    "host_copy_fixed_s": 20e-6,
    "sample_fixed_s": 30e-6, "sample_per_row_s": 1e-6,
    "prefill_step_fixed_s": 5e-4, "prefill_step_per_item_s": 2e-5,
    "decode_step_fixed_s": 5e-4, "decode_step_per_item_s": 1e-5,
    # a leg's first decode step beyond the steady step: not known on a GPU, not modelled
    # (on CPU the tiny model measures 0.15 ms in one process, 0.64 ms in the service)
    "decode_join_s": 0.0,
    "rpc_s": 5e-4,  # one Ray actor call, one way
    "client_s": 0.0,  # an in-process client (the studies' inproc transport)
    "idle_wait_s": 0.002,  # the worker loop's nap (runtime/loop.py)
}
ELEM = {"bfloat16": 2, "float16": 2, "float32": 4}


def analytic_calibration(profile: str, shape: Mapping[str, Any] | str, dtype: str = "bfloat16",
                         assumptions: Mapping[str, float] | None = None) -> Calibration:
    """An analytic calibration of ``profile`` (a PROFILES name) for a model shape (a SHAPES
    name or a dict of its fields)."""
    if profile not in PROFILES:
        raise CalibrationError(f"unknown analytic profile {profile!r}; known: {sorted(PROFILES)}")
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise CalibrationError(f"unknown model shape {shape!r}; known: {sorted(SHAPES)} "
                                   "(or a model directory)")
        model = {"name": shape, **SHAPES[shape]}
    else:
        model = dict(shape)
    if dtype not in ELEM:
        raise CalibrationError(f"dtype must be one of {sorted(ELEM)}, got {dtype!r}")
    prof = PROFILES[profile]
    a = {**ASSUMPTIONS, **(assumptions or {})}
    unknown = set(a) - set(ASSUMPTIONS)
    if unknown:
        raise CalibrationError(f"unknown analytic assumptions {sorted(unknown)}")
    label = (f"{ANALYTIC_LABEL}: roofline of {prof['name']} (published peak figures) for "
             f"{model.get('name', model['architecture'])} in {dtype}")
    sources = {f"assumptions.{k}": "assumed (engine/costs/analytic.py ASSUMPTIONS)" for k in a}
    sources.update({"profile": f"published: {prof['source']}",
                    "control.rpc_s": "assumed", "control.client_s": "assumed",
                    "control.idle_wait_s": "assumed: worker loop constant",
                    "control.delivery": "assumed: one Ray call per step's tokens, "
                                        "never coalesced"})
    return Calibration({
        "format": FORMAT, "kind": "analytic", "label": label, "created_unix_s": time.time(),
        "profile": {"key": profile, **prof}, "model": model, "dtype": dtype,
        "assumptions": a, "links": prof["links"],
        "control": {**{k: a[k] for k in ("rpc_s", "client_s", "idle_wait_s")},
                    "delivery": Delivery(a["rpc_s"], a["rpc_s"]).to_dict()},
        "hardware": {"device": profile, "name": prof["name"]},
        "engine": {"note": "not run: roofline model"}, "sources": sources,
    }, source=f"analytic:{profile}")


# a term that beats the others by this factor at both ends of a run beats them at every step
# between (they are linear in the context), far beyond the few ulps of float rounding
_WIN = 1 + 1e-9
_TABLE_MAX = 1 << 22  # attended-token counts the decode bytes-term table covers (32 MiB)


class RooflineCosts(CostModel):
    def __init__(self, cal: Calibration):
        if cal.kind != "analytic":
            raise CalibrationError(f"{cal.source}: RooflineCosts needs an analytic calibration")
        self.calibration, self.label = cal, cal.label
        g, m = cal.get, lambda k: int(cal.number(f"model.{k}", minimum=1))
        L, h, inter = m("num_layers"), m("hidden_size"), m("intermediate_size")
        nh, nkv, d, v = m("num_heads"), m("num_kv_heads"), m("head_dim"), m("vocab_size")
        elem = ELEM[g("dtype")]
        self.a = {k: cal.number(f"assumptions.{k}") for k in ASSUMPTIONS}
        flops_key = "fp32_flops" if g("dtype") == "float32" else "bf16_flops"
        self.flops = cal.number(f"profile.{flops_key}", minimum=1) * self.a["mfu"]
        self.bw = cal.number("profile.hbm_bytes_per_s", minimum=1) * self.a["mbu"]
        self.dense = L * (2 * h * nh * d + 2 * h * nkv * d + 3 * h * inter)  # params
        self.dense_bytes, self.head_bytes = self.dense * elem, v * h * elem
        self.head_flops = 2 * h * v
        self.attn = 4 * L * nh * d  # FLOPs per (query, key) pair over all layers
        self.kv_bytes = L * 2 * nkv * d * elem  # per token
        self.floor = L * self.a["kernels_per_layer"] * self.a["launch_s"]
        self.max_len = m("max_position_embeddings")
        self._bytes_s = np.empty(0)  # x -> a decode step's bytes term with x tokens attended

    def _step(self, flops: float, nbytes: float) -> float:
        return max(flops / self.flops, nbytes / self.bw, self.floor)

    def prefill_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        n = sum(c for c, _ in chunks)
        pairs = sum(c * (p + (c + 1) / 2) for c, p in chunks)
        kv = sum(p + c for c, p in chunks) + n  # read context and new, write new
        flops = 2 * n * self.dense + self.attn * pairs + self.head_flops
        return self._step(flops, self.dense_bytes + self.head_bytes + kv * self.kv_bytes)

    def decode_run_s(self, batch: int, context: int, longest: int,
                     steps: int) -> Sequence[float]:
        # one formula for one step and for many: the same float operations, bit for bit
        c0 = 2 * batch * self.dense + batch * self.head_flops
        m0 = self.dense_bytes + self.head_bytes
        attn, kvb, fl, bw, floor = self.attn, self.kv_bytes, self.flops, self.bw, self.floor
        last = float(context + batch * (steps - 1))  # the last step's context
        mem = (m0 + (context + batch) * kvb) / bw  # the bytes term's least value (the first)
        if mem > _WIN * max((c0 + attn * last) / fl, floor):  # above the others' greatest
            return self._memory_bound(batch, context, steps)
        if steps <= SMALL_RUN:  # plain floats: numpy's overhead dominates short runs
            return [max((c0 + attn * ctx) / fl, (m0 + (ctx + batch) * kvb) / bw, floor)
                    for ctx in map(float, range(context, context + batch * steps, batch))]
        # the same element-wise float operations, in place (each numpy call costs more than
        # its arithmetic on a run's few hundred elements)
        ctx: Any = np.arange(context, context + batch * steps, batch, dtype=float)
        nbytes: Any = ctx + batch
        nbytes *= kvb
        nbytes += m0
        nbytes /= bw
        ctx *= attn
        ctx += c0
        ctx /= fl
        np.maximum(ctx, nbytes, out=nbytes)
        return np.maximum(nbytes, floor, out=nbytes)

    def _memory_bound(self, batch: int, context: int, steps: int) -> Sequence[float]:
        """``decode_run_s`` where the bytes term is the max of every step: that term alone.
        A long run reads it from a table of the term per attended-token count (the same
        element-wise operations on the same exact integers, computed once)."""
        m0, kvb, bw = self.dense_bytes + self.head_bytes, self.kv_bytes, self.bw
        if steps <= SMALL_RUN:
            return [(m0 + (ctx + batch) * kvb) / bw
                    for ctx in map(float, range(context, context + batch * steps, batch))]
        stop = context + batch * (steps + 1)
        table: Any = self._bytes_s
        nbytes: Any
        if stop > len(table):  # grown by doubling (a few times per simulation), bounded
            if stop > _TABLE_MAX:
                nbytes = np.arange(context + batch, stop, batch, dtype=float)
            else:
                nbytes = np.arange(min(max(stop, 2 * len(table), 4096), _TABLE_MAX),
                                   dtype=float)
            nbytes *= kvb
            nbytes += m0
            nbytes /= bw
            if stop > _TABLE_MAX:
                return nbytes
            table = self._bytes_s = nbytes
        return table[context + batch : stop : batch].copy()

    def sample_s(self, rows: int) -> float:
        return self.a["sample_fixed_s"] + rows * self.a["sample_per_row_s"]

    def _copy(self, tokens: int) -> float:
        return self.a["host_copy_fixed_s"] + tokens * self.kv_bytes / self.a["host_copy_bytes_per_s"]

    def kv_export_s(self, tokens: int) -> float:
        return self._copy(tokens)

    def kv_import_s(self, tokens: int) -> float:
        return self._copy(tokens)

    def leg_join_s(self) -> float:
        return self.a["decode_join_s"]

    def step_overhead_s(self, role: str, items: int) -> float:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return self.a[f"{role}_step_fixed_s"] + items * self.a[f"{role}_step_per_item_s"]

    def link(self, name: str) -> LinkCost:
        links = self.calibration.get("links")
        if name not in links:
            raise CalibrationError(f"{self.calibration.source}: missing entry 'links.{name}' "
                                   f"(an analytic profile has {sorted(links)}: choose one "
                                   "with --interconnect)")
        return LinkCost(name, self.calibration.number(f"links.{name}.latency_s"),
                        self.calibration.number(f"links.{name}.bytes_per_s", minimum=1.0))

    def check_covers(self, limits: Limits) -> None:
        if limits.max_model_len > self.max_len:
            raise CalibrationError(
                f"{self.calibration.source}: max_model_len {limits.max_model_len} exceeds the "
                f"model's max_position_embeddings {self.max_len} (entry "
                "'model.max_position_embeddings')")
        self.link(limits.link)
        _ = self.rpc_s, self.client_s, self.idle_wait_s, self.delivery
