#!/usr/bin/env python3
"""Body flood: many connections each sending a nearly maximal body to a real edge.

Checks that the edge's memory stays bounded when callers send large bodies
(without a token, or held in flight), and prints it.  Starts ``python -m
iopd edge`` (a subprocess on loopback, free ports, no node needed) and opens
``--connections`` connections (default 100), each sending a ``POST
/v1/chat/completions`` head announcing ``--body-bytes`` (default 8 MiB - 1,
the largest body allowed) followed by the body:

* ``--token none``: no ``Authorization``.  The edge should refuse each from
  its head (401) and read no more than its bounded linger.
* ``--token valid``: a valid caller token.  Every body is sent except its
  last byte, held for ``--hold`` seconds (an attacker keeping bodies in
  flight), then completed; at most ``openai.max_inflight_body_bytes`` may be
  received at once, the rest get 503 ``overloaded``.

Prints, per round (``--rounds``, default 2: the second shows whether memory
kept after the first is reused or grows), the edge's RSS before, its peak
and after every connection closed, with the statuses the callers got.  Everything is bounded
(``--deadline``) and stopped at the end.

    .venv/bin/python scripts/body_flood.py [--token none|valid] [--connections N]
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import re
import time
from pathlib import Path

import trio
from edge_process import running_edge

TOKEN = "iop_flood_caller_token_0001"

EDGE_YAML = """\
edge:
  id: flood-edge
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
  log_level: warning
openai:
  listen: 127.0.0.1:0
  principal_tokens:
    - {{token_ref: flood, token_hash_sha256: {token_hash}, principal_ref: flood}}
models:
  - id: echo
    providers: {{echo-1: echo}}
nodes:
  - id: flood-node
    token_hash_sha256: {token_hash}
    providers:
      - {{id: echo-1, type: echo, category: api, models: [echo]}}
"""


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def mib(kib: int) -> str:
    return f"{kib / 1024:.1f} MiB"


async def one_caller(
    port: int, body: bytes, token: str | None, hold: float, statuses: collections.Counter[str]
) -> None:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    reply = b""
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError as exc:
        statuses[f"connect failed: {exc.strerror}"] += 1
        return
    async with stream:

        async def read() -> None:
            nonlocal reply
            while chunk := await stream.receive_some(65536):
                reply += chunk

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
                view = memoryview(body)
                await stream.send_all(head)
                await stream.send_all(view[:-1])
                if hold:
                    await trio.sleep(hold)
                await stream.send_all(view[-1:])
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the edge answered and closed while the body was still going out
    match = re.match(rb"HTTP/1\.1 (\d{3})", reply)
    statuses[match.group(1).decode() if match else "no reply"] += 1


async def flood(args: argparse.Namespace) -> None:
    token_hash = hashlib.sha256(TOKEN.encode()).hexdigest()
    async with running_edge(EDGE_YAML.format(token_hash=token_hash)) as edge:
        await trio.sleep(0.5)
        token = TOKEN if args.token == "valid" else None
        print(
            f"connections={args.connections} body_bytes={args.body_bytes} "
            f"token={args.token} hold_s={args.hold if token else 0}"
        )
        for round_no in range(1, args.rounds + 1):
            await one_round(args, edge.openai_port, edge.pid, token, round_no)
        print(f"tracebacks in the edge's log: {edge.log_text().count('Traceback')}")


async def one_round(
    args: argparse.Namespace, port: int, pid: int, token: str | None, round_no: int
) -> None:
    before = memory_kib(pid)
    body = b"x" * args.body_bytes
    statuses: collections.Counter[str] = collections.Counter()
    started = time.monotonic()
    peak_rss = 0

    async def sample() -> None:
        nonlocal peak_rss
        while True:
            peak_rss = max(peak_rss, memory_kib(pid)["VmRSS"])
            await trio.sleep(0.05)

    with trio.move_on_after(args.deadline) as scope:
        async with trio.open_nursery() as sampler:
            sampler.start_soon(sample)
            async with trio.open_nursery() as callers:
                for _ in range(args.connections):
                    callers.start_soon(one_caller, port, body, token, args.hold, statuses)
            sampler.cancel_scope.cancel()
    elapsed = time.monotonic() - started
    await trio.sleep(2.0)  # let the edge finish its lingers and free what it held
    after = memory_kib(pid)
    print(f"round {round_no}: answers {dict(sorted(statuses.items()))} in {elapsed:.1f} s")
    if scope.cancelled_caught:
        print(f"  DEADLINE: stopped after {args.deadline} s")
    print(
        f"  edge RSS: before {mib(before['VmRSS'])}, peak {mib(max(peak_rss, after['VmHWM']))}, "
        f"after {mib(after['VmRSS'])}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=100)
    parser.add_argument("--body-bytes", type=int, default=8 * 1024 * 1024 - 1)
    parser.add_argument("--token", choices=("none", "valid"), default="none")
    parser.add_argument(
        "--hold", type=float, default=3.0, help="seconds the last byte is held (valid token)"
    )
    parser.add_argument("--deadline", type=float, default=120.0, help="per round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.token == "none":
        args.hold = 0.0
    trio.run(flood, args)


if __name__ == "__main__":
    main()
