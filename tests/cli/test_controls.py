"""``iopd provider drain|disable|enable|set|reset ID`` and ``iopd node drain ID``.

Each command is run as a real process against a running edge: the JSON body
with its ``Content-Type`` (the edge answers 415 without it), the admin token
from ``IOP_ADMIN_TOKEN``, one line per provider on success, and one line on
stderr with exit 1 on any error.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from iopd.admin_client import format_control
from iopd.cli import build_parser
from tests.support.cli import edge_from_file, edge_yaml, iopd, row_of
from tests.support.gateway import running_gateway, token_hash, wait_until


async def test_provider_and_node_commands_change_the_running_edge(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with edge_from_file(tmp_path) as (gw, _):
            await gw.start_node("node-b")  # the nodes hold the controls
            await wait_until(lambda: gw.runtime.hub.session("node-b") is not None)
            admin = ("--admin", gw.admin_url)
            pool = gw.runtime.pool
            code, out, err = await iopd("provider", "drain", "echo-1", *admin)
            assert (code, err) == (0, "")
            assert out == "echo-1 on node-a: drained, in flight 0, capacity 2, priority 0\n"
            code, out, _ = await iopd("provider", "disable", "echo-2", *admin)
            assert code == 0 and pool.control("echo-2").state == "disabled"
            code, out, _ = await iopd("provider", "enable", "echo-2", *admin)
            assert code == 0 and pool.control("echo-2").state == "active"

            code, out, err = await iopd(
                "provider", "set", "echo-2", "--capacity", "7", "--priority", "3", *admin
            )
            assert (code, err) == (0, "")
            assert out == (
                "echo-2 on node-b: active, in flight 0, capacity 7 (override), "
                "priority 3 (override)\n"
            )
            code, out, _ = await iopd("provider", "set", "echo-2", "--capacity", "none", *admin)
            assert code == 0 and "capacity 4, priority 3 (override)" in out

            code, out, _ = await iopd("status", *admin)
            assert row_of(out, "echo-1")[5] == "drained"
            assert row_of(out, "echo-2")[5] == "active"
            assert row_of(out, "echo-2")[11] == "prio=3"

            code, out, _ = await iopd("provider", "reset", "echo-2", *admin)
            assert code == 0 and out.endswith("capacity 4, priority 0\n")
            code, out, err = await iopd("node", "drain", "node-a", *admin)
            assert (code, err) == (0, "")
            assert [line.split(":")[0] for line in out.splitlines()] == [
                "echo-1 on node-a",
                "remote-1 on node-a",
            ]
            assert pool.control("remote-1").state == "draining"
            code, out, _ = await iopd("node", "drain", "node-a", "--json", *admin)
            assert code == 0 and '"providers"' in out

            gw.kill_node("node-b")
            await wait_until(lambda: gw.runtime.hub.session("node-b") is None)
            code, out, err = await iopd("provider", "disable", "echo-2", *admin)
            assert (code, out) == (1, "")
            assert err.startswith("iopd provider disable: admin API answered 409: \"node 'node-b'")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("provider", "drain", "nope"), "iopd provider drain: admin API answered 404: "),
        (("provider", "set", "nope", "--priority", "1"), "iopd provider set: admin API answered 404"),
        (("node", "drain", "nope"), "iopd node drain: admin API answered 404: "),
        (("provider", "set", "echo-1"), "iopd provider set: give --capacity and/or --priority"),
    ],
)
async def test_errors_are_one_line_and_exit_1(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    with trio.fail_after(60):
        async with edge_from_file(tmp_path) as (gw, _):
            code, out, err = await iopd(*args, "--admin", gw.admin_url)
            assert (code, out) == (1, "")
            assert err.startswith(message) and err.count("\n") == 1, err
            assert "Traceback" not in err


async def test_unreachable_admin_is_one_line_and_exit_1() -> None:
    code, out, err = await iopd("provider", "disable", "x", "--admin", "http://127.0.0.1:1")
    assert (code, out) == (1, "")
    assert err.startswith("iopd provider disable: cannot reach the admin API at ")


async def test_commands_send_the_admin_token_from_the_environment(tmp_path: Path) -> None:
    token = "iop_cli-control-token-71c3"
    text = edge_yaml().replace(
        "  admin_listen: 127.0.0.1:0\n",
        f"  admin_listen: 127.0.0.1:0\n  admin_token_hash_sha256: {token_hash(token)}\n",
    )
    with trio.fail_after(60):
        async with running_gateway(text, nodes=["node-a"]) as gw:
            admin = ("--admin", gw.admin_url)
            code, _, err = await iopd("provider", "drain", "echo-1", *admin)
            assert code == 1 and "admin API answered 401" in err
            assert gw.runtime.pool.control("echo-1").state == "active"
            code, _, err = await iopd("provider", "drain", "echo-1", *admin, admin_token=token)
            assert (code, err) == (0, "")
            assert gw.runtime.pool.control("echo-1").state == "draining"


@pytest.mark.parametrize("value", ["-1", "x", "1.5"])
def test_set_refuses_a_bad_value_before_calling(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["provider", "set", "p", "--capacity", value])
    assert info.value.code == 2
    assert "--capacity" in capsys.readouterr().err


def test_set_parses_none_and_leaves_an_option_out() -> None:
    args = build_parser().parse_args(["provider", "set", "p", "--capacity", "none"])
    assert args.capacity is None and "priority" not in args
    args = build_parser().parse_args(["node", "drain", "n1"])
    assert (args.action, args.id, args.config) == ("drain", "n1", None)


def test_format_control_marks_overrides() -> None:
    view = {
        "id": "p",
        "node_id": "n",
        "state": "draining",
        "capacity": 5,
        "priority": 0,
        "override": {"capacity": 5, "priority": None},
        "in_flight": 2,
    }
    assert format_control(view) == "p on n: draining, in flight 2, capacity 5 (override), priority 0"
