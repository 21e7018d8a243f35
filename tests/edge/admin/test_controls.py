"""The runtime-control routes of the admin API, through a running edge.

Routes stay thin (``iopd.edge.admin``); what they answer, and that a drain
lets a request in flight finish without an error, is checked here over HTTP.
The validation cases are in ``tests/edge/test_controls.py``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import trio

from tests.support.admin import raw_admin, two_node_yaml
from tests.support.gateway import http_request, running_gateway, token_hash, wait_until

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "a b c"}]}


def provider_rows(doc: dict[str, object]) -> dict[str, dict[str, object]]:
    return {p["id"]: p for p in doc["providers"]}  # type: ignore[attr-defined, index]


async def test_controls_answer_the_new_view_and_show_in_status() -> None:
    with trio.fail_after(30):
        async with running_gateway(two_node_yaml(), nodes=["node-a"]) as gw:
            adm = gw.handle.admin
            r = await http_request(adm, "POST", "/providers/echo-1/state", body={"state": "disabled"})
            assert r.status == 200, r.body
            assert r.json() == {
                "id": "echo-1",
                "node_id": "node-a",
                "state": "disabled",
                "capacity": 3,
                "priority": 0,
                "override": {"capacity": None, "priority": None},
                "in_flight": 0,
            }
            # node-b is away: it holds echo-2's controls, so none can be set now.
            r = await http_request(
                adm, "POST", "/providers/echo-2/override", body={"capacity": 5, "priority": 2}
            )
            assert r.status == 409, r.body
            assert r.json()["error"]["code"] == "node_disconnected"
            r = await http_request(
                adm, "POST", "/providers/echo-off/override", body={"capacity": 5, "priority": 2}
            )
            assert r.status == 200 and r.json()["capacity"] == 5
            doc = (await http_request(adm, "GET", "/status")).json()
            rows = provider_rows(doc)
            assert (rows["echo-1"]["state"], rows["echo-1"]["enabled"]) == ("disabled", True)
            assert rows["echo-off"]["capacity"] == 5 and rows["echo-off"]["priority"] == 2
            assert rows["echo-off"]["override"] == {"capacity": 5, "priority": 2}
            assert rows["echo-off"]["state"] == "active"  # the config's enabled is apart
            assert rows["echo-2"]["override"] == {"capacity": None, "priority": None}

            # echo-1 is the connected node's only candidate: new requests get a 502.
            r = await http_request(gw.host_port, "POST", "/v1/chat/completions", body=CHAT)
            assert r.status == 502, r.body
            assert r.json()["error"]["message"] == (
                "model group 'echo' has no available provider: "
                "echo-1 disabled, echo-2 node node-b disconnected"
            )
            r = await http_request(adm, "POST", "/providers/echo-1/reset")  # no body is fine
            assert r.status == 200 and r.json()["state"] == "active"
            r = await http_request(gw.host_port, "POST", "/v1/chat/completions", body=CHAT)
            assert r.status == 200

            r = await http_request(adm, "POST", "/nodes/node-a/drain", body={})
            assert r.status == 200
            assert [(p["id"], p["state"]) for p in r.json()["providers"]] == [
                ("echo-1", "drained"),
                ("echo-off", "drained"),
            ]
            metrics = (await http_request(adm, "GET", "/metrics")).body.decode()
            for action, n in [("disable", 1), ("override", 1), ("reset", 1), ("node_drain", 1)]:
                line = f'iop_admin_actions_total{{action="{action}",edge_id="edge-admin"}} {n}.0'
                assert line in metrics


async def test_a_request_while_its_groups_providers_are_drained_gets_503_provider_drained() -> None:
    with trio.fail_after(30):
        async with running_gateway(two_node_yaml(), nodes=["node-a", "node-b"]) as gw:
            adm = gw.handle.admin
            for pid in ("echo-1", "echo-2"):
                r = await http_request(adm, "POST", f"/providers/{pid}/state", body={"state": "draining"})
                assert r.status == 200, r.body
            r = await http_request(gw.host_port, "POST", "/v1/chat/completions", body=CHAT)
            assert r.status == 503, r.body
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("server_error", "provider_drained")
            assert error["message"] == (
                "model group 'echo' is drained: every provider of it is drained by an operator "
                "(echo-1 drained, echo-2 drained); retry later, or `iopd provider enable ID`"
            )
            await http_request(adm, "POST", "/providers/echo-2/state", body={"state": "active"})
            r = await http_request(gw.host_port, "POST", "/v1/chat/completions", body=CHAT)
            assert r.status == 200, r.body


async def test_control_route_errors_are_envelopes() -> None:
    with trio.fail_after(30):
        async with running_gateway(two_node_yaml(), nodes=[]) as gw:
            adm = gw.handle.admin
            cases = [
                ("POST", "/providers/nope/state", {"state": "disabled"}, 404, "provider_id"),
                ("POST", "/nodes/nope/drain", None, 404, "node_id"),
                ("POST", "/providers/echo-1/state", {"state": "off"}, 400, "state"),
                ("POST", "/providers/echo-1/override", {"capacity": -1}, 400, "capacity"),
                ("GET", "/providers/echo-1/state", None, 405, None),
                ("POST", "/providers/echo-1/pause", None, 404, None),
                ("POST", "/providers/echo-1/state/x", None, 404, None),
            ]
            for method, path, body, status, param in cases:
                r = await http_request(adm, method, path, body=body)
                assert r.status == status, (path, r.body)
                assert r.json()["error"]["param"] == param, path
            body = b'{"state": "disabled"}'
            head = "POST /providers/echo-1/state HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            for ctype, status in [
                ("text/plain", 415),
                ("application/x-www-form-urlencoded", 415),  # a browser form's
                (None, 415),
                # past the media-type check: no node is connected to hold it
                ("application/json; charset=utf-8", 409),
            ]:
                line = f"content-type: {ctype}\r\n" if ctype else ""
                got, doc = await raw_admin(
                    adm, head + line + f"content-length: {len(body)}", body=body
                )
                assert got == status, (ctype, doc)
                if status == 415:
                    assert doc is not None
                    assert doc["error"]["code"] == "unsupported_media_type"  # type: ignore[index]


async def test_drain_lets_the_request_in_flight_finish_then_shows_drained() -> None:
    text = two_node_yaml().replace(
        "        capacity: 3\n", "        capacity: 3\n        delay_ms: 300\n"
    )
    with trio.fail_after(30):
        async with running_gateway(text, nodes=["node-a"]) as gw:
            adm = gw.handle.admin
            answers: list[int] = []

            async def call() -> None:
                r = await http_request(gw.host_port, "POST", "/v1/chat/completions", body=CHAT)
                answers.append(r.status)

            async with trio.open_nursery() as n:
                n.start_soon(call)
                await wait_until(lambda: gw.runtime.pool.provider_loads()["echo-1"].in_flight == 1)
                r = await http_request(
                    adm, "POST", "/providers/echo-1/state", body={"state": "draining"}
                )
                assert (r.json()["state"], r.json()["in_flight"]) == ("draining", 1)
            assert answers == [200]  # the caller saw no error
            rows = provider_rows((await http_request(adm, "GET", "/status")).json())
            assert (rows["echo-1"]["state"], rows["echo-1"]["in_flight"]) == ("drained", 0)


async def test_controls_survive_a_refresh(tmp_path: Path) -> None:
    path = tmp_path / "edge.yaml"
    path.write_text(two_node_yaml())
    with trio.fail_after(30):
        nodes = ["node-a", "node-b"]  # the nodes hold the controls
        async with running_gateway(path.read_text(), nodes=nodes, config_path=str(path)) as gw:
            adm = gw.handle.admin
            post = functools.partial(http_request, adm, "POST")
            assert (await post("/providers/echo-1/override", body={"capacity": 9})).status == 200
            assert (await post("/providers/echo-2/state", body={"state": "draining"})).status == 200
            # The file changes both providers' capacity (echo-1 3 -> 4, echo-2 2 -> 1).
            path.write_text(
                two_node_yaml()
                .replace("        capacity: 3\n", "        capacity: 4\n")
                .replace("        capacity: 2\n", "        capacity: 1\n")
            )
            r = await post("/refresh", body={"mode": "apply"})
            assert r.json()["applied"] is True, r.json()
            rows = provider_rows((await http_request(adm, "GET", "/status")).json())
            assert rows["echo-1"]["capacity"] == 9  # the override still wins over the new 4
            assert rows["echo-1"]["override"] == {"capacity": 9, "priority": None}
            assert (rows["echo-2"]["state"], rows["echo-2"]["capacity"]) == ("drained", 1)
            r = await post("/providers/echo-1/reset")
            assert r.json()["capacity"] == 4


async def test_control_routes_want_the_admin_token(tmp_path: Path) -> None:
    text = two_node_yaml().replace(
        "  admin_listen: 127.0.0.1:0\n",
        f"  admin_listen: 127.0.0.1:0\n  admin_token_hash_sha256: {token_hash('adm-tok')}\n",
    )
    with trio.fail_after(30):
        async with running_gateway(text, nodes=["node-a"]) as gw:
            adm = gw.handle.admin
            body = {"state": "disabled"}
            r = await http_request(adm, "POST", "/providers/echo-1/state", body=body)
            assert r.status == 401
            assert gw.runtime.pool.control("echo-1").state == "active"
            good = [("authorization", "Bearer adm-tok")]
            r = await http_request(adm, "POST", "/providers/echo-1/state", body=body, headers=good)
            assert r.status == 200
