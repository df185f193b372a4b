"""/metrics over plain HTTP while a real P/D router (1 prefill + 1 decode Ray actor) serves.

Wired exactly as `pdserve serve --metrics-port` wires it (cluster/cli.py): the router
observes latencies into a ServiceMetrics, `refresh_loop` pulls the workers' stats, and
`serve_metrics` exposes the registry. The text must parse with prometheus_client's own
parser, carry docs/design.md §8's names, and show the requests that just ran.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import ServiceMetrics, refresh_loop, serve_metrics
from cluster.router.types import GenerateSpec
from engine import SamplingParams

# docs/design.md §8 (counters appear with `_total` on the wire; the parser strips it from
# the family name) plus the liveness gauge the dashboard plots.
DESIGN_NAMES = {
    "pdserve:num_requests_running", "pdserve:num_requests_waiting",
    "pdserve:kv_cache_usage_perc", "pdserve:time_to_first_token_seconds",
    "pdserve:inter_token_latency_seconds", "pdserve:e2e_request_latency_seconds",
    "pdserve:prefill_chunk_tokens", "pdserve:kv_transfer_bytes", "pdserve:kv_transfer_seconds",
    "pdserve:kv_send_queue_seconds", "pdserve:kv_inflight_bytes", "pdserve:worker_alive",
}
MAX_TOKENS = 6
# distinct first tokens: no prefix-cache hits, so every prompt token is prefilled
PROMPTS = [tuple(range(1 + 100 * i, 1 + 100 * i + n)) for i, n in enumerate((39, 46, 53))]
NUM_REQUESTS = len(PROMPTS)


def scrape(port: int) -> tuple[str, dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def sample(families: dict, family: str, name: str, **labels) -> float:
    """The value of one sample (0.0 when absent)."""
    for s in families[family].samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return 0.0


def test_metrics_endpoint_shows_latencies_pool_gauges_and_transfers(start_router):
    runner = start_router({"scheduler": {"max_prefill_chunk": 16}, "transfer": {"connector": "tcp"}})
    metrics = ServiceMetrics()
    runner.router.metrics = metrics  # what `pdserve serve --metrics-port` does
    port = serve_metrics(metrics, 0)
    refresher = asyncio.run_coroutine_threadsafe(
        refresh_loop(runner.router, metrics, interval_s=0.2), runner.loop)
    try:
        _, before = scrape(port)
        assert sample(before, "pdserve:time_to_first_token_seconds",
                      "pdserve:time_to_first_token_seconds_count") == 0

        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        results = runner.generate_many([
            GenerateSpec(f"metrics-{i}", p, sp) for i, p in enumerate(PROMPTS)])
        assert [len(toks) for toks, _ in results] == [MAX_TOKENS] * NUM_REQUESTS

        def settled() -> tuple[str, dict] | None:
            text, fam = scrape(port)
            sent = sample(fam, "pdserve:kv_transfer_bytes", "pdserve:kv_transfer_bytes_total",
                          role="prefill")
            chunked = sample(fam, "pdserve:prefill_chunk_tokens",
                             "pdserve:prefill_chunk_tokens_sum")
            return (text, fam) if sent > 0 and chunked == sum(map(len, PROMPTS)) else None

        end = time.monotonic() + 60  # the refresher runs every 0.2 s
        while (got := settled()) is None and time.monotonic() < end:
            time.sleep(0.2)
        assert got is not None, "kv_transfer_bytes_total / prefill_chunk_tokens_sum not there"
        text, fam = got

        assert DESIGN_NAMES <= set(fam), sorted(DESIGN_NAMES - set(fam))
        assert "pdserve:kv_transfer_bytes_total{" in text  # the counter's wire name
        ttft = "pdserve:time_to_first_token_seconds"
        assert sample(fam, ttft, f"{ttft}_count") == NUM_REQUESTS
        assert sample(fam, ttft, f"{ttft}_bucket", le="+Inf") == NUM_REQUESTS
        assert sample(fam, ttft, f"{ttft}_sum") > 0
        e2e = "pdserve:e2e_request_latency_seconds"
        assert sample(fam, e2e, f"{e2e}_count") == NUM_REQUESTS
        itl = "pdserve:inter_token_latency_seconds"
        # the first token comes from prefill; each later one is one ITL observation
        assert sample(fam, itl, f"{itl}_count") == NUM_REQUESTS * (MAX_TOKENS - 1)
        # prompts of 39/46/53 tokens in chunks of <= 16: at least 3 + 3 + 4 chunks
        assert sample(fam, "pdserve:prefill_chunk_tokens",
                      "pdserve:prefill_chunk_tokens_count") >= 10
        assert sample(fam, "pdserve:prefill_chunk_tokens", "pdserve:prefill_chunk_tokens_bucket",
                      le="16.0") == sample(fam, "pdserve:prefill_chunk_tokens",
                                           "pdserve:prefill_chunk_tokens_count")

        # one gauge sample per worker, labelled with its role
        for gauge in ("pdserve:num_requests_running", "pdserve:num_requests_waiting",
                      "pdserve:kv_cache_usage_perc", "pdserve:worker_alive"):
            roles = sorted(s.labels["role"] for s in fam[gauge].samples)
            assert roles == ["decode", "prefill"], (gauge, roles)
        assert sample(fam, "pdserve:worker_alive", "pdserve:worker_alive", role="decode") == 1
        for s in fam["pdserve:kv_cache_usage_perc"].samples:
            assert 0.0 <= s.value <= 1.0
        assert sample(fam, "pdserve:kv_send_queue_seconds",
                      "pdserve:kv_send_queue_seconds_total", role="prefill") >= 0
        assert sample(fam, "pdserve:kv_transfer_seconds", "pdserve:kv_transfer_seconds_total",
                      role="prefill") > 0
    finally:
        refresher.cancel()
        runner.close()
