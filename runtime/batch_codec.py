"""The wire form of one worker step's events: one msgpack message per step and link.

    [worker_id, load | None, [entry, ...]]
    entry = [kind, leg_id, token_ids, finish_reason | None, message, timing | None,
             wall_time, extras | None]

`kind` and `finish_reason` are the enums' string values; `timing` the five LegTiming
fields in order (None when all are zero); `load` the WorkerLoad fields in order.
`extras` is a map of optional per-token data a request asked for (e.g. log-probabilities),
None for the plain token entries of the hot path: each name in EXTRAS is a WorkerEvent
attribute carried when it is not None, with its (to plain data, from plain data)
conversion, so a new optional field costs one entry here (as the log-probs below).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, fields
from typing import Any

import msgpack

from engine.logprobs import TokenLogprobs
from engine.request import FinishReason
from runtime.messages import NO_TIMING, EventKind, LegTiming, WorkerEvent, WorkerLoad


def _lp_to_wire(t: TokenLogprobs | None) -> list | None:
    return None if t is None else [t.token_id, t.logprob, t.rank, t.top]


def _lp_from_wire(row: list | None) -> TokenLogprobs | None:
    if row is None:
        return None
    token_id, logprob, rank, top = row
    return TokenLogprobs(token_id, logprob, rank, tuple(tuple(x) for x in top))


# optional WorkerEvent field -> (to msgpack-able plain data, back)
_LOGPROBS = (lambda lps: [_lp_to_wire(t) for t in lps],
             lambda rows: tuple(_lp_from_wire(r) for r in rows))
EXTRAS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "logprobs": _LOGPROBS, "prompt_logprobs": _LOGPROBS,  # (the prompt's first is None)
}
KIND_OF = {k.value: k for k in EventKind}
FINISH_OF = {f.value: f for f in FinishReason}
_LOAD_FIELDS = len(fields(WorkerLoad))


def encode_batch(worker_id: str, events: list[WorkerEvent], load: WorkerLoad | None) -> bytes:
    entries = []
    for ev in events:
        extras = None
        for name, (to_wire, _) in EXTRAS.items():
            value = getattr(ev, name, None)
            if value is not None:
                extras = extras or {}
                extras[name] = to_wire(value)
        t = ev.timing
        entries.append((
            ev.kind.value, ev.leg_id, ev.token_ids,
            None if ev.finish_reason is None else ev.finish_reason.value, ev.message,
            None if t is NO_TIMING or t == NO_TIMING else astuple(t), ev.wall_time, extras))
    return msgpack.packb((worker_id, None if load is None else astuple(load), entries))


def decode_batch(body: bytes) -> tuple[str, WorkerLoad | None, list[list[Any]]]:
    """(worker_id, load, raw entries): the router reads hot TOKENS entries as they are and
    turns the rest into WorkerEvents with `entry_event`."""
    worker_id, load, entries = msgpack.unpackb(body, use_list=True)
    if load is not None and len(load) == _LOAD_FIELDS:
        load = WorkerLoad(*load)
    else:
        load = None
    return worker_id, load, entries


def entry_event(worker_id: str, e: list[Any]) -> WorkerEvent:
    kind, leg_id, tokens, finish, message, timing, wall, extras = e
    kw = {name: back(extras[name]) for name, (_, back) in EXTRAS.items()
          if extras and name in extras}
    return WorkerEvent(KIND_OF[kind], leg_id, worker_id, tuple(tokens),
                       None if finish is None else FINISH_OF[finish], message, wall,
                       NO_TIMING if timing is None else LegTiming(*timing), **kw)
