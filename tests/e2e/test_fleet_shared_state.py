"""Two edges, one node: what the node holds for both, over real sockets.

* Config across edges: the node applies the highest ``edge.config_revision``
  it has received; an edge that pushed a lower one, or another config at the
  same revision, shows ``config_mismatch`` for that node in ``/status`` and
  keeps serving (on the node's config).
* Runtime controls live on the node: a drain made on edge A shows on edge B,
  survives edge B's restart (the node sends them again), is gone after a
  node restart, and the routes answer 409 ``node_disconnected`` while the
  node is away.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from tests.support.configs import HEARTBEAT, TWO_ECHOES, echo_entry, gateway_yaml, node_entry
from tests.support.gateway import (
    EdgeFleet,
    Gateway,
    http_request,
    running_edges,
    wait_until,
)

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "a b c"}]}


def fleet_yaml(edge_id: str, *, revision: int = 0, capacity: int = 3) -> str:
    return gateway_yaml(
        edge_id=edge_id,
        edge_extra=f"{HEARTBEAT}\n  config_revision: {revision}",
        models=TWO_ECHOES,
        nodes=node_entry(
            "node-a",
            echo_entry(category=None, capacity=capacity)
            + echo_entry("echo-2", category=None, capacity=None),
        ),
    )


async def status(gw: Gateway) -> dict[str, Any]:
    doc: dict[str, Any] = (await http_request(gw.handle.admin, "GET", "/status")).json()
    return doc


async def node_row(gw: Gateway) -> dict[str, Any]:
    row: dict[str, Any] = (await status(gw))["nodes"][0]
    return row


async def provider_row(gw: Gateway, pid: str) -> dict[str, Any]:
    rows = {p["id"]: p for p in (await status(gw))["providers"]}
    return rows[pid]


def node_registry_capacity(fleet: EdgeFleet) -> int:
    registry = fleet.node_handles["node-a"].executor.registry
    capacity: int = registry.get("echo-1").spec.capacity
    return capacity


async def test_the_node_applies_the_highest_revision_and_flags_the_lower_edge(
    tmp_path: Path,
) -> None:
    yamls = [fleet_yaml("edge-1", revision=1), fleet_yaml("edge-2", revision=2, capacity=6)]
    with trio.fail_after(30):
        async with running_edges(yamls, nodes=["node-a"]) as fleet:
            one, two = fleet.edges
            await wait_until(lambda: node_registry_capacity(fleet) == 6)
            await wait_until(lambda: one.runtime.config_mismatch("node-a"))
            row = await node_row(one)
            assert (row["config_revision"], row["config_mismatch"]) == (2, True)
            assert (await status(one))["config_revision"] == 1
            row = await node_row(two)
            assert (row["config_revision"], row["config_mismatch"]) == (2, False)
            # The flagged edge keeps serving, on the node's config.
            r = await http_request(one.host_port, "POST", "/v1/chat/completions", body=CHAT)
            assert r.status == 200, r.body

            # Rolled: edge-1 gets edge-2's config and revision; its refresh pushes it.
            path = tmp_path / "edge-1.yaml"
            path.write_text(fleet_yaml("edge-1", revision=2, capacity=6))
            one.runtime.config_path = str(path)
            report = await one.runtime.refresh("apply")
            assert report["applied"] and report["changed_nodes"] == ["node-a"], report
            await wait_until(lambda: not one.runtime.config_mismatch("node-a"))
            assert (await node_row(one))["config_mismatch"] is False
            assert not two.runtime.config_mismatch("node-a")

            # A higher revision from edge-1 moves the node, and edge-2 is now behind.
            path.write_text(fleet_yaml("edge-1", revision=3, capacity=2))
            assert (await one.runtime.refresh("apply"))["applied"]
            await wait_until(lambda: node_registry_capacity(fleet) == 2)
            await wait_until(lambda: two.runtime.config_mismatch("node-a"))
            assert (await node_row(two))["config_revision"] == 3


async def test_another_config_at_the_same_revision_flags_that_edge_only() -> None:
    yamls = [fleet_yaml("edge-1"), fleet_yaml("edge-2", capacity=5)]
    with trio.fail_after(30):
        async with running_edges(yamls, nodes=["node-a"]) as fleet:
            def flags() -> list[bool]:
                return [gw.runtime.config_mismatch("node-a") for gw in fleet.edges]

            # Whichever edge's push came first is in force: the other is flagged.
            await wait_until(lambda: sum(flags()) == 1)
            flagged = flags()
            assert sorted(flagged) == [False, True], flagged
            in_force = fleet.edges[flagged.index(False)]
            expected = 3 if in_force is fleet.edges[0] else 5
            assert node_registry_capacity(fleet) == expected
            for gw in fleet.edges:
                r = await http_request(gw.host_port, "POST", "/v1/chat/completions", body=CHAT)
                assert r.status == 200, r.body


async def test_controls_live_on_the_node_for_every_edge() -> None:
    yamls = [fleet_yaml("edge-1"), fleet_yaml("edge-2")]
    with trio.fail_after(30):
        async with running_edges(yamls, nodes=["node-a"]) as fleet:
            one, two = fleet.edges
            r = await http_request(
                one.handle.admin, "POST", "/providers/echo-1/state", body={"state": "draining"}
            )
            assert r.status == 200, r.body
            r = await http_request(
                one.handle.admin, "POST", "/providers/echo-2/override", body={"capacity": 7}
            )
            assert r.status == 200, r.body
            # Edge B routes by them and shows them.
            await wait_until(lambda: two.runtime.pool.control("echo-1").state == "draining")
            row = await provider_row(two, "echo-1")
            assert row["state"] == "drained"
            await wait_until(lambda: two.runtime.pool.control("echo-2").capacity == 7)
            assert (await provider_row(two, "echo-2"))["capacity"] == 7

            # Last write wins, whichever edge wrote it.
            r = await http_request(two.handle.admin, "POST", "/providers/echo-2/reset")
            assert r.status == 200, r.body
            await wait_until(lambda: one.runtime.pool.control("echo-2").capacity is None)

            # Edge B restarted: it starts with no controls, the node sends them again.
            two = await fleet.restart_edge(1, yamls[1])
            await wait_until(lambda: two.runtime.hub.session("node-a") is not None)
            assert two.runtime.pool.control("echo-1").state == "draining"
            assert (await provider_row(two, "echo-1"))["state"] == "drained"

            # The node away: nothing can be set, on any edge.
            fleet.node_scopes.pop("node-a").cancel()
            for gw in (one, two):
                await wait_until(lambda gw=gw: gw.runtime.hub.session("node-a") is None)
                r = await http_request(
                    gw.handle.admin, "POST", "/providers/echo-1/reset", body={}
                )
                assert r.status == 409, r.body
                assert r.json()["error"]["code"] == "node_disconnected"
                r = await http_request(gw.handle.admin, "POST", "/nodes/node-a/drain")
                assert r.status == 409, r.body

            # A node restart starts from no controls: every edge clears them.
            await fleet.start_node("node-a")
            for gw in (one, two):
                await wait_until(lambda gw=gw: gw.runtime.pool.control("echo-1").state == "active")
