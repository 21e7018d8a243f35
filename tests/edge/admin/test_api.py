"""The loopback admin API: peer filter, /status shape, route errors.

The peer filter is tested as a function (every address family a socket can
report) and through a running edge whose filter is forced to refuse, so the
wiring of ``is_loopback_peer`` into the admin listener is covered too.
/status is compared key by key with the list in docs/operations.md ("7. Check")
so a renamed or dropped field fails here before it breaks ``iopd status`` or an operator's script.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import trio

from iopd.cli import main
from iopd.config.load import ConfigError, parse_edge_config
from iopd.edge import admin
from tests.support.admin import ADMIN_TOKEN, raw_admin, token_yaml, two_node_yaml
from tests.support.edges import REPORT_KEYS
from tests.support.gateway import http_request, running_gateway, wait_until

STATUS_KEYS = {"edge_id", "nodes", "providers", "queue"}
#: Beyond the core keys: the runtime's snapshot version, bumped by every applied refresh.
STATUS_EXTRA_KEYS = {
    "config_version",
    "config_revision",
    "models",
    "principals",
    "limits_backend",
    "routing",
}
NODE_KEYS = {
    "id",
    "alias",
    "connected",
    "connected_since",
    "providers",
    "config_revision",
    "config_mismatch",
}
PROVIDER_KEYS = {
    "ejected_until",
    "node_id",
    "id",
    "type",
    "category",
    "models",
    "enabled",
    "state",
    "health",
    "capacity",
    "priority",
    "override",
    "in_flight",
    "queued",
    "load_ratio",
    "long_context_capacity",
    "long_in_flight",
    "lifecycle_capabilities",
    "last_error",
}


# ------------------------------------------------------------- peer filter


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("fe80::1%lo", False),
        ("::ffff:10.0.0.1", False),
        ("10.0.0.1", False),
        ("192.168.1.1", False),
        ("0.0.0.0", False),
        ("::", False),
        ("2001:db8::1", False),
        ("localhost", False),  # a peer address is never a name: refuse what does not parse
        ("", False),
        ("not an address", False),
        ("127.0.0.1:80", False),
    ],
)
def test_is_loopback_peer(host: str, allowed: bool) -> None:
    assert admin.is_loopback_peer(host) is allowed


@pytest.mark.parametrize(
    "listen", ["0.0.0.0:7071", "10.0.0.1:7071", "[::]:7071", "example.com:7071"]
)
def test_non_loopback_admin_listen_is_a_config_error(
    listen: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = two_node_yaml(admin_listen=f'"{listen}"')
    with pytest.raises(ConfigError) as info:
        parse_edge_config(text, env={})
    assert any(e.startswith("edge.admin_listen: ") for e in info.value.errors)
    path = tmp_path / "edge.yaml"
    path.write_text(text)
    assert main(["config", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "edge.admin_listen: must be a loopback address" in out


@pytest.mark.parametrize("listen", ["127.0.0.1:7071", "[::1]:7071", "localhost:7071"])
def test_loopback_admin_listen_is_accepted(listen: str) -> None:
    cfg = parse_edge_config(two_node_yaml(admin_listen=f'"{listen}"'), env={})
    assert cfg.edge.admin_listen == listen


async def test_admin_listener_applies_the_peer_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the filter refusing, even loopback gets no answer: the listener uses it."""
    seen: list[str] = []

    def refuse(host: str) -> bool:
        seen.append(host)
        return False

    monkeypatch.setattr("iopd.edge.daemon.is_loopback_peer", refuse)
    with trio.fail_after(30):
        async with running_gateway(two_node_yaml(), nodes=[]) as gw:
            stream = await trio.open_tcp_stream(*gw.handle.admin)
            async with stream:
                await stream.send_all(b"GET /status HTTP/1.1\r\nhost: x\r\n\r\n")
                assert await stream.receive_some(1024) == b""  # closed, no response
            assert seen == ["127.0.0.1"]
            # The OpenAI listener has no such filter.
            r = await http_request(gw.host_port, "GET", "/healthz")
            assert r.status == 200


# ------------------------------------------------------------------ status


async def test_status_shape_lists_every_configured_node_and_provider() -> None:
    with trio.fail_after(30):
        async with running_gateway(two_node_yaml(), nodes=["node-a"]) as gw:
            r = await http_request(gw.handle.admin, "GET", "/status")
            assert r.status == 200
            assert r.header("content-type") == "application/json"
            doc = r.json()
            assert set(doc) == STATUS_KEYS | STATUS_EXTRA_KEYS
            assert doc["edge_id"] == "edge-admin"
            assert doc["queue"] == {
                "depth": 0,
                "max_queue": 7,
                "queued_bytes": 0,
                "max_queued_bytes": 256 << 20,
            }

            nodes = {n["id"]: n for n in doc["nodes"]}
            assert list(nodes) == ["node-a", "node-b"]
            for n in doc["nodes"]:
                assert set(n) == NODE_KEYS
            assert nodes["node-a"]["connected"] is True
            assert isinstance(nodes["node-a"]["connected_since"], float)
            assert nodes["node-a"]["alias"] == "box-a"
            assert nodes["node-a"]["providers"] == ["echo-1", "echo-off"]
            assert nodes["node-b"]["connected"] is False
            assert nodes["node-b"]["connected_since"] is None
            assert nodes["node-b"]["providers"] == ["echo-2"]

            provs = {p["id"]: p for p in doc["providers"]}
            assert list(provs) == ["echo-1", "echo-off", "echo-2"]
            for p in doc["providers"]:
                assert set(p) == PROVIDER_KEYS
                # 0 is kept as 0 (present, numeric), never dropped or null.
                assert p["load_ratio"] == 0 and isinstance(p["load_ratio"], int | float)
                assert p["in_flight"] == 0 and p["queued"] == 0 and p["long_in_flight"] == 0
                assert isinstance(p["last_error"], str)
            assert provs["echo-1"] == {
                **provs["echo-1"],
                "node_id": "node-a",
                "type": "echo",
                "category": "api",
                "models": ["echo"],
                "enabled": True,
                "capacity": 3,
                "long_context_capacity": 0,
                "lifecycle_capabilities": ["streaming"],
            }
            assert provs["echo-1"]["health"] in ("unknown", "healthy")
            assert provs["echo-off"]["enabled"] is False
            assert provs["echo-2"]["node_id"] == "node-b"
            assert provs["echo-2"]["category"] == "local_inference"
            assert provs["echo-2"]["long_context_capacity"] == 1
            # node-b never connected: its provider shows its node's state, not a probe.
            assert provs["echo-2"]["health"] == "disconnected"

            # node-a's node probes its echo provider: health arrives from the node.
            await wait_until(
                lambda: getattr(gw.runtime.health.get("echo-1"), "health", "") == "healthy"
            )
            doc = (await http_request(gw.handle.admin, "GET", "/status")).json()
            assert {p["id"]: p["health"] for p in doc["providers"]}["echo-1"] == "healthy"


async def test_status_reports_in_flight_and_load_ratio() -> None:
    text = two_node_yaml().replace(
        "        capacity: 3\n", "        capacity: 3\n        delay_ms: 200\n"
    )
    with trio.fail_after(30):
        async with running_gateway(text, nodes=["node-a"]) as gw:
            body = {"model": "echo", "messages": [{"role": "user", "content": "a b c d e"}]}
            async with trio.open_nursery() as n:
                n.start_soon(
                    functools.partial(
                        http_request, gw.host_port, "POST", "/v1/chat/completions", body=body
                    )
                )
                await wait_until(lambda: gw.runtime.pool.provider_loads()["echo-1"].in_flight == 1)
                doc = (await http_request(gw.handle.admin, "GET", "/status")).json()
                p = next(p for p in doc["providers"] if p["id"] == "echo-1")
                assert p["in_flight"] == 1
                assert p["load_ratio"] == pytest.approx(1 / 3)

                # Fill echo-1 (node-b, with echo-2, is not connected): the 4th waits.
                for _ in range(3):
                    n.start_soon(
                        functools.partial(
                            http_request, gw.host_port, "POST", "/v1/chat/completions", body=body
                        )
                    )
                await wait_until(lambda: gw.runtime.pool.queue_depth == 1)
                doc = (await http_request(gw.handle.admin, "GET", "/status")).json()
                provs = {p["id"]: p for p in doc["providers"]}
                assert provs["echo-1"]["in_flight"] == 3 and provs["echo-1"]["load_ratio"] == 1
                assert provs["echo-1"]["queued"] == 1
                assert provs["echo-2"]["queued"] == 0  # not a live candidate
                assert doc["queue"]["depth"] == 1 and doc["queue"]["max_queue"] == 7
                assert doc["queue"]["queued_bytes"] == len(json.dumps(body).encode())
                n.cancel_scope.cancel()


# ------------------------------------------------------- routes and errors


async def test_admin_routes_methods_and_envelopes() -> None:
    with trio.fail_after(30):
        async with running_gateway(two_node_yaml(), nodes=[]) as gw:
            adm = gw.handle.admin
            r = await http_request(adm, "GET", "/healthz")
            assert r.status == 200 and r.json() == {"status": "ok"}

            r = await http_request(adm, "HEAD", "/status")
            assert r.status == 200 and r.body == b""
            assert r.header("content-type") == "application/json"

            r = await http_request(adm, "GET", "/metrics")
            assert r.status == 200
            assert (r.header("content-type") or "").startswith("text/plain")
            assert b"iop_queue_depth" in r.body

            for method, path, status, code in [
                ("GET", "/nope", 404, "not_found"),
                ("GET", "/v1/models", 404, "not_found"),
                ("POST", "/status", 405, "method_not_allowed"),
                ("GET", "/refresh", 405, "method_not_allowed"),
                ("DELETE", "/metrics", 405, "method_not_allowed"),
                ("HEAD", "/refresh", 405, "method_not_allowed"),
            ]:
                r = await http_request(adm, method, path)
                assert r.status == status, (method, path)
                if method != "HEAD":
                    err = r.json()["error"]
                    assert set(err) == {"message", "type", "code", "param"}
                    assert err["code"] == code and err["type"] == "invalid_request_error"
                    assert "Traceback" not in err["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"mode": "reload"}', "mode"),
        (b'{"mode": "DRY_RUN"}', "mode"),
        (b'{"mode": 3}', None),
        (b'{"mode": "apply", "force": true}', None),
        (b"{not json", None),
        (b'["apply"]', None),
    ],
)
async def test_refresh_bad_body_is_a_400_envelope(body: bytes, param: str | None) -> None:
    with trio.fail_after(30):
        async with running_gateway(two_node_yaml(), nodes=[]) as gw:
            version = gw.runtime.snapshot.version
            r = await http_request(gw.handle.admin, "POST", "/refresh", body=body)
            assert r.status == 400
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error"
            assert err["code"] == "invalid_request_error"
            assert err["param"] == param
            assert gw.runtime.snapshot.version == version


async def test_refresh_without_config_file_reports_an_error() -> None:
    """An edge started from an in-memory config has no file to reload: refused, arrays kept."""
    with trio.fail_after(30):
        async with running_gateway(two_node_yaml(), nodes=[]) as gw:
            for mode in ("dry_run", "apply"):
                r = await http_request(gw.handle.admin, "POST", "/refresh", body={"mode": mode})
                assert r.status == 200
                doc = r.json()
                assert set(doc) == REPORT_KEYS
                assert doc["mode"] == mode and doc["applied"] is False
                assert len(doc["errors"]) == 1 and doc["errors"][0].startswith("config: ")
                for key in REPORT_KEYS - {"mode", "applied", "errors"}:
                    assert doc[key] == []
            assert gw.runtime.snapshot.version == 1


# ------------------------------------------------ Host and token (DNS rebinding)


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("localhost", True),
        ("LocalHost", True),
        ("localhost:7071", True),
        ("127.0.0.1", True),
        ("127.0.0.1:7071", True),
        ("[::1]", True),
        ("[::1]:7071", True),
        (None, False),
        ("", False),
        ("evil.example", False),
        ("evil.example:7071", False),
        ("127.0.0.1.evil", False),
        ("127.0.0.1.evil:7071", False),
        ("localhost.evil.example", False),
        ("evil.localhost", False),
        ("127.0.0.2:7071", False),
        ("[::1]:7071x", False),
        ("localhost:", False),
        ("localhost:7071:1", False),
        ("::1", False),
        ("127.0.0.1 ", False),
    ],
)
def test_is_loopback_host_header(host: str | None, allowed: bool) -> None:
    assert admin.is_loopback_host_header(host) is allowed


@pytest.mark.parametrize(
    "host", ["evil.example", "127.0.0.1.evil", "evil.example:7071", "localhost.evil.example"]
)
async def test_a_foreign_host_gets_421_on_every_route(host: str) -> None:
    """DNS rebinding: the browser is a loopback peer, but ``Host`` names the page's site."""
    with trio.fail_after(30):
        async with running_gateway(two_node_yaml(), nodes=[]) as gw:
            version = gw.runtime.snapshot.version
            for method, path in [
                ("GET", "/status"),
                ("GET", "/metrics"),
                ("POST", "/refresh"),
                ("GET", "/healthz"),
                ("GET", "/nope"),
            ]:
                status, doc = await raw_admin(
                    gw.handle.admin,
                    f"{method} {path} HTTP/1.1\r\nhost: {host}\r\ncontent-length: 0",
                )
                assert status == 421, (method, path)
                assert doc is not None
                err = doc["error"]
                assert isinstance(err, dict)
                assert err["type"] == "invalid_request_error"
                assert err["code"] == "misdirected_request"
            assert gw.runtime.snapshot.version == version


@pytest.mark.parametrize("host", ["localhost:{port}", "[::1]:{port}", "127.0.0.1", "LOCALHOST"])
async def test_loopback_host_names_are_served(host: str) -> None:
    with trio.fail_after(30):
        async with running_gateway(two_node_yaml(), nodes=[]) as gw:
            port = gw.handle.admin[1]
            status, doc = await raw_admin(
                gw.handle.admin, f"GET /status HTTP/1.1\r\nhost: {host.format(port=port)}"
            )
            assert status == 200 and doc is not None and "edge_id" in doc


async def test_http10_without_host_gets_421() -> None:
    with trio.fail_after(30):
        async with running_gateway(two_node_yaml(), nodes=[]) as gw:
            status, doc = await raw_admin(gw.handle.admin, "GET /status HTTP/1.0")
            assert status == 421 and doc is not None
            status, _ = await raw_admin(gw.handle.admin, "GET /status HTTP/1.0\r\nhost: localhost")
            assert status == 200


async def test_admin_token_is_required_accepted_and_live_on_refresh(tmp_path: Path) -> None:
    path = token_yaml(tmp_path, ADMIN_TOKEN)
    good = [("authorization", f"Bearer {ADMIN_TOKEN}")]
    with trio.fail_after(30):
        async with running_gateway(path.read_text(), nodes=[], config_path=str(path)) as gw:
            adm = gw.handle.admin
            # /healthz stays open (GET and HEAD), with or without a token.
            for method in ("GET", "HEAD"):
                assert (await http_request(adm, method, "/healthz")).status == 200
            assert (await http_request(adm, "GET", "/healthz", headers=good)).status == 200
            wrong_tokens = [
                [],
                [("authorization", "Bearer wrong-token")],
                [("authorization", f"Basic {ADMIN_TOKEN}")],
                [("authorization", f"Bearer {ADMIN_TOKEN}x")],
                [("authorization", f"Bearer {ADMIN_TOKEN.upper()}")],
                [("authorization", "Bearer")],
            ]
            for method, path_ in [
                ("GET", "/status"),
                ("HEAD", "/status"),
                ("GET", "/metrics"),
                ("POST", "/refresh"),
                ("GET", "/nope"),
            ]:
                for hdrs in wrong_tokens:
                    r = await http_request(adm, method, path_, headers=hdrs)
                    assert r.status == 401, (method, path_, hdrs)
                    assert r.header("www-authenticate") == "Bearer"
                    if method != "HEAD":
                        err = r.json()["error"]
                        assert err["type"] == "authentication_error"
                        assert ADMIN_TOKEN not in r.body.decode()
            assert (await http_request(adm, "GET", "/status", headers=good)).status == 200
            assert (await http_request(adm, "GET", "/metrics", headers=good)).status == 200
            assert (await http_request(adm, "GET", "/nope", headers=good)).status == 404
            # A foreign Host is refused even with the token.
            status, _ = await raw_admin(
                adm,
                f"GET /status HTTP/1.1\r\nhost: evil.example\r\nauthorization: Bearer {ADMIN_TOKEN}",
            )
            assert status == 421

            # Live on refresh: removing the hash opens the routes, adding it closes them.
            token_yaml(tmp_path, None)
            r = await http_request(adm, "POST", "/refresh", body={"mode": "apply"}, headers=good)
            assert r.status == 200 and r.json()["applied"] is True
            assert r.json()["restart_required"] == []
            assert (await http_request(adm, "GET", "/status")).status == 200
            token_yaml(tmp_path, "another-admin-token")
            r = await http_request(adm, "POST", "/refresh", body={"mode": "apply"})
            assert r.status == 200 and r.json()["applied"] is True
            assert (await http_request(adm, "GET", "/status", headers=good)).status == 401
            other = [("authorization", "Bearer another-admin-token")]
            assert (await http_request(adm, "GET", "/status", headers=other)).status == 200


@pytest.mark.parametrize("value", ["abc", "A" * 64, "g" * 64, ""])
def test_admin_token_hash_must_be_64_hex(value: str) -> None:
    text = two_node_yaml().replace(
        "  admin_listen: 127.0.0.1:0\n",
        f'  admin_listen: 127.0.0.1:0\n  admin_token_hash_sha256: "{value}"\n',
    )
    with pytest.raises(ConfigError) as info:
        parse_edge_config(text, env={})
    assert any(e.startswith("edge.admin_token_hash_sha256: ") for e in info.value.errors)
