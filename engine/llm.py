"""LLM: the single-process colocated engine (offline API and the baseline of every study)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from engine.block_manager import BlockManager
from engine.chat import render_chat
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.detokenize import BatchDecoder, IncrementalDetokenizer
from engine.device import local_device
from engine.execute import execute_and_sample
from engine.loader import load_model_config, load_tokenizer
from engine.logprobs import PromptLogprobs, TokenLogprobs
from engine.request import FinishReason, Request, SamplingParams
from engine.scheduler import Scheduler
from engine.tp_launch import local_runner
from engine.validation import validate_prompt

Prompt = str | Sequence[int]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    finished: bool
    # SamplingParams.logprobs: one per token; prompt_logprobs: one per prompt token (the
    # first is None). What they hold: engine/logprobs.py.
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True)
class StreamDelta:
    index: int  # position of the prompt in the generate/stream call
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprobs] | None = None  # of new_token_ids (SamplingParams.logprobs)
    prompt_logprobs: PromptLogprobs | None = None  # on a request's first delta


class LLM:
    def __init__(
        self,
        model_dir: str,
        block_size: int = 16,
        max_num_batched_tokens: int = 512,
        max_prefill_chunk: int | None = None,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        num_blocks: int | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        attention_backend: str = "auto",
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int = 1 << 30,
        gpu_memory_utilization: float = 0.9,
        gpu_share: float = 1.0,
        compile: str = "auto",
        tensor_parallel_size: int = 1,
    ):
        """`device`: 'cpu', 'cuda', 'cuda:N' or 'auto'. The KV cache holds `num_blocks`
        blocks, by default `kv_cache_memory_bytes` on CPU and, on a GPU, what the loaded
        weights leave of `gpu_memory_utilization x gpu_share` of its memory. `compile`:
        'none', 'decode', 'all' or 'auto' (the device's default; see engine.compile).
        `tensor_parallel_size` > 1: this process is rank 0 of a group of that many
        processes (engine.parallel; on CUDA one GPU each from `device` on); `shutdown()`,
        or leaving a `with` block, stops them."""
        model = load_model_config(model_dir)
        config = EngineConfig(
            model_dir=str(model_dir),
            model=model,
            cache=CacheConfig(block_size, num_blocks, kv_cache_memory_bytes, enable_prefix_caching,
                              gpu_memory_utilization, gpu_share),
            scheduler=SchedulerConfig(
                max_num_batched_tokens, max_num_seqs, max_prefill_chunk, enable_chunked_prefill,
                max_model_len or model.max_position_embeddings,
            ),
            device=str(local_device(device)), dtype=dtype, attention_backend=attention_backend,
            compile=compile, tensor_parallel_size=tensor_parallel_size,
        )
        self._start(config, max_model_len_given=max_model_len is not None)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """The engine of a ready EngineConfig (its device resolved, e.g. by a worker). A
        max_model_len other than the model's own is an explicit limit (see `_start`)."""
        llm = cls.__new__(cls)
        given = config.scheduler.max_model_len != config.model.max_position_embeddings
        llm._start(config, max_model_len_given=given)
        return llm

    def _start(self, config: EngineConfig, *, max_model_len_given: bool) -> None:
        self.config = config
        # with tensor_parallel_size > 1, rank 0 of a group of local processes
        self.runner, self._tp = local_runner(self, config)
        n_blocks, block_size = self.runner.num_blocks, config.cache.block_size
        capacity = n_blocks * block_size
        if config.scheduler.max_model_len > capacity:
            # A sequence longer than the whole KV pool could never be scheduled (it would
            # wait, or be preempted, forever): refuse an explicit limit, clamp the default.
            if max_model_len_given:
                raise ValueError(
                    f"max_model_len ({config.scheduler.max_model_len}) is larger than the KV "
                    f"cache holds ({n_blocks} blocks x {block_size} = {capacity} tokens)"
                )
            self.config = replace(
                config, scheduler=replace(config.scheduler, max_model_len=capacity)
            )
            self.runner.config = self.config
        self.tokenizer = load_tokenizer(config.model_dir)
        self._decoder: BatchDecoder | None = None
        self.block_manager = BlockManager(n_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self.num_steps = 0

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks this engine started (a no-op without them)."""
        if self._tp is not None:
            self._tp.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- request API ----------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        return [int(t) for t in prompt]

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Request:
        """Validate and queue one request; bad input raises ValueError and queues nothing."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        validate_prompt(ids, self.config.model.vocab_size, self.config.scheduler.max_model_len)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        req = Request(rid, ids, params, eos_token_ids=self.config.model.eos_token_ids)
        self._requests[rid] = req
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[Request]:
        """Schedule, run and sample one step; returns requests that got a token."""
        out = self.scheduler.schedule()
        if not out.items:
            return []
        sampled = execute_and_sample(self.runner, out.items)
        self.num_steps += 1
        touched = self.scheduler.update(out, {s.request.request_id: s.token_id for s in sampled})
        lps = {s.request.request_id: s.logprobs for s in sampled if s.logprobs is not None}
        for r in touched if lps else ():
            if r.request_id in lps:  # update gave each touched request its sampled token
                r.output_logprobs.append(lps[r.request_id])
        for r in touched:
            if r.is_finished:
                self._requests.pop(r.request_id, None)
        return touched

    # ---- offline API ----------------------------------------------------------------
    def stream(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> Iterator[StreamDelta]:
        """Yield new tokens per request as steps produce them (all prompts validated first)."""
        return self._deltas(prompts, params, with_text=True)

    def _deltas(self, prompts: Sequence[Prompt],
                params: SamplingParams | Sequence[SamplingParams] | None,
                with_text: bool) -> Iterator[StreamDelta]:
        plist = self._param_list(prompts, params)
        encoded = [self.encode(p) for p in prompts]
        for ids in encoded:
            validate_prompt(ids, self.config.model.vocab_size, self.config.scheduler.max_model_len)
        reqs = [self.add_request(ids, sp) for ids, sp in zip(encoded, plist, strict=True)]
        index = {r.request_id: i for i, r in enumerate(reqs)}
        sent = {r.request_id: 0 for r in reqs}
        # text deltas by incremental detokenization: a short window per push, not the
        # whole output re-decoded every step; the deltas join to the full decode
        detoks = {r.request_id: IncrementalDetokenizer() for r in reqs} if with_text else {}
        decoder = self._batch_decoder() if with_text else None
        try:
            while any(not r.is_finished for r in reqs):
                touched = [r for r in self.step() if r.request_id in index]
                news = [r.output_token_ids[sent[r.request_id]:] for r in touched]
                texts = decoder.push_many([(detoks[r.request_id], new, r.is_finished)
                                           for r, new in zip(touched, news, strict=True)]
                                          ) if decoder is not None else [""] * len(touched)
                for r, new, delta in zip(touched, news, texts, strict=True):
                    done = sent[r.request_id]
                    sent[r.request_id] = len(r.output_token_ids)
                    lps = r.output_logprobs[done:] if r.sampling_params.logprobs is not None \
                        else None
                    yield StreamDelta(index[r.request_id], r.request_id, new, delta,
                                      r.finish_reason, lps,
                                      r.prompt_logprobs_tuple() if done == 0 else None)
        finally:
            for r in reqs:
                if not r.is_finished:
                    self.abort(r.request_id)

    def _batch_decoder(self) -> BatchDecoder:
        if self._decoder is None:
            self._decoder = BatchDecoder(self.tokenizer)
        return self._decoder

    def generate(
        self, prompts: Sequence[Prompt] | Prompt,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        reasons: dict[int, FinishReason | None] = {}
        rids: dict[int, str] = {}
        lps: dict[int, list[TokenLogprobs]] = {}
        prompt_lps: dict[int, PromptLogprobs] = {}
        for d in self._deltas(prompts, params, with_text=False):
            tokens[d.index].extend(d.new_token_ids)
            rids[d.index] = d.request_id
            if d.finish_reason is not None:
                reasons[d.index] = d.finish_reason
            if d.logprobs is not None:
                lps.setdefault(d.index, []).extend(d.logprobs)
            if d.prompt_logprobs is not None:
                prompt_lps[d.index] = d.prompt_logprobs
        return [
            RequestOutput(
                rids.get(i, ""), self.encode(p), tokens[i],
                self.tokenizer.decode(tokens[i], skip_special_tokens=True),
                reasons.get(i), True, lps.get(i), prompt_lps.get(i),
            )
            for i, p in enumerate(prompts)
        ]

    def chat(
        self, messages: Sequence[Mapping] | Sequence[Sequence[Mapping]],
        params: SamplingParams | Sequence[SamplingParams] | None = None, *,
        add_generation_prompt: bool = True, chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of {role, content} messages) or to several
        (a list of such lists), each rendered by the model's chat template; generation
        stops at the model's EOS tokens (generation_config.json) unless ignore_eos."""
        several = bool(messages) and not isinstance(messages[0], Mapping)
        conversations = list(messages) if several else [messages]
        prompts = [render_chat(self.tokenizer, c, add_generation_prompt=add_generation_prompt,
                               chat_template=chat_template) for c in conversations]
        return self.generate(prompts, params)

    def _param_list(self, prompts, params) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * len(prompts)
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        return list(params)

    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_cache_usage_perc": bm.usage,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
        }
