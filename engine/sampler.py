"""Greedy / temperature / top-k / top-p sampling with per-request seeded generators.

A request with a seed draws from its own `torch.Generator`, so the same seed gives the
same tokens whatever else is in the batch.
"""

from __future__ import annotations

import torch

from engine.request import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] with the tokens outside top-k / the top-p nucleus set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass *before* it already reaches top_p (keeps >= 1 token)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """One token per row of `logits` `[N, V]` (fp32)."""
    out: list[int] = []
    greedy = logits.argmax(dim=-1).tolist() if logits.shape[0] else []
    for row, (sp, gen) in enumerate(zip(params, generators, strict=True)):
        if sp.greedy:
            out.append(int(greedy[row]))
            continue
        scaled = _filter_top_k_top_p(logits[row].float() / sp.temperature, sp.top_k, sp.top_p)
        probs = torch.softmax(scaled, dim=-1).cpu()
        out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return out
