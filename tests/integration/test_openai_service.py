"""The OpenAI HTTP front door on the disaggregated service (1 prefill + 1 decode worker on
local Ray, tcp KV link), next to gRPC in one server: greedy output equal to engine.LLM's
through the official `openai` client, metrics and traces for HTTP requests, stop strings
and a client leaving mid-stream, each ending with zero blocks used on both pools."""

from __future__ import annotations

import ssl
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from cluster.config.serve import ServeConfig
from cluster.grpc.client import PdserveClient
from cluster.launch.launcher import build_disaggregated_router
from cluster.launch.local_backend import LocalBackend
from cluster.metrics import ServiceMetrics
from cluster.serve.server import BackgroundServer
from engine import LLM, SamplingParams
from tests.tls_cert import self_signed_cert


@pytest.fixture(scope="module")
def pd_http(ray_session, tiny_model):
    cfg = ServeConfig.from_dict({
        "model": {"path": str(tiny_model), "device": "cpu"},
        "pools": {"cpus_per_worker": 1.0, "trace": True},
        "cache": {"prefill_block_size": 16, "decode_block_size": 8},
        "scheduler": {"max_prefill_chunk": 9},
        "server": {"port": 0, "http_port": 0, "served_model_name": "tiny"},
    })
    router = build_disaggregated_router(cfg)
    router.metrics = ServiceMetrics()
    srv = BackgroundServer(router, cfg, health_poll_s=0.05)
    srv.start()
    client = openai.OpenAI(base_url=f"{srv.server.http_url}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    grpc_client = PdserveClient(srv.address, timeout=120)
    yield srv, router, client, grpc_client
    client.close()
    grpc_client.close()
    srv.stop(drain_timeout_s=0)


def assert_no_leaks(grpc_client, timeout: float = 30.0) -> None:
    """Zero blocks used, nothing running or queued, on every worker of both pools."""
    end = time.monotonic() + timeout
    while True:
        st = grpc_client.stats()
        idle = st.num_inflight == 0 and all(
            (w.kv_blocks_used, w.num_running, w.num_waiting, w.queue_depth) == (0, 0, 0, 0)
            for w in st.workers)
        if idle or time.monotonic() > end:
            break
        time.sleep(0.1)
    assert idle, st
    assert {w.role for w in st.workers} == {"prefill", "decode"} and all(
        w.alive for w in st.workers)


def test_openai_client_streams_equal_offline_engine(pd_http, tiny_model):
    srv, router, client, grpc_client = pd_http
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 2000, (n,), generator=g).tolist() for n in (3, 9, 17, 40)]
    want = LLM(str(tiny_model)).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    ttft_before = router.metrics.ttft.collect()[0].samples
    count = next(s.value for s in ttft_before if s.name.endswith("_count"))

    def stream(p):
        chunks = list(client.completions.create(
            model="tiny", prompt=p, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True}))
        return chunks

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(stream, prompts))
    for chunks, ref in zip(results, want, strict=True):
        *body, usage = chunks
        assert [t for c in body for t in c.choices[0].token_ids] == ref.token_ids
        assert "".join(c.choices[0].text for c in body) == ref.text
        assert body[-1].choices[0].finish_reason == "length"
        assert usage.usage.completion_tokens == 10
    r = client.completions.create(model="tiny", prompt=prompts[2], max_tokens=10,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want[2].text and r.usage.prompt_tokens == len(prompts[2])
    # HTTP requests are observed like gRPC ones: router latency metrics and worker traces
    after = router.metrics.ttft.collect()[0].samples
    assert next(s.value for s in after if s.name.endswith("_count")) == count + 5
    traced = {e["request_id"].split("#")[0] for e in srv.run(router.drain_traces())}
    assert r.id in traced and any(rid.startswith("cmpl-") for rid in traced - {r.id})
    assert_no_leaks(grpc_client)


def test_stop_string_ends_the_request_on_both_pools(pd_http, tiny_model):
    _, _, client, grpc_client = pd_http
    prompt = [11, 12, 13, 14, 15]
    full = LLM(str(tiny_model)).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                  stop=stop, extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.find(stop)]
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 40
    assert_no_leaks(grpc_client)


def test_client_leaving_mid_stream_frees_both_pools(pd_http):
    srv, _, _, grpc_client = pd_http
    body = {"prompt": list(range(100, 160)), "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{srv.server.http_url}/v1/completions", json=body,
                      headers={"x-request-id": "http-leaver"}, timeout=120) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        decode = [w for w in grpc_client.stats().workers if w.role == "decode"]
        assert decode[0].kv_blocks_used > 0  # it is decoding on the decode pool
    assert_no_leaks(grpc_client)


def test_https_with_the_grpc_certificate_and_token(tiny_model, tmp_path):
    cert, key = self_signed_cert(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("tls-token")
    cfg = ServeConfig().with_values({
        "server.port": 0, "server.http_port": 0, "server.tls_cert": str(cert),
        "server.tls_key": str(key), "server.auth_token_file": str(token_file),
        "server.served_model_name": "tiny"})
    with BackgroundServer(LocalBackend(LLM(str(tiny_model))), cfg) as srv:
        url = srv.server.http_url
        assert url.startswith("https://")
        http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(cert)))
        ok = openai.OpenAI(base_url=f"{url}/v1", api_key="tls-token", max_retries=0,
                           http_client=http)
        r = ok.completions.create(model="tiny", prompt="hi", max_tokens=3,
                                  extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0,
                              http_client=http)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        ok.close()
        with pytest.raises(httpx.HTTPError):  # no plain-text HTTP on the TLS port
            httpx.get(url.replace("https://", "http://") + "/health", timeout=10)
