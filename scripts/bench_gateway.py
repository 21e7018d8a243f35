#!/usr/bin/env python3
"""Benchmark the whole gateway (edge + node, two hops) against the provider it fronts.

One run starts, on loopback with free ports, four kinds of process:

* a fast mock OpenAI-compatible provider (raw trio, canned replies; ``--role provider``);
* ``python -m iopd edge`` and ``python -m iopd node`` with that provider as a
  ``type: openai`` passthrough provider (group ``bench``) plus an ``echo``
  provider (normalized group ``echo``);
* two raw byte relays (``--role relay``) chained in front of the provider:
  the ``relay2`` target, the floor any two-hop trio proxy adds here;
* a load generator (trio + h11 keep-alive client, ``--role load``), one
  process per measurement so its own CPU is never counted.

The same workload runs direct-to-provider and through the edge: closed-loop
non-streaming at concurrency 16 and 64 (req/s, p50/p99), streaming
time-to-first-chunk, open-loop latency at a fixed low rate (added latency;
phase ``mixed``: the same with direct, relays and gateway taking turns in
one run, so the host's drift falls on all three alike),
CPU time per request of the edge and the node (``/proc/<pid>/stat``
utime + stime between the load generator's BEGIN and END marks), and the
cancel latency (caller close -> provider sees its connection closed, over a
slow SSE stream; the monotonic clock is shared by processes on Linux).
Everything is bounded in count and time, and every process started is
stopped at the end.

With ``--hops`` the ``mixed`` phase is also traced with ``perf`` and each
target's time printed hop by hop and step by step (``scripts/hop_timeline.py``).

    .venv/bin/python scripts/bench_gateway.py [--quick] [--json]
    .venv/bin/python scripts/bench_gateway.py --only mixed --hops
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import hop_timeline
import trio

TOKEN = "iop_bench_caller_token_0001"
NODE_TOKEN = "iop_bench_node_token_0001"
GUARD_S = 30.0  # no single step of the harness may take longer than this

PROMPT = "You are a helpful assistant. Write one sentence about the sea, please, and keep it short."

# ------------------------------------------------------------ mock provider

_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1764400000,
        "model": "bench-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "The sea is wide and calm today."},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 24, "completion_tokens": 8, "total_tokens": 32},
    },
    separators=(",", ":"),
).encode()

#: Both names the edge's config says this provider serves: the node's health
#: probe checks each against this list.
_MODELS = (
    b'{"object":"list","data":[{"id":"bench-model","object":"model","owned_by":"bench"},'
    b'{"id":"slow","object":"model","owned_by":"bench"}]}'
)
STREAM_CHUNKS = 16


def _sse_chunk(i: int, content: str | None, finish: str | None = None) -> bytes:
    delta: dict[str, Any] = {} if content is None else {"content": content}
    if i == 0:
        delta["role"] = "assistant"
    doc = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1764400000,
        "model": "bench-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def _chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
_SSE_FIRST = _chunked(_sse_chunk(0, "The"))
_SSE_REST = (
    b"".join(_chunked(_sse_chunk(i, " word")) for i in range(1, STREAM_CHUNKS))
    + _chunked(_sse_chunk(STREAM_CHUNKS, None, "stop"))
    + _chunked(
        b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1764400000,'
        b'"model":"bench-model","choices":[],"usage":{"prompt_tokens":24,'
        b'"completion_tokens":16,"total_tokens":40}}\n\n'
    )
    + _chunked(b"data: [DONE]\n\n")
    + b"0\r\n\r\n"
)


def _response(body: bytes, ctype: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        ctype,
        len(body),
        body,
    )


_COMPLETION_RESPONSE = _response(_COMPLETION)
_MODELS_RESPONSE = _response(_MODELS)


async def read_request(stream: trio.SocketStream, buf: bytearray) -> tuple[bytes, bytes] | None:
    """The next request on ``stream`` as (lower-cased head, body), just enough
    HTTP for the benchmarks' mock servers (``Content-Length`` bodies only);
    None once the client closed.  ``buf`` keeps what arrived after it."""
    end = buf.find(b"\r\n\r\n")
    while end < 0:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buf += data
        end = buf.find(b"\r\n\r\n")
    head = bytes(buf[:end]).lower()
    i = head.find(b"content-length:")
    eol = head.find(b"\r\n", i)
    length = int(head[i + 15 : eol if eol >= 0 else None]) if i >= 0 else 0
    total = end + 4 + length
    while len(buf) < total:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buf += data
    body = bytes(buf[end + 4 : total])
    del buf[:total]
    return head, body


class MockProvider:
    """Canned OpenAI replies; ``"model":"slow"`` streams one chunk per 100 ms and
    records, on the shared monotonic clock, when its caller closed the connection."""

    def __init__(self) -> None:
        self.closes: list[float] = []

    async def handle(self, stream: trio.SocketStream) -> None:
        buf = bytearray()
        try:
            while (request := await read_request(stream, buf)) is not None:
                head, body = request
                if head.startswith(b"get /v1/models"):
                    await stream.send_all(_MODELS_RESPONSE)
                elif head.startswith(b"get /_closes"):
                    closes, self.closes = self.closes, []  # before the await: none lost
                    await stream.send_all(_response(json.dumps(closes).encode()))
                elif b'"model":"slow"' in body.replace(b" ", b""):
                    await self._slow_stream(stream)
                    return
                elif b'"stream":true' in body.replace(b" ", b""):
                    await stream.send_all(_SSE_HEAD + _SSE_FIRST)
                    await stream.send_all(_SSE_REST)
                else:
                    await stream.send_all(_COMPLETION_RESPONSE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def _slow_stream(self, stream: trio.SocketStream) -> None:
        async def watch_eof(cancel: trio.CancelScope) -> None:
            try:
                while await stream.receive_some(65536):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            self.closes.append(time.monotonic())
            cancel.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_eof, nursery.cancel_scope)
            try:
                await stream.send_all(_SSE_HEAD)
                for i in range(600):
                    await stream.send_all(_chunked(_sse_chunk(i, " slow")))
                    await trio.sleep(0.1)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await trio.sleep_forever()  # let watch_eof record the close


async def _serve_relay(upstream_port: int) -> None:
    """A trivial byte relay (the floor a proxy hop can cost): each accepted
    connection gets its own upstream connection, and whatever one side sends
    is written to the other as it arrives.  No parsing, no logging."""

    async def pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
        try:
            while data := await src.receive_some(65536):
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(dst)

    async def handle(down: trio.SocketStream) -> None:
        up = await trio.open_tcp_stream("127.0.0.1", upstream_port)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump, down, up)
            nursery.start_soon(pump, up, down)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listeners[0].socket.getsockname()[1], flush=True)
    await trio.serve_listeners(handle, listeners)


async def _serve_provider() -> None:
    provider = MockProvider()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listeners[0].socket.getsockname()[1], flush=True)
    await trio.serve_listeners(provider.handle, listeners)


# ------------------------------------------------------------ load generator


def _chat_body(model: str, stream: bool) -> bytes:
    doc: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 64,
    }
    if stream:
        doc["stream"] = True
    return json.dumps(doc, separators=(",", ":")).encode()


class Client:
    """One keep-alive HTTP/1.1 connection driven by h11."""

    def __init__(self, stream: trio.SocketStream, host: str, token: str) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)
        self.base_headers = [("host", host), ("authorization", f"Bearer {token}")]

    @classmethod
    async def open(cls, host: str, port: int, token: str) -> Client:
        return cls(await trio.open_tcp_stream(host, port), f"{host}:{port}", token)

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)

    async def request(
        self,
        body: bytes,
        *,
        first_chunk: list[float] | None = None,
        path: str = "/v1/chat/completions",
    ) -> int:
        """POST ``body``; return the status once the whole response is read.

        ``first_chunk`` gets the monotonic time of the first body bytes."""
        if self.conn.our_state is h11.DONE:
            self.conn.start_next_cycle()
        headers = [
            *self.base_headers,
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
        ]
        out = self.conn.send(h11.Request(method="POST", target=path, headers=headers))
        out += self.conn.send(h11.Data(data=body))
        out += self.conn.send(h11.EndOfMessage())
        await self.stream.send_all(out)
        return await self._response(first_chunk)

    async def _response(self, first_chunk: list[float] | None) -> int:
        status = 0
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                if first_chunk is not None and not first_chunk:
                    first_chunk.append(time.monotonic())
            elif isinstance(event, h11.EndOfMessage):
                return status
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("server closed the connection")

    async def first_body_bytes(self, body: bytes) -> float:
        """Send a streaming request and return when its first body bytes arrive."""
        headers = [
            *self.base_headers,
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
        ]
        out = self.conn.send(
            h11.Request(method="POST", target="/v1/chat/completions", headers=headers)
        )
        out += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        await self.stream.send_all(out)
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some(65536))
            elif isinstance(event, h11.Data):
                return time.monotonic()
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                raise ConnectionError("stream ended before its first chunk")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _summary(latencies: list[float], elapsed: float, errors: int) -> dict[str, float]:
    return {
        "requests": len(latencies),
        "errors": errors,
        "rps": len(latencies) / elapsed if elapsed > 0 else 0.0,
        "p50_ms": _pct(latencies, 0.50) * 1e3,
        "p99_ms": _pct(latencies, 0.99) * 1e3,
    }


def _mark(text: str) -> None:
    print(text, flush=True)


async def _closed_loop(args: argparse.Namespace, stream: bool) -> dict[str, float]:
    body = _chat_body(args.model[0], stream)
    port = args.port[0]
    clients = [await Client.open(args.host, port, TOKEN) for _ in range(args.concurrency)]
    latencies: list[float] = []
    errors = 0

    async def worker(client: Client, budget: list[int], record: bool, deadline: float) -> None:
        nonlocal errors
        while budget[0] > 0 and time.monotonic() < deadline:
            budget[0] -= 1
            first: list[float] | None = [] if stream else None
            t0 = time.monotonic()
            status = await client.request(body, first_chunk=first)
            if status != 200:
                errors += 1
            elif record:
                latencies.append((first[0] if first else time.monotonic()) - t0)

    async def run(count: int, record: bool) -> float:
        budget = [count]
        start = time.monotonic()
        async with trio.open_nursery() as nursery:
            for client in clients:
                nursery.start_soon(worker, client, budget, record, start + args.duration)
        return time.monotonic() - start

    with trio.fail_after(args.duration * 2 + GUARD_S):
        await run(args.warmup, False)
        _mark("BEGIN")
        elapsed = await run(args.requests, True)
        _mark("END")
    for client in clients:
        await client.aclose()
    return _summary(latencies, elapsed, errors)


async def _open_loop(args: argparse.Namespace) -> dict[str, Any]:
    """``args.requests`` requests per target started at ``args.rate`` per second
    per target whatever the replies do, each on an idle connection (a new one
    if none is idle).  Each is timed from its send: trio's timers wake up to
    ~1 ms late, which would otherwise swamp the sub-millisecond figures this
    measures.

    With several targets (``--port`` given more than once: the ``mixed``
    phase) their requests take turns, one every ``1 / (rate * targets)``
    seconds, so each target still sees ``rate`` requests per second and a
    slower or faster second on the host falls on all of them alike.
    """
    targets = list(zip(args.port, args.model or ["bench"] * len(args.port), strict=True))
    bodies = [_chat_body(model, False) for _port, model in targets]
    idle: list[list[Client]] = [
        [await Client.open(args.host, port, TOKEN) for _ in range(4)] for port, _model in targets
    ]
    latencies: list[list[float]] = [[] for _ in targets]
    errors = [0] * len(targets)

    async def one(t: int) -> None:
        pool = idle[t]
        client = pool.pop() if pool else await Client.open(args.host, targets[t][0], TOKEN)
        t0 = time.monotonic()
        status = await client.request(bodies[t])
        done = time.monotonic()
        pool.append(client)
        if status != 200:
            errors[t] += 1
        else:
            latencies[t].append(done - t0)

    total = args.requests * len(targets)
    with trio.fail_after(args.requests / args.rate + GUARD_S):
        for t, pool in enumerate(idle):  # warm the connections
            for _ in range(20):
                await pool[0].request(bodies[t])
        _mark("BEGIN")
        start = time.monotonic()
        async with trio.open_nursery() as nursery:
            for i in range(total):
                scheduled = start + i / (args.rate * len(targets))
                await trio.sleep(max(0.0, scheduled - time.monotonic()))
                nursery.start_soon(one, i % len(targets))
        elapsed = time.monotonic() - start
        _mark("END")
    for pool in idle:
        for client in pool:
            await client.aclose()
    summaries = [_summary(lat, elapsed, err) for lat, err in zip(latencies, errors, strict=True)]
    return summaries[0] if len(summaries) == 1 else {"targets": summaries}


async def _provider_closes(args: argparse.Namespace) -> list[float]:
    client = await Client.open(args.host, args.provider_port, TOKEN)
    try:
        body = b""
        out = client.conn.send(
            h11.Request(
                method="GET",
                target="/_closes",
                headers=[*client.base_headers, ("content-length", "0")],
            )
        )
        out += client.conn.send(h11.EndOfMessage())
        await client.stream.send_all(out)
        while True:
            event = client.conn.next_event()
            if event is h11.NEED_DATA:
                client.conn.receive_data(await client.stream.receive_some(65536))
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return [float(x) for x in json.loads(body)]
    finally:
        await client.aclose()


async def _cancel(args: argparse.Namespace) -> dict[str, float]:
    """Open a slow stream, read its first chunk, close the connection; the
    latency is the provider's close time minus ours."""
    body = _chat_body("slow", True)
    latencies: list[float] = []
    missed = 0
    with trio.fail_after(args.requests * 7 + GUARD_S):
        await _provider_closes(args)  # clear
        for _ in range(args.requests):
            client = await Client.open(args.host, args.port[0], TOKEN)
            await client.first_body_bytes(body)
            await trio.sleep(0.05)
            closed_at = time.monotonic()
            await client.aclose()
            for _ in range(500):  # up to ~5 s
                closes = await _provider_closes(args)
                if closes:
                    latencies.append(closes[0] - closed_at)
                    break
                await trio.sleep(0.01)
            else:
                missed += 1
                print(
                    f"cancel run: provider saw no close within 5 s (at {closed_at:.3f})",
                    file=sys.stderr,
                )
    return {
        "runs": len(latencies),
        "missed": missed,
        "p50_ms": _pct(latencies, 0.5) * 1e3,
        "max_ms": max(latencies) * 1e3 if latencies else float("nan"),
    }


async def _load(args: argparse.Namespace) -> None:
    if args.mode == "closed":
        result = await _closed_loop(args, stream=False)
    elif args.mode == "stream":
        result = await _closed_loop(args, stream=True)
    elif args.mode == "open":
        result = await _open_loop(args)
    else:
        result = await _cancel(args)
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------ orchestration

EDGE_YAML = """\
edge:
  id: bench-edge
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
  log_level: {log_level}
openai:
  listen: 127.0.0.1:0
  principal_tokens:
    - token_ref: bench
      token_hash_sha256: {caller_hash}
      principal_ref: bench-user
provider_pool: {{max_queue: 1024, queue_timeout: 30}}
models:
  - id: bench
    providers: {{mock: bench-model}}
  - id: slow
    providers: {{mock: slow}}
  - id: echo
    providers: {{echo-1: echo}}
nodes:
  - id: bench-node
    token_hash_sha256: {node_hash}
    providers:
      - id: mock
        type: openai
        base_url: http://127.0.0.1:{provider_port}
        models: [bench-model, slow]
        capacity: 256
        health_interval: 30
      - id: echo-1
        type: echo
        models: [echo]
        capacity: 256
{limits}"""

#: ``--limits memory|redis``: the bench principal limited by every kind of limit,
#: all far above what the run reaches, so each request is admitted and settled
#: (and, with redis, holds a concurrency lease) without ever being refused.
LIMITS_YAML = """limits:
  backend: {backend}
  redis_url: {redis_url}
  principals:
    - principal_ref: bench-user
      max_concurrent: 100000
      requests_per_minute: 1000000000
      tokens_per_minute: 1000000000000
      tokens_per_day: 1000000000000
"""

NODE_YAML = """\
node:
  id: bench-node
  edge: 127.0.0.1:{wire_port}
  token: {node_token}
  log_level: {log_level}
  accept_legacy_proof: true   # the edge config holds the hash of the token
"""


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def cpu_times(pid: int) -> tuple[float, float]:
    """(utime, stime) of ``pid`` in seconds (``/proc/<pid>/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def run_seconds(pid: int) -> float:
    """On-CPU time of every thread of ``pid`` from the scheduler (ns precision)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total / 1e9


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` in seconds."""
    return sum(cpu_times(pid))


@dataclass
class Processes:
    """Everything the orchestrator started, stopped in reverse order at exit."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, argv: list[str], log: Path | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv``; a daemon with a ``log`` runs in that log's folder.

        (``python -m iopd`` puts its working directory first on the import
        path: run from a checkout, it would import that checkout's ``iopd``
        whatever ``PYTHONPATH`` says, and an A/B of two trees would compare
        one tree with itself.)
        """
        out = open(log, "wb") if log is not None else subprocess.PIPE  # noqa: SIM115
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=log.parent if log is not None else None,
        )
        if log is not None:
            out.close()  # type: ignore[union-attr]
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def processes() -> Iterator[Processes]:
    procs = Processes()
    try:
        yield procs
    finally:
        procs.stop_all()


def _wait_log(path: Path, pattern: str, timeout: float = GUARD_S) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    rx = re.compile(pattern)
    while time.monotonic() < deadline:
        if path.exists():
            m = rx.search(path.read_text(errors="replace"))
            if m:
                return m
        time.sleep(0.05)
    raise SystemExit(
        f"timed out waiting for {pattern!r} in {path.name}:\n{path.read_text()[-2000:]}"
    )


@dataclass
class Target:
    name: str
    port: int
    model: str
    watched: dict[str, int]  # process name -> pid whose CPU is measured


def run_load(
    procs: Processes, target: Target, mode: str, provider_port: int, **opts: Any
) -> dict[str, float]:
    """One load run against ``target``: its latency figures and its daemons' CPU."""
    return run_mixed(procs, [target], mode, provider_port, **opts)[target.name]


def run_mixed(
    procs: Processes,
    targets: list[Target],
    mode: str,
    provider_port: int,
    hops: Path | None = None,
    **opts: Any,
) -> dict[str, dict[str, float]]:
    """One load run whose requests take turns among ``targets`` (one target:
    all of them); each target's figures and the CPU of its own processes per
    request.  With several targets a process they share (the provider) is not
    measured: its time would be theirs together.  With ``hops`` (a file for
    ``perf record``), the measured window is traced and each target's time
    per hop and step printed (``scripts/hop_timeline.py``)."""
    argv = [sys.executable, __file__, "--role", "load", "--mode", mode]
    argv += ["--provider-port", str(provider_port)]
    for target in targets:
        argv += ["--port", str(target.port), "--model", target.model]
    for key, value in opts.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    watched = {
        name: pid
        for t in targets
        for name, pid in t.watched.items()
        if sum(name in other.watched for other in targets) == 1
    }
    proc = procs.start(argv)
    assert proc.stdout is not None
    trace: hop_timeline.HopTrace | None = None
    traced = {name: pid for t in targets for name, pid in t.watched.items()}
    traced["load"] = proc.pid
    cpu0: dict[str, tuple[float, float]] = {}
    cpu: dict[str, tuple[float, float]] = {}
    sched0: dict[str, float] = {}
    sched: dict[str, float] = {}
    raw: dict[str, Any] = {}
    for line_bytes in proc.stdout:
        line = line_bytes.decode().strip()
        if line == "BEGIN":
            if hops is not None:
                trace = hop_timeline.HopTrace(traced, hops)
            cpu0 = {name: cpu_times(pid) for name, pid in watched.items()}
            sched0 = {name: run_seconds(pid) for name, pid in watched.items()}
        elif line == "END":
            if trace is not None:
                trace.stop()
            for name, pid in watched.items():
                user, system = cpu_times(pid)
                cpu[name] = (user - cpu0[name][0], system - cpu0[name][1])
                sched[name] = run_seconds(pid) - sched0[name]
        elif line.startswith("RESULT "):
            raw = json.loads(line[7:])
    if proc.wait(timeout=GUARD_S) != 0 or not raw:
        names = ",".join(t.name for t in targets)
        raise SystemExit(f"load generator failed ({names} {mode})")
    if trace is not None:
        paths = {t.name: sorted(set(t.watched) | {"provider"}) for t in targets}
        hop_timeline.report(hop_timeline.follow(trace.events(), paths), paths)
    summaries = raw["targets"] if len(targets) > 1 else [raw]
    results: dict[str, dict[str, float]] = {}
    for target, result in zip(targets, summaries, strict=True):
        count = result.get("requests", 0)
        per = 1e3 / count if count else float("nan")
        for name in target.watched:
            if name not in cpu:
                continue
            user, system = cpu[name]
            result[f"cpu_{name}_ms"] = (user + system) * per
            result[f"cpu_{name}_user_ms"] = user * per
            result[f"cpu_{name}_sys_ms"] = system * per
            result[f"sched_{name}_ms"] = sched[name] * per
        results[target.name] = result
    return results


def _fmt(value: float, unit: str = "") -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if unit == "rps":
        return f"{value:,.0f}"
    return f"{value:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--role", choices=["provider", "load", "relay"], help=argparse.SUPPRESS)
    parser.add_argument("--upstream-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--mode", choices=["closed", "stream", "open", "cancel"], help=argparse.SUPPRESS
    )
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, action="append", help=argparse.SUPPRESS)
    parser.add_argument("--provider-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", action="append", help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=20.0, help="open-loop rate (req/s)")
    parser.add_argument("--requests", type=int, default=4000, help="requests per closed-loop run")
    parser.add_argument("--warmup", type=int, default=300, help=argparse.SUPPRESS)
    parser.add_argument(
        "--duration", type=float, default=20.0, help="max seconds per closed-loop run"
    )
    parser.add_argument("--open-seconds", type=float, default=10.0, help="open-loop run length")
    parser.add_argument("--streams", type=int, default=300, help="streams for first-chunk timing")
    parser.add_argument(
        "--c1-requests", type=int, default=1000, help="requests of the one-at-a-time phase"
    )
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="idle CPU sample")
    parser.add_argument("--cancels", type=int, default=20, help="cancel-latency runs")
    parser.add_argument("--log-level", default="info", help="edge/node log level")
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    parser.add_argument(
        "--keep-logs", default="", help="directory for the daemons' configs and logs"
    )
    parser.add_argument("--json", action="store_true", help="also print the raw results as JSON")
    parser.add_argument(
        "--hops",
        action="store_true",
        help="trace phase mixed with perf: where each target's time goes, hop by hop",
    )
    parser.add_argument(
        "--embedded",
        action="store_true",
        help="run the node inside the edge process (nodes[].embedded: true): one daemon",
    )
    parser.add_argument(
        "--limits",
        choices=["off", "memory", "redis"],
        default="off",
        help="per-principal limits on the bench caller: in the edge's memory, or in a "
        "redis-server this run starts (one round trip to admit, one to settle)",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma list of phases: idle,c16,c1,c64,stream,open,mixed,echo,cancel",
    )
    args = parser.parse_args()
    if args.role == "provider":
        trio.run(_serve_provider)
        return
    if args.role == "load":
        trio.run(_load, args)
        return
    if args.role == "relay":
        trio.run(_serve_relay, args.upstream_port)
        return
    if args.quick:
        args.requests, args.open_seconds, args.streams, args.cancels = 500, 3.0, 50, 5
        args.c1_requests = 100
        args.idle_seconds = 1.0
    phases = (
        set(args.only.split(","))
        if args.only
        else {"idle", "c16", "c1", "c64", "stream", "open", "mixed", "echo", "cancel"}
    )

    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="iopd-bench-") as tmp_dir, processes() as procs:
        tmp = Path(args.keep_logs or tmp_dir)
        tmp.mkdir(parents=True, exist_ok=True)
        provider = procs.start([sys.executable, __file__, "--role", "provider"])
        assert provider.stdout is not None
        provider_port = int(provider.stdout.readline())
        edge_cfg = tmp / "edge.yaml"
        node_hash = _sha256(NODE_TOKEN)
        edge_yaml = EDGE_YAML.format(
            caller_hash=_sha256(TOKEN),
            node_hash=node_hash,
            provider_port=provider_port,
            log_level=args.log_level,
            limits=_limits_yaml(args.limits, procs, tmp),
        )
        if args.embedded:  # the node runs inside the edge process
            edge_yaml = edge_yaml.replace(f"token_hash_sha256: {node_hash}", "embedded: true")
        edge_cfg.write_text(edge_yaml)
        edge = procs.start(
            [sys.executable, "-m", "iopd", "edge", "--config", str(edge_cfg)], tmp / "edge.log"
        )
        m = _wait_log(tmp / "edge.log", r"event=edge_started .*wire=\S*:(\d+) .*openai=\S*:(\d+)")
        wire_port, edge_port = int(m.group(1)), int(m.group(2))
        daemons = {"edge": edge.pid}
        if not args.embedded:
            node_cfg = tmp / "node.yaml"
            node_cfg.write_text(
                NODE_YAML.format(
                    wire_port=wire_port, node_token=NODE_TOKEN, log_level=args.log_level
                )
            )
            node = procs.start(
                [sys.executable, "-m", "iopd", "node", "--config", str(node_cfg)],
                tmp / "node.log",
            )
            daemons["node"] = node.pid
        _wait_log(tmp / "edge.log", r"event=node_connected")

        direct = Target("direct", provider_port, "bench-model", {"provider": provider.pid})
        gateway = Target("gateway", edge_port, "bench", {**daemons, "provider": provider.pid})
        echo = Target("echo", edge_port, "echo", dict(daemons))
        # The floor of two proxy hops: caller -> raw relay -> raw relay -> provider.
        relay_port = provider_port
        relay_pids: dict[str, int] = {}
        for hop in ("relay_b", "relay_a"):
            relay = procs.start(
                [sys.executable, __file__, "--role", "relay", "--upstream-port", str(relay_port)]
            )
            assert relay.stdout is not None
            relay_port = int(relay.stdout.readline())
            relay_pids[hop] = relay.pid
        relay2 = Target("relay2", relay_port, "bench-model", relay_pids)
        # Wait until the pool lists the provider (first health probe done).
        deadline = time.monotonic() + GUARD_S
        while True:
            try:
                run_load(
                    procs, gateway, "closed", provider_port, requests=1, warmup=0, concurrency=1
                )
                break
            except SystemExit:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

        def phase(name: str, mode: str, targets: list[Target], **opts: Any) -> None:
            if name not in phases:
                return
            for target in targets:
                print(f"  {name:<7} {target.name} ...", file=sys.stderr, flush=True)
                results.setdefault(name, {})[target.name] = run_load(
                    procs, target, mode, provider_port, **opts
                )

        if "idle" in phases:
            # CPU the daemons burn with no traffic (timers, heartbeats, probes).
            before = {n: cpu_seconds(p) for n, p in gateway.watched.items()}
            time.sleep(args.idle_seconds)
            results["idle"] = {
                "gateway": {
                    f"cpu_{n}_ms_per_s": (cpu_seconds(p) - before[n]) * 1e3 / args.idle_seconds
                    for n, p in gateway.watched.items()
                }
            }
        common = {"requests": args.requests, "duration": args.duration, "warmup": args.warmup}
        # One request (or stream) at a time, against the floor of two hops too.
        one_at_a_time = {"concurrency": 1, "warmup": 30}
        floor = [direct, relay2, gateway]
        phase("c16", "closed", [direct, gateway], concurrency=16, **common)
        # The warm counterpart of "open": no daemon sleeps between requests
        # (see docs/performance.md, "Warm against cold").
        phase("c1", "closed", floor, requests=args.c1_requests, **one_at_a_time)
        phase("c64", "closed", [direct, gateway], concurrency=64, **common)
        phase("stream", "stream", floor, requests=args.streams, **one_at_a_time)
        phase("open", "open", floor, rate=args.rate, requests=int(args.rate * args.open_seconds))
        if "mixed" in phases:
            # "open" with the three targets' requests taking turns in one run.
            print("  mixed   direct,relay2,gateway ...", file=sys.stderr, flush=True)
            results["mixed"] = run_mixed(
                procs,
                floor,
                "open",
                provider_port,
                hops=tmp / "hops.perf" if args.hops else None,
                rate=args.rate,
                requests=int(args.rate * args.open_seconds),
            )
        phase("echo", "closed", [echo], concurrency=16, **common)
        phase("cancel", "cancel", [gateway], requests=args.cancels)

    _report(results, args)


def _limits_yaml(kind: str, procs: Any, tmp: Path) -> str:
    """The ``limits:`` section of ``--limits``; with redis, a redis-server started for the run."""
    if kind == "off":
        return ""
    url = "null"
    if kind == "redis":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs.start(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(tmp)],
            tmp / "redis.log",
        )
        deadline = time.monotonic() + GUARD_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        url = f"redis://127.0.0.1:{port}/0"
    return LIMITS_YAML.format(backend=kind, redis_url=url)


def _report(results: dict[str, dict[str, dict[str, float]]], args: argparse.Namespace) -> None:
    titles = {
        "c16": "non-streaming, closed loop, concurrency 16",
        "c1": "non-streaming, one at a time, back to back",
        "c64": "non-streaming, closed loop, concurrency 64",
        "stream": "streaming, one at a time: time to first chunk",
        "open": f"non-streaming, open loop at {args.rate:g} req/s",
        "mixed": f"non-streaming, open loop at {args.rate:g} req/s each, the targets taking turns",
        "echo": "normalized echo provider through the gateway, concurrency 16",
    }
    for name, title in titles.items():
        if name not in results:
            continue
        print(f"\n{title}")
        print(
            f"  {'':<8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'edge CPU':>9} {'node CPU':>9} {'errors':>6}"
        )
        for target, r in results[name].items():
            print(
                f"  {target:<8} {_fmt(r['rps'], 'rps'):>8} {_fmt(r['p50_ms']):>8} {_fmt(r['p99_ms']):>8}"
                f" {_fmt(r.get('cpu_edge_ms', float('nan'))):>9}"
                f" {_fmt(r.get('cpu_node_ms', float('nan'))):>9} {int(r['errors']):>6}"
            )
        d, g = results[name].get("direct"), results[name].get("gateway")
        relay = results[name].get("relay2")
        if d and relay:
            print(
                f"  two raw relays/direct: p50 +{relay['p50_ms'] - d['p50_ms']:.3f} ms, "
                f"p99 +{relay['p99_ms'] - d['p99_ms']:.3f} ms; relay CPU "
                f"{relay['cpu_relay_a_ms'] + relay['cpu_relay_b_ms']:.3f} ms/request"
            )
        if d and g:
            print(
                f"  gateway/direct: throughput x{g['rps'] / d['rps']:.2f}, "
                f"p50 +{g['p50_ms'] - d['p50_ms']:.3f} ms (x{g['p50_ms'] / d['p50_ms']:.2f}), "
                f"p99 +{g['p99_ms'] - d['p99_ms']:.3f} ms; "
                f"edge+node CPU {g['cpu_edge_ms'] + g.get('cpu_node_ms', 0.0):.3f} ms/request"
            )
    if "idle" in results:
        r = results["idle"]["gateway"]
        print(
            f"\nidle CPU (no traffic, {args.idle_seconds:g} s): edge {r['cpu_edge_ms_per_s']:.1f} ms/s,"
            f" node {r.get('cpu_node_ms_per_s', 0.0):.1f} ms/s"
        )
    if "cancel" in results:
        r = results["cancel"]["gateway"]
        print(
            f"\ncancel latency (caller close -> provider connection closed), {int(r['runs'])} runs:"
            f" p50 {r['p50_ms']:.2f} ms, max {r['max_ms']:.2f} ms"
        )
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
