"""OpenAI-compatible request bodies (`/v1/completions`, `/v1/chat/completions`) and the
mapping of a validated body onto the gRPC `GenerateRequest`.

Pydantic checks only the JSON shape (types, unknown fields, the wire's integer widths);
every value check shared with gRPC (ranges, prompt length, vocabulary) is
`cluster.grpc.intake.spec_from_request`, run on the `GenerateRequest` built here, so both
front doors accept and reject exactly the same requests. What is OpenAI-only (n, stop
strings, the model name, the fields not supported yet) is checked here. Every error is an
`OpenAIError` naming the field (`param`) as the client spelled it.

Log-probs: completions take `logprobs: N` (and `echo`, which returns the prompt, with its
log-probs when `logprobs` is set), chat takes `logprobs: true` with `top_logprobs: N`;
both take vLLM's `prompt_logprobs: N`. They map onto GenerateRequest.logprobs /
prompt_logprobs, so the bound (limits.max_logprobs) is the gRPC door's.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.grpc.convert import build_request
from proto.pdserve.v1 import pdserve_pb2 as pb

INT32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
INT64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
MAX_STOP_STRINGS = 16
# Accepted and documented as ignored: they change no output.
IGNORED_FIELDS = ("metadata", "store", "service_tier", "parallel_tool_calls")


class OpenAIError(Exception):
    """An error answered as OpenAI error JSON: {"error": {message, type, param, code}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error",
             404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error",
             499: "client_closed_request", 500: "server_error", 503: "service_unavailable",
             504: "timeout_error"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    """Fields of both endpoints (vLLM's extra sampling parameters included)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    max_tokens: INT32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: INT32 | None = None
    seed: INT64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[INT32] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: INT32 = 0
    ttft_deadline_ms: float | None = None  # pdserve's (as on gRPC): deadline-aware policies
    return_token_ids: bool = False  # vLLM's: token ids beside the text
    prompt_logprobs: INT32 | None = None  # vLLM's: each prompt token's log-prob and top N
    # Not supported yet: any value but "off" is a 400 naming the field (never ignored).
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    min_tokens: Any = None
    min_p: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    parallel_tool_calls: Any = None

    OFF: ClassVar[dict[str, tuple]] = {
        "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
        "repetition_penalty": (None, 1), "logit_bias": (None, {}), "min_tokens": (None, 0),
        "min_p": (None, 0), "best_of": (None, 1), "suffix": (None, ""),
        "tools": (None, []), "tool_choice": (None, "none"),
        "response_format": (None, {"type": "text"}),
    }

    def check(self) -> None:
        """OpenAI-only checks (the rest is spec_from_request's)."""
        for name, off in self.OFF.items():
            value = getattr(self, name, None)
            if not _is_off(value, off):
                raise OpenAIError(400, f"{name} is not supported yet by pdserve (got "
                                  f"{value!r}); leave it unset", name, "unsupported_parameter")
        if self.n != 1:
            raise OpenAIError(400, f"n must be 1 (pdserve returns one choice per request), "
                              f"got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options is only allowed with stream: true",
                              "stream_options")
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS:
            raise OpenAIError(400, f"stop has {len(stops)} strings; at most "
                              f"{MAX_STOP_STRINGS}", "stop")
        if any(not s for s in stops):
            raise OpenAIError(400, "stop strings must not be empty", "stop")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise OpenAIError(400, f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}",
                              "prompt_logprobs")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_n(self) -> int | None:
        """GenerateRequest.logprobs: the top N of each generated token (None: off)."""
        raise NotImplementedError

    def prompt_logprobs_n(self) -> int | None:
        """GenerateRequest.prompt_logprobs (None: off)."""
        return self.prompt_logprobs

    ALIASES: ClassVar[dict[str, str]] = {"tenant": "user", "prompt": "prompt",
                                         "request_id": "x-request-id"}

    def to_request(self, prompt: str | list[int], *, request_id: str, tenant: str,
                   default_max_tokens: int | None = None) -> pb.GenerateRequest:
        """The gRPC door's GenerateRequest for this body: both doors validate it alike
        (cluster.grpc.intake.PromptIntake)."""
        max_tokens = self.requested_max_tokens()
        if max_tokens is None:
            max_tokens = default_max_tokens
        return build_request(
            prompt, request_id=request_id, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, max_tokens=max_tokens, seed=self.seed,
            stop_token_ids=self.stop_token_ids or (), ignore_eos=self.ignore_eos,
            tenant=tenant, priority=self.priority, ttft_deadline_ms=self.ttft_deadline_ms,
            logprobs=self.logprobs_n(), prompt_logprobs=self.prompt_logprobs_n())

    def invalid(self, error: ValueError) -> OpenAIError:
        """A 400 naming the client's field for a validation message."""
        msg = str(error)
        return OpenAIError(400, msg, self.param_of(msg))

    def param_of(self, message: str) -> str:
        """The client's name of the field a spec_from_request message starts with."""
        head = message.split(" ", 1)[0].split(".", 1)[0].split("[", 1)[0]
        return self.ALIASES.get(head, head)


class CompletionRequest(_Common):
    prompt: Any = None
    logprobs: INT32 | None = None  # the N most likely tokens beside each chosen one
    echo: bool | None = None  # the prompt before the completion (its log-probs too)
    top_logprobs: Any = None  # chat's; here `logprobs: N`
    best_of: Any = None
    suffix: Any = None

    def check(self) -> None:
        super().check()
        if self.logprobs is not None and self.logprobs < 0:
            raise OpenAIError(400, f"logprobs must be >= 0, got {self.logprobs}", "logprobs")
        if not _is_off(self.top_logprobs, (None, 0)):
            raise OpenAIError(400, "top_logprobs is a chat completions parameter; on "
                              "/v1/completions, logprobs: N returns the N most likely "
                              "tokens", "top_logprobs", "unsupported_parameter")

    def logprobs_n(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_n(self) -> int | None:
        """With echo, the echoed prompt's log-probs need the prompt's (as vLLM does)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def single_prompt(self) -> str | list[int]:
        """`prompt` as text or token ids; a batch of one is unwrapped."""
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            return p
        if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                       for t in p):
            return p
        if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            raise OpenAIError(400, f"prompt: a batch of {len(p)} prompts is not supported; "
                              "send one request per prompt", "prompt")
        raise OpenAIError(400, "prompt must be a string or a list of token ids (integers)",
                          "prompt")


class ChatCompletionRequest(_Common):
    ALIASES: ClassVar[dict[str, str]] = {"tenant": "user", "prompt": "messages",
                                         "request_id": "x-request-id"}
    messages: Any = None
    logprobs: bool | None = None  # each chosen token's log-prob
    top_logprobs: INT32 | None = None  # and the N most likely tokens (needs logprobs)
    max_completion_tokens: INT32 | None = None
    chat_template: str | None = None  # vLLM's: override the model's template
    add_generation_prompt: bool = True
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None

    def check(self) -> None:
        super().check()
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise OpenAIError(400, "max_tokens and max_completion_tokens differ; set one",
                              "max_completion_tokens")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise OpenAIError(400, f"top_logprobs must be >= 0, got {self.top_logprobs}",
                              "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", "top_logprobs")

    def logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def invalid(self, error: ValueError) -> OpenAIError:
        e = super().invalid(error)
        if e.param == "top_logprobs":  # GenerateRequest.logprobs is chat's top_logprobs
            e.message = "top_logprobs" + e.message[len("logprobs"):]
        return e

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def param_of(self, message: str) -> str:
        name = super().param_of(message)
        if name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        if name == "logprobs":
            return "top_logprobs"
        return name


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "constrained-int"}


def _is_off(value: Any, offs: tuple) -> bool:
    """`value` is one of the "feature off" values (booleans never equal numbers here)."""
    for off in offs:
        if value is off or (
                not isinstance(value, bool) and not isinstance(off, bool | type(None))
                and type(value) in (int, float, dict, list, str) and value == off):
            return True
    return False


def parse_body(model: type[_Common], data: Any) -> _Common:
    """Validate a JSON body; OpenAIError(400) names the first bad field."""
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        err = max(errors, key=lambda x: len(x["loc"]))  # a union's deepest branch says most
        loc = [str(x) for x in err["loc"] if isinstance(x, int) or (
            "[" not in str(x) and str(x) not in _TYPE_TAGS)]
        field = loc[0] if loc else None
        where = ".".join(loc) or "body"
        if err["type"] == "extra_forbidden":
            raise OpenAIError(400, f"{where} is not a known parameter", field,
                              "unknown_parameter") from e
        raise OpenAIError(400, f"{where}: {err['msg']}", field) from e
    req.check()
    return req
