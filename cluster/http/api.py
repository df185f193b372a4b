"""The OpenAI-compatible HTTP API over a RouterAPI: a Starlette app.

    GET  /health                 200 while serving, 503 while draining or a pool is down
    GET  /v1/models              the served model (bearer token when configured)
    POST /v1/completions         prompt as text or token ids
    POST /v1/chat/completions    messages through the model's chat template

It shares the gRPC server's router and ServingState (drain waits for HTTP requests too,
and aborts them with finish_reason "abort"). A request's order of checks: bearer token
(401), draining (503), JSON shape (400), model name (404), values (400, the gRPC door's
own validation), then the router: a full queue is 429, a dead pool 503. A streamed
response starts once the first text is ready, so errors before it still get their HTTP
status; later errors arrive as an SSE `data: {"error": ...}` event before `[DONE]`. A
client that disconnects (at any point) aborts its request on both pools. The fairness
tenant is the `X-PDServe-Tenant` header, else the body's `user`.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cluster.grpc.auth import BearerToken
from cluster.grpc.intake import PromptIntake
from cluster.grpc.servicer import ServingState
from cluster.http.logprobs import LogprobsView, TokenTexts
from cluster.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    parse_body,
)
from cluster.http.responses import DONE, Shaper, error_response, sse
from cluster.http.run import OpenAIRun, Piece
from cluster.http.stream import ClientGone, EventStream, unless_gone
from cluster.router.types import GenerateSpec, RouterAPI
from engine.chat import render_chat

log = logging.getLogger(__name__)

INTERNAL = OpenAIError(500, "internal error in the backend", code="internal")
TENANT_HEADER = "x-pdserve-tenant"
REQUEST_ID_HEADER = "x-request-id"


@dataclass(frozen=True)
class FrontDoorOptions:
    model_name: str
    token: str | None = None  # server.auth_token_file's token
    request_timeout_s: float = 600.0
    max_prompt_tokens: int | None = None


class OpenAIFrontDoor:
    def __init__(self, router: RouterAPI, state: ServingState, opts: FrontDoorOptions,
                 intake: PromptIntake | None = None):
        self.router, self.state, self.opts = router, state, opts
        self.intake = intake or PromptIntake(router, max_prompt_tokens=opts.max_prompt_tokens)
        self.bearer = BearerToken(opts.token) if opts.token else None
        self.created = int(time.time())
        self.texts = TokenTexts(getattr(router, "tokenizer", None), router.detokenize)

    def app(self) -> Starlette:
        routes = [Route("/health", self.health, methods=["GET"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"])]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})

    # ---- plain endpoints --------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        try:
            healthy = bool(self.router.healthy())
        except Exception:
            log.exception("router.healthy() raised")
            healthy = False
        return JSONResponse({"status": "serving" if healthy else "not_serving"},
                            status_code=200 if healthy else 503)

    def _card(self) -> dict:
        return {"id": self.opts.model_name, "object": "model", "created": self.created,
                "owned_by": "pdserve", "max_model_len": self.router.max_model_len,
                "vocab_size": self.router.vocab_size}

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except OpenAIError as e:
            return self._error(e)
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        try:
            self._authorize(request)
            self._check_model(request.path_params["model"])
        except OpenAIError as e:
            return self._error(e)
        return JSONResponse(self._card())

    # ---- generation -------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            self._authorize(request)
            if self.state.draining:
                raise OpenAIError(503, "server is draining; retry on another replica")
            body = await self._json(request)
            req = parse_body(ChatCompletionRequest if chat else CompletionRequest, body)
            self._check_model(req.model)
            spec, echo = await self._spec(req, request, chat)
        except OpenAIError as e:
            return self._error(e)
        run = OpenAIRun(self.router, self.state, spec, stops=req.stop_strings,
                        include_stop=req.include_stop_str_in_output,
                        request_timeout_s=self.opts.request_timeout_s)
        logprobs, prompt_logprobs = req.logprobs_n() is not None, req.prompt_logprobs is not None
        shaper = Shaper(spec.request_id, self.opts.model_name, chat, spec.prompt_token_ids,
                        req.return_token_ids, LogprobsView(self.texts), logprobs,
                        prompt_logprobs, echo)
        headers = {REQUEST_ID_HEADER: spec.request_id}
        pieces = run.pieces()
        handed_over = False
        try:
            if not req.stream:
                text, last = await unless_gone(request, _collect(pieces))
                return JSONResponse(shaper.body(text, run.token_ids, last.finish_reason,
                                                last.stop_reason, run.usage,
                                                tuple(run.logprobs), run.prompt_logprobs),
                                    headers=headers)
            first = await unless_gone(request, anext(pieces))
            handed_over = True
            return EventStream(self._events(run, shaper, pieces, first, req), run.close,
                                headers)
        except OpenAIError as e:
            return self._error(e, headers)
        except ClientGone:
            log.info("client of %s went away before its answer", spec.request_id)
            return Response(status_code=499)
        except Exception:  # a backend bug fails this request alone
            log.exception("request %s failed in the backend", spec.request_id)
            return self._error(INTERNAL, headers)
        finally:
            if not handed_over:
                await pieces.aclose()
                await run.close()

    async def _events(self, run: OpenAIRun, shaper: Shaper, pieces: AsyncIterator[Piece],
                      first: Piece, req) -> AsyncIterator[str]:
        include = req.include_usage
        every = include and req.stream_options.continuous_usage_stats
        try:
            piece = first
            while True:
                if piece.text or piece.finish_reason or shaper.first_chunk or piece.logprobs \
                        or (req.return_token_ids and piece.token_ids):
                    yield sse(shaper.chunk(piece, run.usage if every else None, include,
                                           run.prompt_logprobs))
                if piece.finish_reason is not None:
                    break
                piece = await anext(pieces)
            if include:
                yield sse(shaper.usage_chunk(run.usage))
        except OpenAIError as e:
            log.info("request %s failed mid-stream: %s", run.rid, e.message)
            yield sse(e.body())
        except Exception:
            log.exception("request %s failed in the backend mid-stream", run.rid)
            yield sse(INTERNAL.body())
        finally:
            await pieces.aclose()
        yield DONE

    async def _spec(self, req, request: Request, chat: bool) -> tuple[GenerateSpec, str | None]:
        """The validated spec, and with completions' echo the prompt's text."""
        rid = request.headers.get(REQUEST_ID_HEADER) or \
            f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if rid in self.state.active:
            raise OpenAIError(409, f"request id {rid!r} is already in flight",
                              REQUEST_ID_HEADER)
        default_max = None
        if chat:
            tokenizer = getattr(self.router, "tokenizer", None)
            if tokenizer is None:
                raise OpenAIError(400, "messages: this backend exposes no tokenizer for "
                                  "chat templates; use /v1/completions", "messages")
            try:
                prompt = await self.intake.run_off_loop(functools.partial(
                    render_chat, tokenizer, req.messages,
                    add_generation_prompt=req.add_generation_prompt,
                    chat_template=req.chat_template))
            except ValueError as e:
                raise OpenAIError(400, str(e), "messages") from e
            # like vLLM: without max_tokens, a reply may fill the rest of the context
            default_max = max(1, self.router.max_model_len - len(prompt))
        else:
            prompt = req.single_prompt()
        tenant = request.headers.get(TENANT_HEADER) or req.user or ""
        grpc_req = req.to_request(prompt, request_id=rid, tenant=tenant,
                                  default_max_tokens=default_max)
        try:
            spec = await self.intake.spec(grpc_req, rid)
        except ValueError as e:
            raise req.invalid(e) from e
        echo = None
        if not chat and req.echo:  # the prompt's text (a token prompt's decoded)
            echo = prompt if isinstance(prompt, str) else await self.intake.run_off_loop(
                self.texts.decode, list(spec.prompt_token_ids))
        return spec, echo

    def _authorize(self, request: Request) -> None:
        if self.bearer is not None and not self.bearer.matches(
                request.headers.get("authorization", "")):
            raise OpenAIError(401, "missing or invalid bearer token: send "
                              "'Authorization: Bearer <token>'", code="invalid_api_key")

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.opts.model_name:
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves "
                              f"{self.opts.model_name!r}", "model", "model_not_found")

    @staticmethod
    async def _json(request: Request):
        raw = await request.body()
        try:
            return json.loads(raw)
        except ValueError as e:
            raise OpenAIError(400, f"the request body is not valid JSON ({e})") from e

    @staticmethod
    def _error(e: OpenAIError, headers: dict[str, str] | None = None) -> Response:
        if e.status == 401:
            headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
        return error_response(e, headers)


async def _collect(pieces: AsyncIterator[Piece]) -> tuple[str, Piece]:
    texts = []
    async for piece in pieces:
        texts.append(piece.text)
        if piece.finish_reason is not None:
            return "".join(texts), piece
    raise OpenAIError(500, "the backend ended the stream early")


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return error_response(OpenAIError(exc.status_code, f"{request.method} {request.url.path}: "
                                      f"{exc.detail}"))
