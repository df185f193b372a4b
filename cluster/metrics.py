"""Prometheus metrics of the service (docs/design.md §8 names), served on `--metrics-port`.

Latency histograms are observed by the router as tokens stream (monotonic time in the
server process); pool gauges and KV-transfer counters are refreshed from every worker's
stats on each scrape, so one endpoint shows the whole cluster.

The endpoint follows the gRPC server's security: with `server.auth_token_file` it needs
the same bearer token, and with `server.tls_cert` it serves HTTPS with the same
certificate, so the token never travels in the clear where gRPC would not send it so.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from cluster.grpc.auth import BearerToken
from cluster.ttft_phases import server_phases

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
MAX_TENANT_LABELS = 32  # distinct tenant label values before the rest count as "other"
CHUNK_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ServiceMetrics:
    """Router-side observations + a collector that reads the workers' stats."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.ttft = Histogram("pdserve:time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("pdserve:inter_token_latency_seconds", "Gap between tokens",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds", "Request latency",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft_phase = Histogram(
            "pdserve:ttft_phase_seconds", "The TTFT's server-side phases per tenant: "
            "admission (router clock), prefill_queue and prefill_compute (the prefill "
            "worker's), control (the router's TTFT less those: the trips between them)",
            labelnames=("phase", "tenant"), buckets=LATENCY_BUCKETS, registry=self.registry)
        self.planner = Counter("pdserve:planner_decisions", "The live planner's decisions "
                               "(cluster/serve/planner.py), by action", labelnames=("action",),
                               registry=self.registry)
        self._tenants: set[str] = set()
        self._last_token: dict[str, float] = {}
        self._stats: list[Any] = []
        self._chunk_sizes: dict[str, dict[int, int]] = {}
        self.emulated: str | None = None  # the emulated device's label (engine/emulate/)
        self.registry.register(_PoolCollector(self))

    # ---- router hooks ------------------------------------------------------------------
    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_token(self, flight) -> None:
        now = time.monotonic()
        rid = flight.spec.request_id
        last = self._last_token.get(rid, flight.first_token_at)
        if last is not None:
            self.itl.observe(now - last)
        self._last_token[rid] = now

    def observe_finish(self, usage, tenant: str = "default") -> None:
        self.e2e.observe(usage.e2e_s)
        phases = server_phases(usage.ttft_s, usage.admission_s, usage.queue_s,
                               usage.prefill_s)  # (None: the first token was no prefill's)
        if phases is not None:
            if tenant not in self._tenants and len(self._tenants) >= MAX_TENANT_LABELS:
                tenant = "other"  # tenants are the clients' strings: bound the series
            self._tenants.add(tenant)
            for phase, seconds in phases.items():  # (clocks of two processes: >= 0)
                self.ttft_phase.labels(phase, tenant).observe(max(seconds, 0.0))

    def planner_decision(self, action: str) -> None:
        self.planner.labels(action).inc()

    def forget(self, request_id: str) -> None:
        self._last_token.pop(request_id, None)

    def update_workers(self, workers: list[Any]) -> None:
        self._stats = list(workers)

    def update_chunk_sizes(self, sizes_by_worker: dict[str, dict[int, int]]) -> None:
        """Cumulative chunk-size counts per prefill worker (from their stats)."""
        self._chunk_sizes = {w: dict(c) for w, c in sizes_by_worker.items()}


class _PoolCollector:
    def __init__(self, metrics: ServiceMetrics):
        self.metrics = metrics

    def collect(self):
        labels = ["worker", "role"]
        running = GaugeMetricFamily("pdserve:num_requests_running", "Requests running",
                                    labels=labels)
        waiting = GaugeMetricFamily("pdserve:num_requests_waiting", "Requests waiting",
                                    labels=labels)
        usage = GaugeMetricFamily("pdserve:kv_cache_usage_perc", "KV blocks in use (0-1)",
                                  labels=labels)
        inflight = GaugeMetricFamily("pdserve:kv_inflight_bytes", "KV bytes sent, not acked",
                                     labels=labels)
        sent = CounterMetricFamily("pdserve:kv_transfer_bytes", "KV bytes sent", labels=labels)
        xfer = CounterMetricFamily("pdserve:kv_transfer_seconds", "Time spent writing KV",
                                   labels=labels)
        queued = CounterMetricFamily("pdserve:kv_send_queue_seconds",
                                     "Time KV frames waited in the send queue", labels=labels)
        alive = GaugeMetricFamily("pdserve:worker_alive", "1 if the worker answers",
                                  labels=labels)
        # an emulated accelerator's accounting (engine/emulate/device.py): analytic figures
        busy = GaugeMetricFamily("pdserve:device_busy_ratio", "Emulated device time over "
                                 "wall time since it started (analytic, not measured)",
                                 labels=labels)
        lag = GaugeMetricFamily("pdserve:host_lag_seconds", "How long the emulated device "
                                "waited for the host's next step (latest steps)",
                                labels=[*labels, "quantile"])
        for w in self.metrics._stats:
            lv = [w.worker_id, w.role]
            total = w.kv_blocks_used + w.kv_blocks_free
            running.add_metric(lv, w.num_running)
            waiting.add_metric(lv, w.num_waiting)
            usage.add_metric(lv, w.kv_blocks_used / total if total else 0.0)
            alive.add_metric(lv, 1.0 if w.alive else 0.0)
            if w.role == "prefill":
                inflight.add_metric(lv, w.extra.get("kv_inflight_bytes", 0.0))
                sent.add_metric(lv, w.extra.get("kv_bytes_sent", 0.0))
                xfer.add_metric(lv, w.extra.get("kv_transfer_s", 0.0))
                queued.add_metric(lv, w.extra.get("kv_send_queue_s", 0.0))
            if w.extra.get("device_wall_s"):
                busy.add_metric(lv, w.extra.get("device_busy_ratio", 0.0))
                lag.add_metric([*lv, "0.5"], w.extra.get("host_lag_p50_s", 0.0))
                lag.add_metric([*lv, "0.99"], w.extra.get("host_lag_p99_s", 0.0))
        pools = GaugeMetricFamily("pdserve:pool_workers", "Workers in each pool (the "
                                  "planner moves them)", labels=["role"])
        for role in ("prefill", "decode"):
            pools.add_metric([role], sum(w.role == role for w in self.metrics._stats))
        yield from (running, waiting, usage, inflight, sent, xfer, queued, alive, busy, lag,
                    pools)
        if self.metrics.emulated:  # every figure of this service is the emulated device's
            info = GaugeMetricFamily("pdserve:emulated_device_info", "The service runs on "
                                     "an emulated accelerator: its label", labels=["device"])
            info.add_metric([self.metrics.emulated], 1.0)
            yield info
        yield self._chunk_histogram()

    def _chunk_histogram(self) -> HistogramMetricFamily:
        hist = HistogramMetricFamily("pdserve:prefill_chunk_tokens", "Tokens per prefill chunk",
                                     labels=["worker"])
        for worker, counts in self.metrics._chunk_sizes.items():
            buckets, total = [], 0.0
            for bound in (*CHUNK_BUCKETS, float("inf")):
                n = sum(c for size, c in counts.items() if int(size) <= bound)
                buckets.append((str(float(bound)) if bound != float("inf") else "+Inf", n))
            total = sum(int(size) * c for size, c in counts.items())
            hist.add_metric([worker], buckets, total)
        return hist


async def refresh_loop(router, metrics: ServiceMetrics, interval_s: float = 1.0) -> None:
    """Keep the pool gauges fresh (stats are cheap: one actor call per worker)."""
    while True:
        try:
            stats = await router.stats()
            metrics.update_workers(list(stats.workers))
            metrics.update_chunk_sizes({w.worker_id: dict(w.chunk_sizes)
                                        for w in getattr(router, "prefill", [])})
        except Exception as e:  # a scrape must never take the server down
            log.debug("metrics refresh failed: %s", e)
        await asyncio.sleep(interval_s)


WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


TLS_HANDSHAKE_TIMEOUT_S = 10.0


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # request threads: never joined (no leak), never block exit
    tls: ssl.SSLContext | None = None

    def get_request(self):
        sock, addr = super().get_request()
        if self.tls is None:
            return sock, addr
        sock.settimeout(TLS_HANDSHAKE_TIMEOUT_S)  # a silent client cannot hold a thread
        # the handshake itself runs on the request's thread (finish_request), never here
        return self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

    def finish_request(self, request, client_address) -> None:
        if self.tls is not None:
            try:
                request.do_handshake()
            except (ssl.SSLError, OSError) as e:  # e.g. plain HTTP on the TLS port
                log.debug("metrics TLS handshake with %s failed: %s", client_address, e)
                return
        super().finish_request(request, client_address)


class _SilentHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape would drown the server's own log


def _require_bearer(app: WSGIApp, token: str) -> WSGIApp:
    """`app` behind `Authorization: Bearer <token>` (the gRPC server's check)."""
    bearer = BearerToken(token)

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if bearer.matches(environ.get("HTTP_AUTHORIZATION", "")):
            return app(environ, start_response)
        body = b"401 Unauthorized: send 'Authorization: Bearer <token>'\n"
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                            ("Content-Length", str(len(body))),
                                            ("WWW-Authenticate", "Bearer")])
        return [body]

    return guarded


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """Server-side TLS (1.2 or later) with the gRPC server's certificate and key."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


def serve_metrics(metrics: ServiceMetrics, port: int, host: str = "127.0.0.1",
                  token: str | None = None, tls_cert: str | None = None,
                  tls_key: str | None = None) -> int:
    """Start the /metrics endpoint on a daemon thread; returns the bound port.

    With `token` (server.auth_token_file) every request must carry the bearer token; with
    `tls_cert` / `tls_key` (server.tls_cert / tls_key) it is served over HTTPS only.
    """
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert and tls_key must be given together")
    app: WSGIApp = make_wsgi_app(metrics.registry)
    if token is not None:
        app = _require_bearer(app, token)
    tls = tls_context(tls_cert, tls_key) if tls_cert is not None else None
    # like prometheus_client.start_http_server: pick the family of `host` (IPv6 works)
    family, _, _, _, sockaddr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class Server(_ThreadingWSGIServer):
        address_family = family

    Server.tls = tls
    httpd = make_server(sockaddr[0], port, app, Server, handler_class=_SilentHandler)
    threading.Thread(target=httpd.serve_forever, name="pdserve-metrics", daemon=True).start()
    return httpd.server_port


def serve_metrics_for(server_cfg, metrics: ServiceMetrics) -> str:
    """The endpoint for a ServeConfig's `server` section (port, host, token, TLS);
    returns its URL. A bearer token over plain HTTP off the loopback is warned about."""
    from cluster.grpc.auth import read_token

    token = read_token(server_cfg.auth_token_file) if server_cfg.auth_token_file else None
    port = serve_metrics(metrics, server_cfg.metrics_port, server_cfg.host, token=token,
                         tls_cert=server_cfg.tls_cert, tls_key=server_cfg.tls_key)
    scheme = "https" if server_cfg.tls_cert else "http"
    if token is not None and scheme == "http" and not _loopback(server_cfg.host):
        log.warning("/metrics on %s sends its bearer token in the clear: set server.tls_cert "
                    "and server.tls_key to serve it (and gRPC) over TLS", server_cfg.host)
    host = server_cfg.host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{scheme}://{host}:{port}/metrics"


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"
