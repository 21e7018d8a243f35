"""Callers' tokens and nodes change by refresh under load, through real daemons.

An edge and a node subprocess serve a steady, bounded load loop (plain and
streamed requests with a token that stays) while refreshes, one after the
other, add a token, add a second node with its provider (a third process),
remove a token and remove that node again.  Every request of the loop must
succeed: zero failed; the removed token is refused from the next request on;
the removed node's requests in flight finish before its session ends.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import trio

from tests.support.daemons import (
    CALLER_TOKEN,
    GUARD,
    chat_as,
    chat_body,
    fleet_yaml,
    host_port,
    http_request,
    node_yaml,
    parse_log_line,
    run_daemon,
    sse_payloads,
)

ADDED_TOKEN = "iop_canary_added_51c7e2a9d4"
LEAVING_TOKEN = "iop_canary_leaving_8e6b0f3c2a"
WORKERS = 4
MAX_REQUESTS = 5000  # the loop's bound, whatever the timing
TEXT = "one two three four five six seven eight"  # 8 chunks, 20 ms apart


def live_yaml(*, tokens: list[tuple[str, str]], second_node: bool) -> str:
    """The edge config: ``ops-node`` (echo-1) and, with ``second_node``, ``node-2`` (echo-2)."""
    return fleet_yaml(tokens=tokens, second_node=second_node)


STAYING = (CALLER_TOKEN, "stays")
ADDED = (ADDED_TOKEN, "added")
LEAVING = (LEAVING_TOKEN, "leaving")


class Load:
    """``WORKERS`` callers, each one request after the other with the token that stays."""

    def __init__(self, openai: tuple[str, int]) -> None:
        self.openai = openai
        self.statuses: Counter[int] = Counter()
        self.failures: list[str] = []
        self.stop = trio.Event()
        self.sent = 0

    async def worker(self, n: int) -> None:
        while not self.stop.is_set() and self.sent < MAX_REQUESTS:
            self.sent += 1
            stream = (self.sent + n) % 2 == 0
            resp = await http_request(
                self.openai,
                "POST",
                "/v1/chat/completions",
                chat_body(TEXT, stream=stream),
                token=CALLER_TOKEN,
            )
            self.statuses[resp.status] += 1
            complete = (
                sse_payloads(resp.body)[-1:] == ["[DONE]"] if stream else TEXT.encode() in resp.body
            )
            if resp.status != 200 or resp.truncated or not complete:
                self.failures.append(f"{resp.status} {resp.body[:200]!r}")

    async def served(self, count: int) -> None:
        """Wait until ``count`` more requests were answered."""
        target = sum(self.statuses.values()) + count
        while sum(self.statuses.values()) < target:  # noqa: ASYNC110 - counted by the workers
            await trio.sleep(0.01)


async def apply(admin: tuple[str, int], config: Path, text: str) -> dict[str, object]:
    """Write ``text`` to the edge's config and apply it; assert it applied in full."""
    await trio.Path(config).write_text(text)
    resp = await http_request(admin, "POST", "/refresh", {"mode": "apply"})
    assert resp.status == 200, resp.body
    doc = json.loads(resp.body)
    assert doc["applied"] is True and doc["restart_required"] == [] and doc["errors"] == [], doc
    assert isinstance(doc, dict)
    return doc


FINAL = live_yaml(tokens=[STAYING, ADDED], second_node=False)


async def busy(admin: tuple[str, int], provider: str) -> None:
    """Wait until ``provider`` runs a request (``/status``)."""
    while True:
        status = json.loads((await http_request(admin, "GET", "/status")).body)
        if any(p["id"] == provider and p["in_flight"] for p in status["providers"]):
            return
        await trio.sleep(0.005)


async def test_tokens_and_a_node_added_and_removed_under_load_fail_no_request(
    tmp_path: Path,
) -> None:
    edge_cfg = tmp_path / "edge.yaml"
    edge_cfg.write_text(live_yaml(tokens=[STAYING, LEAVING], second_node=False))
    with trio.fail_after(GUARD * 2):
        async with trio.open_nursery() as nursery:
            async with run_daemon(nursery, "edge", "edge", edge_cfg) as edge:
                started = await edge.wait_event("edge_started")
                wire, openai = host_port(started["wire"]), host_port(started["openai"])
                admin = host_port(started["admin"])
                (tmp_path / "node.yaml").write_text(node_yaml(wire[1], log_format="keyvalue"))
                second = node_yaml(wire[1], node_id="node-2", log_format="keyvalue")
                (tmp_path / "node2.yaml").write_text(second)
                async with run_daemon(nursery, "node", "node", tmp_path / "node.yaml"):
                    await edge.wait_event("node_connected")
                    load = Load(openai)
                    async with trio.open_nursery() as workers:
                        for n in range(WORKERS):
                            workers.start_soon(load.worker, n)
                        await load.served(20)

                        # A token added: accepted at once.
                        assert await chat_as(openai, ADDED_TOKEN) == 401
                        three = [STAYING, LEAVING, ADDED]
                        await apply(admin, edge_cfg, live_yaml(tokens=three, second_node=False))
                        assert await chat_as(openai, ADDED_TOKEN) == 200
                        await load.served(20)

                        # A node with its provider added: it dials in and takes requests.
                        doc = await apply(
                            admin, edge_cfg, live_yaml(tokens=three, second_node=True)
                        )
                        assert doc["changed_nodes"] == ["node-2"]
                        async with run_daemon(nursery, "node-2", "node", tmp_path / "node2.yaml"):
                            await edge.wait_for(
                                lambda ln: (
                                    parse_log_line(ln).get("event") == "node_connected"
                                    and parse_log_line(ln).get("node") == "node-2"
                                )
                            )
                            await edge.wait_for(
                                lambda ln: (
                                    parse_log_line(ln).get("event") == "request"
                                    and parse_log_line(ln).get("provider") == "echo-2"
                                )
                            )
                            await load.served(20)

                            # A token removed: refused from the next request on.
                            assert await chat_as(openai, LEAVING_TOKEN) == 200
                            two = live_yaml(tokens=[STAYING, ADDED], second_node=True)
                            await apply(admin, edge_cfg, two)
                            assert await chat_as(openai, LEAVING_TOKEN) == 401
                            await load.served(20)

                            # The node removed while it runs requests: they finish,
                            # then its session ends.
                            await busy(admin, "echo-2")
                            await apply(admin, edge_cfg, FINAL)
                            await edge.wait_event("node_retired")
                            gone, retired = (
                                edge.output.index(f"event={e} node=node-2")
                                for e in ("node_disconnected", "node_retired")
                            )
                            finished_there = [
                                ln
                                for ln in edge.output[gone:retired].splitlines()
                                if "event=request " in ln and "provider=echo-2" in ln
                            ]
                            assert finished_there, "a request in flight on node-2 finished"
                            assert all(" status=ok" in ln for ln in finished_there), finished_there
                            await load.served(20)
                        load.stop.set()

                    assert load.failures == [], load.failures[:5]
                    assert set(load.statuses) == {200} and sum(load.statuses.values()) >= 100
                    status = json.loads((await http_request(admin, "GET", "/status")).body)
                    assert [n["id"] for n in status["nodes"]] == ["ops-node"]
                    assert [p["id"] for p in status["providers"]] == ["echo-1"]
                    assert all(p["in_flight"] == 0 for p in status["providers"])
            nursery.cancel_scope.cancel()
