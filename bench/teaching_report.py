"""Reading bench.teaching's result: the example's claims (trace structure), this run's
wall-clock observations, and the side-by-side table of (a), (b), (c)."""

from __future__ import annotations

import math
from typing import Any


def _parts(result: dict[str, Any]) -> tuple[dict, dict, dict, int, int]:
    w, c = result["whole"]["timings"], result["chunked"]["timings"]
    d = result.get("disagg", {}).get("timings", {})
    if d and not d.get("worker_trace_events", 1):
        d = {}  # the service recorded no worker events: nothing to check, not a "no"
    chunk = result["spec"]["chunk"]
    return w, c, d, chunk, math.ceil(result["spec"]["long_prompt"] / chunk)


def _lt(a, b) -> bool | None:
    return None if a is None or b is None else a < b


def claims(result: dict[str, Any]) -> dict[str, bool | None]:
    """The example's statements, checked on the structure of the traces: which step or
    worker carried what, in which order. No wall-clock comparison, so a busy or a fast
    machine gives the same answers (None: not measurable in this run)."""
    w, c, d, chunk, n_chunks = _parts(result)
    return {
        "chunked: S's next token comes earlier (after one chunk of L, not all of it)":
            _lt(c.get("l_share_before_s_next"), w.get("l_share_before_s_next")),
        "chunked: L's first token comes later (S streams more tokens first)":
            _lt(w.get("s_tokens_before_l_first"), c.get("s_tokens_before_l_first")),
        "whole: L prefills in one step": w["l_prefill_steps"] == 1,
        "chunked: L prefills in chunks, each step shared with S's decode":
            c["l_prefill_steps"] == n_chunks and c["l_steps_shared_with_s"] == n_chunks,
        # a step may also carry a little of another prompt, so L may take one more
        "disagg: L prefills in chunks": (d["l_prefill_steps"] >= n_chunks
                                         and d["l_max_chunk_tokens"] <= chunk) if d else None,
        "disagg: S decodes on a worker that never runs L's prefill":
            (bool(d["s_decode_workers"]) and bool(d["l_prefill_workers"])
             and not set(d["s_decode_workers"]) & set(d["l_prefill_workers"])) if d else None,
    }


def observations(result: dict[str, Any]) -> dict[str, bool | None]:
    """Wall-clock orderings of this run: what the millisecond figures show. They follow
    from the claims on an idle machine, but load can flip them (a whole prefill can be
    slower than its chunks on a busy CPU, see ``crossover``), so they are reported, never
    relied on."""
    w, c, d, _, _ = _parts(result)
    return {
        "chunked: S's next token came earlier (ms)":
            _lt(c["s_next_token_ms"], w["s_next_token_ms"]),
        "chunked: L's first token came later (ms)": _lt(w["l_ttft_ms"], c["l_ttft_ms"]),
        "disagg: an S decode step ran inside L's prefill":
            (d["s_decode_steps_during_l_prefill"] >= 1) if d else None,
        "disagg: L's KV was on the wire before its prefill ended":
            d.get("l_kv_send_before_last_chunk_end") if d else None,
    }


ROWS = (("s_next_token_ms", "S: next token after L arrives (ms)"),
        ("s_max_gap_during_prefill_ms", "S: worst token gap around L's prefill (ms)"),
        ("l_ttft_ms", "L: time to first token (ms)"),
        ("l_prefill_steps", "L: prefill steps"),
        ("l_steps_shared_with_s", "L: steps shared with S's decode"))


def side_by_side(result: dict[str, Any]) -> str:
    """The timings of (a), (b), (c) as a fixed-width table."""
    cols = [m for m in ("whole", "chunked", "disagg") if m in result]
    heads = {"whole": f"(a) whole ({result['spec']['long_prompt']})",
             "chunked": f"(b) chunked ({result['spec']['chunk']})",
             "disagg": f"(c) disagg 1P+1D ({result['spec']['chunk']})"}
    lines = [f"{'':44s}" + "".join(f"{heads[m]:>24s}" for m in cols)]
    for key, label in ROWS:
        cells = []
        for m in cols:
            v = result[m]["timings"].get(key)
            cells.append(f"{'n/a' if v is None else (f'{v:.1f}' if isinstance(v, float) else v):>24}")
        lines.append(f"{label:44s}" + "".join(cells))
    return "\n".join(lines)
