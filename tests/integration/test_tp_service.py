"""Tensor-parallel workers through the real service (local Ray, gRPC, tcp KV link):
`--prefill-tp 2 --decode-tp 1` and the reverse give transformers' greedy tokens; GetStats
shows the groups; a dead rank takes its group down and the restart path takes over."""

from __future__ import annotations

import time

import pytest
import ray

from cluster.config.serve import ServeConfig
from cluster.grpc.client import PdserveClient
from cluster.launch.launcher import build_disaggregated_router
from cluster.serve.server import BackgroundServer
from runtime.worker import rank_actor_name
from tests.integration.test_pd_grpc import assert_no_leaks
from tests.unit.test_engine_exactness import hf_greedy, prompt


def _serve(model_dir, prefill_tp: int, decode_tp: int, connector: str = "tcp"):
    cfg = ServeConfig.from_dict({
        # a request meeting a pool that is restarting waits for it (however slow the
        # machine), so the fault test does not race the restart
        "limits": {"restart_grace_s": 600.0},
        "model": {"path": str(model_dir), "device": "cpu"},
        "pools": {"cpus_per_worker": 0.5, "prefill_tp": prefill_tp, "decode_tp": decode_tp},
        "cache": {"prefill_block_size": 16, "decode_block_size": 8},
        "scheduler": {"max_prefill_chunk": 9},
        "transfer": {"connector": connector},
        "server": {"port": 0},
    })
    srv = BackgroundServer(build_disaggregated_router(cfg), cfg, health_poll_s=0.05)
    srv.start()
    return srv, PdserveClient(srv.address, timeout=120)


def _check_exact(client, model_dir, lengths) -> None:
    for n in lengths:
        p = prompt(n, seed=n)
        toks = [t for c in client.generate(p, max_tokens=8, temperature=0.0, ignore_eos=True)
                for t in c.token_ids]
        assert toks == hf_greedy(model_dir, p, 8), f"prompt len {n}"


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "connector"),
                         [(2, 1, "tcp"), (1, 2, "ray"), (2, 2, "torchdist")])
def test_different_tp_on_the_two_pools_matches_transformers(ray_session, tiny_model,
                                                            prefill_tp, decode_tp, connector):
    srv, client = _serve(tiny_model, prefill_tp, decode_tp, connector)
    try:
        _check_exact(client, tiny_model, (1, 9, 17, 40))
        stats = {w.role: w.extra for w in client.stats().workers}
        assert {r: e["tensor_parallel_size"] for r, e in stats.items()} == {
            "prefill": prefill_tp, "decode": decode_tp}
        # each rank sends its own heads, cut for each decode rank: two streams per request,
        # so two frames per chunk (9 chunks of <= 9 tokens), none gathered through rank 0
        assert stats["prefill"]["kv_frames_sent"] == 2 * 9, stats["prefill"]
        for handle, tp in ((srv.router.prefill[0], prefill_tp), (srv.router.decode[0], decode_tp)):
            ranks = ray.get(handle.actor.ready.remote()).tp_ranks  # the placement report
            assert len(ranks) == (tp if tp > 1 else 0)
            assert [r.split(":")[0] for r in ranks] == [f"rank {i}" for i in range(len(ranks))]
            assert len({r.split(" on node ")[1].split(",")[0] for r in ranks}) <= 1  # one node
        assert_no_leaks(client)
        # no rank's link still holds a request (GetStats merges every rank's link stats)
        after = {w.role: w.extra for w in client.stats().workers}
        assert after["prefill"]["send_queue_depth"] == 0
        assert after["decode"]["kv_rx_active_requests"] == 0
    finally:
        client.close()
        srv.stop(drain_timeout_s=0)


def test_a_dead_rank_restarts_its_group_and_serving_goes_on(ray_session, tiny_model):
    srv, client = _serve(tiny_model, 2, 1)
    try:
        _check_exact(client, tiny_model, (12,))
        ranks = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].endswith(rank_actor_name("prefill-0", 1))]
        assert len(ranks) == 1
        ray.kill(ray.get_actor(ranks[0]["name"], namespace=ranks[0]["namespace"]),
                 no_restart=False)
        # the next request's prefill fails the group; rank 0 exits, Ray restarts both, the
        # group re-forms and the router re-dispatches the request
        _check_exact(client, tiny_model, (20,))
        deadline = time.monotonic() + 120
        while srv.router.prefill[0].restarts < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert srv.router.prefill[0].restarts >= 1
        _check_exact(client, tiny_model, (7,))
        assert_no_leaks(client)
    finally:
        client.close()
        srv.stop(drain_timeout_s=0)
