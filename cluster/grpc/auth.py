"""Bearer-token authentication and TLS credentials for the gRPC server (and client).

Clients send `authorization: Bearer <token>` metadata on every call. The health service
(`/grpc.health.v1.Health/*`) is exempt so that load balancers and Kubernetes probes,
which cannot send tokens, can still see SERVING/NOT_SERVING; reflection is not exempt.
Tokens are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


def read_token(path: str | Path) -> str:
    """The token in `path` (surrounding whitespace stripped); ValueError if empty."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"server.auth_token_file {str(path)!r} is empty")
    return token


def server_credentials(cert_file: str | Path, key_file: str | Path) -> grpc.ServerCredentials:
    """TLS credentials from PEM files (server.tls_cert / server.tls_key)."""
    cert = Path(cert_file).read_bytes()
    key = Path(key_file).read_bytes()
    return grpc.ssl_server_credentials([(key, cert)])


def channel_credentials(ca_file: str | Path | None) -> grpc.ChannelCredentials:
    """TLS channel credentials trusting `ca_file` (None: the system roots)."""
    root = Path(ca_file).read_bytes() if ca_file else None
    return grpc.ssl_channel_credentials(root_certificates=root)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Per-call metadata carrying the bearer token (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def _denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that fails with UNAUTHENTICATED."""

    async def unary(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    kw = {"request_deserializer": handler.request_deserializer,
          "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class BearerToken:
    """The expected `Bearer <token>` value, compared in constant time (never logged)."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("token must be non-empty")
        self._expected = f"Bearer {token}".encode()

    def matches(self, got: str | bytes) -> bool:
        got_bytes = got.encode("latin-1", "replace") if isinstance(got, str) else bytes(got)
        return hmac.compare_digest(got_bytes, self._expected)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>` with UNAUTHENTICATED."""

    def __init__(self, token: str, exempt_prefixes: tuple[str, ...] = EXEMPT_PREFIXES):
        self._token = BearerToken(token)
        self._exempt = exempt_prefixes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], object],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(self._exempt):
            return handler
        metadata = dict(details.invocation_metadata or ())
        got = metadata.get("authorization", "")
        if self._token.matches(got):
            return handler
        reason = "missing" if not got else "invalid"
        log.warning("rejected %s: %s bearer token", details.method, reason)
        return _denied(handler, f"{reason} bearer token: send 'authorization: Bearer <token>'")
