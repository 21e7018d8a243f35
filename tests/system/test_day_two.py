"""Day two under load, through real daemons and the operator's own commands.

A load loop of about 20 requests a second and 20 streams held open run while
an operator, one step after the other, adds a caller's token, adds a node with
its provider, removes a token and restarts the edge — each with ``iopd
refresh`` / ``iopd restart --config edge.yaml`` (the admin URL is never typed:
the CLI reads it from the config).  Counted, not sampled: every request of the
loop is answered 200, every open stream ends whole with ``[DONE]``, the
removed token is refused from the next request on, and after the restart
both nodes are served by the new edge process.
"""

from __future__ import annotations

import json
from pathlib import Path

import trio

from tests.support.cli import iopd as run_iopd_command
from tests.support.daemons import (
    CALLER_TOKEN,
    Daemon,
    Response,
    chat_as,
    chat_body,
    fleet_yaml,
    host_port,
    http_request,
    kill_successors,
    node_yaml,
    parse_log_line,
    run_daemon,
    sse_payloads,
    stream_until_first_chunk,
    streamed_text,
)
from tests.support.gateway import free_port, wait_until

ADDED_TOKEN = "iop_canary_added_3f8a1c6e20"
LEAVING_TOKEN = "iop_canary_leaving_b7d2e94c51"
RATE = 20.0  # requests a second, across the loop's workers
WORKERS = 4
OPEN_STREAMS = 20
STREAM_WORDS = 120  # at 100 ms a word: 12 s, across every step below
MAX_REQUESTS = 4000  # the loop's bound, whatever the timing


def day_two_yaml(admin_port: int, *, tokens: list[tuple[str, str]], second_node: bool) -> str:
    """The edge config at each step: the admin listener on a fixed port (the
    CLI finds it in the file), providers slow enough to keep streams open."""
    return fleet_yaml(
        tokens=tokens,
        second_node=second_node,
        edge_id="day-two",
        admin_listen=f"127.0.0.1:{admin_port}",
        capacity=32,
        delay_ms=100,
        queue_timeout=20,
    )


STAYING = (CALLER_TOKEN, "stays")
ADDED = (ADDED_TOKEN, "added")
LEAVING = (LEAVING_TOKEN, "leaving")


class PacedLoad:
    """``WORKERS`` callers sending ``RATE`` requests a second in all, paced, each
    on a new connection, with the token that stays."""

    def __init__(self, openai: tuple[str, int]) -> None:
        self.openai = openai
        self.answered: list[int] = []
        self.failures: list[str] = []
        self.stop = trio.Event()
        self.running = 0
        self.done = trio.Event()

    async def worker(self, n: int) -> None:
        self.running += 1
        try:
            await self._loop(n)
        finally:
            self.running -= 1
            if not self.running:
                self.done.set()

    async def _loop(self, n: int) -> None:
        period = WORKERS / RATE
        next_at = trio.current_time() + n * period / WORKERS
        while not self.stop.is_set() and len(self.answered) < MAX_REQUESTS:
            await trio.sleep_until(next_at)
            next_at += period
            try:
                resp = await http_request(
                    self.openai,
                    "POST",
                    "/v1/chat/completions",
                    chat_body("ping"),
                    token=CALLER_TOKEN,
                )
            except OSError as exc:  # refused or reset
                self.failures.append(f"error {exc!r}")
                continue
            self.answered.append(resp.status)
            if resp.status != 200 or b"ping" not in resp.body:
                self.failures.append(f"{resp.status} {resp.body[:200]!r}")

    async def served(self, count: int) -> None:
        target = len(self.answered) + count
        await wait_until(lambda: len(self.answered) >= target, interval=0.02)


async def iopd(*args: str) -> str:
    """Run ``python -m iopd ARGS`` as the operator would (no admin URL in the
    environment); its stdout, asserting exit 0."""
    code, out, err = await run_iopd_command(*args)
    assert code == 0, (args, out, err)
    return out


async def test_day_two_changes_and_a_restart_fail_no_request_and_drop_no_stream(
    tmp_path: Path,
) -> None:
    admin_port = free_port()
    edge_cfg = tmp_path / "edge.yaml"
    tokens = [STAYING, LEAVING]
    edge_cfg.write_text(day_two_yaml(admin_port, tokens=tokens, second_node=False))
    edges: list[Daemon] = []  # whose successors to kill, however the test ends
    try:
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                async with run_daemon(nursery, "edge", "edge", edge_cfg) as edge:
                    edges.append(edge)
                    started = await edge.wait_event("edge_started")
                    wire, openai = host_port(started["wire"]), host_port(started["openai"])
                    (tmp_path / "node.yaml").write_text(node_yaml(wire[1], log_format="keyvalue"))
                    second = node_yaml(wire[1], node_id="node-2", log_format="keyvalue")
                    (tmp_path / "node2.yaml").write_text(second)
                    async with run_daemon(nursery, "node", "node", tmp_path / "node.yaml"):
                        await edge.wait_event("node_connected")
                        load = PacedLoad(openai)
                        streams: dict[str, Response] = {}
                        text = " ".join(f"w{i}" for i in range(STREAM_WORDS))
                        async with trio.open_nursery() as running:
                            for n in range(WORKERS):
                                running.start_soon(load.worker, n)
                            firsts = []
                            for i in range(OPEN_STREAMS):
                                first = trio.Event()
                                firsts.append(first)
                                running.start_soon(
                                    stream_until_first_chunk, openai, text, streams, first, f"s{i}"
                                )
                            for first in firsts:
                                await first.wait()
                            await load.served(10)

                            # 1. A caller's token added.
                            tokens = [STAYING, LEAVING, ADDED]
                            edge_cfg.write_text(
                                day_two_yaml(admin_port, tokens=tokens, second_node=False)
                            )
                            await iopd("refresh", "--config", str(edge_cfg))
                            assert await chat_as(openai, ADDED_TOKEN) == 200
                            await load.served(10)

                            # 2. A node with its provider added (a third process dials in).
                            edge_cfg.write_text(
                                day_two_yaml(admin_port, tokens=tokens, second_node=True)
                            )
                            await iopd("refresh", "--config", str(edge_cfg))
                            async with run_daemon(
                                nursery, "node-2", "node", tmp_path / "node2.yaml"
                            ):
                                await edge.wait_for(
                                    lambda ln: (
                                        parse_log_line(ln).get("event") == "request"
                                        and parse_log_line(ln).get("provider") == "echo-2"
                                    )
                                )
                                await load.served(10)

                                # 3. A token removed: refused from the next request on.
                                tokens = [STAYING, ADDED]
                                edge_cfg.write_text(
                                    day_two_yaml(admin_port, tokens=tokens, second_node=True)
                                )
                                await iopd("refresh", "--config", str(edge_cfg))
                                assert await chat_as(openai, LEAVING_TOKEN) == 401
                                await load.served(10)

                                # 4. The edge restarted: a new process takes the sockets.
                                said = await iopd("restart", "--config", str(edge_cfg))
                                assert said.startswith("restarted: the new edge process (pid ")
                                assert await edge.wait_exit() == 0  # the old one drained, left
                                await wait_until(
                                    lambda: len(edge.events("node_connected")) >= 4, interval=0.05
                                )
                                await load.served(20)
                                status = json.loads(
                                    (
                                        await http_request(
                                            ("127.0.0.1", admin_port), "GET", "/status"
                                        )
                                    ).body
                                )
                                load.stop.set()
                                await load.done.wait()  # before node-2 stops
                    nursery.cancel_scope.cancel()
    finally:
        for started in edges:
            kill_successors(started)

    assert load.failures == [], load.failures[:5]
    assert set(load.answered) == {200} and len(load.answered) >= 60
    assert len(streams) == OPEN_STREAMS
    for resp in streams.values():
        assert resp.status == 200 and not resp.truncated
        payloads = sse_payloads(resp.body)
        assert payloads[-1] == "[DONE]"
        assert streamed_text(payloads).split() == text.split()
    assert sorted(n["id"] for n in status["nodes"] if n["connected"]) == ["node-2", "ops-node"]
    assert len(edge.events("edge_started")) == 2
