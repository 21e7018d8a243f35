#!/usr/bin/env python3
"""Soak: N concurrent streams for M minutes through real edge + node daemons.

Usage: ``python scripts/soak.py [--streams N] [--minutes M | --seconds S]
[--words W] [--delay-ms D] [--max-requests R]`` (defaults: 4 streams,
0.5 minutes, 24 words per request, 2 ms per chunk).

Starts ``python -m iopd edge`` and ``python -m iopd node`` as subprocesses on
loopback (ports picked by the edge, read from its ``edge_started`` line), with
the built-in ``echo`` provider.  Each stream is a keep-alive connection that
sends streaming chat requests one after another; request ``k`` of stream
``s`` carries the words ``s<s>-<k>-<j>`` for j = 0..W-1, and the echo sends
them back one chunk per word.  Every response is checked chunk by chunk: no
lost, duplicated or reordered chunk, a finish chunk, then ``[DONE]``.

RSS and open file descriptors of the edge and the node are sampled after a
warm-up and at the end; at the end ``/status`` must show nothing in flight
and an empty queue, and no daemon may have logged a traceback.  Prints a
summary; exit status 1 on any violation (including RSS growth above
``--max-rss-growth-mib`` or fd growth above ``--max-fd-growth``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import trio

NODE_TOKEN = "soak-node-token-not-secret"

EDGE_YAML = """\
edge:
  id: soak-edge
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
openai:
  listen: 127.0.0.1:0
provider_pool: {{max_queue: 256, queue_timeout: 30}}
models:
  - id: echo
    providers: {{echo-1: echo}}
nodes:
  - id: soak-node
    token_hash_sha256: {node_hash}
    providers:
      - id: echo-1
        type: echo
        category: api
        models: [echo]
        capacity: {capacity}
        delay_ms: {delay_ms}
"""

NODE_YAML = """\
node:
  id: soak-node
  edge: {wire}
  token: ${{IOP_NODE_TOKEN}}
  reconnect_initial_backoff: 0.1
  reconnect_max_backoff: 1
  log_level: warning
  accept_legacy_proof: true   # the edge config holds the hash of the token
"""

_ADDR = re.compile(r"(\w+)=(\S+)")


# ------------------------------------------------------------------ daemons


@dataclass
class Daemon:
    """A ``python -m iopd`` subprocess whose output is collected line by line."""

    name: str
    proc: trio.Process
    lines: list[str] = field(default_factory=list)  # the most recent lines only
    tracebacks: int = 0
    changed: trio.Event = field(default_factory=trio.Event)

    async def collect(self) -> None:
        assert self.proc.stdout is not None
        buf = b""
        try:
            async for chunk in self.proc.stdout:
                buf += chunk
                *done, buf = buf.split(b"\n")
                for raw in done:
                    line = raw.decode("utf-8", "replace")
                    self.tracebacks += "Traceback" in line
                    self.lines.append(line)
                if len(self.lines) > 4000:  # bounded memory on long soaks
                    del self.lines[:2000]
                self.changed.set()
                self.changed = trio.Event()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    async def wait_line(self, pred: Callable[[str], bool]) -> str:
        seen = 0
        while True:
            for line in self.lines[seen:]:
                if pred(line):
                    return line
            seen = len(self.lines)
            if self.proc.returncode is not None:
                raise RuntimeError(f"{self.name} exited:\n" + "\n".join(self.lines[-20:]))
            await self.changed.wait()


async def start_daemon(nursery: trio.Nursery, name: str, kind: str, config: Path) -> Daemon:
    env = dict(os.environ, IOP_NODE_TOKEN=NODE_TOKEN, PYTHONUNBUFFERED="1")
    env.pop("NOTIFY_SOCKET", None)
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "iopd", kind, "--config", str(config)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    daemon = Daemon(name, proc)
    nursery.start_soon(daemon.collect)
    return daemon


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


# ------------------------------------------------------------------ client


@dataclass
class Stats:
    requests: int = 0
    chunks: int = 0
    violations: list[str] = field(default_factory=list)

    def violate(self, text: str) -> None:
        self.violations.append(text)


class KeepAliveClient:
    """Requests one after another on one HTTP/1.1 connection (reopened if closed)."""

    def __init__(self, addr: tuple[str, int]) -> None:
        self.addr = addr
        self.stream: trio.SocketStream | None = None
        self.conn = h11.Connection(h11.CLIENT)

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()
            self.stream = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.stream is None or self.conn.our_state is not h11.IDLE:
            await self.aclose()
            self.stream = await trio.open_tcp_stream(*self.addr)
            self.conn = h11.Connection(h11.CLIENT)
        conn, stream = self.conn, self.stream
        head = [
            ("host", f"{self.addr[0]}:{self.addr[1]}"),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
        ]
        await stream.send_all(
            conn.send(h11.Request(method="POST", target=path, headers=head))
            + conn.send(h11.Data(data=body))
            + conn.send(h11.EndOfMessage())
        )
        status, chunks = 0, []
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(ev, h11.Response):
                status = ev.status_code
            elif isinstance(ev, h11.Data):
                chunks.append(bytes(ev.data))
            elif isinstance(ev, h11.EndOfMessage):
                break
            elif isinstance(ev, h11.ConnectionClosed):
                raise ConnectionError("closed mid-response")
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        return status, b"".join(chunks)


def check_stream(body: bytes, words: list[str]) -> str | None:
    """The violation in one streamed response (None if it is exactly right)."""
    events = [
        line[6:]
        for line in body.decode("utf-8", "replace").split("\n")
        if line.startswith("data: ")
    ]
    if not events or events[-1] != "[DONE]":
        return "no [DONE] terminal"
    deltas: list[str] = []
    finish = None
    for raw in events[:-1]:
        doc = json.loads(raw)
        if "error" in doc:
            return f"error event: {doc['error'].get('code')}"
        for choice in doc.get("choices", []):
            content = choice.get("delta", {}).get("content")
            if content:
                deltas.append(content)
            finish = choice.get("finish_reason") or finish
    got = [d.strip() for d in deltas]
    if got != words:
        lost = [w for w in words if w not in got]
        dup = len(got) - len(set(got))
        reordered = not lost and not dup
        return f"chunks differ: lost={lost[:3]} duplicated={dup} reordered={reordered}"
    if finish != "stop":
        return f"finish_reason {finish!r}"
    return None


async def stream_worker(
    index: int,
    addr: tuple[str, int],
    deadline: float,
    words_per_request: int,
    stats: Stats,
    budget: list[int],
) -> None:
    client = KeepAliveClient(addr)
    seq = 0
    try:
        while trio.current_time() < deadline and budget[0] > 0:
            budget[0] -= 1
            words = [f"s{index}-{seq}-{j}" for j in range(words_per_request)]
            body = json.dumps(
                {
                    "model": "echo",
                    "stream": True,
                    "messages": [{"role": "user", "content": " ".join(words)}],
                }
            ).encode()
            try:
                with trio.fail_after(30):
                    status, data = await client.post("/v1/chat/completions", body)
            except (OSError, ConnectionError, h11.ProtocolError, trio.TooSlowError) as exc:
                stats.violate(f"stream {index} request {seq}: {type(exc).__name__}: {exc}")
                await client.aclose()
                seq += 1
                continue
            stats.requests += 1
            if status != 200:
                stats.violate(f"stream {index} request {seq}: HTTP {status}: {data[:120]!r}")
            else:
                problem = check_stream(data, words)
                if problem is not None:
                    stats.violate(f"stream {index} request {seq}: {problem}")
                stats.chunks += len(words)
            seq += 1
    finally:
        await client.aclose()


async def get_json(addr: tuple[str, int], path: str) -> Any:
    stream = await trio.open_tcp_stream(*addr)
    async with stream:
        await stream.send_all(
            f"GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n".encode()
        )
        raw = b""
        while piece := await stream.receive_some(65536):
            raw += piece
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


# ------------------------------------------------------------------ main


async def soak(args: argparse.Namespace) -> int:
    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    stats = Stats()
    with tempfile.TemporaryDirectory(prefix="iopd-soak-") as tmp:
        edge_cfg = Path(tmp) / "edge.yaml"
        edge_cfg.write_text(
            EDGE_YAML.format(
                node_hash=hashlib.sha256(NODE_TOKEN.encode()).hexdigest(),
                capacity=max(1, args.streams),
                delay_ms=args.delay_ms,
            )
        )
        async with trio.open_nursery() as nursery:
            edge = await start_daemon(nursery, "edge", "edge", edge_cfg)
            node: Daemon | None = None
            try:
                with trio.fail_after(30):
                    started = await edge.wait_line(lambda ln: "event=edge_started" in ln)
                    addrs = dict(_ADDR.findall(started))
                    openai, admin = _hostport(addrs["openai"]), _hostport(addrs["admin"])
                    node_cfg = Path(tmp) / "node.yaml"
                    node_cfg.write_text(NODE_YAML.format(wire=addrs["wire"]))
                    node = await start_daemon(nursery, "node", "node", node_cfg)
                    while True:
                        status = await get_json(admin, "/status")
                        if all(n["connected"] for n in status["nodes"]):
                            break
                        await trio.sleep(0.05)
                # Warm up (imports, first connections), then sample.
                warm = Stats()
                await stream_worker(-1, openai, trio.current_time() + 1.0, 4, warm, [20])
                stats.violations += warm.violations
                pids = {"edge": edge.proc.pid, "node": node.proc.pid}
                before = {k: (rss_kib(p), open_fds(p)) for k, p in pids.items()}
                started_at = time.monotonic()
                deadline = trio.current_time() + seconds
                budget = [args.max_requests]
                async with trio.open_nursery() as workers:
                    for i in range(args.streams):
                        workers.start_soon(
                            stream_worker, i, openai, deadline, args.words, stats, budget
                        )
                elapsed = time.monotonic() - started_at
                await trio.sleep(0.5)  # let closed connections settle
                after = {k: (rss_kib(p), open_fds(p)) for k, p in pids.items()}
                status = await get_json(admin, "/status")
                providers = status["providers"]
                queue = status["queue"]
                assert isinstance(providers, list) and isinstance(queue, dict)
                in_flight = sum(int(p["in_flight"]) for p in providers)
                if in_flight:
                    stats.violate(f"in_flight {in_flight} after the run")
                if queue["depth"]:
                    stats.violate(f"queue depth {queue['depth']} after the run")
                for name, (rss0, fds0) in before.items():
                    rss1, fds1 = after[name]
                    if rss1 - rss0 > args.max_rss_growth_mib * 1024:
                        stats.violate(f"{name} RSS grew {rss0} -> {rss1} KiB")
                    if fds1 - fds0 > args.max_fd_growth:
                        stats.violate(f"{name} open fds grew {fds0} -> {fds1}")
                for d in (edge, node):
                    if d is not None and d.tracebacks:
                        stats.violate(f"{d.name} logged a traceback")
            finally:
                for daemon in (edge, node):
                    if daemon is not None and daemon.proc.returncode is None:
                        daemon.proc.kill()
                        with trio.CancelScope(shield=True):
                            await daemon.proc.wait()
                nursery.cancel_scope.cancel()

    print(
        f"soak: {args.streams} streams x {seconds:g} s: {stats.requests} requests, "
        f"{stats.chunks} chunks in {elapsed:.1f} s ({stats.requests / elapsed:.1f} req/s, "
        f"{stats.chunks / elapsed:.0f} chunks/s)"
    )
    for name in ("edge", "node"):
        (rss0, fds0), (rss1, fds1) = before[name], after[name]
        print(f"  {name}: rss {rss0} -> {rss1} KiB ({rss1 - rss0:+d}), fds {fds0} -> {fds1}")
    print(f"  in_flight after: {in_flight}, queue depth after: {queue['depth']}")
    for v in stats.violations[:20]:
        print("  VIOLATION " + v)
    print(f"  violations={len(stats.violations)}")
    return 1 if stats.violations else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=4, help="concurrent streams (N)")
    parser.add_argument("--minutes", type=float, default=0.5, help="duration (M)")
    parser.add_argument("--seconds", type=float, default=None, help="duration in seconds")
    parser.add_argument("--words", type=int, default=24, help="words (chunks) per request")
    parser.add_argument("--delay-ms", type=int, default=2, help="echo delay per chunk")
    parser.add_argument("--max-requests", type=int, default=1_000_000, help="request cap")
    parser.add_argument("--max-rss-growth-mib", type=float, default=64)
    parser.add_argument("--max-fd-growth", type=int, default=8)
    args = parser.parse_args(argv)
    if args.streams < 1 or args.streams > 256:
        parser.error("--streams must be 1..256")
    if (args.seconds if args.seconds is not None else args.minutes * 60) > 24 * 3600:
        parser.error("at most a day")
    return trio.run(soak, args)


if __name__ == "__main__":
    sys.exit(main())
