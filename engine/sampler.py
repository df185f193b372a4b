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
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request import SamplingParams

# Per-request generators live on the CPU (Request owns them); a seeded row sampled on a
# GPU uses a generator on that device made once from the request's seed, kept for as
# long as the request's own generator lives.
_DEVICE_GENERATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: torch.Tensor | None = None  # [N, V] fp32 log-probs each row was sampled from


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
    neg_inf = torch.tensor(float("-inf"), device=x.device)
    k_idx = (top_k.long() - 1).clamp(min=0, max=max(k_max, 1) - 1)[:, None]  # [N, 1]
    if not any_top_p:
        kth = torch.topk(x, k_max, dim=-1).values.gather(1, k_idx)  # [N, 1]
        kth = torch.where(top_k[:, None] > 0, kth, neg_inf)
        return x.masked_fill(x < kth, float("-inf"))
    sorted_x, order = x.sort(dim=-1, descending=True)
    if k_max:
        kth = torch.where(top_k[:, None] > 0, sorted_x.gather(1, k_idx), neg_inf)
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


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    *,
    with_logprobs: bool = False,
) -> SamplerOutput:
    """One token per row of `logits` `[N, V]` (see the module doc)."""
    n, vocab = logits.shape
    if len(params) != n or len(generators) != n:
        raise ValueError(f"{n} logit rows but {len(params)} params / {len(generators)} generators")
    if n == 0:
        return SamplerOutput([], logits.new_empty((0, vocab)) if with_logprobs else None)
    greedy_ids = logits.argmax(dim=-1)
    if all(sp.greedy for sp in params) and not with_logprobs:
        return SamplerOutput(greedy_ids.tolist())
    host, k_max, any_top_p = _row_params(params, vocab)
    if logits.device.type == "cuda":
        host = host.pin_memory()
    temp, top_p, top_k, greedy = host.to(logits.device, non_blocking=True).unbind(1)
    x = logits.float() / temp[:, None]
    if k_max or any_top_p:
        x = _filter(x, top_p, top_k, k_max, any_top_p)
    probs = torch.softmax(x, dim=-1)
    sampled = (probs / _exponentials(probs, params, generators)).argmax(dim=-1)
    ids = torch.where(greedy > 0, greedy_ids, sampled)
    logprobs = torch.log_softmax(x, dim=-1) if with_logprobs else None
    return SamplerOutput(ids.tolist(), logprobs)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of `logits` `[N, V]` (fp32), chosen on the logits' device."""
    return sample_batch(logits, params, generators).token_ids
