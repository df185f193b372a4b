"""Run as a script: a two-node Ray cluster on this machine (ray.cluster_utils.Cluster),
the prefill worker pinned to one node and the decode worker to the other, tcp connector.
Prints one JSON line: the node ids and whether the tokens equal engine.LLM's."""

from __future__ import annotations

import asyncio
import json
import sys

import ray
from ray.cluster_utils import Cluster

from cluster.config.serve import ServeConfig
from cluster.launch.launcher import LaunchOptions, build_disaggregated_router
from cluster.router.types import GenerateSpec
from engine import LLM, SamplingParams


def main(model_dir: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"prefill_node": 1}, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"decode_node": 1})
    ray.init(address=cluster.address)
    cfg = ServeConfig.from_dict({
        "model": {"path": model_dir, "device": "cpu"},
        "pools": {"cpus_per_worker": 1.0, "address": cluster.address},
        "transfer": {"connector": "tcp"},
        "scheduler": {"max_prefill_chunk": 11},
    })
    router = build_disaggregated_router(cfg, LaunchOptions(
        prefill_resources={"prefill_node": 0.5}, decode_resources={"decode_node": 0.5}))
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [list(range(1, 30)), list(range(50, 140))]

    async def run():
        outs = []
        for i, p in enumerate(prompts):
            toks = []
            async for d in router.generate(GenerateSpec(f"two-node-{i}", tuple(p), sp)):
                toks += d.token_ids
            outs.append(toks)
        await router.shutdown(2)
        return outs

    prefill_node, decode_node = router.prefill[0].node_id, router.decode[0].node_id
    outs = asyncio.run(run())
    ref = [o.token_ids for o in LLM(model_dir).generate(prompts, sp)]
    print(json.dumps({"prefill_node": prefill_node, "decode_node": decode_node,
                      "equal": outs == ref}))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
