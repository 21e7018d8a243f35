"""``iopd demo``: an edge, one node and the built-in ``echo`` provider in one process.

The node is an embedded node (``nodes[].embedded``, ``iopd.edge.embedded``):
it talks to the edge over the real wire on loopback, exactly as two daemons
would; only the process is shared, and its token is minted in memory, so no
file holds one (``configs/demo.yaml`` is the two-daemon form, which needs a
token from ``iopd token``).  The config is ``iopd/demo.yaml``, with the
OpenAI port from ``--port``, the admin port from ``--admin-port`` (0 = any
free port, so a second demo can run) and the wire on a free port.
"""

from __future__ import annotations

import functools
import sys
from importlib import resources
from typing import TYPE_CHECKING

import msgspec
import trio

from iopd.config.load import ConfigError, parse_edge_config
from iopd.config.schema import EdgeConfig
from iopd.logs import setup_logging
from iopd.startup import StartupError, run_daemon

if TYPE_CHECKING:
    from iopd.edge.daemon import EdgeHandle

DEMO_NODE_ID = "demo-node"


DEFAULT_PORT = 8080
DEFAULT_ADMIN_PORT = 7071  # where `iopd status` and `iopd refresh` look by default


def demo_config(port: int, admin_port: int = DEFAULT_ADMIN_PORT) -> EdgeConfig:
    """The embedded demo edge config: OpenAI on ``port``, admin on ``admin_port``, wire on any."""
    text = resources.files("iopd").joinpath("demo.yaml").read_text(encoding="utf-8")
    cfg = parse_edge_config(text, source="demo.yaml")
    openai = msgspec.structs.replace(cfg.openai, listen=f"127.0.0.1:{port}")
    edge = msgspec.structs.replace(
        cfg.edge, node_listen="127.0.0.1:0", admin_listen=f"127.0.0.1:{admin_port}"
    )
    return msgspec.structs.replace(cfg, edge=edge, openai=openai)


def banner(base: str, admin: str, admin_port: int) -> str:
    """What the demo prints once it serves: where everything is and the exact commands."""
    # On the default port `iopd status` finds the demo with no flag; elsewhere the
    # command names the port the demo really bound (``--admin-port 0``).
    flag = "" if admin_port == DEFAULT_ADMIN_PORT else f" --admin {admin}"
    return f"""
iopd demo is serving (edge + node '{DEMO_NODE_ID}' + echo provider).

  OpenAI base URL:  {base}
  model:            echo
  console:          {admin}/  (open it in a browser: nodes, providers, model groups)
  admin API:        {admin}  (/status, /metrics)

Try:
  curl -s {base}/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "echo", "messages": [{{"role": "user", "content": "hello from iopd"}}]}}'

Operate it from another terminal:
  iopd status{flag}
  iopd provider drain echo-1{flag}
  iopd provider enable echo-1{flag}

Press Ctrl-C to stop.
"""


async def run_demo(
    port: int,
    admin_port: int = DEFAULT_ADMIN_PORT,
    *,
    task_status: trio.TaskStatus[EdgeHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    from iopd.edge.daemon import run_edge

    cfg = demo_config(port, admin_port)
    async with trio.open_nursery() as nursery:
        handle = await nursery.start(functools.partial(run_edge, cfg, None, handle_signals=True))
        base = handle.base_url
        admin = f"http://127.0.0.1:{handle.admin[1]}"
        print(banner(base, admin, handle.admin[1]), flush=True)
        task_status.started(handle)


def demo_main(port: int = DEFAULT_PORT, admin_port: int = DEFAULT_ADMIN_PORT) -> int:
    """``iopd demo``; a port in use raises ``StartupError`` (one line, exit 1)."""
    from iopd.edge.daemon import ListenFailed

    try:
        demo_config(port, admin_port)
    except ConfigError as exc:  # pragma: no cover - the embedded file is tested
        for line in exc.errors:
            print(line, file=sys.stderr)
        return 1
    setup_logging("keyvalue", "info")
    try:
        run_daemon(functools.partial(run_demo, port, admin_port))
    except ListenFailed as exc:
        # Name the flag that picks the port in use: 7071 is taken by a first demo.
        flag = {"openai.listen": "--port", "edge.admin_listen": "--admin-port"}.get(exc.key)
        if flag is None:
            raise
        hint = (
            f"another process holds that port (a first demo?): run with {flag} 0 for any free port"
            if exc.in_use
            else f"pick another port with {flag}"
        )
        raise StartupError(
            exc.what, f"{exc.address} ({flag})", f"{exc.os_reason}: {hint}"
        ) from None
    return 0
