"""The wire form of one worker step's events: one msgpack message per step and link.

    [worker_id, load | None, [entry, ...]]
    entry = [kind, leg_id, token_ids, finish_reason | None, message, timing | None,
             wall_time, extras | None]

`kind` and `finish_reason` are the enums' string values (str enums: msgpack writes them);
`timing` the five LegTiming fields in order (None when all are zero); `load` the WorkerLoad fields in order.
`extras` is a map of optional per-token data a request asked for (e.g. log-probabilities),
None for the plain token entries of the hot path: each name in EXTRAS is a WorkerEvent
attribute carried when it is not None, with its (to plain data, from plain data)
conversion, so a new optional field costs one entry here (as the log-probs below).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from operator import attrgetter
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
    "first_token": (int, int),  # on decode's first TOKENS entry of a leg only
}
KIND_OF = {k.value: k for k in EventKind}
FINISH_OF = {f.value: f for f in FinishReason}
_LOAD_FIELDS = len(fields(WorkerLoad))
# C-level field getters (no Python frame per event): LegTiming's and WorkerLoad's fields
# as tuples, and the extras' values in EXTRAS order (rebuilt when EXTRAS changes)
_timing_tuple = attrgetter(*(f.name for f in fields(LegTiming)))
_load_tuple = attrgetter(*(f.name for f in fields(WorkerLoad)))
_extras_getter: list = [(), None]  # [names, getter of their values as a tuple]


def _extras_of() -> tuple[tuple[str, ...], Callable[[WorkerEvent], tuple]]:
    names = tuple(EXTRAS)
    if names != _extras_getter[0]:
        get = attrgetter(*names) if names else (lambda ev: ())
        _extras_getter[:] = names, (lambda ev: (get(ev),)) if len(names) == 1 else get
    return _extras_getter[0], _extras_getter[1]


def encode_batch(worker_id: str, events: list[WorkerEvent], load: WorkerLoad | None) -> bytes:
    """One step's message. Runs once per event of every step (per generated token): the
    enums go as they are (str subclasses: msgpack writes their values), and an event
    without extras or timing costs one tuple."""
    entries = []
    names, extras_of = _extras_of()
    append, no_extras = entries.append, (None,) * len(names)
    for ev in events:
        values = extras_of(ev)
        extras = None
        if values != no_extras:
            extras = {name: EXTRAS[name][0](v)
                      for name, v in zip(names, values, strict=True) if v is not None}
        t = ev.timing
        append((ev.kind, ev.leg_id, ev.token_ids, ev.finish_reason, ev.message,
                None if t is NO_TIMING or t == NO_TIMING else _timing_tuple(t), ev.wall_time,
                extras))
    return msgpack.packb((worker_id, None if load is None else _load_tuple(load), entries))


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
