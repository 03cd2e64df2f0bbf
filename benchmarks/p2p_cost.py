"""What a call through two p2p daemons costs in CPU, by how it travels: hivemind's unary calls (one persistent
connection to the daemon, messages up to 4 MiB) against streams (a libp2p stream per call), a bulk transfer
(a stage's state) in bare messages of a given size, and the same bytes as a `state` call of the swarm's own
(`StageClient` to `StageServicer`: its framing, checks and joining of parts) with its parts of a given size.

    PYTHONPATH=src .venv/bin/python benchmarks/p2p_cost.py [--calls 300] [--kib 512] [--bulk-mib 74]

Both peers run in this process, each with its own daemon; the CPU of this process (both peers' Python side)
and of each daemon is read from /proc around each batch of calls.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from swarm.net import protocol
from swarm.net.protocol import Tagged, bound_stream_messages
from swarm.net.servicer import StageServicer
from swarm.net.transport import StageClient

CHUNKS_KIB = (4032, 1024, 256)  # message sizes of the bulk transfer: 4032 is the protocol's (swarm.net.protocol)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class StateServer:
    """A stage server that only serves its state: `mib` MiB of float32 in four tensors."""

    max_request_bytes = 1 << 20

    def __init__(self, mib: int) -> None:
        values = mib * 2**20 // 4
        self.tensors = [torch.randn(values // 4) for _ in range(4)]

    def refused(self, *args) -> None:
        raise AssertionError("nothing is refused here")

    async def state(self, meta, tensors, caller):
        return {"epoch": 1}, [Tagged("state", t) for t in self.tensors]


def message(cls, payload: bytes):
    msg = cls()
    msg.tensors.add().buffer = payload
    return msg


async def measure(name: str, calls: int, one, pids: dict[str, int]) -> None:
    for _ in range(min(20, calls)):  # connections and caches warm
        await one()
    before, started = {k: cpu_seconds(p) for k, p in pids.items()}, time.perf_counter()
    for _ in range(calls):
        await one()
    wall = (time.perf_counter() - started) / calls
    used = {k: (cpu_seconds(p) - before[k]) / calls for k, p in pids.items()}
    spent = "  ".join(f"{k} {v * 1e3:.2f}" for k, v in used.items())
    print(f"{name:<28} {wall * 1e3:8.2f} ms/call  CPU ms/call: {spent}", flush=True)


async def main(calls: int, kib: int, bulk_mib: int) -> None:
    bound_stream_messages()  # stream messages read as a peer reads them (swarm.net.node.start_dht)
    server = await P2P.create()
    client = await P2P.create(initial_peers=await server.get_visible_maddrs())
    pids = {"python": os.getpid(), "server daemon": server._child.pid, "client daemon": client._child.pid}
    try:
        payload = os.urandom(kib * 1024)

        async def unary(request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
            return message(runtime_pb2.ExpertResponse, payload)

        async def stream(requests, context: P2PContext):
            async for _ in requests:
                pass
            yield message(runtime_pb2.ExpertResponse, payload)

        bulk = {"chunk": b""}

        async def state(requests, context: P2PContext):
            async for _ in requests:
                pass
            for _ in range(bulk_mib * 2**20 // len(bulk["chunk"])):
                yield message(runtime_pb2.ExpertResponse, bulk["chunk"])

        await server.add_protobuf_handler("unary", unary, runtime_pb2.ExpertRequest)
        for name, handler in (("stream", stream), ("state", state)):
            await server.add_protobuf_handler(name, handler, runtime_pb2.ExpertRequest, stream_input=True,
                                              stream_output=True)

        async def requests():
            yield message(runtime_pb2.ExpertRequest, payload)

        async def streamed(name: str = "stream") -> None:
            replies = await client.iterate_protobuf_handler(server.peer_id, name, requests(),
                                                            runtime_pb2.ExpertResponse)
            async for _ in replies:
                pass

        async def one_unary() -> None:
            await client.call_protobuf_handler(server.peer_id, "unary", message(runtime_pb2.ExpertRequest, payload),
                                               runtime_pb2.ExpertResponse)

        print(f"{kib} KiB each way")
        for _ in range(2):
            await measure("stream", calls, streamed, pids)
            await measure("unary", calls, one_unary, pids)
        payload = b""
        print(f"{bulk_mib} MiB from server to client, one call")
        for chunk in CHUNKS_KIB:
            bulk["chunk"] = os.urandom(chunk * 1024)
            await measure(f"in messages of {chunk} KiB", 3, lambda: streamed("state"), pids)
        await StageServicer(StateServer(bulk_mib)).add_p2p_handlers(server)
        stage = StageClient(client)
        print(f"{bulk_mib} MiB as the swarm's own state call")
        for chunk in CHUNKS_KIB:
            protocol.CHUNK_BYTES = chunk * 1024  # (the sender's parts: the receiver takes any size)
            await measure(f"in parts of {chunk} KiB", 4,
                          lambda: stage.call(server.peer_id.to_base58(), "state", {}, [], 120), pids)
    finally:
        await client.shutdown()
        await server.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--kib", type=int, default=512, help="payload of each request and reply")
    parser.add_argument("--bulk-mib", type=int, default=74)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.kib, args.bulk_mib))
