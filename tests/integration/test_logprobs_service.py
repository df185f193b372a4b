"""Log-probs through the real disaggregated service (1 prefill + 1 decode worker on local
Ray, tcp KV link, prefill blocks of 16, decode blocks of 8, chunks of 9): the prompt's
log-probs computed chunk by chunk on the prefill worker, the first token's there too, the
rest on the decode worker, all equal to transformers' log_softmax in fp32, through gRPC
and the OpenAI API (echo + logprobs as lm-eval sends them), also for a prompt whose
blocks are in the prefill worker's prefix cache; ends with zero blocks on both pools."""

from __future__ import annotations

import openai
import pytest
import torch

from cluster.config.serve import ServeConfig
from cluster.grpc.client import PdserveClient
from cluster.launch.launcher import build_disaggregated_router
from cluster.serve.server import BackgroundServer
from tests.integration.test_openai_service import assert_no_leaks
from tests.logprobs_ref import check_entry, check_prompt, hf_logprobs


@pytest.fixture(scope="module")
def pd_service(ray_session, tiny_model):
    cfg = ServeConfig.from_dict({
        "model": {"path": str(tiny_model), "device": "cpu"},
        "pools": {"cpus_per_worker": 1.0},
        "cache": {"prefill_block_size": 16, "decode_block_size": 8},
        "scheduler": {"max_prefill_chunk": 9},
        "server": {"port": 0, "http_port": 0, "served_model_name": "tiny"},
    })
    srv = BackgroundServer(build_disaggregated_router(cfg), cfg, health_poll_s=0.05)
    srv.start()
    client = openai.OpenAI(base_url=f"{srv.server.http_url}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    grpc_client = PdserveClient(srv.address, timeout=120)
    yield client, grpc_client
    client.close()
    grpc_client.close()
    srv.stop(drain_timeout_s=0)


def test_logprobs_of_the_pd_service_equal_transformers(pd_service, tiny_model):
    client, grpc_client = pd_service
    prompt = torch.randint(1, 2000, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    # twice: the second time the prompt's first 32 tokens are in the prefill's prefix
    # cache, which a request with prompt log-probs skips (a cached prefix has no logits)
    for _ in range(2):
        out = grpc_client.complete(prompt, max_tokens=6, temperature=0, ignore_eos=True,
                                   logprobs=3, prompt_logprobs=2)
        ids = list(out.token_ids)
        ref = hf_logprobs(tiny_model, prompt + ids)
        assert len(out.logprobs) == len(ids) == 6
        for i, lp in enumerate(out.logprobs):  # token 0 from prefill, 1.. from decode
            check_entry(lp, ref[len(prompt) - 1 + i], ids[i], 3)
        check_prompt((None, *out.prompt_logprobs), ref, prompt, 2)
        assert out.usage.cached_prompt_tokens == 0
    cached = grpc_client.complete(prompt, max_tokens=2, temperature=0, ignore_eos=True)
    assert cached.usage.cached_prompt_tokens == 32  # others still hit the cache
    # lm-eval's local-completions loglikelihood request over HTTP
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0,
                                  logprobs=1, echo=True,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    lp = r.choices[0].logprobs
    seq = prompt + r.choices[0].token_ids
    ref = hf_logprobs(tiny_model, seq)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(seq)
    got = torch.tensor(lp.token_logprobs[1:])
    want = ref[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert_no_leaks(grpc_client)
