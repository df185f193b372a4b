"""KV transfer bandwidth: raw loopback socket vs the tcp, nixl, torchdist and ray connectors.

Every configuration sends the same bytes three ways, interleaved so machine load hits
all of them alike, and prints GB/s with ``ratio vs raw`` and ``send N us``: the mean time
the caller spends inside one ``KVSender.send`` (the prefill thread's share of sending;
framing, scheduling and writing happen on the link thread). The receiving side always runs
in another process (a spawned child for raw/tcp/nixl/torchdist, a Ray actor for ray), as a
decode worker would. For nixl the run first prints which UCX transports carried its writes
and notifications (UCX's protocol tables of the sending process, ``--no-ucx-info`` skips). Payloads are exported once (untimed) from a paged cache with the given block size,
so rows that differ only in block size repeat a measurement (a view of the noise).

    python -m tools.kv_transfer_bw --quick
    python -m tools.kv_transfer_bw --connectors raw,tcp --chunk-tokens 256,2048
    python -m tools.kv_transfer_bw --connectors raw,tcp,nixl --block-sizes 16 \
        --chunk-tokens 64,256,1024,2048,2688      # 1.5 .. 63 MiB chunks

Model shape defaults to qwen2-0.5b (24 layers, 2 KV heads, head_dim 64, fp32): 24576 bytes
of KV per token. Numbers on a shared 2-core machine are noisy; read the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import multiprocessing as mp
import os
import socket
import sys
import time

import torch

from kv_transfer import KVChunk, TransferConfig, make_receiver, make_sender
from kv_transfer.testing import PagedKV
from kv_transfer.wire import payload_view

SECRET = os.urandom(32)
MiB = 1 << 20


def _child(conn, kind: str, cfg: TransferConfig | None) -> None:
    """Receiving process: answers ("run", nbytes[, chunk_bytes]) with ("done", seconds)."""
    torch.set_num_threads(1)
    if kind == "raw":
        ls = socket.create_server(("127.0.0.1", 0))
        conn.send(ls.getsockname()[1])
        s, _ = ls.accept()
        while (cmd := conn.recv())[0] == "run":
            _, total, chunk_bytes = cmd
            buf = memoryview(bytearray(chunk_bytes))
            got = 0
            while got < total:  # recv_into a preallocated buffer: the best Python can do
                n = 0
                while n < chunk_bytes:
                    n += s.recv_into(buf[n:])
                got += chunk_bytes
            conn.send(("done",))
        return
    rx = make_receiver(cfg)
    conn.send(rx.endpoint)
    while (cmd := conn.recv())[0] == "run":
        _, total = cmd[:2]
        got = 0
        while got < total:
            ev = rx.poll()
            for c in ev.chunks:
                got += c.nbytes
                rx.release(c)
            if not ev.chunks:
                rx.wait(0.05)
        conn.send(("done",))
    rx.close()


def _spawn(kind: str, cfg: TransferConfig | None):
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_child, args=(child, kind, cfg), daemon=True)
    proc.start()
    return proc, parent, parent.recv()


def _pool(args, block: int, chunk: int) -> list[torch.Tensor]:
    """Distinct chunk payloads (about --pool-mib of them), exported from a paged cache."""
    per_token = args.layers * 2 * args.kv_heads * args.head_dim * 4
    count = max(2, args.pool_mib * MiB // (chunk * per_token))
    cache = PagedKV(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                    block_size=block, num_blocks=-(-count * chunk // block))
    cache.allocate("pool", count * chunk)
    cache.fill_random("pool", count * chunk, seed=block + chunk)
    return [cache.export("pool", i * chunk, (i + 1) * chunk) for i in range(count)]


def _run_raw(sock, pipe, pool, n: int) -> float:
    views = [payload_view(p) for p in pool]
    pipe.send(("run", n * len(views[0]), len(views[0])))
    t0 = time.perf_counter()
    for i in range(n):
        sock.sendall(views[i % len(views)])
    pipe.recv()
    return time.perf_counter() - t0


def _send_all(tx, dest: str, pool, n: int, chunk: int, tag: str) -> float:
    """Send n chunks; returns the seconds the caller spent inside ``send`` (a prefill
    worker's share of sending: the rest happens on the link thread)."""
    per_req = 8  # a request streams 8 chunks, like a long prompt prefilled chunk by chunk
    in_send = 0.0
    for i in range(n):
        rid, seq = f"{tag}-{i // per_req}", i % per_req
        final = seq == per_req - 1 or i == n - 1
        c = KVChunk(rid, seq, seq * chunk, (seq + 1) * chunk, pool[i % len(pool)],
                    is_final=final, first_token=1 if final else None)
        t0 = time.perf_counter()
        tx.send(c, dest=dest)
        in_send += time.perf_counter() - t0
    return in_send


def _run_tcp(tx, endpoint, pipe, pool, n, chunk, tag) -> tuple[float, float]:
    pipe.send(("run", n * pool[0].nbytes))
    t0 = time.perf_counter()
    in_send = _send_all(tx, endpoint, pool, n, chunk, tag)
    pipe.recv()
    return time.perf_counter() - t0, in_send


def _ucx_transports(run) -> list[str]:
    """Run ``run()`` with this process's stdout (fd 1, where UCX prints) captured, and
    return UCX's protocol choices from it: one "operation: transports" line per table of
    a peer endpoint (intra- or inter-node; the agent's loopback "self" tables skipped)."""
    import tempfile

    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+") as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            run()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read()
    found: dict[str, set[str]] = {}
    title, op = "", None
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 1:  # a table's title lines: "<worker> intra-node cfg#1", then the op
            if "-node cfg#" in cells[0] or " self cfg#" in cells[0]:
                title, op = cells[0], None
            elif title and op is None:
                op = cells[0]
        elif len(cells) == 3 and op and " self cfg#" not in title and cells[0] != "Range":
            kind = ("writes (ucp_put)" if op.startswith("remote memory write") else
                    "notifications (ucp_am)" if op.startswith("active message") else op)
            found.setdefault(kind, set()).add(cells[2])
    return [f"{op}: {', '.join(sorted(t))}" for op, t in found.items()]


def _ray_setup(cfg: TransferConfig):
    import ray

    from kv_transfer.ray_connector import KVDeliverMixin, RayReceiver

    @ray.remote(num_cpus=0, max_concurrency=4)
    class Sink(KVDeliverMixin):
        def __init__(self, cfg: TransferConfig) -> None:
            torch.set_num_threads(1)
            self.kv_receiver = RayReceiver(cfg, endpoint="kv-bench-sink")

        def drain(self, total: int, timeout_s: float = 300.0) -> int:
            got, deadline = 0, time.monotonic() + timeout_s
            while got < total and time.monotonic() < deadline:
                ev = self.kv_receiver.poll()
                for c in ev.chunks:
                    got += c.nbytes
                    self.kv_receiver.release(c)
                if not ev.chunks:
                    self.kv_receiver.wait(0.05)
            return got

    path = os.pathsep.join([os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    sink = Sink.options(name="kv-bench-sink").remote(cfg)
    ray.get(sink.drain.remote(0))
    return ray, sink, make_sender(cfg)


def _run_ray(ray, sink, tx, pool, n, chunk, tag) -> tuple[float, float]:
    done = sink.drain.remote(n * pool[0].nbytes)
    t0 = time.perf_counter()
    in_send = _send_all(tx, "kv-bench-sink", pool, n, chunk, tag)
    if ray.get(done) < n * pool[0].nbytes:
        raise RuntimeError(f"ray sink timed out; sender events: {tx.poll().failed[:3]}")
    return time.perf_counter() - t0, in_send


def _keep(best: dict[str, float], send_us: dict[str, float], n: int, total: int, c: str,
          dt: float, in_send: float) -> None:
    best[c] = max(best.get(c, 0), total / dt)
    send_us[c] = min(send_us.get(c, float("inf")), in_send / n * 1e6)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="short run: blocks 16,128; chunks 64,256,2048; 128 MiB per measurement; 1 repeat")
    p.add_argument("--connectors", default="raw,tcp,nixl,torchdist,ray",
                   help="comma list of raw (plain socket sendall/recv_into), tcp, nixl, torchdist, ray")
    p.add_argument("--nixl-ucx-error-handling", default="none", choices=["none", "peer"],
                   help="TransferConfig.nixl_ucx_error_handling (none: UCX shared-memory transports)")
    p.add_argument("--no-ucx-info", action="store_true",
                   help="skip the report of the UCX transports that carried nixl's transfers")
    p.add_argument("--block-sizes", default="16,32,64,128", help="paged-cache block sizes (tokens)")
    p.add_argument("--chunk-tokens", default="64,256,1024,2048", help="tokens per sent KVChunk")
    p.add_argument("--mib", type=int, default=512, help="MiB sent per measurement")
    p.add_argument("--repeats", type=int, default=3, help="measurements per config; the best counts")
    p.add_argument("--pool-mib", type=int, default=64, help="MiB of distinct payloads cycled through")
    p.add_argument("--layers", type=int, default=24, help="model layers (qwen2-0.5b: 24)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (qwen2-0.5b: 2)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim (qwen2-0.5b: 64); dtype is fp32")
    p.add_argument("--credit-window-mib", type=int, default=256, help="TransferConfig.credit_window_bytes")
    p.add_argument("--max-frame-mib", type=int, default=64, help="TransferConfig.max_frame_bytes")
    p.add_argument("--coalesce-kib", type=int, default=1024, help="TransferConfig.coalesce_bytes")
    p.add_argument("--checksum", default="auto", choices=["auto", "crc32", "adler32", "xxh3_64"],
                   help="frame checksum; auto = xxh3_64 if the xxhash package is installed, else crc32")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if args.quick:
        args.block_sizes, args.chunk_tokens, args.mib, args.repeats = "16,128", "64,256,2048", 128, 1
    conns = [c for c in args.connectors.split(",") if c]
    blocks = [int(x) for x in args.block_sizes.split(",")]
    chunks = [int(x) for x in args.chunk_tokens.split(",")]
    torch.set_num_threads(1)
    cfg = TransferConfig(connector="tcp", secret=SECRET, credit_window_bytes=args.credit_window_mib * MiB,
                         max_frame_bytes=args.max_frame_mib * MiB, coalesce_bytes=args.coalesce_kib << 10,
                         checksum=args.checksum)
    per_token = args.layers * 2 * args.kv_heads * args.head_dim * 4
    print(f"# KV per token {per_token} B; {args.mib} MiB per measurement, best of {args.repeats}; "
          f"checksum {cfg.checksum_algo}")
    procs = []
    if "raw" in conns:
        proc, raw_pipe, port = _spawn("raw", None)
        procs.append(proc)
        raw_sock = socket.create_connection(("127.0.0.1", port))
        raw_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if "tcp" in conns:
        proc, tcp_pipe, endpoint = _spawn("tcp", cfg)
        procs.append(proc)
        tcp_tx = make_sender(cfg)
    if "nixl" in conns:
        nixl_cfg = dataclasses.replace(cfg, connector="nixl",
                                       nixl_ucx_error_handling=args.nixl_ucx_error_handling)
        proc, nixl_pipe, nixl_endpoint = _spawn("nixl", nixl_cfg)
        procs.append(proc)
        if not args.no_ucx_info:  # the sender's agent starts on its first link: now
            os.environ["UCX_PROTO_INFO"] = "y"
        nixl_tx = make_sender(nixl_cfg)
        warm = _pool(args, blocks[0], chunks[0])[:1]

        def _warm() -> None:
            _run_tcp(nixl_tx, nixl_endpoint, nixl_pipe, warm, 3, chunks[0], "warm")

        if args.no_ucx_info:
            _warm()
        else:
            print(f"# nixl (ucx_error_handling_mode={args.nixl_ucx_error_handling}) "
                  "UCX transports: " + "; ".join(_ucx_transports(_warm)), flush=True)
            os.environ.pop("UCX_PROTO_INFO", None)
    if "torchdist" in conns:
        dist_cfg = dataclasses.replace(cfg, connector="torchdist")
        proc, dist_pipe, dist_endpoint = _spawn("torchdist", dist_cfg)
        procs.append(proc)
        dist_tx = make_sender(dist_cfg)
    if "ray" in conns:
        ray, sink, ray_tx = _ray_setup(dataclasses.replace(cfg, connector="ray"))
    results = []
    for block in blocks:
        for chunk in chunks:
            if chunk < block or chunk % block:
                continue
            pool = _pool(args, block, chunk)
            n = max(3, args.mib * MiB // pool[0].nbytes)
            best: dict[str, float] = {}
            send_us: dict[str, float] = {}  # best mean time in one send call, microseconds
            keep = functools.partial(_keep, best, send_us, n, n * pool[0].nbytes)

            for r in range(args.repeats):
                tag = f"b{block}c{chunk}r{r}"
                if "raw" in conns:
                    best["raw"] = max(best.get("raw", 0), n * pool[0].nbytes / _run_raw(raw_sock, raw_pipe, pool, n))
                if "tcp" in conns:
                    keep("tcp", *_run_tcp(tcp_tx, endpoint, tcp_pipe, pool, n, chunk, tag))
                if "nixl" in conns:
                    keep("nixl", *_run_tcp(nixl_tx, nixl_endpoint, nixl_pipe, pool, n, chunk, tag))
                if "torchdist" in conns:
                    keep("torchdist", *_run_tcp(dist_tx, dist_endpoint, dist_pipe, pool, n, chunk, tag))
                if "ray" in conns:
                    keep("ray", *_run_ray(ray, sink, ray_tx, pool, n, chunk, tag))
            parts = []
            for c in conns:
                s = f"{c} {best[c] / 1e9:5.2f} GB/s"
                if c != "raw" and "raw" in best:
                    s += f" ratio vs raw: {best[c] / best['raw']:.2f}"
                if c in send_us:
                    s += f" send {send_us[c]:.0f} us"
                parts.append(s)
            print(f"block={block:4d} chunk={chunk:5d} tok ({pool[0].nbytes / MiB:5.1f} MiB): "
                  + " | ".join(parts), flush=True)
            results.append({"block": block, "chunk_tokens": chunk, "chunk_bytes": pool[0].nbytes,
                            **{f"{c}_GBps": best[c] / 1e9 for c in conns},
                            **{f"{c}_send_us": v for c, v in send_us.items()}})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    for pipe in [x for x in (locals().get("raw_pipe"), locals().get("tcp_pipe"),
                             locals().get("nixl_pipe"), locals().get("dist_pipe")) if x]:
        pipe.send(("stop",))
    if "tcp" in conns:
        tcp_tx.close()
    if "nixl" in conns:
        nixl_tx.close()
    if "torchdist" in conns:
        dist_tx.close()
    if "ray" in conns:
        ray_tx.close()
        ray.shutdown()
    for proc in procs:
        proc.join(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
