"""A restart that refuses nothing: ``SIGUSR2`` (or ``iopd restart``) hands a real edge's sockets to a new
``iopd edge`` while a load loop and open streams run; the node follows it.

Counted, not sampled: every request of the loop is answered 200 (none refused,
reset or failed), every stream that was open across the hand-over ends with
its whole text and ``[DONE]``, the old process exits by itself, and the node is
served by the new one (same ports, a new ``connected_since``).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import trio

from tests.support.daemons import (
    CALLER_TOKEN,
    Cluster,
    Daemon,
    Response,
    chat_body,
    cluster,
    get_status,
    http_request,
    kill_successors,
    parse_log_line,
    sse_payloads,
    stream_until_first_chunk,
    streamed_text,
)
from tests.support.gateway import wait_until

LOOP_TASKS = 4
STREAMS = 6
STREAM_WORDS = 40  # at 100 ms a word: a 4 s stream, across the hand-over


async def _load_loop(c: Cluster, stop: trio.Event, outcomes: list[str]) -> None:
    """Requests back to back, each on a new connection, until ``stop``."""
    while not stop.is_set():
        try:
            resp = await http_request(
                c.openai, "POST", "/v1/chat/completions", chat_body("ping"), token=CALLER_TOKEN
            )
            outcomes.append(str(resp.status))
        except OSError as exc:  # refused or reset: what this test says never happens
            outcomes.append(f"error:{exc!r}")


@pytest.mark.parametrize("how", ["signal", "cli"])
async def test_a_restart_hands_over_with_nothing_refused(tmp_path: Path, how: str) -> None:
    edges: list[Daemon] = []  # whose successors to kill, however the test ends
    try:
        with trio.fail_after(90):
            async with cluster(tmp_path, capacity=32, delay_ms=100) as c:
                edges.append(c.edge)
                before = await get_status(c)
                outcomes: list[str] = []
                streams: dict[str, Response] = {}
                stop = trio.Event()
                text = " ".join(f"w{i}" for i in range(STREAM_WORDS))
                async with trio.open_nursery() as nursery:
                    for _ in range(LOOP_TASKS):
                        nursery.start_soon(_load_loop, c, stop, outcomes)
                    started = []
                    for i in range(STREAMS):
                        event = trio.Event()
                        started.append(event)
                        nursery.start_soon(
                            stream_until_first_chunk, c.openai, text, streams, event, f"s{i}"
                        )
                    for event in started:
                        await event.wait()
                    served_before = len(outcomes)
                    if how == "signal":
                        c.edge.proc.send_signal(signal.SIGUSR2)
                    else:  # iopd restart: answered once the successor took over
                        host, port = c.admin
                        done_cli = await trio.run_process(
                            [sys.executable, "-m", "iopd", "restart"],
                            env=dict(os.environ, IOP_ADMIN_URL=f"http://{host}:{port}"),
                            capture_stdout=True,
                            capture_stderr=True,
                            check=False,
                        )
                        assert done_cli.returncode == 0, done_cli.stderr
                        assert b"restarted: the new edge process (pid " in done_cli.stdout
                    await c.edge.wait_event("handover_done")
                    assert await c.edge.wait_exit() == 0  # the old one drained and left
                    # The new process serves the same ports, and the node is back on it.
                    await c.edge.wait_for(
                        lambda ln: (
                            parse_log_line(ln).get("event") == "node_connected"
                            and len(c.edge.events("node_connected")) >= 2
                        )
                    )
                    mark = len(outcomes)
                    # The loop goes on against the new one.
                    await wait_until(lambda: len(outcomes) >= mark + 20, interval=0.05)
                    stop.set()
                after = await get_status(c)
    finally:
        for edge in edges:
            kill_successors(edge)

    failures = [o for o in outcomes if o != "200"]
    assert failures == [], failures
    assert len(outcomes) > served_before + 20
    assert len(streams) == STREAMS
    for resp in streams.values():
        assert resp.status == 200 and not resp.truncated
        payloads = sse_payloads(resp.body)
        assert payloads[-1] == "[DONE]"
        assert streamed_text(payloads).split() == text.split()
    node_before = before["nodes"][0] if isinstance(before["nodes"], list) else before["nodes"]
    node_after = after["nodes"][0] if isinstance(after["nodes"], list) else after["nodes"]
    assert node_after != node_before  # a new session on the new process
    assert len(c.edge.events("edge_started")) == 2
    told = c.edge.events("handover_wire")
    assert told and told[0]["nodes_told"] == "1"
    assert c.edge.events("drain_started")[-1]["handover"] == "yes"
