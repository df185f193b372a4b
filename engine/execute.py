"""The one execute -> sample path: a scheduled batch through the model, one token
sampled for every row that samples. Used by the colocated engine (engine.LLM) and by
both worker engines; none of them calls the runner or the sampler directly."""

from __future__ import annotations

from collections.abc import Sequence

from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampler import sample
from engine.scheduler import ScheduledItem


def execute_and_sample(runner: ModelRunner, items: Sequence[ScheduledItem]
                       ) -> list[tuple[Request, int]]:
    """Run `items` as one batch; returns (request, sampled token) for each row that
    samples (a decode, or a prefill's last chunk), in the runner's row order."""
    ids, logits = runner.execute([i.to_chunk() for i in items])
    if not ids:
        return []
    by_id = {i.request.request_id: i.request for i in items}
    reqs = [by_id[rid] for rid in ids]
    tokens = sample(logits, [r.sampling_params for r in reqs], [r.generator for r in reqs])
    return list(zip(reqs, tokens, strict=True))
