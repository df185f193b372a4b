"""PromptIntake: one path from a GenerateRequest to a GenerateSpec for every front door.

Sizes are checked before any tokenizing (`check_request`), text is tokenized off the
event loop, then `spec_from_request` validates the rest, naming the field.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from cluster.config import LimitsSection
from cluster.convert import DEFAULT_MAX_LOGPROBS, check_request, spec_from_request
from cluster.types import GenerateSpec, RouterAPI
from proto.pdserve.v1 import pdserve_pb2 as pb

DEFAULT_MAX_PROMPT_BYTES = LimitsSection().max_prompt_bytes


class PromptIntake:
    def __init__(self, router: RouterAPI, *, max_prompt_tokens: int | None = None,
                 max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS, logprobs_mode: str = "processed"):
        self.router = router
        self.max_prompt_tokens = max_prompt_tokens
        self.max_prompt_bytes = max_prompt_bytes
        self.max_logprobs = max_logprobs
        self.logprobs_mode = logprobs_mode
        # Off the event loop (streams and health checks never wait for a long text), one
        # at a time: a HF fast tokenizer used from two threads at once can fail with
        # "Already borrowed".
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-tokenize")

    async def run_off_loop(self, fn, *args):
        """Run tokenizer work (encode, chat templates) on the intake's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def spec(self, request: pb.GenerateRequest, request_id: str) -> GenerateSpec:
        """The validated spec; ValueError names the offending field."""
        router = self.router
        check_request(request, request_id=request_id, max_model_len=router.max_model_len,
                      max_prompt_bytes=self.max_prompt_bytes)
        if request.WhichOneof("prompt") == "text":
            ids = await self.run_off_loop(router.tokenize, request.text)
        else:
            ids = request.token_ids.ids
        return spec_from_request(request, request_id=request_id, prompt_ids=ids,
                                 vocab_size=router.vocab_size, max_model_len=router.max_model_len,
                                 max_prompt_tokens=self.max_prompt_tokens,
                                 max_logprobs=self.max_logprobs,
                                 logprobs_mode=self.logprobs_mode)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
