"""Operations against real daemons: ``python -m iopd edge`` and ``python -m iopd node``
as subprocesses on loopback, driven by signals, as systemd would;
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

import json
import signal
from pathlib import Path

import pytest
import trio

from tests.support.daemons import (
    CALLER_TOKEN,
    GUARD,
    NODE_TOKEN,
    WRONG_TOKEN,
    Response,
    chat_body,
    cluster,
    edge_yaml,
    get_status,
    http_request,
    notify_socket,
    parse_log_line,
    run_daemon,
    sse_payloads,
    stream_until_first_chunk,
    streamed_text,
    wait_until_refused,
)
from tests.support.paths import ROOT

# ------------------------------------------------------------------- tests


async def test_sigterm_lets_an_in_flight_stream_finish_then_exits_0(tmp_path: Path) -> None:
    words = [f"w{i}" for i in range(12)]
    text = " ".join(words)
    with trio.fail_after(GUARD):
        async with cluster(tmp_path, drain_timeout=30, delay_ms=100) as c:
            results: dict[str, Response] = {}
            first = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream_until_first_chunk, c.openai, text, results, first)
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
                nursery.start_soon(stream_until_first_chunk, c.openai, text, results, first)
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
                nursery.start_soon(stream_until_first_chunk, c.openai, text, results, first)
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
                nursery.start_soon(stream_until_first_chunk, c.openai, text, results, first)
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
    edge_cfg = tmp_path / "edge.yaml"
    edge_cfg.write_text(edge_yaml())
    with trio.fail_after(GUARD):
        async with notify_socket(tmp_path) as (path, next_states), trio.open_nursery() as nursery:
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
    from iopd.edge.daemon import CUT_GRACE

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
