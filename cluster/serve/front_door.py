"""A child front door of `pdserve serve --api-servers N` (see cluster/serve/front_doors.py).

    python -m cluster.serve.front_door     # reads a pickled ChildSpec on stdin (from its parent)

It joins the parent's Ray cluster, finds the workers by actor name, builds a Router over
them (its own control-channel links; it does not own the pools: its shutdown leaves them
running), serves the shared port with SO_REUSEPORT, prints READY, and runs until SIGTERM
(drain, then exit) or until its parent goes away (stdin closes).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import signal
import sys
import threading

from cluster.config.serve import ServeConfig
from cluster.serve.front_doors import ChildSpec, attach_peers
from runtime.event_loop import run as run_loop

log = logging.getLogger("pdserve.front_door")


def build_router(spec: ChildSpec, cfg: ServeConfig):
    import ray

    from cluster.router.pool import WorkerHandle
    from cluster.router.router import Router
    from engine.loader import load_model_config, load_tokenizer

    ray.init(address=spec.ray_address, namespace=spec.namespace, configure_logging=False,
             log_to_driver=False)
    handles = []
    for worker_id, role, actor_name, info in spec.workers:
        h = WorkerHandle(worker_id, role, ray.get_actor(actor_name), actor_name=actor_name)
        h.refresh(info)
        handles.append(h)
    model = load_model_config(cfg.model.path)
    return Router([h for h in handles if h.role == "prefill"],
                  [h for h in handles if h.role == "decode"], spec.router_config,
                  load_tokenizer(cfg.model.path), model.vocab_size,
                  cfg.model.max_model_len or model.max_position_embeddings,
                  model.eos_token_ids, channel_secret=spec.channel_secret)


async def run(spec: ChildSpec) -> None:
    from cluster.serve.server import GenerationServer

    cfg = ServeConfig.from_dict(spec.config)
    router = build_router(spec, cfg)
    await router.start()  # its channels are up before it takes a request
    server = GenerationServer(router, cfg)
    await server.start()
    peers = attach_peers(server, spec.index, cfg.server.api_servers, spec.peers_dir)
    await peers.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, lambda: None)  # the parent decides (Ctrl-C)
    threading.Thread(target=lambda: (sys.stdin.buffer.read(),
                                     loop.call_soon_threadsafe(stop.set)), daemon=True).start()
    print("READY", flush=True)
    await stop.wait()
    await server.stop()  # drain, then the router's shutdown (the pools stay up)
    await peers.stop()


def main() -> None:
    spec: ChildSpec = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s front-door-{spec.index} %(levelname)s %(message)s")
    run_loop(run(spec), ServeConfig.from_dict(spec.config).server.event_loop)
    import ray

    ray.shutdown()


if __name__ == "__main__":
    main()
