"""The one execute -> sample path: a scheduled batch through the model, one token
sampled for every row that samples. Used by the colocated engine (engine.LLM) and by
both worker engines; none of them calls the runner or the sampler directly.

Log-probs (engine/logprobs.py) come from the same step: the sampled rows' from the
sampler's pass, and a prefill chunk of a request that asks for prompt log-probs gets the
logits at each of its tokens from the runner; the log-prob of prompt token i + 1 is read
off position i. Everything a step brings to the host (sampled ids, packed log-probs)
travels in one copy; a step where nobody asks copies the ids alone, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from engine.device import to_device
from engine.logprobs import TokenLogprobs, unpack
from engine.model_runner import ModelRunner, SeqChunk
from engine.request import Request
from engine.sampler import DeviceSample, gather_logprobs, sample_on_device


@dataclass(slots=True)
class ScheduledItem:
    request: Request
    start: int  # global index of the first token fed
    num_tokens: int
    is_prefill: bool

    @property
    def completes_prefill(self) -> bool:
        return self.is_prefill and self.start + self.num_tokens == self.request.prefill_len

    def to_chunk(self) -> SeqChunk:
        r = self.request
        if not self.is_prefill:  # a decode: one token, past the prompt (once per token)
            return SeqChunk(r.request_id, (r.output_token_ids[self.start - len(
                r.prompt_token_ids)],), self.start, tuple(r.block_ids), True)
        end, n = self.start + self.num_tokens, len(r.prompt_token_ids)
        # slice prompt and outputs apart: no copy of the whole token list per step
        tokens = r.prompt_token_ids[self.start : end] if end <= n else (
            r.prompt_token_ids[self.start :] + r.output_token_ids[max(0, self.start - n) : end - n])
        return SeqChunk(r.request_id, tuple(tokens), self.start, tuple(r.block_ids),
                        sample=not self.is_prefill or self.completes_prefill)


@dataclass(slots=True)  # one per sampled row (per token of a decode step): not frozen,
class Sampled:  # whose __init__ costs 3x a plain one's (object.__setattr__ per field)
    """One sampled row: its request, the token, and its log-probs if the request asked."""

    request: Request
    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class _PromptSpan:
    """Prompt tokens [first, first + n) get their log-probs from a chunk's first n rows."""

    request: Request
    first: int
    n: int


def _prompt_span(item: ScheduledItem) -> _PromptSpan | None:
    """The prompt tokens whose log-probs this prefill chunk yields, if its request wants
    them: positions [start, end) predict tokens [start + 1, end + 1), up to the prompt's
    last token (the last position's logits sample the first output token)."""
    r = item.request
    if not item.is_prefill or not r.wants_prompt_logprobs:
        return None
    n = min(item.start + item.num_tokens, r.num_prompt_tokens - 1) - item.start
    return _PromptSpan(r, item.start + 1, n) if n > 0 else None


class StepLaunch:
    """A step on its way to the device: ``result()`` waits for its end (the step's one
    host sync, where its ids come to the host) and returns its Sampled rows, once."""

    __slots__ = ("_collect", "_out")

    def __init__(self, collect: Callable[[], list[Sampled]]):
        self._collect: Callable[[], list[Sampled]] | None = collect
        self._out: list[Sampled] = []

    def result(self) -> list[Sampled]:
        if self._collect is not None:
            self._out, self._collect = self._collect(), None
        return self._out


def _done(out: list[Sampled]) -> StepLaunch:
    return StepLaunch(lambda: out)


def execute_and_sample(runner: ModelRunner, items: Sequence[ScheduledItem]) -> list[Sampled]:
    """Run `items` as one batch; returns a Sampled for each row that samples (a decode,
    or a prefill's last chunk), in the runner's row order. Prompt log-probs computed by
    the step are stored on their requests (`Request.prompt_logprobs`)."""
    return launch_and_sample(runner, items).result()


def launch_and_sample(runner: ModelRunner, items: Sequence[ScheduledItem]) -> StepLaunch:
    """`execute_and_sample` in two halves: the step is queued (forward and sampling on
    the device; on a CPU runner it has run by the return) and the handle's ``result()``
    brings the ids to the host. Between the two the host may do other work: the overlap
    of decode_worker/engine.py (docs/design.md §3, "Overlap")."""
    if getattr(runner, "samples_itself", False):  # the emulated device: no logits at all
        launch = getattr(runner, "launch", None)  # (engine/emulate/runner.py)
        return launch(items) if launch is not None else _done(runner.execute_and_sample(items))
    chunks: list[SeqChunk] = []
    spans: list[_PromptSpan] = []
    for item in items:
        chunk, span = item.to_chunk(), _prompt_span(item)
        if span is not None:
            chunk = replace(chunk, all_logits=True)
            spans.append(span)
        chunks.append(chunk)
    step = runner.run(chunks)
    if not step.sample_ids and not spans:
        return _done([])
    by_id = {i.request.request_id: i.request for i in items}
    reqs = [by_id[rid] for rid in step.sample_ids]
    params = [r.sampling_params for r in reqs]
    drawn = sample_on_device(step.logits, params, [r.generator for r in reqs])
    if not drawn.rows and not spans:
        ids = drawn.ids
        return StepLaunch(lambda: [Sampled(r, t) for r, t in
                                   zip(reqs, ids.tolist(), strict=True)])
    parts = drawn.host_parts()
    k = 0
    if spans:
        k = max(s.request.sampling_params.prompt_logprobs for s in spans)
        parts.append(_prompt_pack(step.all_logits, spans, k, step.logits.device))
    packed = torch.cat(parts)
    return StepLaunch(lambda: _collect(packed, drawn, spans, k, reqs, params))


def _collect(packed: torch.Tensor, drawn: DeviceSample, spans: list[_PromptSpan], k: int,
             reqs: list[Request], params: list) -> list[Sampled]:
    """The host half of a step with log-probs: its one host copy, unpacked."""
    flat = packed.tolist()  # the step's one host copy
    out, offset = drawn.finish(flat, 0, params)
    for s in spans:
        r = s.request
        targets = r.prompt_token_ids[s.first:s.first + s.n]
        entries, offset = unpack(flat, offset, targets, k,
                                 [r.sampling_params.prompt_logprobs] * s.n)
        if r.prompt_logprobs is None:
            r.prompt_logprobs = [None]
        del r.prompt_logprobs[s.first:]  # a recomputed chunk replaces what it held
        assert len(r.prompt_logprobs) == s.first, "prompt chunks run in order from 0"
        r.prompt_logprobs.extend(entries)
    lps = out.token_logprobs or [None] * len(reqs)
    return [Sampled(r, t, lp) for r, t, lp in zip(reqs, out.token_ids, lps, strict=True)]


def _prompt_pack(all_logits: dict[str, torch.Tensor], spans: list[_PromptSpan], k: int,
                 device: torch.device) -> torch.Tensor:
    """Packed raw log-probs (gather_logprobs) of every span's prompt tokens, in
    span order, from one log-softmax over all their rows."""
    logits = torch.cat([all_logits[s.request.request_id][:s.n] for s in spans])  # [M, V]
    targets = to_device([t for s in spans for t in
                         s.request.prompt_token_ids[s.first:s.first + s.n]],
                        torch.long, device)
    return gather_logprobs(logits.float().log_softmax(dim=-1), targets, k).flatten()
