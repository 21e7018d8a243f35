"""``iopd demo``: an edge, one node and the built-in ``echo`` provider in one process.

The node talks to the edge over the real wire on loopback, exactly as two
daemons would; only the process is shared.  The config is ``iopd/demo.yaml``
(the same file as ``configs/demo.yaml``), with the OpenAI port from ``--port``
and the wire on a free port.
"""

from __future__ import annotations

import functools
import sys
from importlib import resources

import msgspec
import trio

from iopd.config.load import ConfigError, parse_edge_config
from iopd.config.schema import EdgeConfig, NodeConfigFile, NodeSection
from iopd.logs import setup_logging

DEMO_NODE_ID = "demo-node"
#: Demo only: its SHA-256 is in demo.yaml.  Never reuse it for a real node.
DEMO_NODE_TOKEN = "demo-node-token"


def demo_config(port: int) -> EdgeConfig:
    """The embedded demo edge config, OpenAI listener on ``port``, wire on a free port."""
    text = resources.files("iopd").joinpath("demo.yaml").read_text(encoding="utf-8")
    cfg = parse_edge_config(text, source="demo.yaml")
    openai = msgspec.structs.replace(cfg.openai, listen=f"127.0.0.1:{port}")
    admin_port = 7071 if port else 0
    edge = msgspec.structs.replace(
        cfg.edge, node_listen="127.0.0.1:0", admin_listen=f"127.0.0.1:{admin_port}"
    )
    return msgspec.structs.replace(cfg, edge=edge, openai=openai)


def demo_node_config(wire_port: int) -> NodeConfigFile:
    return NodeConfigFile(
        node=NodeSection(id=DEMO_NODE_ID, edge=f"127.0.0.1:{wire_port}", token=DEMO_NODE_TOKEN)
    )


async def run_demo(port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[no-untyped-def]
    from iopd.edge.run import run_edge
    from iopd.node.run import run_node

    cfg = demo_config(port)
    async with trio.open_nursery() as nursery:

        async def edge_then_stop(task_status=trio.TASK_STATUS_IGNORED):  # type: ignore[no-untyped-def]
            await run_edge(cfg, None, handle_signals=True, task_status=task_status)
            nursery.cancel_scope.cancel()  # the edge drained: stop the node too

        handle = await nursery.start(edge_then_stop)
        node_cfg = demo_node_config(handle.wire[1])
        await nursery.start(functools.partial(run_node, node_cfg))
        base = handle.base_url
        print(
            f"""
iopd demo is serving (edge + node '{DEMO_NODE_ID}' + echo provider).

  OpenAI base URL:  {base}
  model:            echo
  admin API:        http://127.0.0.1:{handle.admin[1]}  (/status, /metrics)

Try:
  curl -s {base}/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "echo", "messages": [{{"role": "user", "content": "hello from iopd"}}]}}'

Press Ctrl-C to stop.
""",
            flush=True,
        )
        task_status.started(handle)


def demo_main(port: int = 8080) -> int:
    try:
        demo_config(port)
    except ConfigError as exc:  # pragma: no cover - the embedded file is tested
        for line in exc.errors:
            print(line, file=sys.stderr)
        return 1
    setup_logging("keyvalue", "info")
    try:
        trio.run(run_demo, port)
    except OSError as exc:
        print(f"iopd demo: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0
