"""What an operator reads when a node or a reload goes wrong: one line saying what
is wrong and what to do, asserted exactly, from real ``iopd`` processes.

* ``node.edge`` written as a URL: the start-up refusal names the key and the
  ``host:port`` form (not "an IPv6 address must be in brackets");
* a node started before its edge: connection refused, the address, that the
  edge may not be running yet, and when it retries (not ``OSError``);
* a node pointed at the edge's OpenAI port: the HTTP answer named as such, and
  the key to fix (not a frame length);
* a SIGHUP (``systemctl reload``) that applies nothing: each reason in the log
  with what to do (not only a count).
"""

from __future__ import annotations

import signal
from pathlib import Path

import trio

from tests.support.daemons import (
    NODE_TOKEN,
    Daemon,
    assert_one_line,
    edge_yaml,
    host_port,
    node_yaml,
    notify_socket,
    parse_log_line,
    run_daemon,
    run_iopd,
)
from tests.support.gateway import free_port

GUARD = 30.0


def _node_config(tmp_path: Path, port: int) -> Path:
    path = tmp_path / "node.yaml"
    path.write_text(node_yaml(port, log_format="keyvalue"))
    return path


async def test_a_url_in_node_edge_names_the_key_and_the_form(tmp_path: Path) -> None:
    path = _node_config(tmp_path, 7070)
    text = path.read_text().replace("${IOP_NODE_TOKEN}", NODE_TOKEN)
    path.write_text(text.replace("edge: 127.0.0.1:7070", "edge: http://127.0.0.1:8080"))
    result = await run_iopd("node", "--config", str(path))
    assert_one_line(
        result,
        "node.edge: must be host:port, not a URL (got 'http://127.0.0.1:8080'): write the address "
        "of the edge's edge.node_listen (the wire port, not the OpenAI port), e.g. 127.0.0.1:7070",
    )


async def _event(daemon: Daemon, event: str) -> tuple[str, dict[str, str]]:
    line = await daemon.wait_for(lambda ln: parse_log_line(ln).get("event") == event)
    return line, parse_log_line(line)


async def test_a_node_before_its_edge_says_so_and_retries(tmp_path: Path) -> None:
    port = free_port()
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            async with run_daemon(nursery, "node", "node", _node_config(tmp_path, port)) as node:
                line, fields = await _event(node, "edge_unreachable")
                assert fields["level"] == "warning"
                assert fields["edge"] == f"127.0.0.1:{port}"
                assert fields["reason"] == (
                    f"connection refused by 127.0.0.1:{port}: the edge may not be running yet, "
                    "or this is not its edge.node_listen"
                )
                assert 0 <= float(fields["retry_in_s"]) <= 1  # node.reconnect_max_backoff
                assert "OSError" not in node.output
            nursery.cancel_scope.cancel()


async def test_a_node_dialling_the_openai_port_is_told_it_is_http(tmp_path: Path) -> None:
    edge_cfg = tmp_path / "edge.yaml"
    # A short header timeout: the OpenAI listener answers the node's bytes with a 408 soon.
    edge_cfg.write_text(
        edge_yaml(openai={"header_timeout": 0.5})
    )
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            async with run_daemon(nursery, "edge", "edge", edge_cfg) as edge:
                started = await edge.wait_event("edge_started")
                openai_port = host_port(started["openai"])[1]
                node_cfg = _node_config(tmp_path, openai_port)
                async with run_daemon(nursery, "node", "node", node_cfg) as node:
                    _, fields = await _event(node, "edge_link_lost")
                    assert fields["level"] == "error"
                    assert fields["reason"] == (
                        f"127.0.0.1:{openai_port} answered in HTTP: this is an HTTP server, not "
                        "an iopd wire listener: point node.edge at edge.node_listen"
                    )
                    assert "1213486160" not in node.output
            nursery.cancel_scope.cancel()


async def test_a_failed_sighup_logs_each_reason_with_what_to_do(tmp_path: Path) -> None:
    edge_cfg = tmp_path / "edge.yaml"
    good = edge_yaml()
    edge_cfg.write_text(good)
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            async with run_daemon(nursery, "edge", "edge", edge_cfg) as edge:
                await edge.wait_event("edge_started")
                # Two problems: both are logged, each on its line.
                edge_cfg.write_text(
                    edge_yaml(max_queue=-1, queue_timeout=0)
                )
                edge.proc.send_signal(signal.SIGHUP)
                await edge.wait_for(lambda ln: "queue_timeout" in ln and "sighup_refresh" in ln)
                failed = edge.events("sighup_refresh")
                assert [f["outcome"] for f in failed] == ["failed", "failed"]
                assert [f["problem"] for f in failed] == [
                    "provider_pool.max_queue: must be >= 0 (got -1)",
                    "provider_pool.queue_timeout: must be > 0 (got 0.0)",
                ]
                assert {f["hint"] for f in failed} == {
                    "nothing was applied: fix the config and reload again "
                    f"(`iopd config check {edge_cfg}` lists every problem)"
                }
                assert {f["level"] for f in failed} == {"error"}

                # A key that needs a restart: named, with the two ways out.
                edge_cfg.write_text(
                    edge_yaml(edge={"node_listen": "127.0.0.1:1"})
                )
                edge.proc.send_signal(signal.SIGHUP)
                line = await edge.wait_for(lambda ln: "event=sighup_refresh outcome=refused" in ln)
                refused = parse_log_line(line)
                assert refused["restart_required"] == "edge.node_listen"
                assert refused["hint"] == (
                    "nothing was applied: these keys change only at a restart; revert them and "
                    "reload to apply the rest, or restart the edge"
                )
            nursery.cancel_scope.cancel()


async def test_systemctl_status_says_the_last_reload_failed(tmp_path: Path) -> None:
    """The unit's status text (``systemctl status``) after a failed reload names the reason."""
    edge_cfg = tmp_path / "edge.yaml"
    good = edge_yaml()
    edge_cfg.write_text(good)
    with trio.fail_after(GUARD):
        async with notify_socket(tmp_path) as (path, next_states), trio.open_nursery() as nursery:
            async with run_daemon(nursery, "edge", "edge", edge_cfg, notify_socket=path) as edge:
                assert "READY=1" in await next_states()
                await edge.wait_event("edge_started")
                edge_cfg.write_text(edge_yaml(max_queue=-1))
                edge.proc.send_signal(signal.SIGHUP)
                assert "RELOADING=1" in await next_states()
                after = await next_states()
                assert "READY=1" in after
                assert (
                    "STATUS=serving the previous config; the last reload failed: "
                    "provider_pool.max_queue: must be >= 0 (got -1)"
                ) in after
                edge_cfg.write_text(good)
                edge.proc.send_signal(signal.SIGHUP)
                assert "RELOADING=1" in await next_states()
                assert "STATUS=serving" in await next_states()  # fixed: the text says so
            nursery.cancel_scope.cancel()
