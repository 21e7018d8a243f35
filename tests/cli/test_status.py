"""``iopd status`` and ``iopd refresh`` as real subprocesses against a running edge.

The edge runs in this process (tests/support/gateway.py); the CLI runs as
``python -m iopd ...`` through ``trio.run_process``, so its exit code, stdout
and stderr are exactly what an operator's shell sees.  The table formatter is
also tested directly for layout cases a live edge cannot easily produce.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import trio

from iopd.admin_client import format_report, format_status
from tests.support.cli import edge_from_file, edge_yaml, iopd, row_of
from tests.support.gateway import (
    free_port,
    http_request,
    running_gateway,
    token_hash,
    wait_until,
)

TABLE_COLUMNS = [
    "NODE",
    "PROVIDER",
    "TYPE",
    "CATEGORY",
    "ENABLED",
    "STATE",
    "HEALTH",
    "IN_FLIGHT",
    "LOAD",
    "QUEUED",
    "LONG",
    "OVERRIDE",
    "INDEX",
    "HIT_RATE",
    "MODELS",
    "LAST ERROR",
]


# ------------------------------------------------------------------ status


async def test_status_table_lists_every_node_and_provider(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with edge_from_file(tmp_path, delay_ms=200) as (gw, _):
            # remote-1 points at a closed port: the node's probe reports it unhealthy.
            await wait_until(
                lambda: getattr(gw.runtime.health.get("remote-1"), "health", "") == "unhealthy"
            )
            async with trio.open_nursery() as n:
                # Long enough for whole blocks of the prefix index.
                prompt = "a b c d " + "x" * 2048
                body = {"model": "echo", "messages": [{"role": "user", "content": prompt}]}

                async def call() -> None:
                    await http_request(gw.host_port, "POST", "/v1/chat/completions", body=body)

                n.start_soon(call)
                await wait_until(lambda: gw.runtime.pool.provider_loads()["echo-1"].in_flight == 1)
                code, out, err = await iopd("status", "--admin", gw.admin_url)
                n.cancel_scope.cancel()

            assert code == 0, err
            assert err == ""
            lines = out.splitlines()
            assert lines[0] == "edge edge-cli"
            header = next(ln for ln in lines if ln.startswith("NODE") and "HEALTH" in ln)
            positions = [header.find(col) for col in TABLE_COLUMNS]
            assert -1 not in positions, header
            assert positions == sorted(positions), header

            # Nodes, connected or not.
            node_section = out.split("\n\n")[1].splitlines()
            assert node_section[0].split() == ["NODE", "ALIAS", "CONNECTED", "PROVIDERS"]
            node_rows = {ln.split()[0]: ln.split() for ln in node_section[1:]}
            assert list(node_rows) == ["node-a", "node-b"]
            assert node_rows["node-b"] == ["node-b", "-", "no", "echo-2"]
            assert node_rows["node-a"][:3] == ["node-a", "box-a", "yes"]
            assert node_rows["node-a"][3] == "echo-1,remote-1"

            echo1 = row_of(out, "echo-1")
            assert echo1[:7] == ["node-a", "echo-1", "echo", "api", "yes", "active", "healthy"]
            assert echo1[7:12] == ["1/2", "0.50", "0", "0/0", "-"]
            # The granted request's prompt is in echo-1's prefix index; no lookup
            # counted yet (echo-1 was the only provider up): no hit rate.
            blocks = gw.runtime.pool.scheduler.router.index.stats("echo-1").blocks
            assert blocks > 0
            assert echo1[12:15] == [str(blocks), "-", "echo"]

            remote = row_of(out, "remote-1")
            assert remote[6] == "unhealthy"
            assert remote[7:15] == ["0/1", "0.00", "0", "0/0", "-", "0", "-", "remote-model"]
            remote_line = next(ln for ln in lines if " remote-1 " in ln)
            last_error = " ".join(gw.runtime.health["remote-1"].last_error.split())
            assert last_error
            assert f"remote-model  ! {last_error[:30]}" in remote_line

            echo2 = row_of(out, "echo-2")
            assert echo2[:7] == [
                "node-b",
                "echo-2",
                "echo",
                "local_inference",
                "yes",
                "active",
                "disconnected",
            ]
            assert echo2[7:15] == ["0/4", "0.00", "0", "0/1", "-", "0", "-", "echo"]
            assert len(echo2) == 15  # no last error

            assert lines[-1] == "queue depth 0 / max 12"


async def test_status_json_is_the_admin_document(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with edge_from_file(tmp_path) as (gw, _):
            # The scheme may be left out: host:port is enough.
            bare = gw.admin_url.removeprefix("http://")
            code, out, err = await iopd("status", "--json", "--admin", bare)
            assert code == 0, err
            doc = json.loads(out)
            live = (await http_request(gw.handle.admin, "GET", "/status")).json()
            # Health may move between the two reads; everything else is equal.
            for d in (doc, live):
                for p in d["providers"]:
                    p.pop("health"), p.pop("last_error")
            assert doc == live
            assert [p["id"] for p in doc["providers"]] == ["echo-1", "remote-1", "echo-2"]
            assert [n["connected"] for n in doc["nodes"]] == [True, False]


@pytest.mark.parametrize("command", ["status", "refresh", "restart"])
async def test_unreachable_admin_exits_1_with_a_clear_message(command: str) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with trio.fail_after(60):
        code, out, err = await iopd(command, "--admin", url)
    assert code == 1
    assert out == ""
    assert err.startswith(f"iopd {command}: cannot reach the admin API at {url}")
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "url",
    ["ftp://127.0.0.1:7071", "http://127.0.0.1:notaport", "http://127.0.0.1:99999", "http://"],
)
async def test_bad_admin_url_exits_1_without_traceback(url: str) -> None:
    with trio.fail_after(60):
        code, out, err = await iopd("status", "--admin", url)
    assert code == 1
    assert out == ""
    assert err.startswith("iopd status: ")
    assert "Traceback" not in err


async def test_admin_that_is_not_http_exits_1_without_traceback() -> None:
    """Pointing --admin at something that answers garbage (a wrong port)."""

    async def garbage(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.receive_some(1024)
            await stream.send_all(b"\x00\x00\x00\x05hello, not http\r\n\r\n")

    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            [listener] = await n.start(
                functools.partial(trio.serve_tcp, garbage, 0, host="127.0.0.1")
            )
            port = listener.socket.getsockname()[1]
            for command in ("status", "refresh"):
                code, out, err = await iopd(command, "--admin", f"http://127.0.0.1:{port}")
                assert code == 1
                assert err.startswith(f"iopd {command}: ") and "Traceback" not in err
            n.cancel_scope.cancel()


async def test_admin_pointed_at_the_openai_listener(tmp_path: Path) -> None:
    """A plausible mistake: the OpenAI port answers 404 envelopes; the CLI says so."""
    with trio.fail_after(60):
        async with edge_from_file(tmp_path) as (gw, _):
            host, port = gw.host_port
            code, out, err = await iopd("status", "--admin", f"http://{host}:{port}")
            assert code == 1 and out == ""
            assert err.startswith("iopd status: admin API answered 404")
            assert "Traceback" not in err


# ----------------------------------------------------------------- refresh


async def test_refresh_exit_codes_and_report(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with edge_from_file(tmp_path) as (gw, path):
            admin = ("--admin", gw.admin_url)

            # Nothing changed: both succeed.
            code, out, err = await iopd("refresh", "--dry-run", *admin)
            assert (code, err) == (0, "")
            assert out.splitlines()[0] == "mode: dry_run   applied: no"
            code, out, _ = await iopd("refresh", *admin)
            assert code == 0 and out.splitlines()[0] == "mode: apply   applied: yes"

            # A live change: the dry run reports it (exit 0), the apply applies it.
            path.write_text(edge_yaml(cap1=5))
            code, out, _ = await iopd("refresh", "--dry-run", *admin)
            assert code == 0
            assert "changed_providers: echo-1" in out and "applied: no" in out
            assert gw.runtime.snapshot.config.nodes[0].providers[0].capacity == 2
            code, out, _ = await iopd("refresh", *admin)
            assert code == 0 and "applied: yes" in out
            assert "changed_nodes: node-a" in out
            code, out, _ = await iopd("status", *admin)
            assert row_of(out, "echo-1")[7] == "0/5"

            # Restart-required: refused, exit 1 for the dry run and the apply.
            path.write_text(edge_yaml(cap1=5, remote_base="http://127.0.0.1:10"))
            for dry in (True, False):
                code, out, _ = await iopd("refresh", *(["--dry-run"] if dry else []), *admin)
                assert code == 1
                assert "applied: no" in out
                assert "restart_required: nodes[0].providers[1].base_url" in out
            assert gw.runtime.snapshot.version == 2  # one changing apply above, none since

            # Validation error: refused, the error printed as path: reason.
            path.write_text(edge_yaml(cap1=0))
            for dry in (True, False):
                code, out, _ = await iopd("refresh", *(["--dry-run"] if dry else []), *admin)
                assert code == 1
                assert "errors: nodes[0].providers[0].capacity: " in out
            assert gw.runtime.snapshot.version == 2


# --------------------------------------------------------- the formatters


def status_doc(**provider: Any) -> dict[str, Any]:
    p = {
        "node_id": "node-a",
        "id": "echo-1",
        "type": "echo",
        "category": "api",
        "models": ["echo"],
        "enabled": True,
        "health": "healthy",
        "capacity": 4,
        "in_flight": 0,
        "queued": 0,
        "load_ratio": 0,
        "long_context_capacity": 0,
        "long_in_flight": 0,
        "lifecycle_capabilities": [],
        "last_error": "",
    }
    p.update(provider)
    return {
        "edge_id": "e",
        "nodes": [
            {
                "id": p["node_id"],
                "alias": None,
                "connected": True,
                "connected_since": 1.0,
                "providers": [p["id"]],
            }
        ],
        "providers": [p],
        "queue": {"depth": 3, "max_queue": 9},
    }


def test_format_status_aligns_long_ids() -> None:
    long_node = "node-with-a-very-long-identifier"
    long_prov = "provider-with-an-even-longer-identifier"
    doc = status_doc()
    doc["providers"].append(
        {**doc["providers"][0], "node_id": long_node, "id": long_prov, "models": ["m1", "m2"]}
    )
    doc["nodes"].append({**doc["nodes"][0], "id": long_node, "providers": [long_prov]})
    lines = format_status(doc).splitlines()
    header = next(ln for ln in lines if "PROVIDER" in ln and "HEALTH" in ln)
    rows = [ln for ln in lines if " healthy " in ln]
    assert len(rows) == 2
    col = header.index("HEALTH")
    for row in rows:
        assert row[col:].startswith("healthy"), (header, row)
    assert row_of("\n".join(rows), long_prov)[14] == "m1,m2"


def test_format_status_keeps_a_multiline_last_error_on_one_row() -> None:
    doc = status_doc(health="unhealthy", last_error="first line\nsecond\tline " + "x" * 500)
    text = format_status(doc)
    [row] = [ln for ln in text.splitlines() if " echo-1 " in ln]
    assert "! first line second line" in row
    assert len(row) < 400
    assert "second" not in text.replace(row, "")


def test_format_status_zero_and_missing_values() -> None:
    text = format_status(status_doc(load_ratio=0, in_flight=0, capacity=4))
    row = row_of(text, "echo-1")
    assert row[5] == "-"  # an older edge's /status has no state
    # ... nor routing: no index size, no hit rate.
    assert row[7:15] == ["0/4", "0.00", "0", "0/0", "-", "-", "-", "echo"]
    assert text.splitlines()[-1] == "queue depth 3 / max 9"
    # A node without alias or providers still renders.
    doc = status_doc()
    doc["nodes"][0]["providers"] = []
    assert "node-a         -" in format_status(doc)


def index_row(blocks: int, lookups: int, hits: int) -> dict[str, Any]:
    """One provider of ``/status`` ``routing.providers``."""
    rate = round(hits / lookups, 4) if lookups else 0.0
    return {"index_blocks": blocks, "lookups": lookups, "hits": hits, "hit_rate": rate}


def test_format_status_shows_each_providers_index_and_each_groups_policy() -> None:
    doc = status_doc()
    doc["providers"].append({**doc["providers"][0], "id": "echo-2"})
    doc["routing"] = {
        "index_blocks": 1234,
        "providers": {"echo-1": index_row(1234, 8, 6), "echo-2": index_row(0, 0, 0)},
        "decisions": {},
    }
    doc["models"] = [
        {"id": "echo", "source": "models", "routing": "prefix", "providers": []},
        {"id": "flat", "source": "models", "routing": "least_load", "providers": []},
    ]
    text = format_status(doc)
    header = next(ln for ln in text.splitlines() if ln.startswith("NODE") and "HEALTH" in ln)
    assert header.split()[11:14] == ["OVERRIDE", "INDEX", "HIT_RATE"]
    assert row_of(text, "echo-1")[12:14] == ["1234", "0.75"]
    # No lookup counted it yet: its hit rate is not 0, it is unknown.
    assert row_of(text, "echo-2")[12:14] == ["0", "-"]
    models = text.split("\n\n")[3].splitlines()
    assert models[0].split()[:4] == ["MODEL", "SOURCE", "ROUTING", "PROVIDERS"]
    assert [ln.split()[:3] for ln in models[1:]] == [
        ["echo", "models", "prefix"],
        ["flat", "models", "least_load"],
    ]


def test_format_status_of_an_edge_older_than_routing() -> None:
    doc = status_doc()
    doc["models"] = [{"id": "echo", "source": "models", "providers": []}]
    text = format_status(doc)
    assert row_of(text, "echo-1")[12:14] == ["-", "-"]
    [model] = [ln for ln in text.splitlines() if ln.startswith("echo ")]
    assert model.split() == ["echo", "models", "-", "-"]
    # A routing document without this provider (it joined after the read): ``-`` too.
    doc["routing"] = {"providers": {"other": index_row(5, 1, 1)}}
    assert row_of(format_status(doc), "echo-1")[12:14] == ["-", "-"]


def test_format_report_lists_every_key() -> None:
    doc = {
        "mode": "apply",
        "applied": False,
        "changed_nodes": [],
        "changed_providers": ["p1"],
        "changed_models": [],
        "restart_required": ["openai.listen", "edge.id"],
        "errors": [],
    }
    assert format_report(doc).splitlines() == [
        "mode: apply   applied: no",
        "changed_nodes: -",
        "changed_providers: p1",
        "changed_models: -",
        "restart_required: openai.listen, edge.id",
        "errors: -",
    ]


def test_format_report_puts_each_of_several_errors_on_its_own_line() -> None:
    doc = {
        "mode": "dry_run",
        "applied": False,
        "changed_nodes": [],
        "changed_providers": [],
        "changed_models": [],
        "restart_required": [],
        "errors": [
            "edge.admin_listen: must be a loopback address (127.0.0.0/8, ::1 or localhost)",
            "nodes[0].providers[0].capacity: must be >= 1",
        ],
    }
    assert format_report(doc).splitlines()[-3:] == [
        "errors: 2",
        "  edge.admin_listen: must be a loopback address (127.0.0.0/8, ::1 or localhost)",
        "  nodes[0].providers[0].capacity: must be >= 1",
    ]


@pytest.mark.parametrize("answer", [b'{"ok": true}', b"[1, 2]", b'"text"', b"null"])
async def test_json_that_is_not_the_admin_document_exits_1(answer: bytes) -> None:
    """Some other HTTP service on that port answering 200 with JSON."""

    async def other_service(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.receive_some(4096)
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(answer), answer)
            )

    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            [listener] = await n.start(
                functools.partial(trio.serve_tcp, other_service, 0, host="127.0.0.1")
            )
            url = f"http://127.0.0.1:{listener.socket.getsockname()[1]}"
            for command in ("status", "refresh"):
                code, out, err = await iopd(command, "--admin", url)
                assert code == 1, (command, out)
                assert err == f"iopd {command}: {url} did not answer like the admin API\n"
            n.cancel_scope.cancel()


# ------------------------------------------------------------ admin token


async def test_status_and_refresh_send_the_admin_token_from_the_environment(
    tmp_path: Path,
) -> None:
    token = "iop_cli-admin-token-2d8e"
    path = tmp_path / "edge.yaml"
    path.write_text(
        edge_yaml().replace(
            "  admin_listen: 127.0.0.1:0\n",
            f"  admin_listen: 127.0.0.1:0\n  admin_token_hash_sha256: {token_hash(token)}\n",
        )
    )
    with trio.fail_after(60):
        async with running_gateway(path.read_text(), nodes=[], config_path=str(path)) as gw:
            admin = ("--admin", gw.admin_url)
            for command in ("status", "refresh"):
                code, out, err = await iopd(command, *admin)
                assert (code, out) == (1, "")
                assert err.startswith(f"iopd {command}: admin API answered 401: ")
                assert "IOP_ADMIN_TOKEN" in err and "Traceback" not in err
                code, _, err = await iopd(command, *admin, admin_token="wrong")
                assert code == 1 and "answered 401 (a wrong token)" in err
            code, out, err = await iopd("status", *admin, admin_token=token)
            assert (code, err) == (0, "") and "echo-1" in out
            code, out, err = await iopd("refresh", *admin, admin_token=token)
            assert (code, err) == (0, "") and "applied: yes" in out


async def test_a_421_says_which_host_names_the_admin_api_answers() -> None:
    """An admin port behind something that rewrites Host; the bearer is sent as is."""
    seen: list[bytes] = []

    async def misdirected(stream: trio.SocketStream) -> None:
        async with stream:
            seen.append(await stream.receive_some(4096))
            body = b'{"error": {"message": "no", "type": "invalid_request_error"}}'
            await stream.send_all(
                b"HTTP/1.1 421 Misdirected Request\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
            )

    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            [listener] = await n.start(
                functools.partial(trio.serve_tcp, misdirected, 0, host="127.0.0.1")
            )
            url = f"http://127.0.0.1:{listener.socket.getsockname()[1]}"
            code, out, err = await iopd("status", "--admin", url, admin_token="tok-123")
            assert (code, out) == (1, "")
            assert err.startswith("iopd status: admin API answered 421: ")
            assert "localhost, 127.0.0.1 or [::1]" in err
            assert b"\r\nauthorization: bearer tok-123\r\n" in seen[0].lower()
            n.cancel_scope.cancel()


def test_format_principals_shows_in_flight_queued_and_what_is_left() -> None:
    from iopd.admin_client import format_principals

    def w(limit: int, used: int) -> dict[str, object]:
        return {"limit": limit, "used": used, "remaining": limit - used if limit else None, "reset_s": 12.5}

    doc = {
        "principals": [
            {
                "principal_ref": "team-a",
                "in_flight": 2,
                "queued": 3,
                "max_concurrent": 2,
                "share": 3,
                "requests_per_minute": w(10, 4),
                "tokens_per_minute": w(0, 50),
                "tokens_per_day": w(1000, 999),
            }
        ]
    }
    lines = format_principals(doc).splitlines()
    assert lines[0].split()[:3] == ["PRINCIPAL", "IN_FLIGHT", "QUEUED"]
    cells = lines[1].split()
    assert cells[:7] == ["team-a", "2/2", "3", "3", "6", "-", "1"]
    assert "4/10 (12.5s)" in lines[1] and "50/-" in lines[1]
    assert format_principals({"principals": []}) == "no principal is configured or active"


async def test_restart_of_an_edge_that_cannot_hand_over_says_why(tmp_path: Path) -> None:
    """An edge run inside another program (here: the tests) has no ``iopd edge`` to start."""
    with trio.fail_after(60):
        async with edge_from_file(tmp_path) as (gw, _path):
            code, out, err = await iopd("restart", admin_url=gw.admin_url)
    assert code == 1 and out == ""
    assert err.strip() == (
        "iopd restart: admin API answered 409: "
        "'no restart: this edge cannot start a successor'"
    )
