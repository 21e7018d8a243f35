#!/usr/bin/env python3
"""Feed N mutated frames to ``FrameDecoder`` and ``Connection``; count outcomes.

Usage: ``python scripts/fuzz_wire.py [N] [--seed S]`` (default N = 1,000,000).

Each case starts from a valid frame of a real message, applies 1-6 random
mutations (bit flip, byte set, insert, delete, truncate, random length
prefix; half the cases then get a consistent length prefix), and is fed in random slices to a fresh decoder and to a connection in
one of three states (fresh edge, open edge, open node), then EOF.  Exit status
is 1 if anything but a ``wire.errors.WireError`` escapes, else 0.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from collections import Counter

from wire.connection import Connection, Role
from wire.errors import WireError
from wire.framing import FrameDecoder, encode_frame
from wire.messages import (
    PROTOCOL_VERSION,
    Cancel,
    Challenge,
    Credit,
    Heartbeat,
    Hello,
    HelloAck,
    Message,
    NodeConfig,
    NodeConfigAck,
    Proof,
    ProviderSpec,
    ProviderStatus,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    RunEvent,
    RunRequest,
    Usage,
)

SAMPLES: list[Message] = [
    Hello(protocol_version=PROTOCOL_VERSION, node_id="node-a", token="", nonce="n" * 24),
    Challenge(nonce="n" * 48, salt=b"salt", iterations=4096),
    Proof(proof=bytes(32)),
    HelloAck(edge_id="edge-1"),
    Heartbeat(seq=3),
    ProviderStatus(),
    RunRequest(
        stream_id=1,
        provider_id="p",
        adapter="echo",
        target="m",
        messages=[{"role": "user", "content": "hello there"}],
        params={"temperature": 0.5},
    ),
    RunEvent(stream_id=1, kind="text", text="hello wörld"),
    RunEvent(stream_id=1, kind="complete", usage=Usage(input_tokens=1, output_tokens=2)),
    ProviderTunnelRequest(stream_id=2, provider_id="p", method="POST", path="/v1/x", body=b"{}"),
    ProviderTunnelFrame(stream_id=1, kind="body", data=b"data: {}\n\n"),
    ProviderTunnelFrame(
        stream_id=1,
        kind="whole",
        status=200,
        headers=[("content-type", "application/json")],
        data=b'{"usage": {}}',
        body_usage=Usage(input_tokens=3, output_tokens=4),
        reasoning_chars=2,
    ),
    NodeConfig(stream_id=3, version=1, providers=[ProviderSpec(id="x", type="echo")]),
    NodeConfigAck(stream_id=1, version=1),
    Cancel(stream_id=1, reason="r"),
    Credit(stream_id=1, frames=3),
]
FRAMES = [encode_frame(m) for m in SAMPLES]
MAX_FRAME = 4096


def mutate(rng: random.Random) -> bytes:
    data = bytearray(rng.choice(FRAMES))
    for _ in range(rng.randint(1, 6)):
        op = rng.randrange(6)
        i = rng.randrange(len(data)) if data else 0
        if op == 0 and data:
            data[i] ^= 1 << rng.randrange(8)
        elif op == 1 and data:
            data[i] = rng.randrange(256)
        elif op == 2:
            data[i:i] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and data:
            del data[i]
        elif op == 4:
            del data[i:]
        elif op == 5 and len(data) >= 4:
            data[0:4] = rng.randrange(2**32).to_bytes(4, "big")
    if len(data) > 4 and rng.random() < 0.5:
        # Half the cases get a consistent length prefix, so the mutated body
        # reaches msgspec and the state machine instead of failing on length.
        data[0:4] = (len(data) - 4).to_bytes(4, "big")
    return bytes(data)


def open_connection(role: Role) -> Connection:
    edge, node = Connection(Role.EDGE), Connection(Role.NODE)
    edge.receive_data(node.send(SAMPLES[0]))  # Hello
    node.receive_data(edge.send(SAMPLES[1]))  # Challenge
    edge.receive_data(node.send(SAMPLES[2]))  # Proof
    node.receive_data(edge.send(SAMPLES[3]))  # HelloAck
    node.receive_data(edge.send(SAMPLES[6]))  # stream 1 open
    return edge if role is Role.EDGE else node


def feed(target: FrameDecoder | Connection, data: bytes, rng: random.Random) -> str:
    """Feed ``data`` in random slices, then EOF; return the outcome's name."""
    try:
        pos = 0
        got = 0
        while pos < len(data):
            step = rng.randint(1, 64)
            chunk = data[pos : pos + step]
            pos += step
            if isinstance(target, FrameDecoder):
                got += len(target.feed(chunk))
            else:
                got += len(target.receive_data(chunk))
        if isinstance(target, FrameDecoder):
            target.eof()
        else:
            target.receive_eof()
    except WireError as exc:
        return type(exc).__name__
    return "decoded" if got else "empty"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", nargs="?", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    decoder_outcomes: Counter[str] = Counter()
    conn_outcomes: Counter[str] = Counter()
    escaped = 0
    start = time.perf_counter()
    for case in range(args.n):
        data = mutate(rng)
        which = case % 3
        conn = (
            Connection(Role.EDGE, max_frame_bytes=MAX_FRAME)
            if which == 0
            else open_connection(Role.EDGE if which == 1 else Role.NODE)
        )
        for target, outcomes in (
            (FrameDecoder(MAX_FRAME), decoder_outcomes),
            (conn, conn_outcomes),
        ):
            try:
                outcomes[feed(target, data, rng)] += 1
            except Exception:  # the bug this script hunts for
                escaped += 1
                outcomes["ESCAPED"] += 1
                if escaped <= 5:
                    print(f"case {case}: {data!r}", file=sys.stderr)
                    traceback.print_exc()
    elapsed = time.perf_counter() - start
    print(f"seed={seed} cases={args.n} elapsed={elapsed:.1f}s ({args.n / elapsed:,.0f} cases/s)")
    print("FrameDecoder:", dict(decoder_outcomes.most_common()))
    print("Connection:  ", dict(conn_outcomes.most_common()))
    if escaped:
        print(f"FAIL: {escaped} undefined exceptions escaped", file=sys.stderr)
        return 1
    print("OK: only defined WireError subclasses")
    return 0


if __name__ == "__main__":
    sys.exit(main())
