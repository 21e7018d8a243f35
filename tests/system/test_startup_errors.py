"""Start-up failures are one line on stderr and exit 1.

Each test runs ``python -m iopd ...`` as a subprocess, as an operator or
systemd would, and checks what reaches the terminal: exit status 1, exactly
one stderr line ``iopd <command>: <what> <address/path>: <reason>``, and no
traceback.  A taken port is a socket this test holds (bound on port 0, so it
is free of collisions with anything else).  The demo's ``--admin-port 0``
lets a second demo run next to a first one; the last test starts one and
reads the admin URL it prints.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.support import configs
from tests.support.configs import ANY_PORT
from tests.support.daemons import assert_one_line, run_iopd
from tests.support.gateway import http_request

GUARD = 30.0  # seconds; each process normally exits within one
NODE_TOKEN = "iop_canary_startup_node_4e1c"

NODE_YAML = """\
node:
  id: n1
  edge: 127.0.0.1:9
  token: {token}
{tls}"""


def edge_yaml(
    *,
    node_listen: str = ANY_PORT,
    admin_listen: str = ANY_PORT,
    openai_listen: str = ANY_PORT,
    tls: dict[str, str] | None = None,
) -> str:
    """Edge ``startup-edge`` serving ``echo`` on node ``n1``; ``tls`` its ``edge.tls``."""
    edge: dict[str, Any] = {"node_listen": node_listen, "admin_listen": admin_listen}
    if tls is not None:
        edge["tls"] = tls
    return configs.edge_yaml(
        edge_id="startup-edge",
        edge=edge,
        openai={"listen": openai_listen},
        nodes=[
            {
                "id": "n1",
                "token_hash_sha256": hashlib.sha256(NODE_TOKEN.encode()).hexdigest(),
                "providers": [{"id": "echo-1", "type": "echo", "models": ["echo"]}],
            }
        ],
    )


@contextmanager
def taken_port() -> Iterator[int]:
    """A loopback port held by a listening socket for the duration."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


# ------------------------------------------------------------------ a port in use


@pytest.mark.parametrize(
    ("listener", "key"),
    [
        ("openai_listen", "openai.listen"),
        ("node_listen", "edge.node_listen"),
        ("admin_listen", "edge.admin_listen"),
    ],
)
async def test_edge_port_in_use(tmp_path: Path, listener: str, key: str) -> None:
    with taken_port() as port:
        config = tmp_path / "edge.yaml"
        config.write_text(edge_yaml(**{listener: f"127.0.0.1:{port}"}))
        result = await run_iopd("edge", "--config", str(config))
    assert_one_line(
        result,
        f"iopd edge: cannot listen on 127.0.0.1:{port} ({key}): address already in use: "
        f"another process holds that port: stop it, or set {key} to a free port",
    )
    # The log on stdout carries the same reason for log collectors.
    assert "event=edge_failed" in result[1]


async def test_demo_port_in_use() -> None:
    with taken_port() as port:
        result = await run_iopd("demo", "--port", str(port), "--admin-port", "0")
    assert_one_line(
        result,
        f"iopd demo: cannot listen on 127.0.0.1:{port} (--port): address already in use: "
        "another process holds that port (a first demo?): run with --port 0 for any free port",
    )


async def test_demo_admin_port_in_use_names_the_flag() -> None:
    with taken_port() as port:
        result = await run_iopd("demo", "--port", "0", "--admin-port", str(port))
    assert_one_line(
        result,
        f"iopd demo: cannot listen on 127.0.0.1:{port} (--admin-port): address already in use: "
        "another process holds that port (a first demo?): run with --admin-port 0 for any "
        "free port",
    )


async def test_demo_rejects_a_port_out_of_range() -> None:
    code, _, stderr = await run_iopd("demo", "--admin-port", "70000")
    assert code == 2  # argparse usage error, before anything starts
    assert "--admin-port: must be 0-65535 (got 70000)" in stderr
    assert "Traceback" not in stderr


# ------------------------------------------------------------------ TLS files


async def test_edge_tls_cert_missing(tmp_path: Path) -> None:
    cert, key = tmp_path / "missing.pem", tmp_path / "missing.key"
    config = tmp_path / "edge.yaml"
    config.write_text(edge_yaml(tls={"cert": str(cert), "key": str(key)}))
    result = await run_iopd("edge", "--config", str(config))
    assert_one_line(
        result, f"iopd edge: cannot read edge.tls.cert {cert}: no such file or directory"
    )


async def test_edge_tls_cert_not_pem(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("not a certificate\n")
    key.write_text("not a key\n")
    config = tmp_path / "edge.yaml"
    config.write_text(edge_yaml(tls={"cert": str(cert), "key": str(key)}))
    code, stdout, stderr = await run_iopd("edge", "--config", str(config))
    assert code == 1 and "Traceback" not in stdout + stderr
    (line,) = stderr.splitlines()
    assert line.startswith(f"iopd edge: cannot load edge.tls certificates {cert}, {key}: "), line


async def test_node_tls_ca_missing(tmp_path: Path) -> None:
    ca = tmp_path / "absent-ca.pem"
    config = tmp_path / "node.yaml"
    config.write_text(NODE_YAML.format(token=NODE_TOKEN, tls=f"  tls: {{ca: {ca}}}\n"))
    result = await run_iopd("node", "--config", str(config))
    assert_one_line(result, f"iopd node: cannot read node.tls.ca {ca}: no such file or directory")
    assert NODE_TOKEN not in result[1] + result[2]


# ------------------------------------------------------------------ the config file


@pytest.mark.parametrize("command", ["edge", "node"])
async def test_config_missing(tmp_path: Path, command: str) -> None:
    path = tmp_path / "absent.yaml"
    result = await run_iopd(command, "--config", str(path))
    assert_one_line(result, f"iopd {command}: cannot read config {path}: no such file or directory")


async def test_config_is_a_directory(tmp_path: Path) -> None:
    result = await run_iopd("node", "--config", str(tmp_path))
    assert_one_line(result, f"iopd node: cannot read config {tmp_path}: is a directory")


async def test_config_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "edge.yaml"
    path.write_bytes(b"edge:\n  id: \xff\n")
    result = await run_iopd("edge", "--config", str(path))
    assert_one_line(
        result, f"iopd edge: cannot read config {path}: not UTF-8 text (byte offset 12)"
    )


# ------------------------------------------------------------------ a second demo


async def test_demo_on_free_ports_prints_where_its_admin_api_is() -> None:
    """``--port 0 --admin-port 0``: a demo that never collides with a first one."""
    with trio.fail_after(GUARD):
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "iopd", "demo", "--port", "0", "--admin-port", "0"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        try:
            assert proc.stdout is not None
            out = b""
            while b"Press Ctrl-C" not in out:
                chunk = await proc.stdout.receive_some(65536)
                assert chunk, out.decode()
                out += chunk
            text = out.decode()
            admin = re.search(r"admin API: +http://127\.0\.0\.1:(\d+)", text)
            assert admin is not None, text
            port = int(admin.group(1))
            admin_url = f"http://127.0.0.1:{port}"
            assert port != 7071 and f"  iopd status --admin {admin_url}\n" in text
            assert f"  console:          {admin_url}/  (open it in a browser" in text
            # The printed command, run as printed, reaches this demo.
            code, out, err = await run_iopd("status", "--admin", admin_url)
            assert (code, err) == (0, ""), err
            assert out.startswith("edge demo-edge\n")
            status = await http_request(("127.0.0.1", port), "GET", "/status")
            assert status.status == 200
            proc.send_signal(signal.SIGINT)
            assert await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()
