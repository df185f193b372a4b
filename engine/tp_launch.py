"""A tensor-parallel group on one host for the in-process engine (engine.LLM): this
process is rank 0, ranks 1..N-1 are child processes (`python -m engine.tp_launch`:
a fresh interpreter that, unlike multiprocessing's spawn, never re-runs the user's
script, so no `if __name__ == "__main__"` guard is needed).

Ranks meet at a TCPStore that rank 0 serves on a free port; the engine config reaches
the children through it (pickled). A child that fails before it joins writes its error
to the store, and rank 0, waiting for each join in short slices, checks the child is
alive between them: a failed start is an error naming the rank, never a hang. Once joined, a rank that dies closes its gloo/NCCL connections and
the next collective fails at once; `describe_dead` names it (pid and exit code).

Clean shutdown: `close()` sends STOP, joins the children (terminating any that linger)
and leaves the process group. It also runs when the LLM is garbage-collected or the
interpreter exits; if rank 0 is killed, the children's next collective (or their store
connection, while starting) fails and they exit: no orphans.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
import traceback
import weakref
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.parallel.state import TPGroupError, current_group, destroy_group, init_group
from engine.tp_driver import make_runner, serve_rank

log = logging.getLogger(__name__)
JOIN_TIMEOUT_S = 300.0  # loading a big model on a slow disk still joins within this
ONE_GPU_ENV = "PDSERVE_TP_ONE_GPU"
_JOINED, _ERROR, _CONFIG = "pdserve/tp/joined/", "pdserve/tp/error/", "pdserve/tp/config"


def one_gpu() -> bool:
    """`PDSERVE_TP_ONE_GPU=1`: every rank on the configured GPU, all-reduces over gloo. A
    check of the CUDA code path on a one-GPU machine (NCCL refuses two ranks on one GPU);
    it says nothing of NCCL or of speed."""
    return os.environ.get(ONE_GPU_ENV, "") == "1"


def _backend(config: EngineConfig) -> str | None:
    return "gloo" if one_gpu() else None


def rank_device(config: EngineConfig, rank: int) -> str:
    """Rank r of a one-host group runs on the r-th GPU after the configured one."""
    device = torch.device(config.device)
    if device.type != "cuda" or one_gpu():
        return config.device
    index = (device.index or 0) + rank
    count = torch.cuda.device_count()
    if (device.index or 0) + config.tensor_parallel_size > count:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} from "
                         f"{config.device} needs that many GPUs; {count} visible")
    return f"cuda:{index}"


def _rank_main(rank: int, size: int, port: int, threads: int) -> None:
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False,
                          timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    try:
        config = pickle.loads(store.get(_CONFIG))
        config = replace(config, device=rank_device(config, rank))
        store.set(f"{_JOINED}{rank}", "1")
        group = init_group(rank, size, store, torch.device(config.device), _backend(config))
        serve_rank(make_runner(config, config.cache.num_blocks), group)
    except BaseException as e:
        try:
            store.set(f"{_ERROR}{rank}", "".join(traceback.format_exception_only(e)).strip())
        except Exception:  # noqa: BLE001 - rank 0 is gone: nobody to tell
            pass
        raise
    finally:
        destroy_group()


class LocalGroup:
    """Ranks 1..N-1 of `config` as child processes; the caller becomes rank 0."""

    def __init__(self, config: EngineConfig):
        size = config.tensor_parallel_size
        self.size = size
        rank_device(config, size - 1)  # enough GPUs for every rank, before starting any
        self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True,
                                   wait_for_workers=False,
                                   timeout=timedelta(seconds=JOIN_TIMEOUT_S))
        self.store.set(_CONFIG, pickle.dumps(config))
        threads = max(1, torch.get_num_threads() // size)
        # the children import this package from where this process found it
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "engine.tp_launch", str(r), str(size),
             str(self.store.port), str(threads)], env=env) for r in range(1, size)]
        self.closed = False
        self.stop = None  # () -> None: rank 0's DriverRunner.stop_ranks
        try:
            for r, p in enumerate(self.procs, start=1):
                self._wait_joined(r, p)
            self.group = init_group(0, size, self.store,
                                    torch.device(rank_device(config, 0)), _backend(config))
        except BaseException:
            self.close()
            raise

    def _wait_joined(self, rank: int, proc: subprocess.Popen) -> None:
        key, deadline = f"{_JOINED}{rank}", time.monotonic() + JOIN_TIMEOUT_S
        while not self.store.check([key]):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise TPGroupError(f"tensor-parallel rank {rank} did not start: "
                                   f"{self.describe_dead() or 'no answer'}")
            time.sleep(0.05)  # a poll, not a wait for something to happen in time

    def _error(self, rank: int) -> str:
        try:
            if self.store.check([f"{_ERROR}{rank}"]):
                return self.store.get(f"{_ERROR}{rank}").decode()
        except RuntimeError:
            pass
        return ""

    def describe_dead(self) -> str | None:
        """'rank r (pid p) exited with code c: error' of every child that has exited."""
        dead = []
        for r, p in enumerate(self.procs, start=1):
            if p.poll() is None:
                continue
            err = self._error(r)
            dead.append(f"rank {r} (pid {p.pid}) exited with code {p.returncode}"
                        + (f": {err}" if err else ""))
        return "; ".join(dead) or None

    def close(self) -> None:
        """Stop the children (`self.stop()`, once rank 0's runner exists, asks them to
        leave their loop first), join them and leave the group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        stop = self.stop
        if stop is not None:
            try:
                stop()
            except RuntimeError as e:  # a dead rank: the others are terminated below
                log.warning("tensor-parallel group: stop failed (%s)", e)
        for p in self.procs:
            try:
                p.wait(10.0 if stop is not None else 0.0)
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(5.0)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        destroy_group()


def local_runner(owner: object, config: EngineConfig) -> tuple[ModelRunner, LocalGroup | None]:
    """The runner of an in-process engine `owner`. With tensor_parallel_size > 1 (and this
    process in no group yet), ranks 1..N-1 start as child processes and this process
    becomes rank 0; the group is closed by `LocalGroup.close`, or when `owner` is
    garbage-collected or the interpreter exits."""
    if config.tensor_parallel_size == 1 or current_group() is not None:
        return make_runner(config, config.cache.num_blocks), None
    group = LocalGroup(config)
    try:
        runner = make_runner(config, config.cache.num_blocks, group.describe_dead)
    except BaseException:
        group.close()
        raise
    group.stop = runner.stop_ranks
    weakref.finalize(owner, group.close)
    return runner, group


if __name__ == "__main__":  # a child rank: rank, size, store port, torch threads
    _rank_main(*(int(a) for a in sys.argv[1:5]))
