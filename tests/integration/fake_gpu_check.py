"""Run as a script: a local Ray that claims one GPU (none exists: Ray only counts it),
the service started with the defaults (device auto, pools.gpus_per_worker 1.0), then the
colocated baseline with two engines. Prints one JSON line: the placement note, each
worker's GPU share, Ray GPU ids and device, and whether the tokens equal engine.LLM's.
Workers see no CUDA device here, so they run on the CPU."""

from __future__ import annotations

import asyncio
import json
import logging
import sys

import ray

from cluster.config.serve import ServeConfig
from cluster.launch.launcher import build_colocated_pool_router, build_disaggregated_router
from cluster.router.types import GenerateSpec
from engine import LLM, SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(1, 30)), list(range(50, 90))]


class Notes(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def serve(router, tag: str) -> dict:
    async def run():
        outs = []
        for i, p in enumerate(PROMPTS):
            toks = []
            async for d in router.generate(GenerateSpec(f"{tag}-{i}", tuple(p), SP)):
                toks += d.token_ids
            outs.append(toks)
        return outs

    workers = {h.worker_id: ray.get(h.actor.ready.remote(), timeout=60)
               for h in {id(h): h for h in router.prefill + router.decode}.values()}
    gpus_used = ray.cluster_resources()["GPU"] - ray.available_resources().get("GPU", 0.0)
    loop = asyncio.new_event_loop()
    outs = loop.run_until_complete(run())
    loop.run_until_complete(router.shutdown(2))
    loop.close()
    return {"outs": outs, "gpus_used": gpus_used,
            "workers": {w: {k: getattr(info, k) for k in ("device", "gpu_ids",
                                                          "cuda_visible_devices")}
                        for w, info in workers.items()}}


def main(model_dir: str) -> None:
    notes = Notes()
    logging.getLogger("cluster.launch.launcher").addHandler(notes)
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, namespace="pdserve-fake-gpu",
             configure_logging=False, log_to_driver=False)
    cfg = ServeConfig.from_dict({"model": {"path": model_dir},  # device: auto (default)
                                 "transfer": {"connector": "ray"}})
    pd = serve(build_disaggregated_router(cfg), "pd")
    colocated = serve(build_colocated_pool_router(cfg, 2, True), "co")
    ref = [o.token_ids for o in LLM(model_dir).generate(PROMPTS, SP)]
    print(json.dumps({"notes": notes.messages, "pd": pd, "colocated": colocated,
                      "pd_equal": pd["outs"] == ref, "colocated_equal": colocated["outs"] == ref}))
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
