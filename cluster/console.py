"""What every `pdserve` command shares on the console: logging, one-line errors (exit
status 2), the config from --config and flags, and the stats table. Kept apart from
cluster/cli.py so that its subcommands (cluster/demo.py, bench's plug-ins) can use them
without importing the CLI that imports them."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn

from cluster.config.flags import config_from_args
from cluster.config.serve import ServeConfig


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def fail(message: str) -> NoReturn:
    print(f"pdserve: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def config_or_exit(args: argparse.Namespace) -> ServeConfig:
    """ServeConfig from --config and flags; a bad key/value exits 2 with the message."""
    try:
        return config_from_args(args)
    except (ValueError, OSError) as e:
        fail(str(e))


def format_stats(stats) -> str:
    """A fixed-width table of a ClusterStats."""
    head = ("WORKER", "ROLE", "ALIVE", "RUNNING", "WAITING", "KV_USED", "KV_FREE", "QUEUE",
            "SEND_Q")
    rows = [head] + [(w.worker_id, w.role, "yes" if w.alive else "NO", w.num_running,
                      w.num_waiting, w.kv_blocks_used, w.kv_blocks_free, w.queue_depth,
                      w.send_queue_depth) for w in stats.workers]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines = ["  ".join(str(v).ljust(n) for v, n in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    lines.append(f"router: queue={stats.router_queue_depth} inflight={stats.num_inflight} "
                 f"serving={'yes' if stats.serving else 'no'}")
    return "\n".join(lines)
