"""Operations against real daemons: ``python -m iopd edge`` and ``python -m iopd node``
as subprocesses on loopback, driven by signals, as systemd would (SPEC §9);
plus consistency checks of the shipped systemd units.

Why subprocesses: drain on SIGTERM, refresh on SIGHUP, the exit code and what
reaches stdout can only be seen from outside the process.  Every listener is
configured on port 0; the edge reports what it bound in its ``edge_started``
log line, which the test reads.  The echo provider's ``delay_ms`` makes a
stream last long enough to signal the edge in the middle of it.

These tests use the real clock (a subprocess cannot share the autojump
clock), but assert only outcomes, never durations; each is guarded by
``trio.fail_after`` and kills its processes in ``finally``.
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
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import pytest
import trio

from tests.support.paths import ROOT
from wire import scram

GUARD = 30.0  # seconds: generous, the tests normally take 2-8 s each

# Canary secrets: they must never appear in any daemon output.
CALLER_TOKEN = "iop_canary_caller_7f3a9c1e5b"
NODE_TOKEN = "iop_canary_node_2d8e4b6a0c"
WRONG_TOKEN = "iop_canary_wrong_9b1d3f5e7a"

EDGE_YAML = """\
edge:
  id: ops-edge
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
  drain_timeout: {drain_timeout}
  log_format: {log_format}
openai:
  listen: 127.0.0.1:0
  principal_tokens:
    - token_ref: canary-ref
      token_hash_sha256: {caller_hash}
      principal_ref: ops-user
      alias: opsalice
provider_pool: {{max_queue: 8, queue_timeout: 10}}
models:
  - id: echo
    providers: {{echo-1: echo}}
nodes:
  - id: ops-node
    token_verifier: "{node_verifier}"
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
  id: ops-node
  edge: 127.0.0.1:{wire_port}
  token: ${{IOP_NODE_TOKEN}}
  reconnect_initial_backoff: 0.1
  reconnect_max_backoff: 1
  log_format: {log_format}
"""


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
) -> str:
    return EDGE_YAML.format(
        drain_timeout=drain_timeout,
        delay_ms=delay_ms,
        capacity=capacity,
        log_format=log_format,
        caller_hash=_sha256(CALLER_TOKEN),
        node_verifier=node_verifier(NODE_TOKEN),
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


def _hostport(text: str) -> tuple[str, int]:
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


@asynccontextmanager
async def cluster(tmp_path: Path, **edge_opts: Any) -> AsyncIterator[Cluster]:
    """An edge and a node subprocess, the node connected and its provider listed."""
    log_format = edge_opts.get("log_format", "keyvalue")
    edge_cfg = tmp_path / "edge.yaml"
    edge_cfg.write_text(edge_yaml(**edge_opts))
    async with trio.open_nursery() as nursery:
        async with run_daemon(nursery, "edge", "edge", edge_cfg) as edge:
            started = await edge.wait_event("edge_started")
            wire = _hostport(started["wire"])
            node_cfg = tmp_path / "node.yaml"
            node_cfg.write_text(NODE_YAML.format(wire_port=wire[1], log_format=log_format))
            async with run_daemon(nursery, "node", "node", node_cfg) as node:
                c = Cluster(
                    edge=edge,
                    node=node,
                    openai=_hostport(started["openai"]),
                    admin=_hostport(started["admin"]),
                    edge_config=edge_cfg,
                )
                await edge.wait_event("node_connected")
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


async def get_status(c: Cluster) -> dict[str, Any]:
    resp = await http_request(c.admin, "GET", "/status")
    assert resp.status == 200
    doc = json.loads(resp.body)
    assert isinstance(doc, dict)
    return doc


async def stream_until_first_chunk(
    c: Cluster, text: str, results: dict[str, Response], first: trio.Event
) -> None:
    def seen(piece: bytes) -> None:
        if b"data: " in piece:
            first.set()

    results["stream"] = await http_request(
        c.openai,
        "POST",
        "/v1/chat/completions",
        chat_body(text, stream=True),
        token=CALLER_TOKEN,
        on_data=seen,
    )


async def wait_until_refused(addr: tuple[str, int]) -> None:
    """Return once connecting to ``addr`` is refused (the caller's guard bounds it)."""
    while True:
        try:
            stream = await trio.open_tcp_stream(*addr)
        except OSError:
            return
        await stream.aclose()
        await trio.sleep(0.02)


# ------------------------------------------------------------------- tests


async def test_sigterm_lets_an_in_flight_stream_finish_then_exits_0(tmp_path: Path) -> None:
    words = [f"w{i}" for i in range(12)]
    text = " ".join(words)
    with trio.fail_after(GUARD):
        async with cluster(tmp_path, drain_timeout=30, delay_ms=100) as c:
            results: dict[str, Response] = {}
            first = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream_until_first_chunk, c, text, results, first)
                await first.wait()
                c.edge.proc.send_signal(signal.SIGTERM)
                drain = await c.edge.wait_event("drain_started")
                assert drain["in_flight"] == "1"
                # Draining: the OpenAI listener closes (shortly after the log line).
                await wait_until_refused(c.openai)
            resp = results["stream"]
            assert resp.status == 200
            assert not resp.truncated
            payloads = sse_payloads(resp.body)
            assert payloads[-1] == "[DONE]"
            assert streamed_text(payloads) == text
            assert await c.edge.wait_exit() == 0
            assert not c.edge.events("drain_deadline")
            assert c.edge.events("edge_stopped")


async def test_drain_deadline_cuts_a_long_stream_with_a_terminal_error(tmp_path: Path) -> None:
    text = " ".join(f"w{i}" for i in range(60))  # 60 chunks x 200 ms: far beyond the deadline
    with trio.fail_after(GUARD):
        async with cluster(tmp_path, drain_timeout=1, delay_ms=200) as c:
            results: dict[str, Response] = {}
            first = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream_until_first_chunk, c, text, results, first)
                await first.wait()
                c.edge.proc.send_signal(signal.SIGTERM)
            resp = results["stream"]
            assert resp.status == 200  # the stream had started before the cut
            assert not resp.truncated  # a normalized stream ends with an error event
            payloads = sse_payloads(resp.body)
            assert "[DONE]" not in payloads
            error = json.loads(payloads[-1])["error"]
            assert error["code"] == "shutting_down"
            assert error["type"] == "server_error"
            assert len(streamed_text(payloads).split()) < 60
            assert await c.edge.wait_exit() == 0
            assert c.edge.events("drain_deadline")[0]["cut"] == "1"
            (line,) = c.edge.events("request")
            assert line["status"] == "cancelled"


async def test_second_signal_stops_at_once(tmp_path: Path) -> None:
    text = " ".join(f"w{i}" for i in range(60))
    with trio.fail_after(GUARD):
        async with cluster(tmp_path, drain_timeout=60, delay_ms=200) as c:
            results: dict[str, Response] = {}
            first = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream_until_first_chunk, c, text, results, first)
                await first.wait()
                c.edge.proc.send_signal(signal.SIGTERM)
                await c.edge.wait_event("drain_started")
                c.edge.proc.send_signal(signal.SIGTERM)
                # Far sooner than the 60 s drain (the guard would fire otherwise).
                assert await c.edge.wait_exit() == 0
            await c.edge.wait_event("edge_stop_now")
            assert "[DONE]" not in sse_payloads(results["stream"].body)


async def test_node_sigterm_finishes_its_runs_then_exits_0(tmp_path: Path) -> None:
    text = " ".join(f"w{i}" for i in range(12))
    with trio.fail_after(GUARD):
        async with cluster(tmp_path, delay_ms=100) as c:
            results: dict[str, Response] = {}
            first = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream_until_first_chunk, c, text, results, first)
                await first.wait()
                c.node.proc.send_signal(signal.SIGTERM)
                await c.node.wait_event("node_drain_start")
            resp = results["stream"]
            assert resp.status == 200
            payloads = sse_payloads(resp.body)
            assert payloads[-1] == "[DONE]"
            assert streamed_text(payloads) == text
            assert await c.node.wait_exit() == 0
            assert not c.node.events("node_drain_cancel")
            await c.edge.wait_event("node_disconnected")
            assert c.edge.proc.returncode is None


async def test_sighup_applies_a_capacity_change_visible_in_status(tmp_path: Path) -> None:
    with trio.fail_after(GUARD):
        async with cluster(tmp_path, capacity=2) as c:
            (provider,) = (await get_status(c))["providers"]
            assert provider["id"] == "echo-1"
            assert provider["capacity"] == 2
            c.edge_config.write_text(edge_yaml(capacity=5))
            c.edge.proc.send_signal(signal.SIGHUP)
            applied = await c.edge.wait_event("refresh")
            assert applied["outcome"] == "applied"
            assert applied["providers"] == "echo-1"
            (provider,) = (await get_status(c))["providers"]
            assert provider["capacity"] == 5

            # A restart-required change is refused whole: nothing changes.
            c.edge_config.write_text(edge_yaml(capacity=7, delay_ms=5))
            c.edge.proc.send_signal(signal.SIGHUP)
            refused = await c.edge.wait_for(
                lambda ln: parse_log_line(ln).get("outcome") == "refused"
            )
            assert "delay_ms" in parse_log_line(refused)["restart_required"]
            (provider,) = (await get_status(c))["providers"]
            assert provider["capacity"] == 5
            assert c.edge.proc.returncode is None  # SIGHUP never stops the edge


@pytest.mark.parametrize("log_format", ["keyvalue", "json"])
async def test_one_request_line_per_request_and_no_secrets(tmp_path: Path, log_format: str) -> None:
    with trio.fail_after(GUARD):
        async with cluster(tmp_path, log_format=log_format, delay_ms=0) as c:
            ok = await http_request(
                c.openai, "POST", "/v1/chat/completions", chat_body("one two three"),
                token=CALLER_TOKEN,
            )  # fmt: skip
            assert ok.status == 200
            streamed = await http_request(
                c.openai, "POST", "/v1/chat/completions", chat_body("a b", stream=True),
                token=CALLER_TOKEN,
            )  # fmt: skip
            assert streamed.status == 200
            denied = await http_request(
                c.openai, "POST", "/v1/chat/completions", chat_body("x"), token=WRONG_TOKEN
            )
            assert denied.status == 401
            missing = await http_request(
                c.openai, "POST", "/v1/chat/completions", chat_body("x", model="nope"),
                token=CALLER_TOKEN,
            )  # fmt: skip
            assert missing.status == 404

            request_ids = [r.headers.get("x-request-id") for r in (ok, streamed, denied, missing)]
            c.edge.proc.send_signal(signal.SIGTERM)
            assert await c.edge.wait_exit() == 0
            # The node loses the edge and keeps retrying; stop it too.
            c.node.proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(10):
                await c.node.wait_exit()

        lines = c.edge.events("request")
        assert len(lines) == 4, c.edge.output
        for line in lines:
            for key in (
                "request_id", "principal", "group", "provider", "mode", "status",
                "duration_ms", "input_tokens", "output_tokens",
            ):  # fmt: skip
                assert key in line, (key, line)
            float(line["duration_ms"])
        by_status = [(ln["status"], ln["group"]) for ln in lines]
        assert by_status == [
            ("ok", "echo"),
            ("ok", "echo"),
            ("auth_error", "unknown"),
            ("client_error", "unknown"),
        ]
        first = lines[0]
        assert first["principal"] == "opsalice"
        assert first["provider"] == "echo-1"
        assert first["mode"] == "normalized"
        assert first["input_tokens"] == "4"  # ceil(len("one two three") / 4)
        assert first["output_tokens"] == "3"  # three chunks
        assert lines[1]["output_tokens"] == "2"
        # Errors carry x-request-id; it is the log line's request_id.
        for rid, line in zip(request_ids, lines, strict=True):
            if rid is not None:
                assert rid == line["request_id"]
        assert request_ids[2] is not None and request_ids[3] is not None
        if log_format == "json":
            for raw in c.edge.lines + c.node.lines:
                if raw.strip():
                    json.loads(raw)  # every line is one JSON document

        everything = c.edge.output + "\n" + c.node.output
        for secret in (CALLER_TOKEN, NODE_TOKEN, WRONG_TOKEN):
            assert secret not in everything
        assert "Traceback" not in everything


async def test_edge_notifies_systemd_ready_reloading_stopping(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_DGRAM)
    await sock.bind(path)

    async def next_states() -> list[str]:
        return (await sock.recv(4096)).decode().split("\n")

    edge_cfg = tmp_path / "edge.yaml"
    edge_cfg.write_text(edge_yaml())
    with sock, trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            async with run_daemon(nursery, "edge", "edge", edge_cfg, notify_socket=path) as edge:
                ready = await next_states()
                assert "READY=1" in ready
                await edge.wait_event("edge_started")  # READY=1 only once it serves

                edge.proc.send_signal(signal.SIGHUP)
                reloading = await next_states()
                assert "RELOADING=1" in reloading
                assert any(st.startswith("MONOTONIC_USEC=") for st in reloading)
                assert "READY=1" in await next_states()  # never left "reloading"

                edge.proc.send_signal(signal.SIGTERM)
                assert "STOPPING=1" in await next_states()
                assert await edge.wait_exit() == 0
            nursery.cancel_scope.cancel()


# ------------------------------------------------------------ systemd units

UNIT_DIR = ROOT / "scripts" / "systemd"


def _unit(name: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as section -> key -> every value (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in (UNIT_DIR / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key, []).append(value)
    return sections


@pytest.mark.parametrize(
    ("unit", "kind"), [("iopd-edge.service", "edge"), ("iopd-node.service", "node")]
)
def test_units_match_the_cli_and_the_drain(unit: str, kind: str) -> None:
    from iopd.cli import build_parser
    from iopd.config.schema import EdgeSection, NodeSection
    from iopd.edge.run import CUT_GRACE

    svc = _unit(unit)["Service"]
    (exec_start,) = svc["ExecStart"]
    argv = exec_start.split()
    assert argv[0].endswith("/bin/iopd")
    args = build_parser().parse_args(argv[1:])  # the real CLI accepts the unit's command
    assert args.command == kind
    assert args.config == f"/etc/iopd/{kind}.yaml"
    assert svc["Type"] == ["notify"]  # iopd.sdnotify sends READY=1
    assert "AF_UNIX" in svc["RestrictAddressFamilies"][0].split()  # the notify socket
    assert svc["KillSignal"] == ["SIGTERM"]
    assert svc["Restart"] == ["on-failure"]
    assert svc["User"] == ["iopd"]
    assert svc["EnvironmentFile"] == [f"-/etc/iopd/{kind}.env"]
    assert (UNIT_DIR / f"{kind}.env.example").is_file()
    default_drain = (
        EdgeSection(id="e", node_listen="127.0.0.1:1", admin_listen="127.0.0.1:2").drain_timeout
        if kind == "edge"
        else NodeSection(id="n", edge="127.0.0.1:1", token="t").drain_timeout
    )
    assert float(svc["TimeoutStopSec"][0]) > default_drain + CUT_GRACE
    if kind == "edge":
        assert svc["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    else:
        assert "ExecReload" not in svc  # the node gets its config from the edge
