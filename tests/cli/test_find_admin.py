"""Where ``iopd status|refresh|provider|node drain`` find the admin API.

First match wins: ``--admin URL``, ``$IOP_ADMIN_URL``, ``edge.admin_listen`` of
the edge config given with ``--config`` (or of the system config when it can
be read), the default.  ``find_admin`` is tested for the order and every
message; the CLI as a real subprocess against a running edge for what an
operator types: a config path and no URL.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from iopd.admin_client import DEFAULT_ADMIN, AdminError, find_admin
from tests.support.cli import edge_from_file, iopd
from tests.support.gateway import free_port

EDGE = "edge:\n  id: e\n  admin_listen: {listen}\n"


def _config(tmp_path: Path, listen: str, name: str = "edge.yaml") -> str:
    path = tmp_path / name
    path.write_text(EDGE.format(listen=listen))
    return str(path)


def test_flag_wins_over_env_and_config(tmp_path: Path) -> None:
    config = _config(tmp_path, "127.0.0.1:7001")
    env = {"IOP_ADMIN_URL": "http://127.0.0.1:7002"}
    target = find_admin("http://127.0.0.1:7003", config, env)
    assert (target.url, target.source) == ("http://127.0.0.1:7003", "--admin")


def test_env_wins_over_config(tmp_path: Path) -> None:
    config = _config(tmp_path, "127.0.0.1:7001")
    target = find_admin(None, config, {"IOP_ADMIN_URL": " http://127.0.0.1:7002 "})
    assert (target.url, target.source) == ("http://127.0.0.1:7002", "$IOP_ADMIN_URL")


@pytest.mark.parametrize(
    ("listen", "url"),
    [
        ("127.0.0.1:7001", "http://127.0.0.1:7001"),
        ("localhost:7001", "http://localhost:7001"),
        ("'[::1]:7001'", "http://[::1]:7001"),
    ],
)
def test_config_names_the_admin_listener(tmp_path: Path, listen: str, url: str) -> None:
    config = _config(tmp_path, listen)
    target = find_admin(None, config, {})
    assert (target.url, target.source) == (url, f"edge.admin_listen in {config}")


def test_the_system_config_is_read_when_no_config_is_given(tmp_path: Path) -> None:
    system = _config(tmp_path, "127.0.0.1:7004", "system.yaml")
    target = find_admin(None, None, {}, system_config=system)
    assert target.url == "http://127.0.0.1:7004"
    absent = str(tmp_path / "absent.yaml")
    target = find_admin(None, None, {}, system_config=absent)
    assert (target.url, target.source) == (DEFAULT_ADMIN, "the default")


def _refusal(tmp_path: Path, text: str) -> str:
    path = tmp_path / "edge.yaml"
    path.write_text(text)
    with pytest.raises(AdminError) as info:
        find_admin(None, str(path), {})
    return str(info.value)


def test_config_problems_are_one_line_with_what_to_do(tmp_path: Path) -> None:
    p = tmp_path / "edge.yaml"
    assert _refusal(tmp_path, "node:\n  id: n\n") == (
        f"{p} is a node config: give the edge's config (its edge.admin_listen names the admin API)"
    )
    assert _refusal(tmp_path, "edge:\n  id: e\n") == (
        f"{p} has no edge.admin_listen: give the edge's config or --admin URL"
    )
    assert _refusal(tmp_path, EDGE.format(listen="127.0.0.1:0")) == (
        f"edge.admin_listen in {p} is port 0 (any free port): give --admin URL or set "
        "IOP_ADMIN_URL to the port the edge logged (event=edge_started admin=...)"
    )
    assert _refusal(tmp_path, EDGE.format(listen="'${ADMIN}'")) == (
        f"edge.admin_listen in {p} is an environment reference (${{ADMIN}}): "
        "give --admin URL or set IOP_ADMIN_URL"
    )
    assert _refusal(tmp_path, "edge: [\n") == (
        f"config {p} is not valid YAML (`iopd config check {p}` says where)"
    )
    with pytest.raises(AdminError, match=r"^cannot read config .*absent\.yaml: no such file"):
        find_admin(None, str(tmp_path / "absent.yaml"), {})


# ------------------------------------------------------------------ real processes


async def test_status_and_controls_find_the_edge_by_its_config(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with edge_from_file(tmp_path) as (gw, _):
            port = gw.handle.admin[1]
            config = _config(tmp_path, f"127.0.0.1:{port}", "running.yaml")
            code, out, err = await iopd("status", "--config", config)
            assert (code, err) == (0, "")
            assert out.startswith("edge edge-cli\n")
            code, _, err = await iopd("provider", "drain", "echo-1", "--config", config)
            assert (code, err) == (0, "")
            assert gw.runtime.pool.control("echo-1").state == "draining"
            # The environment variable alone, and it wins over a config that is wrong.
            wrong = _config(tmp_path, f"127.0.0.1:{free_port()}", "wrong.yaml")
            code, out, err = await iopd("status", "--config", wrong, admin_url=gw.admin_url)
            assert (code, err) == (0, ""), err
            code, _, err = await iopd("refresh", "--dry-run", admin_url=gw.admin_url)
            assert (code, err) == (0, ""), err


async def test_nobody_listening_names_what_to_try(tmp_path: Path) -> None:
    port = free_port()
    config = _config(tmp_path, f"127.0.0.1:{port}")
    code, out, err = await iopd("status", "--config", config)
    assert (code, out) == (1, "")
    assert err == (
        f"iopd status: cannot reach the admin API at http://127.0.0.1:{port} "
        f"(edge.admin_listen in {config}): connection refused; is the edge running with that "
        "config? (`systemctl status iopd-edge`, or its log)\n"
    )
    code, out, err = await iopd("node", "drain", "n1", admin_url=f"127.0.0.1:{port}")
    assert (code, out) == (1, "")
    assert err == (
        f"iopd node drain: cannot reach the admin API at 127.0.0.1:{port} ($IOP_ADMIN_URL): "
        "connection refused; is the edge running, and is that its edge.admin_listen? "
        "(--admin URL wins over $IOP_ADMIN_URL; unset it to use --config EDGE_CONFIG)\n"
    )
    code, out, err = await iopd("refresh", "--admin", f"http://127.0.0.1:{port}")
    assert err == (
        f"iopd refresh: cannot reach the admin API at http://127.0.0.1:{port} (--admin): "
        "connection refused; is the edge running, and is that its edge.admin_listen? "
        "(--config EDGE_CONFIG reads it from the edge's config)\n"
    )


def test_an_unreadable_system_config_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    system = _config(tmp_path, "127.0.0.1:7004", "system.yaml")
    # As an operator outside the iopd group sees /etc/iopd/edge.yaml (mode 0640).
    monkeypatch.setattr("iopd.admin_client.os.access", lambda path, mode: False)
    target = find_admin(None, None, {}, system_config=system)
    assert (target.url, target.source) == (DEFAULT_ADMIN, "the default")
    assert target.hint == (
        f"is the edge running? {system} names its admin API but cannot be read by this user: "
        "run as a member of its group (or with sudo), or give --config EDGE_CONFIG, "
        "--admin URL or IOP_ADMIN_URL"
    )


def test_the_default_says_how_to_point_elsewhere() -> None:
    target = find_admin(None, None, {}, system_config="/nonexistent/edge.yaml")
    assert target.hint == (
        "is the edge running? If its edge.admin_listen is another address, give "
        "--config EDGE_CONFIG, --admin URL or IOP_ADMIN_URL"
    )


async def test_a_config_problem_is_one_line_and_exit_1(tmp_path: Path) -> None:
    config = _config(tmp_path, "127.0.0.1:0")
    code, out, err = await iopd("provider", "enable", "x", "--config", config)
    assert (code, out) == (1, "")
    assert err.startswith(f"iopd provider enable: edge.admin_listen in {config} is port 0")
    assert err.count("\n") == 1


@pytest.mark.parametrize("args", [(), ("provider",), ("config",)])
async def test_a_command_without_its_subcommand_prints_the_commands(
    args: tuple[str, ...],
) -> None:
    code, out, err = await iopd(*args)
    assert (code, err) == (0, "")
    assert out.startswith("usage: iopd")
    assert "Traceback" not in out
    if not args:
        for command in ("edge", "node", "demo", "status", "refresh", "provider", "token"):
            assert f"\n    {command} " in out, command
        assert "  iopd node drain ID\n" in out
