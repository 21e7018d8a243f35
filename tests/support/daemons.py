"""Real daemons for the system tests: ``python -m iopd edge`` / ``node`` as subprocesses on
loopback, their configs, the log line they bind with, and a raw HTTP client to reach them.

Every listener is on port 0; the edge reports what it bound in its ``edge_started``
log line, which ``run_daemon`` reads.  Each helper kills its processes in ``finally``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import trio

from tests.support import configs
from wire import scram

GUARD = 30.0  # seconds: generous, the tests normally take 2-8 s each

# Canary secrets: they must never appear in any daemon output.
CALLER_TOKEN = "iop_canary_caller_7f3a9c1e5b"
NODE_TOKEN = "iop_canary_node_2d8e4b6a0c"
WRONG_TOKEN = "iop_canary_wrong_9b1d3f5e7a"


def node_yaml(wire_port: int, *, node_id: str = "ops-node", log_format: str | None = None) -> str:
    """A node daemon's config: ``node_id`` dialling the edge's wire port on loopback with the
    token from ``IOP_NODE_TOKEN``, reconnecting after 0.1 s up to 1 s."""
    text = (
        f"node:\n  id: {node_id}\n  edge: 127.0.0.1:{wire_port}\n  token: ${{IOP_NODE_TOKEN}}\n"
        "  reconnect_initial_backoff: 0.1\n  reconnect_max_backoff: 1\n"
    )
    return text + (f"  log_format: {log_format}\n" if log_format is not None else "")


def principal_token_line(token: str, ref: str) -> str:
    """One ``openai.principal_tokens`` entry (YAML flow, list-item indented)."""
    digest = hashlib.sha256(token.encode()).hexdigest()
    return f"    - {{token_ref: {ref}, token_hash_sha256: {digest}, principal_ref: p-{ref}}}\n"


def fleet_yaml(
    *,
    tokens: list[tuple[str, str]],
    second_node: bool,
    edge_id: str = "live-edge",
    admin_listen: str = "127.0.0.1:0",
    capacity: int = 4,
    delay_ms: int = 20,
    queue_timeout: float = 10,
    drain_timeout: float = 30,
) -> str:
    """An edge whose callers hold ``tokens`` ((token, ref) pairs) and whose model
    ``echo`` is served by ``ops-node`` (echo-1) and, with ``second_node``, by
    ``node-2`` (echo-2): the config a refresh test writes again and again."""
    verifier = node_verifier(NODE_TOKEN)
    group = "{echo-1: echo, echo-2: echo}" if second_node else "{echo-1: echo}"
    provider = "type: echo, category: api, models: [echo], "
    provider += f"capacity: {capacity}, delay_ms: {delay_ms}"
    text = f"""\
edge:
  id: {edge_id}
  node_listen: 127.0.0.1:0
  admin_listen: {admin_listen}
  drain_timeout: {drain_timeout}
openai:
  listen: 127.0.0.1:0
  principal_tokens:
{"".join(principal_token_line(t, ref) for t, ref in tokens)}\
provider_pool: {{max_queue: 64, queue_timeout: {queue_timeout}}}
models:
  - id: echo
    providers: {group}
nodes:
  - id: ops-node
    token_verifier: "{verifier}"
    providers:
      - {{id: echo-1, {provider}}}
"""
    if second_node:
        text += f"""\
  - id: node-2
    token_verifier: "{verifier}"
    providers:
      - {{id: echo-2, {provider}}}
"""
    return text


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def node_verifier(token: str) -> str:
    """The ``nodes[].token_verifier`` of ``token`` (nodes refuse the legacy hash form);
    one per token, so a config written again is the same config."""
    return scram.Verifier.create(token, iterations=scram.MIN_ITERATIONS).encode()


def edge_yaml(
    *,
    drain_timeout: float = 30,
    delay_ms: int = 100,
    capacity: int = 2,
    log_format: str = "keyvalue",
    max_queue: int = 8,
    queue_timeout: float = 10,
    edge: Mapping[str, Any] | None = None,
    openai: Mapping[str, Any] | None = None,
) -> str:
    """The daemons' edge ``ops-edge``: caller ``CALLER_TOKEN`` (alias ``opsalice``), model
    ``echo`` on ``ops-node`` (echo-1, words ``delay_ms`` apart); ``edge``/``openai``: more keys
    of those sections (or other values)."""
    caller = {
        "token_ref": "canary-ref",
        "token_hash_sha256": _sha256(CALLER_TOKEN),
        "principal_ref": "ops-user",
        "alias": "opsalice",
    }
    provider = configs.echo_provider(capacity=capacity, delay_ms=delay_ms)
    return configs.edge_yaml(
        edge_id="ops-edge",
        edge={"drain_timeout": drain_timeout, "log_format": log_format, **(edge or {})},
        openai={"principal_tokens": [caller], **(openai or {})},
        provider_pool={"max_queue": max_queue, "queue_timeout": queue_timeout},
        nodes=[
            {"id": "ops-node", "token_verifier": node_verifier(NODE_TOKEN), "providers": [provider]}
        ],
    )


_KV = re.compile(r"""(\w+)=("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|\S*)""")


def parse_log_line(line: str) -> dict[str, str]:
    """A log line in either format → its fields (quotes stripped)."""
    if line.startswith("{"):
        try:
            doc = json.loads(line)
        except ValueError:
            return {}
        return {str(k): str(v) for k, v in doc.items()} if isinstance(doc, dict) else {}
    fields = {}
    for key, value in _KV.findall(line):
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        fields[key] = value
    return fields


def host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


# --------------------------------------------------------------- processes


@dataclass
class Daemon:
    """A running ``python -m iopd ...`` with its output collected line by line."""

    name: str
    proc: trio.Process
    lines: list[str] = field(default_factory=list)
    _changed: trio.Event = field(default_factory=trio.Event)
    eof: bool = False

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    async def collect(self) -> None:
        assert self.proc.stdout is not None
        buf = b""
        try:
            async for chunk in self.proc.stdout:
                buf += chunk
                *complete, buf = buf.split(b"\n")
                for raw in complete:
                    self.lines.append(raw.decode("utf-8", "replace"))
                if complete:
                    self._wake()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass
        if buf:
            self.lines.append(buf.decode("utf-8", "replace"))
        self.eof = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def events(self, event: str) -> list[dict[str, str]]:
        out = []
        for line in self.lines:
            f = parse_log_line(line)
            if f.get("event") == event:
                out.append(f)
        return out

    async def wait_for(self, predicate: Callable[[str], bool]) -> str:
        """The first output line matching ``predicate`` (waits for it)."""
        seen = 0
        while True:
            for line in self.lines[seen:]:
                if predicate(line):
                    return line
            seen = len(self.lines)
            if self.eof:
                raise AssertionError(f"{self.name} ended without the expected line:\n{self.output}")
            await self._changed.wait()

    async def wait_event(self, event: str) -> dict[str, str]:
        line = await self.wait_for(lambda ln: parse_log_line(ln).get("event") == event)
        return parse_log_line(line)

    async def wait_exit(self) -> int:
        code = await self.proc.wait()
        return code


@asynccontextmanager
async def run_daemon(
    nursery: trio.Nursery,
    name: str,
    kind: str,
    config: Path,
    *,
    notify_socket: str | None = None,
) -> AsyncIterator[Daemon]:
    env = dict(os.environ, IOP_NODE_TOKEN=NODE_TOKEN, PYTHONUNBUFFERED="1")
    env.pop("NOTIFY_SOCKET", None)
    if notify_socket is not None:
        env["NOTIFY_SOCKET"] = notify_socket
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "iopd", kind, "--config", str(config)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    daemon = Daemon(name, proc)
    nursery.start_soon(daemon.collect)
    try:
        yield daemon
    finally:
        if proc.returncode is None:
            proc.kill()
        with trio.CancelScope(shield=True):
            await proc.wait()


@dataclass
class Cluster:
    edge: Daemon
    node: Daemon
    openai: tuple[str, int]
    admin: tuple[str, int]
    edge_config: Path
    wire: tuple[str, int]


@asynccontextmanager
async def edge_and_node(
    nursery: trio.Nursery,
    tmp_path: Path,
    edge_cfg: Path,
    *,
    node_id: str = "ops-node",
    log_format: str | None = None,
) -> AsyncIterator[Cluster]:
    """The edge daemon on ``edge_cfg``, then a node daemon ``node_id`` dialling its wire port
    (``node_yaml``); the node is started, not yet waited for."""
    async with run_daemon(nursery, "edge", "edge", edge_cfg) as edge:
        started = await edge.wait_event("edge_started")
        wire = host_port(started["wire"])
        node_cfg = tmp_path / "node.yaml"
        node_cfg.write_text(node_yaml(wire[1], node_id=node_id, log_format=log_format))
        async with run_daemon(nursery, "node", "node", node_cfg) as node:
            yield Cluster(
                edge=edge,
                node=node,
                openai=host_port(started["openai"]),
                admin=host_port(started["admin"]),
                edge_config=edge_cfg,
                wire=wire,
            )


@asynccontextmanager
async def cluster(tmp_path: Path, **edge_opts: Any) -> AsyncIterator[Cluster]:
    """An edge and a node subprocess, the node connected and its provider listed."""
    log_format = edge_opts.get("log_format", "keyvalue")
    edge_cfg = tmp_path / "edge.yaml"
    edge_cfg.write_text(edge_yaml(**edge_opts))
    async with trio.open_nursery() as nursery:
        async with edge_and_node(nursery, tmp_path, edge_cfg, log_format=log_format) as c:
            await c.edge.wait_event("node_connected")
            yield c
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------- HTTP


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    truncated: bool = False


async def http_request(
    addr: tuple[str, int],
    method: str,
    path: str,
    body: Any = None,
    *,
    token: str | None = None,
    on_data: Callable[[bytes], None] | None = None,
) -> Response:
    """One request on a fresh connection; ``on_data`` sees each body piece as it arrives."""
    stream = await trio.open_tcp_stream(*addr)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        data = json.dumps(body).encode() if body is not None else b""
        headers = [("host", f"{addr[0]}:{addr[1]}"), ("connection", "close")]
        if body is not None:
            headers += [("content-type", "application/json"), ("content-length", str(len(data)))]
        if token is not None:
            headers.append(("authorization", f"Bearer {token}"))
        out = conn.send(h11.Request(method=method, target=path, headers=headers))
        if data:
            out += conn.send(h11.Data(data=data))
        out += conn.send(h11.EndOfMessage())
        await stream.send_all(out)
        resp: Response | None = None
        chunks: list[bytes] = []
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                assert resp is not None, "the connection ended before a response head"
                resp.truncated = True  # closed mid-body
                break
            if event is h11.NEED_DATA:
                raw = await stream.receive_some(65536)
                conn.receive_data(raw)
                continue
            if isinstance(event, h11.Response):
                resp = Response(
                    event.status_code, {k.decode(): v.decode() for k, v in event.headers}
                )
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
                if on_data is not None:
                    on_data(bytes(event.data))
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
        assert resp is not None
        resp.body = b"".join(chunks)
        return resp


def chat_body(text: str, *, stream: bool = False, model: str = "echo") -> dict[str, Any]:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": text}]}


def sse_payloads(body: bytes) -> list[str]:
    return [
        line.removeprefix("data: ")
        for line in body.decode().split("\n")
        if line.startswith("data: ")
    ]


def streamed_text(payloads: list[str]) -> str:
    text = ""
    for p in payloads:
        if p == "[DONE]":
            continue
        doc = json.loads(p)
        for choice in doc.get("choices", []):
            text += choice.get("delta", {}).get("content") or ""
    return text


async def chat_as(openai: tuple[str, int], token: str) -> int:
    """The status of one small chat request with ``token``."""
    resp = await http_request(openai, "POST", "/v1/chat/completions", chat_body("hi"), token=token)
    return resp.status


async def get_status(c: Cluster) -> dict[str, Any]:
    resp = await http_request(c.admin, "GET", "/status")
    assert resp.status == 200
    doc = json.loads(resp.body)
    assert isinstance(doc, dict)
    return doc


async def stream_until_first_chunk(
    openai: tuple[str, int],
    text: str,
    results: dict[str, Response],
    first: trio.Event,
    key: str = "stream",
) -> None:
    """A streamed chat of ``text``: ``first`` set at its first chunk, the whole
    response in ``results[key]`` at its end."""

    def seen(piece: bytes) -> None:
        if b"data: " in piece:
            first.set()

    results[key] = await http_request(
        openai,
        "POST",
        "/v1/chat/completions",
        chat_body(text, stream=True),
        token=CALLER_TOKEN,
        on_data=seen,
    )


def kill_successors(edge: Daemon) -> None:
    """Kill every edge process ``edge`` started at a hand-over (its log names each
    one at ``handover_started``): a successor outlives its parent by design, so a
    test that ends early must not leave it behind."""
    for started in edge.events("handover_started"):
        try:
            os.kill(int(started["successor_pid"]), signal.SIGKILL)
        except (ProcessLookupError, ValueError, KeyError):
            pass


async def wait_until_refused(addr: tuple[str, int]) -> None:
    """Return once connecting to ``addr`` is refused (the caller's guard bounds it)."""
    while True:
        try:
            stream = await trio.open_tcp_stream(*addr)
        except OSError:
            return
        await stream.aclose()
        await trio.sleep(0.02)


async def run_iopd(*args: str) -> tuple[int, str, str]:
    """Run ``python -m iopd ARGS`` to its end: exit status, stdout, stderr."""
    with trio.fail_after(GUARD):
        proc = await trio.run_process(
            [sys.executable, "-m", "iopd", *args],
            stdin=subprocess.DEVNULL,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


def assert_one_line(result: tuple[int, str, str], expected: str) -> None:
    """``run_iopd``'s result is exit 1 with ``expected`` as its one stderr line, no traceback."""
    code, stdout, stderr = result
    assert code == 1, (code, stdout, stderr)
    assert stderr.splitlines() == [expected], stderr
    assert "Traceback" not in stdout + stderr


@asynccontextmanager
async def notify_socket(
    tmp_path: Path,
) -> AsyncIterator[tuple[str, Callable[[], Awaitable[list[str]]]]]:
    """A systemd notify socket in ``tmp_path``: its path (``run_daemon(notify_socket=)``) and
    a function that waits for the next notification's states."""
    path = str(tmp_path / "notify.sock")
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_DGRAM)
    await sock.bind(path)

    async def next_states() -> list[str]:
        return (await sock.recv(4096)).decode().split("\n")

    with sock:
        yield path, next_states
