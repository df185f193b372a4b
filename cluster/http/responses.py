"""OpenAI response bodies: completions and chat completions, whole or as SSE chunks.

Shapes follow the OpenAI API (`text_completion`, `chat.completion`,
`chat.completion.chunk`), with vLLM's extensions: `stop_reason` (the stop string or stop
token id that ended the output) and, on request (`return_token_ids`), `token_ids` per
choice and `prompt_token_ids`. `logprobs` is null unless asked for (then shaped by
cluster/http/logprobs.py, per chunk for the chunk's tokens); vLLM's `prompt_logprobs`
is on the choice (completions) or the response (chat), on the first chunk when streamed.
`echo` (completions) puts the prompt's text, and with `logprobs` its tokens, before the
completion's (on the first chunk when streamed).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from starlette.responses import JSONResponse

from cluster.http.logprobs import LogprobsView
from cluster.http.protocol import OpenAIError
from cluster.http.run import Piece
from engine.logprobs import PromptLogprobs, TokenLogprobs

DONE = "data: [DONE]\n\n"


def sse(data: dict) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def error_response(e: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


@dataclass
class Shaper:
    """Builds the bodies of one request (`chat` selects the chat completion shapes)."""

    request_id: str
    model: str
    chat: bool
    prompt_token_ids: tuple[int, ...]
    return_token_ids: bool = False
    view: LogprobsView | None = None  # with any of the three below
    logprobs: bool = False  # choice.logprobs
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field
    echo: str | None = None  # completions' echo: the prompt's text
    created: int = field(default_factory=lambda: int(time.time()))
    first_chunk: bool = True  # no chunk sent yet: the next one opens the stream

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model}

    def _choice(self, text: str, token_ids, finish: str | None, stop_reason, *,
                delta: bool, logprobs: tuple[TokenLogprobs, ...] = (),
                prompt_logprobs: PromptLogprobs | None = None) -> dict:
        """One choice; `prompt_logprobs` is given to the first chunk (or the body) only."""
        choice: dict = {"index": 0}
        opening = not delta or self.first_chunk
        echo = self.echo is not None and not self.chat and opening
        if not self.chat:
            choice["text"] = self.echo + text if echo else text
        elif delta:
            choice["delta"] = {"content": text} if text else {}
            if self.first_chunk:
                choice["delta"] = {"role": "assistant", "content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice.update(logprobs=self._logprobs(token_ids, logprobs, prompt_logprobs, echo),
                      finish_reason=finish, stop_reason=stop_reason)
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        if self.prompt_logprobs and opening and not self.chat:
            choice["prompt_logprobs"] = self._prompt(prompt_logprobs)
        return choice

    def _logprobs(self, token_ids, logprobs: tuple[TokenLogprobs, ...],
                  prompt_logprobs: PromptLogprobs | None, echo: bool) -> dict | None:
        if not self.logprobs:
            return None
        assert self.view is not None, "a Shaper with logprobs has a view"
        if self.chat:
            return self.view.chat(logprobs)
        ids, entries = list(token_ids), list(logprobs)
        if echo:  # the prompt's tokens first (the first one has no log-prob)
            ids = list(self.prompt_token_ids) + ids
            entries = list(prompt_logprobs or [None] * len(self.prompt_token_ids)) + entries
        return self.view.completion(ids, entries)

    def _prompt(self, prompt_logprobs: PromptLogprobs | None) -> list | None:
        assert self.view is not None, "a Shaper with prompt_logprobs has a view"
        return None if prompt_logprobs is None else self.view.prompt(prompt_logprobs)

    def body(self, text: str, token_ids, finish: str | None, stop_reason,
             usage: dict, logprobs: tuple[TokenLogprobs, ...] = (),
             prompt_logprobs: PromptLogprobs | None = None) -> dict:
        """The whole (non-streamed) response."""
        out = self._head(self.object)
        out["choices"] = [self._choice(text, token_ids, finish, stop_reason, delta=False,
                                       logprobs=logprobs, prompt_logprobs=prompt_logprobs)]
        out["usage"] = usage
        if self.return_token_ids:
            out["prompt_token_ids"] = list(self.prompt_token_ids)
        if self.prompt_logprobs and self.chat:
            out["prompt_logprobs"] = self._prompt(prompt_logprobs)
        return out

    def chunk(self, piece: Piece, usage: dict | None, include_usage: bool,
              prompt_logprobs: PromptLogprobs | None = None) -> dict:
        """One streamed chunk; `usage` is null on chunks when include_usage is on;
        `prompt_logprobs` (the run's) go on the first chunk."""
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = [self._choice(piece.text, piece.token_ids, piece.finish_reason,
                                       piece.stop_reason, delta=True, logprobs=piece.logprobs,
                                       prompt_logprobs=prompt_logprobs)]
        if self.return_token_ids and self.first_chunk:
            out["prompt_token_ids"] = list(self.prompt_token_ids)
        if self.prompt_logprobs and self.chat and self.first_chunk:
            out["prompt_logprobs"] = self._prompt(prompt_logprobs)
        self.first_chunk = False
        if include_usage:
            out["usage"] = usage
        return out

    def usage_chunk(self, usage: dict) -> dict:
        """The extra last chunk of stream_options.include_usage: no choices, the usage."""
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = []
        out["usage"] = usage
        return out
