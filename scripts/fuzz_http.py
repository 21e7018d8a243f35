#!/usr/bin/env python3
"""Throw N malformed or mutated HTTP requests at a real edge; count outcomes.

Usage: ``python scripts/fuzz_http.py [N] [--seed S] [--concurrency C]
[--target HOST:PORT]`` (default N = 2,000, at least 200).

An edge and a node (the built-in ``echo`` provider) run in this process on
loopback port 0, so the fuzzer sees real sockets and also every log record;
``--target`` fuzzes a running edge instead (responses only).
Each case is one TCP connection: the case's bytes are written, the write side
is closed, and everything the edge sends back is read until it closes.

Case families: random bytes; valid requests with 1-4 byte mutations; broken
chunked bodies; absurd headers (huge, many, invalid, conflicting lengths);
odd request lines and targets; valid HTTP carrying hostile JSON; framings
h11 and llhttp both refuse, most with a second request hidden behind them;
parser limits: trailer floods, CONNECT and odd targets, empty-line floods,
long runs of spaces in a value.

The contract checked: every response is HTTP with a status below
500, or 501 for a method or transfer-coding the edge does not implement; a
4xx carries the OpenAI error envelope; no body contains a traceback; no log
record carries one either; no case hangs.  Bytes that are not HTTP may
simply get the connection closed.  A "framing" case must be refused with
exactly one response (400, 405 or 501): a second one would mean the hidden
request was served.  Exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import h11
import trio

#: How long one case may take before it counts as a hang (seconds).
CASE_TIMEOUT = 10.0

NODE_TOKEN = "fuzz-node-token"

EDGE_YAML = f"""\
edge:
  id: fuzz-edge
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
openai:
  listen: 127.0.0.1:0
  header_timeout: 5
  body_timeout: 5
  max_body_bytes: 65536
  max_header_bytes: 8192
provider_pool: {{max_queue: 64, queue_timeout: 5}}
models:
  - id: echo
    providers: {{echo-1: echo}}
nodes:
  - id: fuzz-node
    token_hash_sha256: {hashlib.sha256(NODE_TOKEN.encode()).hexdigest()}
    providers:
      - id: echo-1
        type: echo
        category: api
        models: [echo]
        capacity: 16
"""

_CHAT = json.dumps(
    {"model": "echo", "messages": [{"role": "user", "content": "hello fuzz"}]}
).encode()
_CHAT_STREAM = json.dumps(
    {"model": "echo", "stream": True, "messages": [{"role": "user", "content": "a b c"}]}
).encode()


def _req(method: str, target: str, body: bytes | None = None, extra: str = "") -> bytes:
    head = f"{method} {target} HTTP/1.1\r\nHost: edge\r\n{extra}"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + (body or b"")


def _chunked(body: bytes) -> bytes:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    mid = len(body) // 2
    parts = [body[:mid], body[mid:]]
    out = head.encode()
    for p in parts:
        out += f"{len(p):x}\r\n".encode() + p + b"\r\n"
    return out + b"0\r\n\r\n"


VALID: list[bytes] = [
    _req("GET", "/healthz"),
    _req("GET", "/v1/models"),
    _req("POST", "/v1/chat/completions", _CHAT),
    _req("POST", "/v1/chat/completions", _CHAT_STREAM),
    _req("POST", "/v1/responses", json.dumps({"model": "echo", "input": "hi"}).encode()),
    _req("POST", "/api/chat", json.dumps({"model": "echo", "messages": []}).encode()),
    _req("GET", "/api/tags"),
    _chunked(_CHAT),
]

_SPECIAL = [b"\r", b"\n", b"\r\n", b"\x00", b":", b" ", b"\t", b"\xff", b"\x80", b"%", b"/", b"0"]


def _mutate(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        pos = rng.randrange(len(buf) + 1)
        if op == 0 and buf:
            i = min(pos, len(buf) - 1)
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf[pos:pos] = rng.choice(_SPECIAL)
        elif op == 2 and buf:
            del buf[pos : pos + rng.randint(1, 8)]
        elif op == 3:
            del buf[pos:]
        elif op == 4 and buf:
            start = rng.randrange(len(buf))
            piece = buf[start : start + rng.randint(1, 32)]
            buf[pos:pos] = piece * rng.randint(1, 4)
        else:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 16))
    return bytes(buf)


def _broken_chunked(rng: random.Random) -> bytes:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    bodies = [
        b"zz\r\n{}\r\n0\r\n\r\n",  # size not hex
        b"-5\r\nhello\r\n0\r\n\r\n",  # negative size
        b"ffffffffffffffffffff\r\nx\r\n",  # absurd size
        b"5\r\nhelloXX0\r\n\r\n",  # missing CRLF after data
        b"5;" + b"e" * 5000 + b"\r\nhello\r\n0\r\n\r\n",  # huge extension
        b'3\r\n{"a\r\n',  # truncated, no last chunk
        b"2\r\n{}\r\n0\r\nX-Trailer: " + b"t" * 10000 + b"\r\n\r\n",  # huge trailer
        b"100000\r\n" + b"a" * 70000 + b"\r\n0\r\n\r\n",  # over max_body_bytes
        b"\r\n\r\n\r\n",
        b"0\r\n\r\n",  # empty body: a JSON error
        rng.randbytes(rng.randint(1, 200)),
    ]
    case = rng.choice(bodies)
    extra = b""
    if rng.random() < 0.3:  # conflicting framing
        extra = b"Content-Length: " + str(rng.randint(0, 100)).encode() + b"\r\n"
    return head[:-2] + extra + b"\r\n" + case


def _absurd_headers(rng: random.Random) -> bytes:
    base = "POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\n"
    variants = [
        "X-Big: " + "a" * rng.randint(9000, 70000) + "\r\n",
        "".join(f"X-H{i}: v\r\n" for i in range(rng.randint(500, 3000))),
        "No colon here\r\n",
        "Bad Name: x\r\n",
        " folded: continuation\r\n",
        "X-A: v\r\n continued line\r\n",
        "Content-Length: -1\r\n",
        "Content-Length: 99999999999999999999999\r\n",
        "Content-Length: 5\r\nContent-Length: 7\r\n",
        "Content-Length: abc\r\n",
        "Content-Length: 1e3\r\n",
        "Transfer-Encoding: gzip\r\n",
        "Transfer-Encoding: chunked, chunked\r\n",
        "Expect: 100-continue\r\n",
        "Connection: upgrade\r\nUpgrade: websocket\r\n",
        "Authorization: Bearer " + "x" * 5000 + "\r\n",
        "Authorization: \x01\x02\r\n",
        "Host: \r\n",
        "Host: a\r\nHost: b\r\n",
        ":\r\n",
        "X-Nul: a\x00b\r\n",
    ]
    hdrs = rng.choice(variants)
    body = _CHAT if rng.random() < 0.5 else b""
    if "Content-Length" not in hdrs and "Transfer-Encoding" not in hdrs:
        hdrs += f"Content-Length: {len(body)}\r\n"
    return (base + hdrs + "\r\n").encode("latin-1") + body


def _odd_request_line(rng: random.Random) -> bytes:
    lines = [
        "GET / HTTP/2.0",
        "GET / HTTP/1.1 extra",
        "GET\t/healthz\tHTTP/1.1",
        "get /healthz HTTP/1.1",
        "GET /healthz",
        "GET",
        "",
        "BREW /coffee HTTP/1.1",
        "DELETE /v1/chat/completions HTTP/1.1",
        "PUT /v1/models HTTP/1.1",
        "OPTIONS * HTTP/1.1",
        "CONNECT 127.0.0.1:1 HTTP/1.1",
        "GET http://example.invalid/v1/models HTTP/1.1",
        "GET /../../etc/passwd HTTP/1.1",
        "GET //status HTTP/1.1",
        "GET /%2e%2e/status HTTP/1.1",
        "GET /v1/models?" + "q" * rng.randint(100, 20000) + " HTTP/1.1",
        "GET /" + "a" * rng.randint(5000, 70000) + " HTTP/1.1",
        "GET /v1/\xff\xfe HTTP/1.1",
        "HEAD /v1/models HTTP/1.1",
        "HEAD /nope HTTP/1.1",
        "POST /v1/chat/completions HTTP/1.0",
        "GET /healthz HTTP/1.1\r\nHost: edge\r\n\r\nGET /nope HTTP/1.1",  # pipelined
    ]
    line = rng.choice(lines)
    return (line + "\r\nHost: edge\r\nContent-Length: 0\r\n\r\n").encode("latin-1")


def _hostile_json(rng: random.Random) -> bytes:
    depth = rng.choice([rng.randint(100, 999), rng.randint(1000, 20000)])
    bodies: list[bytes] = [
        b"[" * depth + b"]" * depth,
        b'{"model": "echo", "messages": ' + b"[" * depth + b"]" * depth + b"}",
        b'{"model": "echo", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"model": "echo", "messages": [{"role": "user", "content": NaN}]}',
        b'{"model": 1e999, "messages": []}',
        b'{"model": "echo", "messages": "not a list"}',
        b'{"model": "echo", "messages": [{"role": "user", "content": [{"type": "x"}]}]}',
        b'{"model": "echo", "messages": [{"role": 7, "content": null}]}',
        b'{"model": "echo", "messages": [{}], "max_tokens": -99999999999999999999}',
        b'{"model": "echo", "messages": [], "tools": [{"type": "function"}]}',
        b'{"model": "echo", "messages": [], "metadata": {"k": {"x": 1}}}',
        b'{"model": "echo", "messages": [], "stream": "yes"}',
        b'{"model": "echo", "messages": [], "stream_options": 5}',
        b'{"model": "echo", "input": [1, 2, 3]}',
        b'{"model": "echo", "input": {"a": ' + b"[" * 100 + b"]" * 100 + b"}}",
        b'{"model": "echo", "messages": [{"role": "user", "content": '
        + b"[" * depth
        + b"]" * depth
        + b"}]}",
        b'{"model": "echo", "messages": [], "tools": [{"type": "function", "function": '
        + b'{"name": "f", "parameters": '
        + b'{"type": "object", "properties": {"a": ' * depth
        + b"{}"
        + b"}}" * depth
        + b"}}]}",
        b'{"model": "echo", "stream": true, "messages": [{"role": "user", "content": "'
        + b"w " * depth
        + b'"}]}',
        b"\xef\xbb\xbf{}",
        b"\xff\xfe\x00\x00",
        b"null",
        b'"str"',
        b"{" + b'"a":1,' * 5000 + b'"model": "echo"}',
        json.dumps({"model": "e" * 10000, "messages": []}).encode(),
        json.dumps(
            {"model": "echo", "messages": [{"role": "user", "content": "x"}] * 2000}
        ).encode(),
    ]
    body = rng.choice(bodies)
    target = rng.choice(["/v1/chat/completions", "/v1/responses", "/api/chat", "/api/generate"])
    return _req("POST", target, body)


_HIDDEN = b"GET /v1/models HTTP/1.1\r\nHost: edge\r\n\r\n"
_NOT_SP = [b"\xa0", b"\x85", b"\x0b", b"\x0c", b"\r", b"\x00"]


def _refused_framing(rng: random.Random) -> bytes:
    """A framing llhttp refuses (h11 too, but for CL+TE and twice the same CL), usually
    with a request hidden after it."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
    te = head + b"Transfer-Encoding: chunked\r\n\r\n"
    ws = rng.choice(_NOT_SP)
    eol = rng.choice([b"\n", b"\r\r\n", b"\r"])
    variants = [
        head + b"Transfer-Encoding: chunked" + ws + b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        head + b"Transfer-Encoding: " + ws + b"chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        head + b"Content-Length: 2" + ws + b"\r\n\r\n{}",
        head + b"Content-Length: " + ws + b"2\r\n\r\n{}",
        te + rng.choice([b" ", b"\t"]) + b"2\r\n{}\r\n0\r\n\r\n",
        te + b"2" + rng.choice([b" ", b"\t"]) + b";a\r\n{}\r\n0\r\n\r\n",
        te + b"2" + eol + b"{}\r\n0\r\n\r\n",
        te + b"2\r\n{}\r\n0" + eol + b"\r\n",
        te + b"2;a" + eol + b"{}\r\n0\r\n\r\n",
        te + b"2\r\n{}" + eol + b"0\r\n\r\n",
        te + b"2\r\n{}\r\n0\r\nX: 1" + eol + b"\r\n",
        head + b"X-A: 1" + eol + b"Content-Length: 2\r\n\r\n{}",
        head.replace(b"HTTP/1.1\r\n", b"HTTP/1.1" + eol, 1) + b"Content-Length: 2\r\n\r\n{}",
        head + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        head + b"Content-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
        head + b"Transfer-Encoding: chunked\r\n folded\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    ]
    return rng.choice(variants) + (_HIDDEN if rng.random() < 0.8 else b"")


def _parser_limits(rng: random.Random) -> bytes:
    """Trailer floods, CONNECT and odd targets, empty-line floods, runs of spaces."""
    te = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\n"
          b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n")
    variants = [
        te + b"X-T: v\r\n" * rng.randint(1000, 200000) + b"\r\n",
        te + b"X-T: " + b"v" * rng.randint(8000, 20000) + b"\r\n\r\n",
        rng.choice([b"CONNECT edge:443", b"CONNECT /v1/models", b"GET *", b"GET edge:443",
                    b"OPTIONS *", b"GET v1/models", b"BREW /v1/models", b"get /v1/models"])
        + b" HTTP/1.1\r\nHost: edge\r\n\r\n",
        b"\r\n" * rng.randint(1, 40) + b"GET /v1/models HTTP/1.1\r\nHost: edge\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: edge\r\nX-S: a" + b" " * rng.randint(1000, 8000)
        + b"b\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nTransfer-Encoding: "
        + rng.choice([b"gzip, chunked", b"gzip", b"chunked, gzip", b"identity, chunked"])
        + b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    ]
    return rng.choice(variants)


#: Families whose every case must be refused, with one response and a close.
REFUSED_FAMILIES = frozenset({"framing"})


def make_case(rng: random.Random) -> tuple[str, bytes]:
    """One fuzz case: ``(family, bytes to send)``."""
    family = rng.choice(
        ["random", "mutated", "mutated", "mutated", "chunked", "headers", "line", "json",
         "framing", "limits"]
    )
    if family == "random":
        return family, rng.randbytes(rng.randint(1, 2048))
    if family == "mutated":
        return family, _mutate(rng.choice(VALID), rng)
    if family == "chunked":
        return family, _broken_chunked(rng)
    if family == "headers":
        return family, _absurd_headers(rng)
    if family == "line":
        return family, _odd_request_line(rng)
    if family == "framing":
        return family, _refused_framing(rng)
    if family == "limits":
        return family, _parser_limits(rng)
    return family, _hostile_json(rng)


# ---------------------------------------------------------------- checking


def parse_responses(raw: bytes, method: str) -> list[tuple[int, bytes]]:
    """Every complete response in ``raw`` as ``(status, body)``, in order.

    Raises ``h11.RemoteProtocolError`` when the bytes are not valid HTTP.
    """
    conn = h11.Connection(h11.CLIENT)
    out: list[tuple[int, bytes]] = []
    first = True
    while True:
        # Our side of the state machine must have "sent" a request for h11
        # to parse the next response; the bytes it produces are discarded.
        conn.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
        conn.send(h11.EndOfMessage())
        if first:
            conn.receive_data(raw)
            conn.receive_data(b"")
            first = False
        status, body = 0, b""
        while True:
            try:
                ev = conn.next_event()
            except h11.RemoteProtocolError:
                if conn.trailing_data[0]:
                    raise
                if status:  # a stream cut because our half-close reads as a disconnect
                    out.append((status, body))
                return out  # or closed before a final response (e.g. after a 100)
            if isinstance(ev, h11.InformationalResponse):
                out.append((ev.status_code, b""))
            elif isinstance(ev, h11.Response):
                status = ev.status_code
            elif isinstance(ev, h11.Data):
                body += bytes(ev.data)
            elif isinstance(ev, h11.EndOfMessage):
                out.append((status, body))
                break
            else:  # NEED_DATA or ConnectionClosed: nothing more to read
                if status:
                    out.append((status, body))
                return out
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            return out
        if not conn.trailing_data[0]:
            return out  # nothing more was sent (a keep-alive reply, then EOF)
        conn.start_next_cycle()


def _is_envelope(body: bytes, ollama: bool = False) -> bool:
    """The OpenAI envelope; for a request to an Ollama route (``/api/*``) also
    Ollama's ``{"error": "..."}`` (what the route refuses takes that shape; a
    request the parser cannot read has no route yet and gets the envelope)."""
    try:
        doc = json.loads(body)
        err = doc["error"]
        if ollama and isinstance(err, str):
            return bool(err) and set(doc) == {"error"}
        return isinstance(err["message"], str) and bool(err["type"]) and bool(err["code"])
    except (ValueError, KeyError, TypeError):
        return False


def _ollama_target(payload: bytes) -> bool:
    """The request line of ``payload`` targets one of Ollama's routes."""
    return b" /api/" in payload.split(b"\r\n", 1)[0]


def check_response(
    raw: bytes, head_request: bool, ollama: bool = False
) -> tuple[str, str | None]:
    """``(outcome, violation or None)`` for everything one connection received
    (``ollama``: the request targeted ``/api/*``, whose errors take Ollama's shape)."""
    if not raw:
        return "closed", None
    if b"Traceback" in raw:
        return "traceback", "a traceback in the response"
    try:
        responses = parse_responses(raw, "HEAD" if head_request else "GET")
    except h11.RemoteProtocolError as exc:
        return "non_http", f"a reply that is not HTTP ({exc}): {raw[:80]!r}"
    if not responses:
        return "non_http", f"no complete response head: {raw[:80]!r}"
    final = [(s, b) for s, b in responses if s >= 200]
    if not final:
        return "closed_after_1xx", None
    for status, body in responses:
        if status >= 500 and status != 501:
            return str(status), f"a 5xx status: {[s for s, _ in responses]}"
        if 400 <= status < 500 and not head_request and not _is_envelope(body, ollama):
            shape = "Ollama's error shape" if ollama else "the OpenAI envelope"
            return str(status), f"a {status} without {shape}: {body[:120]!r}"
    return str(final[0][0]), None


def check_refused(raw: bytes) -> str | None:
    """For a case that must be refused: None when exactly one refusal came back."""
    try:
        statuses = [status for status, _ in parse_responses(raw, "GET")]
    except h11.RemoteProtocolError:
        return "a reply that is not HTTP"
    if statuses[:1] not in ([400], [405], [501]) or len(statuses) != 1:
        return f"not refused with exactly one response: {statuses}"
    return None


class _TracebackCatcher(logging.Handler):
    """Collects every log record that carries an exception (or says Traceback)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.bad: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info or "Traceback" in text or record.levelno >= logging.ERROR:
            self.bad.append(f"{record.name}: {text}")


@dataclass
class FuzzReport:
    """What a fuzz run saw: outcomes by family, violations, logged errors."""

    cases: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    families: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    logged_errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations and not self.logged_errors


async def run_case(addr: tuple[str, int], payload: bytes) -> bytes:
    """Send ``payload`` on a fresh connection, close our side, read until EOF."""
    stream = await trio.open_tcp_stream(*addr)
    received = bytearray()
    async with stream:

        async def send() -> None:
            try:
                await stream.send_all(payload)
                await stream.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            try:
                while chunk := await stream.receive_some(65536):
                    received += chunk
            except trio.BrokenResourceError:
                pass  # reset by the edge after it answered: fine
    return bytes(received)


async def fuzz_edge(
    addr: tuple[str, int], n: int, seed: int, *, concurrency: int = 4
) -> FuzzReport:
    """Run ``n`` cases against the OpenAI listener at ``addr``."""
    rng = random.Random(seed)
    cases = [make_case(rng) for _ in range(n)]
    report = FuzzReport(cases=n)
    limiter = trio.CapacityLimiter(concurrency)

    async def one(index: int, family: str, payload: bytes) -> None:
        async with limiter:
            report.families[family] += 1
            try:
                with trio.fail_after(CASE_TIMEOUT):
                    raw = await run_case(addr, payload)
            except trio.TooSlowError:
                report.outcomes["hang"] += 1
                report.violations.append(f"case {index} ({family}) hung: {payload[:80]!r}")
                return
            head = payload.startswith(b"HEAD ")
            outcome, problem = check_response(raw, head, _ollama_target(payload))
            if problem is None and family in REFUSED_FAMILIES:
                problem = check_refused(raw)
            report.outcomes[outcome] += 1
            if problem is not None:
                report.violations.append(f"case {index} ({family}): {problem}; {payload[:80]!r}")

    start = time.monotonic()
    async with trio.open_nursery() as nursery:
        for i, (family, payload) in enumerate(cases):
            nursery.start_soon(one, i, family, payload)
    report.seconds = time.monotonic() - start
    return report


async def fuzz_in_process_edge(n: int, seed: int, *, concurrency: int = 4) -> FuzzReport:
    """Start an edge + echo node in this process and fuzz its OpenAI listener."""
    from iopd.config.load import parse_edge_config
    from iopd.config.schema import NodeConfigFile, NodeSection
    from iopd.edge.daemon import run_edge
    from iopd.node.run import run_node

    catcher = _TracebackCatcher()
    root = logging.getLogger()
    root.addHandler(catcher)
    old_level = root.level
    root.setLevel(logging.DEBUG)
    try:
        cfg = parse_edge_config(EDGE_YAML, env={})
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(run_edge, cfg)
            host, port = handle.wire
            node_cfg = NodeConfigFile(
                node=NodeSection(
                    id="fuzz-node",
                    edge=f"{host}:{port}",
                    token=NODE_TOKEN,
                    accept_legacy_proof=True,  # the edge config holds the hash of the token
                )
            )
            nursery.start_soon(run_node, node_cfg)
            while handle.runtime.hub.connected_since("fuzz-node") is None:  # noqa: ASYNC110
                await trio.sleep(0.01)
            assert handle.openai is not None
            report = await fuzz_edge(handle.openai, n, seed, concurrency=concurrency)
            nursery.cancel_scope.cancel()
    finally:
        root.removeHandler(catcher)
        root.setLevel(old_level)
    report.logged_errors = catcher.bad
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", nargs="?", type=int, default=2000, help="cases (min 200)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--target",
        metavar="HOST:PORT",
        help="fuzz an edge that is already running (its OpenAI listener) instead of "
        "starting one in process; its logs are then not checked here",
    )
    args = parser.parse_args(argv)
    n = max(200, args.n)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    if args.target:
        host, _, port = args.target.rpartition(":")
        addr = (host.strip("[]"), int(port))
        report = trio.run(lambda: fuzz_edge(addr, n, seed, concurrency=args.concurrency))
    else:
        report = trio.run(lambda: fuzz_in_process_edge(n, seed, concurrency=args.concurrency))
    print(f"fuzz_http: {report.cases} cases, seed {seed}, {report.seconds:.1f} s")
    print("  families: " + ", ".join(f"{k}={v}" for k, v in sorted(report.families.items())))
    print("  outcomes: " + ", ".join(f"{k}={v}" for k, v in sorted(report.outcomes.items())))
    for line in report.violations[:20]:
        print("  VIOLATION " + line)
    for line in report.logged_errors[:20]:
        print("  LOGGED " + line)
    print(f"  violations={len(report.violations)} logged_errors={len(report.logged_errors)}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
