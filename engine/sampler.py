"""Greedy / temperature / top-k / top-p sampling, batched on the logits' device.

One pass per step for the whole batch, on the device that holds the logits:

    x      = logits / T                       per-row temperature ([N, V] fp32)
    x      = top-k, then top-p masks of x     (-inf outside; one sort, only if a row uses top-p)
    token  = argmax(softmax(x) / E)           E ~ Exp(1) i.i.d. per row and token

The exponential race gives P(token = i) = softmax(x)_i exactly, with no host round trip
(a multinomial would need one per row). Greedy rows take argmax(logits). A row with a
generator (a request with a seed) draws its E from it, on the logits' device, so the same
seed gives the same tokens whatever else is in the batch; other rows share one draw. The
chosen ids come to the host in one copy. `log_softmax(x)` of the same pass is what a row
was sampled from: `sample_batch(..., with_logprobs=True)` returns it.

Rows whose request asks for log-probs (`SamplingParams.logprobs`, see engine/logprobs.py
for what they are) get them from the same pass: one log-softmax over those rows only, their
top-N gathered on the device and brought to the host in the same copy as the chosen ids.
A batch where no row asks pays nothing for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.device import to_device
from engine.logprobs import TokenLogprobs, unpack
from engine.request import SamplingParams

# Per-request generators live on the CPU (Request owns them); a seeded row sampled on a
# GPU uses a generator on that device made once from the request's seed, kept for as
# long as the request's own generator lives.
_DEVICE_GENERATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: torch.Tensor | None = None  # [N, V] fp32 log-probs each row was sampled from
    # per row: its TokenLogprobs if its request asked for them (SamplingParams.logprobs)
    token_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class DeviceSample:
    """A step's draw before it leaves the device: `ids` [N] and, for the rows in `rows`
    (those that asked for log-probs), their packed log-probs `[len(rows), 2 + 2k]`
    (gather_logprobs)."""

    ids: torch.Tensor
    rows: list[int]
    packed: torch.Tensor | None = None
    k: int = 0
    full: torch.Tensor | None = None  # with_logprobs: [N, V]

    def host_parts(self) -> list[torch.Tensor]:
        """What goes to the host, as float64 (ids are exact)."""
        if self.packed is None:
            return [self.ids.double()]
        return [self.ids.double(), self.packed.flatten()]

    def finish(self, flat: list[float], offset: int, params: Sequence[SamplingParams]
               ) -> tuple[SamplerOutput, int]:
        """The output, read from the host copy `flat` of `host_parts()` at `offset`."""
        n = self.ids.shape[0]
        ids = [int(t) for t in flat[offset:offset + n]]
        offset += n
        per_row: list[TokenLogprobs | None] | None = None
        if self.rows:
            lps, offset = unpack(flat, offset, [ids[i] for i in self.rows], self.k,
                                 [params[i].logprobs for i in self.rows])
            per_row = [None] * n
            for i, lp in zip(self.rows, lps, strict=True):
                per_row[i] = lp
        return SamplerOutput(ids, self.full, per_row), offset


def generator_on(gen: torch.Generator, device: torch.device) -> torch.Generator:
    """`gen` itself if it lives on `device`, else its twin there (seeded with its seed)."""
    if gen.device == device:
        return gen
    per_device = _DEVICE_GENERATORS.setdefault(gen, {})
    twin = per_device.get(device)
    if twin is None:
        twin = torch.Generator(device=device).manual_seed(gen.initial_seed())
        per_device[device] = twin
    return twin


def _row_params(params: Sequence[SamplingParams], vocab: int) -> tuple[torch.Tensor, int, bool]:
    """`[N, 4]` fp32 rows (temperature, top_p, top_k, greedy) with disabled filters made
    inert: greedy rows T = 1, top_p = 2 (never reached), top_k = 0 (off); the largest
    top_k in use; whether any row uses top-p."""
    rows, k_max, any_top_p = [], 0, False
    for sp in params:
        greedy = sp.greedy
        k = sp.top_k if 0 < sp.top_k < vocab and not greedy else 0
        p = sp.top_p if sp.top_p < 1.0 and not greedy else 2.0
        rows.append((1.0 if greedy else sp.temperature, p, float(k), float(greedy)))
        k_max = max(k_max, k)
        any_top_p = any_top_p or p < 1.0
    return torch.tensor(rows, dtype=torch.float32), k_max, any_top_p


def _filter(x: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, k_max: int,
            any_top_p: bool) -> torch.Tensor:
    """`x` `[N, V]` with tokens outside each row's top-k, then its top-p nucleus, at -inf.

    top-k keeps every token tied with the k-th value; top-p drops a token when the mass
    of the tokens before it (renormalised over the top-k) already reaches p, so >= 1 stays.
    """
    k_idx = (top_k.long() - 1).clamp(min=0, max=max(k_max, 1) - 1)[:, None]  # [N, 1]
    if not any_top_p:
        kth = torch.topk(x, k_max, dim=-1).values.gather(1, k_idx)  # [N, 1]
        kth = kth.masked_fill(top_k[:, None] <= 0, float("-inf"))  # (no host scalar)
        return x.masked_fill(x < kth, float("-inf"))
    sorted_x, order = x.sort(dim=-1, descending=True)
    if k_max:
        kth = sorted_x.gather(1, k_idx).masked_fill(top_k[:, None] <= 0, float("-inf"))
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def _exponentials(like: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise `[N, V]`: sampled rows with a generator draw from it, the others share
    one draw (greedy rows never touch their generator: their noise is unused)."""
    q = torch.empty_like(like)
    own = [g if not sp.greedy else None for sp, g in zip(params, generators, strict=True)]
    if any(g is None and not sp.greedy for sp, g in zip(params, own, strict=True)):
        q.exponential_()
    for row, gen in enumerate(own):
        if gen is not None:
            q[row].exponential_(generator=generator_on(gen, like.device))
    # exponential_ may return 0 on some devices: keep p / q finite
    return q.clamp_min_(torch.finfo(q.dtype).tiny)


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """`[L, 2 + 2k]` float64 on the device: per row (chosen log-prob, rank, k top ids,
    k top log-probs) of log-probs `[L, V]` and chosen ids `[L]` (engine/logprobs.py)."""
    k = min(k, logprobs.shape[1])
    picked = logprobs.gather(1, chosen.long()[:, None])  # [L, 1]
    rank = (logprobs >= picked).sum(dim=1, keepdim=True, dtype=torch.int32)  # [L, 1]
    parts = [picked.double(), rank.double()]
    if k:
        top = torch.topk(logprobs, k, dim=1)  # sorted, best first
        parts += [top.indices.double(), top.values.double()]
    return torch.cat(parts, dim=1)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index (NaN counting as maximal), as `x.argmax(dim=-1)`.
    An fp32 CPU tensor goes through numpy: torch's CPU argmax costs ~2.7 us per 2,048-wide
    row here (~10% of a tiny model's decode step), numpy's ~0.16 us, with the same ids."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad:
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def sample_on_device(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    *,
    with_logprobs: bool = False,
) -> DeviceSample:
    """One token per row of `logits` `[N, V]`, and the log-probs of the rows that ask,
    left on the device (see the module doc)."""
    n, vocab = logits.shape
    if len(params) != n or len(generators) != n:
        raise ValueError(f"{n} logit rows but {len(params)} params / {len(generators)} generators")
    rows = [i for i, sp in enumerate(params) if sp.logprobs is not None]
    if n == 0:
        return DeviceSample(logits.new_empty((0,), dtype=torch.long), [],
                            full=logits.new_empty((0, vocab)) if with_logprobs else None)
    greedy_ids = argmax_rows(logits)
    x = None  # the logits each row is sampled from (None: every row is greedy)
    ids = greedy_ids
    if not all(sp.greedy for sp in params) or with_logprobs:
        host, k_max, any_top_p = _row_params(params, vocab)
        if logits.device.type == "cuda":
            host = host.pin_memory()
        temp, top_p, top_k, greedy = host.to(logits.device, non_blocking=True).unbind(1)
        x = logits.float() / temp[:, None]
        if k_max or any_top_p:
            x = _filter(x, top_p, top_k, k_max, any_top_p)
        probs = torch.softmax(x, dim=-1)
        sampled = argmax_rows(probs / _exponentials(probs, params, generators))
        ids = torch.where(greedy > 0, greedy_ids, sampled)
    out = DeviceSample(ids, rows, full=torch.log_softmax(x, dim=-1) if with_logprobs else None)
    if rows:
        out.k = max(params[i].logprobs for i in rows)
        # the rows that ask, as one index on the device (none when every row asks)
        idx = None if len(rows) == n else to_device(rows, torch.long, logits.device)

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if idx is None else t.index_select(0, idx)

        src = _logprob_source(pick(logits).float(), None if x is None else pick(x),
                              [params[i] for i in rows])
        out.packed = gather_logprobs(src.log_softmax(dim=-1), pick(ids), out.k)
    return out


def _logprob_source(raw: torch.Tensor, x: torch.Tensor | None,
                    params: Sequence[SamplingParams]) -> torch.Tensor:
    """`[L, V]` fp32 logits whose log-softmax the rows asking for log-probs report: the
    processed `x` (temperature, filters; greedy rows are unprocessed in it), or the `raw`
    logits for logprobs_mode "raw" (engine/logprobs.py)."""
    if x is None:
        return raw
    modes = [sp.logprobs_mode == "raw" for sp in params]
    if all(modes):
        return raw
    if not any(modes):
        return x
    return torch.where(to_device(modes, torch.bool, raw.device)[:, None], raw, x)


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    *,
    with_logprobs: bool = False,
) -> SamplerOutput:
    """One token per row of `logits` `[N, V]` (see the module doc); one host copy."""
    d = sample_on_device(logits, params, generators, with_logprobs=with_logprobs)
    if not d.rows:
        return SamplerOutput(d.ids.tolist(), d.full)
    flat = torch.cat(d.host_parts()).tolist()
    return d.finish(flat, 0, params)[0]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of `logits` `[N, V]` (fp32), chosen on the logits' device."""
    return sample_batch(logits, params, generators).token_ids
