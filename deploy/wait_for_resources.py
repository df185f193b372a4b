"""Wait until a Ray cluster offers the resources pdserve's pools will ask for.

    python deploy/wait_for_resources.py --timeout 1800 GPU=16 prefill_node=8 decode_node=8

Joins the cluster like the pdserve driver does (RAY_ADDRESS, else 'auto'), polls
`ray.cluster_resources()` and exits 0 once every NAME=AMOUNT is there, 1 on timeout.
`pdserve serve` plans its pools against the resources present when it starts (it does not
wait for an autoscaler), so cluster launchers run this first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_wants(items: list[str]) -> dict[str, float]:
    """['GPU=8', 'decode_node=1'] -> {'GPU': 8.0, 'decode_node': 1.0}."""
    wants = {}
    for item in items:
        name, sep, amount = item.partition("=")
        if not sep or not name:
            raise ValueError(f"expected NAME=AMOUNT, got {item!r}")
        wants[name] = float(amount)
        if wants[name] <= 0:
            raise ValueError(f"{name}: amount must be > 0, got {amount}")
    return wants


def missing(have: dict[str, float], wants: dict[str, float]) -> dict[str, float]:
    """What is still short: {name: amount wanted} for every resource below its amount."""
    return {k: v for k, v in wants.items() if have.get(k, 0.0) < v}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("resources", nargs="+", help="NAME=AMOUNT, e.g. GPU=8 decode_node=1")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds (default 600)")
    p.add_argument("--interval", type=float, default=5.0, help="poll period in seconds")
    args = p.parse_args(argv)
    try:
        wants = parse_wants(args.resources)
    except ValueError as e:
        p.error(str(e))

    import ray

    ray.init(address=args.address, log_to_driver=False, configure_logging=False)
    end = time.monotonic() + args.timeout
    try:
        while True:
            have = ray.cluster_resources()
            short = missing(have, wants)
            if not short:
                print(f"wait_for_resources: ready: {wants}", flush=True)
                return 0
            if time.monotonic() > end:
                print(f"wait_for_resources: timed out after {args.timeout:g}s; still short "
                      f"of {short}; the cluster has {have}", file=sys.stderr, flush=True)
                return 1
            print(f"wait_for_resources: waiting for {short}", flush=True)
            time.sleep(args.interval)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
