"""OpenAI response bodies: completions and chat completions, whole or as SSE chunks.

Shapes follow the OpenAI API (`text_completion`, `chat.completion`,
`chat.completion.chunk`), with vLLM's extensions: `stop_reason` (the stop string or stop
token id that ended the output) and, on request (`return_token_ids`), `token_ids` per
choice and `prompt_token_ids`. `logprobs` is always null until log-probabilities land.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from starlette.responses import JSONResponse

from cluster.openai_protocol import OpenAIError
from cluster.openai_run import Piece

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
    created: int = field(default_factory=lambda: int(time.time()))
    first_chunk: bool = True  # no chunk sent yet: the next one opens the stream

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model}

    def _choice(self, text: str, token_ids, finish: str | None, stop_reason, *,
                delta: bool) -> dict:
        choice: dict = {"index": 0}
        if not self.chat:
            choice["text"] = text
        elif delta:
            choice["delta"] = {"content": text} if text else {}
            if self.first_chunk:
                choice["delta"] = {"role": "assistant", "content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice.update(logprobs=None, finish_reason=finish, stop_reason=stop_reason)
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def body(self, text: str, token_ids, finish: str | None, stop_reason,
             usage: dict) -> dict:
        """The whole (non-streamed) response."""
        out = self._head(self.object)
        out["choices"] = [self._choice(text, token_ids, finish, stop_reason, delta=False)]
        out["usage"] = usage
        if self.return_token_ids:
            out["prompt_token_ids"] = list(self.prompt_token_ids)
        return out

    def chunk(self, piece: Piece, usage: dict | None, include_usage: bool) -> dict:
        """One streamed chunk; `usage` is null on chunks when include_usage is on."""
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = [self._choice(piece.text, piece.token_ids, piece.finish_reason,
                                       piece.stop_reason, delta=True)]
        if self.return_token_ids and self.first_chunk:
            out["prompt_token_ids"] = list(self.prompt_token_ids)
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
