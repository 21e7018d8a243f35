#!/usr/bin/env python3
"""Time decoding and applying the largest node messages the edge admits.

Usage: ``python scripts/bench_node_status.py [--providers N] [--rounds R]``

An authenticated node can send the edge any message the wire decodes.  Each
case here is one such message, run through what the edge does with it, in
process: the frame decoder of the edge's connection, then the apply step
(``EdgeRuntime.provider_status`` for health, the hub's cut-and-scrub for a
relayed error).  The edge config gives the node ``--providers`` providers
with an API key each (so the secret scrubber has work to do).  Printed: the
frame size, the decode's best and worst milliseconds and the apply step's
worst over ``--rounds`` rounds.  Decoding grows with the frame (any message
of ``edge.max_frame_bytes`` costs about as much: UTF-8 checks and copies);
the apply step is bounded by the node's configured providers.

Cases:

* ``status-unknown``: ``MAX_STATUS_ENTRIES`` entries, every id unknown, each
  ``last_error`` as long as the frame allows (the rogue node's best shot);
* ``status-own``: ``MAX_STATUS_ENTRIES`` entries naming the node's own
  providers in turn, every health flipped and a long ``last_error``;
* ``status-refused``: a frame of ``MAX_STATUS_ENTRIES + 1`` entries, refused
  at the array header (the decode error is the measured cost);
* ``run-error``: a ``RunEvent`` error whose message fills the frame.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable

import msgspec
import trio

from iopd.config.load import parse_edge_config
from iopd.edge.nodes.node_text import scrubbed_message
from iopd.edge.runtime.edge_runtime import EdgeRuntime
from wire.errors import MalformedFrame
from wire.framing import MAX_FRAME_BYTES, FrameDecoder, encode_frame
from wire.messages import MAX_STATUS_ENTRIES, ProviderHealth, ProviderStatus, RunEvent

NODE = "rogue"


def _config(providers: int) -> str:
    lines = "\n".join(
        f"      - {{id: p{i}, type: openai, base_url: 'http://127.0.0.1:9', models: [m], "
        f"api_key: sk-key-{i:04d}-abcdefghijklmnop}}"
        for i in range(providers)
    )
    return f"""
edge: {{id: bench, node_listen: 127.0.0.1:0, admin_listen: 127.0.0.1:0}}
openai: {{listen: 127.0.0.1:0}}
models:
  - id: m
    providers: {{p0: m}}
nodes:
  - id: {NODE}
    token_hash_sha256: "{"0" * 64}"
    providers:
{lines}
"""


def _filling(entries: int, overhead: int = 64) -> int:
    """The ``last_error`` length that makes ``entries`` entries fill one frame."""
    return (MAX_FRAME_BYTES - 1024) // entries - overhead


def _time(label: str, frame: bytes, apply: Callable[[object], object], rounds: int) -> None:
    decode_ms, apply_ms = [], []
    outcome = ""
    for _ in range(rounds):
        decoder = FrameDecoder(MAX_FRAME_BYTES)
        t0 = time.perf_counter()
        try:
            msgs = decoder.feed(frame)
        except MalformedFrame as exc:  # the session would close here
            decode_ms.append((time.perf_counter() - t0) * 1000)
            outcome = f"refused ({str(exc)[:50]})"
            continue
        t1 = time.perf_counter()
        result = apply(msgs[0])
        apply_ms.append((time.perf_counter() - t1) * 1000)
        decode_ms.append((t1 - t0) * 1000)
        outcome = f"apply returned {result!r}"
    applied = f"apply worst={max(apply_ms):7.2f} ms" if apply_ms else " " * 22
    print(
        f"{label:15} frame={len(frame) / 2**20:6.2f} MiB  decode best={min(decode_ms):6.2f} "
        f"worst={max(decode_ms):6.2f} ms  {applied}  {outcome}"
    )


async def _main(providers: int, rounds: int) -> None:
    logging.basicConfig(level=logging.CRITICAL)  # the cost measured is the edge's, not a sink's
    rt = EdgeRuntime.create(parse_edge_config(_config(providers), env={}))
    filler = _filling(MAX_STATUS_ENTRIES)

    def status(msg: object) -> object:
        assert isinstance(msg, ProviderStatus)
        return rt.provider_status(NODE, msg)

    unknown = ProviderStatus(
        providers=[
            ProviderHealth(provider_id=f"ghost-{i}", health="unhealthy", last_error="e" * filler)
            for i in range(MAX_STATUS_ENTRIES)
        ]
    )
    _time("status-unknown", encode_frame(unknown), status, rounds)
    # Every round flips every provider: each is a health change.
    frames = [
        encode_frame(
            ProviderStatus(
                providers=[
                    ProviderHealth(
                        provider_id=f"p{i % providers}",
                        health="unhealthy" if (i + r) % 2 else "healthy",
                        last_error=f"sk-key-{i % providers:04d}-abcdefghijklmnop " * (filler // 30),
                    )
                    for i in range(MAX_STATUS_ENTRIES)
                ]
            )
        )
        for r in range(2)
    ]
    _time("status-own", frames[0], status, 1)
    _time("status-own", frames[1], status, 1)
    refused = ProviderStatus(
        providers=[ProviderHealth(provider_id=f"g{i}") for i in range(MAX_STATUS_ENTRIES + 1)]
    )
    _time("status-refused", encode_frame(refused), status, rounds)
    run_error = RunEvent(
        stream_id=1, kind="error", code="provider_error", message="m" * (MAX_FRAME_BYTES - 1024)
    )
    _time(
        "run-error",
        encode_frame(run_error),
        lambda m: len(scrubbed_message(msgspec.structs.replace(m), rt.scrub).message),  # type: ignore[arg-type]
        rounds,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--providers", type=int, default=8, help="providers configured for the node")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    trio.run(_main, args.providers, args.rounds)


if __name__ == "__main__":
    main()
