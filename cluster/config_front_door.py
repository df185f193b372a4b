"""The front door's sections of ServeConfig (cluster/config.py): `limits` (what a request
may ask and how long it may wait, enforced at the door and by the router) and `server`
(ports, TLS, auth, logging, front-door processes, streaming).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cluster.config_fields import Section, opt
from cluster.front_door_loop import EVENT_LOOPS


@dataclass(frozen=True)
class LimitsSection(Section):
    NAME: ClassVar[str] = "limits"
    max_queue_len: int = opt(256, "waiting requests before RESOURCE_EXHAUSTED", ge=1)
    request_timeout_s: float = opt(600.0, "a request running longer ends DEADLINE_EXCEEDED",
                                   gt=0)
    kv_wait_timeout_s: float = opt(60.0, "a decode worker that gets no KV for this long after "
                                   "the prefill finished (or its last chunk) fails the leg, "
                                   "which is re-dispatched", gt=0)
    drain_timeout_s: float = opt(30.0, "on SIGTERM, how long running requests may finish", ge=0)
    restart_grace_s: float = opt(15.0, "with a whole pool dead, how long new requests wait for "
                                 "Ray to restart a worker before UNAVAILABLE", gt=0)
    max_prompt_tokens: int | None = opt(None, "reject longer prompts (default: "
                                        "max_model_len - 1)", ge=1)
    max_prompt_bytes: int = opt(1 << 20, "reject a text prompt larger than this many bytes "
                                "of UTF-8 before tokenizing it", ge=1)
    max_logprobs: int = opt(20, "largest number of top log-probs a request may ask for "
                            "(logprobs, top_logprobs, prompt_logprobs; as vLLM's)", ge=0)


@dataclass(frozen=True)
class ServerSection(Section):
    NAME: ClassVar[str] = "server"
    host: str = opt("127.0.0.1", "gRPC bind address ('0.0.0.0' for all interfaces)")
    port: int = opt(50051, "gRPC port (0 = ephemeral)", ge=0, le=65535)
    http_port: int | None = opt(None, "OpenAI-compatible HTTP API port (/v1/completions, "
                                "/v1/chat/completions, /v1/models, /health; default: off; "
                                "0 = ephemeral); the same bearer token as gRPC", ge=0, le=65535)
    served_model_name: str | None = opt(None, "the model name of the HTTP API's /v1/models and "
                                        "'model' field (default: model.path as given)")
    metrics_port: int | None = opt(None, "Prometheus /metrics port (default: off); needs "
                                   "the bearer token too when auth_token_file is set",
                                   ge=0, le=65535)
    tls_cert: str | None = opt(None, "PEM certificate chain file: serve TLS")
    tls_key: str | None = opt(None, "PEM private key file (with tls_cert)")
    auth_token_file: str | None = opt(None, "file holding a bearer token clients must send "
                                      "as 'authorization: Bearer <token>'")
    log_level: str = opt("info", "log level", choices=("debug", "info", "warning", "error"))
    api_servers: int = opt(1, "front-door processes serving the gRPC port together "
                           "(SO_REUSEPORT) over the same worker pools; the HTTP API and "
                           "metrics are served by the first one only", ge=1)
    stream_interval: int = opt(1, "tokens per streamed message (the first token and the last "
                               "message go at once); a client that reads slower than tokens "
                               "arrive gets them coalesced in any case", ge=1)
    event_loop: str = opt("auto", "the front doors' event loop: uvloop (its loop machinery in "
                          "C: less CPU per streamed message), asyncio, or auto (uvloop when "
                          "installed)", choices=EVENT_LOOPS)

    def _check(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise self._bad("tls_key" if self.tls_key is None else "tls_cert",
                            "must be set together with tls_cert/tls_key")
        if self.metrics_port is not None and self.metrics_port == self.port != 0:
            raise self._bad("metrics_port", "must differ from server.port")
        if self.http_port is not None and self.http_port != 0 and self.http_port in (
                self.port, self.metrics_port):
            raise self._bad("http_port", "must differ from server.port and server.metrics_port")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise self._bad("served_model_name", "must not be empty")
