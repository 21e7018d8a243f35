#!/usr/bin/env python3
"""What bounding one provider read by ``read_timeout`` costs: a trio cancel
scope around the read against the client's ``ReadWatch``, and a bare read.

Each round writes one piece into a socket pair and reads it back through
``fastsend.receive_some`` (a wait for readability, one ``read(2)``), as the
node does for every piece of a streamed reply.  Prints µs per read for the
three ways in alternating runs, and the cost each way adds to the bare read.

    python scripts/bench_read_watch.py [--reads 20000] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import trio

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from iopd.http.read_watch import ReadWatch  # noqa: E402
from iopd.transport import fastsend  # noqa: E402

PIECE = b"data: {}\n\n"


async def _bare(a: trio.SocketStream, b: trio.SocketStream, reads: int) -> float:
    t = time.perf_counter()
    for _ in range(reads):
        fastsend.write_now(a, PIECE)
        await fastsend.receive_some(b, 65536)
    return time.perf_counter() - t


async def _scope(a: trio.SocketStream, b: trio.SocketStream, reads: int) -> float:
    t = time.perf_counter()
    for _ in range(reads):
        fastsend.write_now(a, PIECE)
        with trio.CancelScope(deadline=trio.current_time() + 60.0) as scope:
            await fastsend.receive_some(b, 65536)
        if scope.cancelled_caught:
            raise trio.TooSlowError
    return time.perf_counter() - t


async def _watch(a: trio.SocketStream, b: trio.SocketStream, reads: int) -> float:
    watch = ReadWatch()
    t = time.perf_counter()
    for _ in range(reads):
        fastsend.write_now(a, PIECE)
        watch.begin(b, 60.0, _never)
        try:
            await fastsend.receive_some(b, 65536)
        finally:
            watch.end(b)
    return time.perf_counter() - t


def _never() -> None:
    raise AssertionError("a read of a piece already written timed out")


async def main(reads: int, runs: int) -> None:
    a, b = await _socket_pair()
    ways = {"bare read": _bare, "cancel scope": _scope, "ReadWatch": _watch}
    results: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(runs):
        for name, way in ways.items():
            results[name].append(await way(a, b, reads) / reads * 1e6)
    bare = statistics.median(results["bare read"])
    print(f"{reads} reads x {runs} runs (median µs per read)")
    for name, xs in results.items():
        med = statistics.median(xs)
        extra = "" if name == "bare read" else f"   +{med - bare:.2f} µs over the bare read"
        print(f"  {name:<13} {med:6.2f} µs{extra}")


async def _socket_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    left, right = trio.socket.socketpair()
    return trio.SocketStream(left), trio.SocketStream(right)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--reads", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    trio.run(main, args.reads, args.runs)
