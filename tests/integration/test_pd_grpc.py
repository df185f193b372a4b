"""The disaggregated service over its real gRPC front door (1 prefill + 1 decode worker on
local Ray, tcp KV link): exact tokens, bad input, client cancel, leak checks."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from cluster.config.serve import ServeConfig
from cluster.grpc.client import PdserveClient
from cluster.launch.launcher import build_disaggregated_router
from cluster.serve.server import BackgroundServer
from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def pd_server(ray_session, tiny_model):
    cfg = ServeConfig.from_dict({
        "model": {"path": str(tiny_model), "device": "cpu"},
        "pools": {"cpus_per_worker": 1.0},
        "cache": {"prefill_block_size": 16, "decode_block_size": 8},
        "scheduler": {"max_prefill_chunk": 9, "overlap": False},  # the serial decode loop
        "transfer": {"connector": "tcp"},
        "server": {"port": 0},
    })
    srv = BackgroundServer(build_disaggregated_router(cfg), cfg, health_poll_s=0.05)
    srv.start()
    client = PdserveClient(srv.address, timeout=120)
    yield srv, client
    client.close()
    srv.stop(drain_timeout_s=0)


def wait_idle(client, timeout=30.0):
    end = time.monotonic() + timeout
    while True:
        st = client.stats()
        idle = st.num_inflight == 0 and all(
            (w.kv_blocks_used, w.num_running, w.num_waiting) == (0, 0, 0) for w in st.workers)
        if idle or time.monotonic() > end:
            return st
        time.sleep(0.1)


def assert_no_leaks(client):
    st = wait_idle(client)
    assert st.num_inflight == 0
    for w in st.workers:
        assert w.alive and w.kv_blocks_used == 0 and w.num_running == 0, w


def test_concurrent_streams_equal_offline_engine(pd_server, tiny_model):
    _, client = pd_server
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 2000, (n,), generator=g).tolist()
               for n in (1, 8, 9, 16, 17, 33, 60, 100)]
    ref = LLM(str(tiny_model)).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    with ThreadPoolExecutor(len(prompts)) as pool:
        streams = list(pool.map(lambda p: list(client.generate(
            p, max_tokens=10, temperature=0.0, ignore_eos=True)), prompts))
    for chunks, want in zip(streams, ref, strict=True):
        assert [t for c in chunks for t in c.token_ids] == want.token_ids
        assert "".join(c.text for c in chunks) == want.text
        assert chunks[-1].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 10
        u = chunks[-1].usage  # the TTFT's phases: the router's and the prefill worker's
        assert u.admission_s > 0 and u.queue_s >= 0 and u.prefill_s > 0
        assert u.admission_s + u.queue_s + u.prefill_s < u.ttft_s
    assert_no_leaks(client)


@pytest.mark.parametrize("kwargs,field", [
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2], "temperature": -1.0}, "temperature"),
    ({"prompt": [1, 2], "top_p": 1.5}, "top_p"),
    ({"prompt": [1, 999999]}, "token"),
    ({"prompt": list(range(1, 5000))}, "max_model_len"),
])
def test_bad_input_is_invalid_argument_and_server_keeps_serving(pd_server, kwargs, field):
    _, client = pd_server
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate(kwargs.pop("prompt"), **kwargs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    ok = client.complete([5, 6, 7], max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(ok.token_ids) == 3


def test_client_cancel_mid_decode_frees_both_pools(pd_server):
    _, client = pd_server
    stream = client.generate(list(range(3, 40)), max_tokens=500, temperature=0.0,
                             ignore_eos=True)
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for chunk in stream:
            got.extend(chunk.token_ids)
            if len(got) >= 4:
                threading.Thread(target=stream.cancel).start()
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert 4 <= len(got) < 500
    assert_no_leaks(client)


@pytest.mark.parametrize("ending", ["finished", "abort-rpc", "client-cancel", "invalid"])
def test_a_request_id_is_served_again_right_after_its_request_ended(pd_server, tiny_model,
                                                                      ending):
    """Clients retry with their own ids: the same id, sent again as soon as its request
    ended (any way), gets exact tokens from both pools; nothing leaks."""
    _, client = pd_server
    rid = f"reused-{ending}"
    prompt = list(range(11, 50))
    if ending == "finished":
        first = client.complete(prompt, request_id=rid, max_tokens=4, temperature=0.0,
                                ignore_eos=True)
        assert first.finish_reason == "length"
    elif ending == "invalid":
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(prompt, request_id=rid, max_tokens=0))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    else:
        stream = client.generate(prompt, request_id=rid, max_tokens=500, temperature=0.0,
                                 ignore_eos=True)
        it = iter(stream)
        next(it)
        if ending == "abort-rpc":
            assert client.abort(rid) is True
        else:
            stream.cancel()
    want = LLM(str(tiny_model)).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    again = client.complete(prompt, request_id=rid, max_tokens=6, temperature=0.0,
                            ignore_eos=True)
    assert list(again.token_ids) == want.token_ids and again.finish_reason == "length"
    if ending == "abort-rpc":
        assert list(it)[-1].finish_reason == "abort"
    assert_no_leaks(client)
