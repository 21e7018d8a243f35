#!/usr/bin/env python3
"""Replay the hostile callers of docs/reliability.md against one real edge; print what happened.

Starts ``python -m iopd edge`` on loopback (free ports) with an embedded node
serving an ``echo`` provider (capacity 4), then plays each hostile caller
in turn.  While a case runs, a second caller asks
``GET /v1/models`` every 50 ms on its own keep-alive connection; the table
shows the slowest of those answers (the bar: the edge keeps
answering others within 1 s), what the hostile caller got, and the edge's
RSS before the case and at its peak.  Cut keys and caller headers upstream
need a provider that misbehaves; they are replayed by ``tests/hostile/test_admin_secrets.py``.

Everything is bounded (each case has a deadline) and the edge is stopped at
the end.  Nothing here asserts: it prints figures for docs/reliability.md.

    .venv/bin/python scripts/replay_hostile.py [--only NAME[,NAME...]]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio
import trio.lowlevel
from edge_process import running_edge

TOKEN = "iop_replay_caller_token_0001"
ADMIN_TOKEN = "iop_replay_admin_token_0001"

EDGE_YAML = """\
edge:
  id: replay-edge
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
  log_level: warning
openai:
  listen: 127.0.0.1:0
  send_timeout: 2
  principal_tokens:
    - {{token_ref: replay, token_hash_sha256: {token_hash}, principal_ref: replay}}
models:
  - id: echo
    providers: {{echo-1: echo}}
nodes:
  - id: replay-node
    embedded: true
    providers:
      - {{id: echo-1, type: echo, category: api, models: [echo], capacity: 4}}
"""


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------- raw HTTP


async def exchange(port: int, data: bytes, *, read_for: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection; everything the edge answers until it closes."""
    reply = b""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        try:
            await stream.send_all(data)
        except trio.BrokenResourceError:
            pass
        with trio.move_on_after(read_for):
            try:
                while chunk := await stream.receive_some(65536):
                    reply += chunk
            except trio.BrokenResourceError:
                pass
    return reply


def statuses(reply: bytes) -> str:
    found = re.findall(rb"HTTP/1\.1 (\d{3})", reply)
    return "+".join(s.decode() for s in found) or "closed, no answer"


def post(path: str, body: bytes, *, extra: str = "", host: str = "x") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}"
        "Connection: close\r\n\r\n"
    ).encode() + body


def chat(content: str, tools: list[object] | None = None, **more: object) -> bytes:
    body: dict[str, object] = {"model": "echo", "messages": [{"role": "user", "content": content}]}
    if tools is not None:
        body["tools"] = tools
    body.update(more)
    return json.dumps(body).encode()


def tool(parameters: object) -> list[object]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


# -------------------------------------------------------------------- cases


@dataclass
class Edge:
    port: int
    admin_port: int
    pid: int


@dataclass
class Result:
    answer: str
    note: str = ""
    extra: dict[str, str] = field(default_factory=dict)


async def case_ref_loop(edge: Edge) -> Result:
    schema = {"type": "object", "allOf": [{"$ref": "#"}, {"$ref": "#"}, {"$ref": "#"}]}
    reply = await exchange(
        edge.port,
        post(
            "/v1/chat/completions",
            chat('<tool_call>{"name":"f","arguments":{}}</tool_call>', tool(schema)),
        ),
    )
    return Result(
        statuses(reply), "tool call" if b'"tool_calls"' in reply else "plain-text fallback"
    )


async def case_backtracking(edge: Edge) -> Result:
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}}
    text = '<tool_call>{"name":"f","arguments":{"a":"' + "a" * 40 + '!"}}</tool_call>'
    reply = await exchange(edge.port, post("/v1/chat/completions", chat(text, tool(schema))))
    return Result(
        statuses(reply), "tool call" if b'"tool_calls"' in reply else "plain-text fallback"
    )


async def case_unclosed_tags(edge: Edge) -> Result:
    reply = await exchange(
        edge.port, post("/v1/chat/completions", chat("<tool_call>" * 8_000, tool({})))
    )
    return Result(statuses(reply), f"88 KB of unclosed tags, answer {len(reply) // 1024} KiB")


async def case_body_flood(edge: Edge) -> Result:
    size = 8 * 1024 * 1024 - 1
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {size}\r\nConnection: close\r\n\r\n"
    ).encode()
    chunk = b"x" * 65536
    answers: dict[str, int] = {}

    async def one() -> None:
        reply = b""
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", edge.port)
        except OSError:
            answers["connect failed"] = answers.get("connect failed", 0) + 1
            return
        async with stream:

            async def read() -> None:
                nonlocal reply
                with trio.move_on_after(15):
                    while data := await stream.receive_some(65536):
                        reply += data

            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read)
                    await stream.send_all(head)
                    sent = 0
                    while sent < size - 1:
                        await stream.send_all(chunk[: min(len(chunk), size - 1 - sent)])
                        sent += len(chunk)
            except* (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        key = statuses(reply)
        answers[key] = answers.get(key, 0) + 1

    with trio.move_on_after(30):
        async with trio.open_nursery() as nursery:
            for _ in range(100):
                nursery.start_soon(one)
    return Result(
        ", ".join(f"{n} x {k}" for k, n in sorted(answers.items())), "100 x 8 MiB - 1, no token"
    )


async def case_json_amplification(edge: Edge) -> Result:
    size = 8 * 1024 * 1024 - 1  # openai.max_body_bytes is 8 MiB
    prefix = b'{"model":"echo","messages":[{"role":"user","content":"hi"}],"junk":['
    body = prefix + b"[]," * ((size - len(prefix) - 3) // 3) + b"[]]}"
    answers: list[str] = []

    async def one() -> None:
        answers.append(
            statuses(await exchange(edge.port, post("/v1/chat/completions", body), read_for=30))
        )

    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(one)
    return Result(", ".join(sorted(set(answers))) + f" (x{len(answers)})", "ten 8 MiB bodies of []")


async def case_never_reads(edge: Edge) -> Result:
    request = post("/v1/chat/completions", chat("word " * 4000, stream=True))
    socks: list[socket.socket] = []
    for _ in range(4):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", edge.port))
        s.sendall(request)
        socks.append(s)
    start = time.monotonic()
    try:
        with trio.move_on_after(60):
            reply = await exchange(edge.port, post("/v1/chat/completions", chat("next caller")))
        waited = time.monotonic() - start
    finally:
        for s in socks:
            s.close()
    return Result(
        statuses(reply),
        f"4 never-reading streams on 4 slots; the next caller served after {waited:.2f} s "
        "(send_timeout 2 s)",
    )


_B = chat("hi")  # a valid request body: a framing accepted by mistake gets 200
_C = b"%x" % len(_B)
FRAMINGS: dict[str, bytes] = {
    "TE chunked\\xa0": b"Transfer-Encoding: chunked\xa0\r\n\r\n"
    + _C
    + b"\r\n"
    + _B
    + b"\r\n0\r\n\r\n",
    "TE \\xa0chunked": b"Transfer-Encoding: \xa0chunked\r\n\r\n"
    + _C
    + b"\r\n"
    + _B
    + b"\r\n0\r\n\r\n",
    "TE chunked\\x85": b"Transfer-Encoding: chunked\x85\r\n\r\n"
    + _C
    + b"\r\n"
    + _B
    + b"\r\n0\r\n\r\n",
    "CL n\\xa0": b"Content-Length: %d\xa0\r\n\r\n" % len(_B) + _B,
    "chunk size with leading space": b"Transfer-Encoding: chunked\r\n\r\n "
    + _C
    + b"\r\n"
    + _B
    + b"\r\n0\r\n\r\n",
    "chunk line ending in bare LF": b"Transfer-Encoding: chunked\r\n\r\n"
    + _C
    + b"\n"
    + _B
    + b"\r\n0\r\n\r\n",
    "bare LF in a chunk extension": b"Transfer-Encoding: chunked\r\n\r\n"
    + _C
    + b";a=\nb\r\n"
    + _B
    + b"\r\n0\r\n\r\n",
    "header line ending \\r\\r\\n": b"X-A: b\r\r\nContent-Length: %d\r\n\r\n" % len(_B) + _B,
    "unknown transfer-coding": b"Transfer-Encoding: gzip, chunked\r\n\r\n"
    + _C
    + b"\r\n"
    + _B
    + b"\r\n0\r\n\r\n",
}


async def case_framings(edge: Edge) -> Result:
    seen: dict[str, str] = {}
    for name, tail in FRAMINGS.items():
        data = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + TOKEN.encode()
            + b"\r\nConnection: close\r\n"
            + tail
        )
        seen[name] = statuses(await exchange(edge.port, data, read_for=3))
    return Result(
        "; ".join(f"{k}: {v}" for k, v in seen.items()),
        "each must be refused (400, 501 for an unknown coding), never served",
    )


async def case_admin_host(edge: Edge) -> Result:
    data = b"GET /status HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n"
    return Result(
        statuses(await exchange(edge.admin_port, data)), "admin /status with Host: evil.example"
    )


async def case_trailers(edge: Edge) -> Result:
    trailer = b"".join(b"X-T%d: %s\r\n" % (i, b"v" * 1000) for i in range(1600))
    data = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + TOKEN.encode()
        + b"\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"
        + trailer
        + b"\r\n"
    )
    return Result(statuses(await exchange(edge.port, data)), "1.6 MB trailer section")


async def case_head_byte_by_byte(edge: Edge) -> Result:
    head = (
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + TOKEN.encode()
        + b"\r\n"
        + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 50) for i in range(1000))
    )
    cpu0 = cpu_seconds(edge.pid)
    stream = await trio.open_tcp_stream("127.0.0.1", edge.port)
    reply = b""
    async with stream:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            for i in range(len(head)):
                await stream.send_all(head[i : i + 1])
                if i % 64 == 0:
                    await trio.lowlevel.checkpoint()
            await stream.send_all(b"\r\n")
        except trio.BrokenResourceError:
            pass
        with trio.move_on_after(5):
            try:
                while chunk := await stream.receive_some(65536):
                    reply += chunk
                    break
            except trio.BrokenResourceError:
                pass
    cpu = cpu_seconds(edge.pid) - cpu0
    return Result(
        statuses(reply), f"{len(head) // 1024} KiB head, one byte per send: edge CPU {cpu:.2f} s"
    )


async def case_connect(edge: Edge) -> Result:
    data = b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"
    return Result(statuses(await exchange(edge.port, data)), "CONNECT")


CASES: dict[str, tuple[str, Callable[[Edge], Awaitable[Result]]]] = {
    "ref_loop": ("1 self-referring $ref schema", case_ref_loop),
    "backtracking": ("1 ^(a+)+$ pattern", case_backtracking),
    "unclosed_tags": ("1 unclosed <tool_call> scan", case_unclosed_tags),
    "body_flood": ("2 bodies before auth", case_body_flood),
    "json_amplification": ("3 JSON amplification", case_json_amplification),
    "never_reads": ("4 callers that never read", case_never_reads),
    "framings": ("5 framings h11 and llhttp refuse", case_framings),
    "admin_host": ("6 admin Host (DNS rebinding)", case_admin_host),
    "trailers": ("9 1.6 MB trailers", case_trailers),
    "head_bytes": ("9 head rescanned per read", case_head_byte_by_byte),
    "connect": ("9 CONNECT", case_connect),
}


# ------------------------------------------------------------------ driver


async def probe_models(port: int, worst: list[float], stop: trio.Event) -> None:
    """GET /v1/models every 50 ms on one keep-alive connection; the slowest answer."""
    request = (
        f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
    ).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        buf = b""
        while not stop.is_set():
            start = time.monotonic()
            await stream.send_all(request)
            while True:
                end = buf.find(b"\r\n\r\n")
                if end >= 0:
                    length = int(re.search(rb"content-length: (\d+)", buf[:end].lower()).group(1))  # type: ignore[union-attr]
                    if len(buf) >= end + 4 + length:
                        buf = buf[end + 4 + length :]
                        break
                data = await stream.receive_some(65536)
                if not data:
                    return
                buf += data
            worst[0] = max(worst[0], time.monotonic() - start)
            with trio.move_on_after(0.05):
                await stop.wait()


async def run_case(edge: Edge, name: str) -> None:
    title, fn = CASES[name]
    worst = [0.0]
    stop = trio.Event()
    rss0 = rss_kib(edge.pid)
    peak = [rss0]

    async def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_kib(edge.pid))
            with trio.move_on_after(0.05):
                await stop.wait()

    started = time.monotonic()
    result = Result("deadline")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe_models, edge.port, worst, stop)
        nursery.start_soon(sample)
        with trio.move_on_after(120):
            result = await fn(edge)
        stop.set()
    took = time.monotonic() - started
    print(f"\n{title}  [{name}]  ({took:.1f} s)")
    print(f"  answer: {result.answer}")
    if result.note:
        print(f"  note: {result.note}")
    print(
        f"  GET /v1/models meanwhile: slowest {worst[0] * 1000:.0f} ms; "
        f"edge RSS {rss0 / 1024:.0f} MiB before, {peak[0] / 1024:.0f} MiB peak"
    )


async def main_async(names: list[str]) -> None:
    token_hash = hashlib.sha256(TOKEN.encode()).hexdigest()
    async with running_edge(EDGE_YAML.format(token_hash=token_hash)) as proc:
        edge = Edge(proc.openai_port, proc.admin_port, proc.pid)
        for name in names:
            await run_case(edge, name)
        print(f"\ntracebacks in the edge's log: {proc.log_text().count('Traceback')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated case names: " + ",".join(CASES))
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s): {', '.join(unknown)}")
    trio.run(main_async, names)


if __name__ == "__main__":
    main()
