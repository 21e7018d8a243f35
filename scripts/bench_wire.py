#!/usr/bin/env python3
"""Wire micro-benchmarks: codec speed and round trips through the real transport.

Usage: ``python scripts/bench_wire.py [--seconds S] [--concurrency C]``

1. encode+decode of RunEvent-sized frames (a ~20-char text delta): the bare
   framing (``encode_frame`` + ``FrameDecoder``) and through the sans-IO
   ``Connection`` (state table included).
2. Round trips over loopback TCP: a ``NodeHub`` behind ``serve_wire`` and a
   ``NodeLink`` whose handler answers every RunRequest with one ``complete``
   event; sequential and with C concurrent streams.
3. The baseline: a raw trio TCP echo of the same request/response bytes
   (length-prefixed, no protocol, no state), and the ratio between the two.

Everything runs in one process and one trio loop (both ends share a core).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import time

import trio

from iopd.config.schema import NodeEntry, NodeSection
from iopd.edge.nodes.hub import FrameDirection, HubSettings, NodeHub, WireErrorReason
from iopd.node.edges.link import NodeLink
from iopd.node.handler import StreamSender
from iopd.transport.listen import serve_wire
from wire.connection import Connection, Role
from wire.framing import FrameDecoder, encode_frame
from wire.messages import (
    PROTOCOL_VERSION,
    Challenge,
    ControlState,
    ControlUpdate,
    Hello,
    HelloAck,
    NodeConfig,
    NodeConfigAck,
    NodeConfigState,
    Proof,
    ProviderStatus,
    ProviderTunnelRequest,
    RunEvent,
    RunRequest,
)

TEXT = "The quick brown fox "  # a ~20-char text delta
EVENT = RunEvent(stream_id=12345, kind="text", text=TEXT)
REQUEST = RunRequest(
    stream_id=0,
    provider_id="echo-1",
    adapter="echo",
    target="m",
    messages=[{"role": "user", "content": "hi"}],
)
TOKEN = "bench-token"


def bench_codec(seconds: float) -> None:
    frame = encode_frame(EVENT)
    print(f"RunEvent frame: {len(frame)} bytes")
    dec = FrameDecoder()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(1000):
            dec.feed(encode_frame(EVENT))
        n += 1000
    rate = n / (time.perf_counter() - start)
    print(f"codec: encode_frame + FrameDecoder.feed:        {rate:>12,.0f} msgs/s")

    edge, node = Connection(Role.EDGE), Connection(Role.NODE)
    edge.receive_data(node.send(Hello(protocol_version=PROTOCOL_VERSION, node_id="n", token="")))
    node.receive_data(edge.send(Challenge(nonce="n" * 48, salt=b"s", iterations=4096)))
    edge.receive_data(node.send(Proof(proof=bytes(32))))
    node.receive_data(edge.send(HelloAck(edge_id="e")))
    node.receive_data(
        edge.send(
            RunRequest(stream_id=1, provider_id="p", adapter="echo", target="m", window=2**62)
        )
    )
    ev = RunEvent(stream_id=1, kind="text", text=TEXT)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(1000):
            edge.receive_data(node.send(ev))
        n += 1000
    rate = n / (time.perf_counter() - start)
    print(f"codec: Connection.send + receive_data (checked): {rate:>12,.0f} msgs/s")


class OneShotHandler:
    """Answers every RunRequest with one complete event."""

    async def on_config(self, msg: NodeConfig) -> NodeConfigAck:
        return NodeConfigAck(stream_id=msg.stream_id, version=msg.version)

    def start_early(self, req: RunRequest | ProviderTunnelRequest) -> None:
        return None

    async def serve_stream(
        self, req: RunRequest | ProviderTunnelRequest, sender: StreamSender, early: None
    ) -> None:
        await sender.send(RunEvent(stream_id=req.stream_id, kind="complete", text=TEXT))

    def cancel(self, stream_id: int, reason: str) -> None:
        pass

    def current_status(self) -> ProviderStatus:
        return ProviderStatus()

    def on_controls(self, msg: ControlUpdate) -> None:
        pass

    def config_state(self) -> NodeConfigState:
        return NodeConfigState(revision=0, digest="")

    def control_state(self) -> ControlState:
        return ControlState()


class BenchHubOwner:
    """The hub's owner (``HubOwner``): one node ``n``, events ignored."""

    def known_nodes(self) -> dict[str, NodeEntry]:
        return {
            "n": NodeEntry(id="n", token_hash_sha256=hashlib.sha256(TOKEN.encode()).hexdigest())
        }

    def node_config(self, node_id: str) -> NodeConfig:
        return NodeConfig(stream_id=0, version=1)

    def node_connected(self, node_id: str) -> None:
        pass

    def node_disconnected(self, node_id: str) -> None:
        pass

    def provider_status(self, node_id: str, msg: ProviderStatus) -> None:
        pass

    def node_config_state(self, node_id: str, msg: NodeConfigState) -> None:
        pass

    def node_controls(self, node_id: str, msg: ControlState) -> None:
        pass

    def wire_frames(self, direction: FrameDirection, n: int) -> None:
        pass

    def wire_error(self, reason: WireErrorReason, detail: str) -> None:
        pass


async def bench_transport(seconds: float, concurrency: int) -> tuple[float, float]:
    settings = HubSettings(
        edge_id="bench",
        heartbeat_interval=5,
        heartbeat_timeout=15,
        handshake_timeout=5,
        max_frame_bytes=16 << 20,
    )
    hub = NodeHub(settings, owner=BenchHubOwner())
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(serve_wire, hub.handle_connection, "127.0.0.1", 0)
        link = NodeLink(
            NodeSection(id="n", edge=f"{host}:{port}", token=TOKEN, accept_legacy_proof=True),
            OneShotHandler(),
            software_version="bench",
        )
        nursery.start_soon(link.run)
        while hub.session("n") is None:  # noqa: ASYNC110 - no event for "hub has a session"
            await trio.sleep(0.01)
        session = hub.session("n")
        assert session is not None

        async def one() -> None:
            async with session.open_stream(REQUEST) as replies:
                async for _ in replies:
                    pass

        for _ in range(200):  # warm up
            await one()
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(100):
                await one()
            n += 100
        sequential = n / (time.perf_counter() - start)

        counts = [0] * concurrency
        deadline = time.perf_counter() + seconds

        async def worker(i: int) -> None:
            while time.perf_counter() < deadline:
                await one()
                counts[i] += 1

        start = time.perf_counter()
        async with trio.open_nursery() as workers:
            for i in range(concurrency):
                workers.start_soon(worker, i)
        concurrent = sum(counts) / (time.perf_counter() - start)
        await hub.aclose("bench over")
        nursery.cancel_scope.cancel()
    return sequential, concurrent


async def bench_raw_echo(seconds: float) -> float:
    """Baseline: the same request/response bytes over a raw trio TCP connection."""
    request = encode_frame(
        RunRequest(
            **{**{f: getattr(REQUEST, f) for f in REQUEST.__struct_fields__}, "stream_id": 1}
        )
    )
    response = encode_frame(RunEvent(stream_id=1, kind="complete", text=TEXT))

    async def read_frame(stream: trio.abc.Stream, buf: bytearray) -> None:
        while True:
            if len(buf) >= 4:
                size = int.from_bytes(buf[:4], "big")
                if len(buf) >= 4 + size:
                    del buf[: 4 + size]
                    return
            data = await stream.receive_some(65536)
            if not data:
                raise EOFError
            buf += data

    async def server(stream: trio.abc.Stream) -> None:
        buf = bytearray()
        try:
            while True:
                await read_frame(stream, buf)
                await stream.send_all(response)
        except (EOFError, trio.BrokenResourceError):
            pass

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, host="127.0.0.1"), server, 0
        )
        port = listeners[0].socket.getsockname()[1]
        client = await trio.open_tcp_stream("127.0.0.1", port)
        buf = bytearray()
        for _ in range(200):
            await client.send_all(request)
            await read_frame(client, buf)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(100):
                await client.send_all(request)
                await read_frame(client, buf)
            n += 100
        rate = n / (time.perf_counter() - start)
        await client.aclose()
        nursery.cancel_scope.cancel()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the link logs the (expected) close at the end
    bench_codec(args.seconds)
    sequential, concurrent = trio.run(bench_transport, args.seconds, args.concurrency)
    raw = trio.run(bench_raw_echo, args.seconds)
    print(f"transport: NodeHub <-> NodeLink round trips, sequential: {sequential:>10,.0f} /s")
    print(
        f"transport: same, {args.concurrency} concurrent streams:          {concurrent:>10,.0f} /s"
    )
    print(f"baseline: raw trio TCP echo of the same bytes:        {raw:>10,.0f} /s")
    print(f"ratio sequential wire / raw echo: {sequential / raw:.2f}")


if __name__ == "__main__":
    main()
