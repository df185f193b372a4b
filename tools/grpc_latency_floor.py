"""The gRPC latency floor on this host: a bare grpc.aio server (uvloop, pdserve's own
messages, no pdserve code behind it) in another process answers a streaming Generate
with one message at once; the client times send -> first message. Half of that round
trip is what `pdserve simulate --client-ms` should assume for a client like `pdserve
bench` (the analytic profiles assume an in-process client: 0 ms).

    python -m tools.grpc_latency_floor [--calls 400] [--prompt-len 128]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _serve(port: int) -> None:
    import grpc

    from proto.pdserve.v1 import pdserve_pb2 as pb
    from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

    class Floor(pb_grpc.GenerationServicer):
        async def Generate(self, request, context):  # noqa: N802 - the RPC's name
            yield pb.GenerateResponse(request_id="floor", token_ids=[1], text="a")

    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(Floor(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def _client(port: int, calls: int, prompt_len: int) -> list[float]:
    import grpc

    from proto.pdserve.v1 import pdserve_pb2 as pb
    from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.GenerationStub(ch)
        out = []
        for _ in range(calls):
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(prompt_len))))
            t = time.perf_counter()
            async for _r in stub.Generate(req):
                out.append(time.perf_counter() - t)
                break
            await asyncio.sleep(0.002)  # one call at a time, as one stream's requests
        return out[calls // 10:]  # the first calls warm the channel up


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.grpc_latency_floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server process
    a = p.parse_args(argv)
    import uvloop

    if a.serve:
        uvloop.run(_serve(a.serve))
        return 0
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "tools.grpc_latency_floor", "--serve",
                               str(port)], stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise SystemExit("grpc_latency_floor: the floor server did not start")
        rtt = uvloop.run(_client(port, a.calls, a.prompt_len))
    finally:
        server.terminate()
        server.wait(10)
    q = statistics.quantiles(rtt, n=100)
    med = statistics.median(rtt)
    print(f"grpc floor, send -> first streamed message (two processes, uvloop, "
          f"{len(rtt)} calls): p50 {med * 1e3:.3f} ms, p90 {q[89] * 1e3:.3f} ms")
    print(f"one way (half the p50): --client-ms {med * 1e3 / 2:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
