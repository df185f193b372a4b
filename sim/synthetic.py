"""Synthetic calibrations: cost tables given as functions, labelled "synthetic, not
measured". For tests whose expected timings follow from the costs by hand, and for
what-if questions ("if a decode step took 5 ms ...").

    cal = synthetic_calibration(prefill=lambda c, p: 0.01, decode=lambda b, l: 0.005,
                                rpc_s=0.001)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.costs.calibration import FORMAT, SYNTHETIC_LABEL, Calibration
from engine.costs.delivery import Delivery

TINY_SHAPE: dict[str, Any] = {  # engine/tiny_model.py PRESETS["tiny"] with its tokenizer
    "name": "tiny-shape", "architecture": "LlamaForCausalLM", "vocab_size": 2048,
    "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
    "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
    "tie_word_embeddings": False}


def synthetic_calibration(
    *, prefill: Callable[[int, int], float], decode: Callable[[int, int], float],
    chunks: Sequence[int] = (1, 16, 64, 256, 512, 1024), contexts: Sequence[int] = (0, 4096),
    batches: Sequence[int] = (1, 64), decode_contexts: Sequence[int] = (1, 4096),
    sample_s: float = 0.0, kv_copy_s_per_token: float = 0.0, step_overhead_s: float = 0.0,
    decode_join_s: float = 0.0,
    link_latency_s: float = 0.0, link_bytes_per_s: float = 1e12, rpc_s: float = 0.0,
    client_s: float = 0.0, idle_wait_s: float = 0.002, delivery: Delivery | None = None,
    model: Mapping[str, Any] = TINY_SHAPE, dtype: str = "float32",
    links: Sequence[str] = ("inproc", "tcp"), context_stat: str = "mean",
) -> Calibration:
    """``prefill(C, P)`` and ``decode(B, L)`` in seconds, sampled on the given grids (the
    model interpolates between grid points, so linear functions are reproduced exactly).
    ``delivery`` defaults to tokens reaching the router ``rpc_s`` after their step."""
    delivery = delivery or Delivery(rpc_s, rpc_s)
    xs = [1, 4096]
    return Calibration({
        "format": FORMAT, "kind": "synthetic", "created_unix_s": time.time(),
        "label": f"{SYNTHETIC_LABEL}: costs given by hand",
        "hardware": {"device": "cpu", "name": "synthetic"}, "engine": {"note": "not run"},
        "model": dict(model), "dtype": dtype, "workload": {"synthetic": True},
        "prefill": {"chunk": list(chunks), "context": list(contexts),
                    "seconds": [[prefill(c, p) for p in contexts] for c in chunks]},
        "decode": {"batch": list(batches), "context": list(decode_contexts),
                   "seconds": [[decode(b, L) for L in decode_contexts] for b in batches],
                   "context_stat": context_stat},
        "sampling": {"x": xs, "seconds": [sample_s, sample_s]},
        "kv_export": {"x": xs, "seconds": [kv_copy_s_per_token * x for x in xs]},
        "kv_import": {"x": xs, "seconds": [kv_copy_s_per_token * x for x in xs]},
        "overheads": {**{f"{r}_step": {"x": [1, 64], "seconds": [step_overhead_s] * 2}
                         for r in ("prefill", "decode")}, "decode_join_s": decode_join_s},
        "links": {name: {"latency_s": link_latency_s, "bytes_per_s": link_bytes_per_s}
                  for name in links},
        "control": {"rpc_s": rpc_s, "client_s": client_s, "idle_wait_s": idle_wait_s,
                    "delivery": delivery.to_dict()},
        "sources": {"all": "synthetic: given by hand"},
    }, source="synthetic")
