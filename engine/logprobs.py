"""Log-probabilities of tokens: what a position reports (plain data, no torch: these
cross process boundaries and the server's config reads LOGPROBS_MODES).

What is reported (SamplingParams.logprobs / prompt_logprobs / logprobs_mode):

- a **sampled** token's log-prob and its top N come from the log-softmax of the logits the
  token was drawn from. `logprobs_mode="processed"` (the default): the distribution the
  sampler drew from, i.e. the logits divided by the temperature, then the top-k and top-p
  filters (renormalised; a token outside them has log-prob -inf). A greedy request
  (temperature 0) reports the model's raw distribution, log_softmax(logits), whatever its
  top-k / top-p. `logprobs_mode="raw"` (vLLM's default `raw_logprobs`): always the raw
  log_softmax(logits), before temperature and filters.
- a **prompt** token's log-prob (`prompt_logprobs`) is always raw: the log-softmax of the
  logits at the position before it (the first prompt token has none).

`rank` is vLLM's: the number of tokens whose log-prob is >= the token's (1 = the most
likely). `top` holds the N most likely tokens, best first (it may or may not contain the
token itself).

The device pass (engine.sampler.gather_logprobs) packs, for L rows of log-probs `[L, V]`,
the chosen tokens' values, their ranks and the top-K ids and values into one `[L, 2 + 2K]`
float64 tensor (token ids are exact in float64), so a step brings them to the host in one
copy, together with its sampled ids; the full `[L, V]` never leaves the device. `unpack`
reads them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LOGPROBS_MODES = ("processed", "raw")


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the token there, its log-prob and rank, and the N most likely."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-prob), best first


PromptLogprobs = tuple[TokenLogprobs | None, ...]  # one per prompt token; the first is None


def unpack(flat: Sequence[float], offset: int, chosen: Sequence[int], k: int,
           ns: Sequence[int]) -> tuple[list[TokenLogprobs], int]:
    """TokenLogprobs of rows packed by `gather_logprobs` (with the same `k`, row i keeping
    its own `ns[i]` top entries), read from the host list `flat` at `offset`; returns them
    and the offset past them."""
    width = 2 + 2 * k
    out = []
    for i, (token, n) in enumerate(zip(chosen, ns, strict=True)):
        row = flat[offset + i * width: offset + (i + 1) * width]
        n = min(n, k)
        top = tuple((int(row[2 + j]), float(row[2 + k + j])) for j in range(n))
        out.append(TokenLogprobs(int(token), float(row[0]), int(row[1]), top))
    return out, offset + len(chosen) * width
