"""A rogue edge against a real ``iopd node`` process: the node decides what it runs.

The edge is scripted (``FakeEdge``, the real wire and the edge's own SCRAM
code) and pushes a ``cli`` provider whose command and health command would
each write a file.  Two ways in, both shut:

* it knows only the old ``sha256(token)`` of the node and asks for the
  legacy proof: the node (no ``node.accept_legacy_proof``) refuses before
  any session, logs how to migrate, and never gets the push;
* it holds the real verifier (an edge that was taken over): the node applies
  the rest of the push, reports the provider refused, answers a run on it
  with an error, and no process is ever started.

"No process started" is asserted twice: neither file exists, and the node
process has no child at any point we look (``/proc/<pid>/task/*/children``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio

from tests.support.daemons import NODE_TOKEN, Daemon, run_daemon
from tests.support.wire_peers import FakeEdge, FakeEdgeSession
from wire.messages import (
    NodeConfig,
    ProviderSpec,
    ProviderStatus,
    RunEvent,
    RunRequest,
)

GUARD = 60.0

NODE_YAML = """\
node:
  id: node-1
  edge: {edge}
  token: ${{IOP_NODE_TOKEN}}
  reconnect_initial_backoff: 0.1
  reconnect_max_backoff: 1
  allowed_commands:
    - {allowed}
"""

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def _rogue(tmp_path: Path) -> ProviderSpec:
    return ProviderSpec(
        id="rogue",
        type="cli",
        command=["sh", "-c", f"id > {tmp_path / 'ran'}"],
        health_command=["sh", "-c", f"id > {tmp_path / 'probed'}"],
        health_interval=0.05,
    )


#: The one command the node's operator allows (exactly this argv).
ALLOWED = ["sh", "-c", "cat > /dev/null; echo consented"]


def _push(tmp_path: Path) -> NodeConfig:
    return NodeConfig(
        stream_id=1,
        version=1,
        providers=[
            _rogue(tmp_path),
            ProviderSpec(id="agent", type="cli", command=ALLOWED),
            ProviderSpec(id="far", type="openai", base_url="http://192.0.2.1:8000"),
        ],
    )


def _children(pid: int) -> list[str]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += (task / "children").read_text().split()
    return out


def _node_yaml(tmp_path: Path, edge: FakeEdge) -> Path:
    path = tmp_path / "node.yaml"
    allowed = "[" + ", ".join(f'"{a}"' for a in ALLOWED) + "]"
    path.write_text(NODE_YAML.format(edge=edge.address, allowed=allowed))
    return path


def _nothing_ran(tmp_path: Path, node: Daemon) -> None:
    assert not (tmp_path / "ran").exists()
    assert not (tmp_path / "probed").exists()
    assert _children(node.proc.pid) == []


async def test_the_legacy_proof_is_refused_and_nothing_is_pushed(tmp_path: Path) -> None:
    with trio.fail_after(GUARD):
        async with (
            FakeEdge.serve(
                token=NODE_TOKEN, secret="token_sha256", node_config=_push(tmp_path)
            ) as edge,
            trio.open_nursery() as nursery,
        ):
            async with run_daemon(nursery, "node", "node", _node_yaml(tmp_path, edge)) as node:
                line = await node.wait_event("edge_legacy_proof_refused")
                assert "token_verifier" in line["reason"]
                assert "node.accept_legacy_proof" in line["reason"]
                assert NODE_TOKEN not in node.output
                assert node.proc.returncode is None  # it keeps trying, slowly
                with trio.move_on_after(0.5):
                    await edge.accept()
                    raise AssertionError("a session opened on the legacy proof")
                assert node.events("node_config_applied") == []
                _nothing_ran(tmp_path, node)
            nursery.cancel_scope.cancel()


async def _refusal_reported(session: FakeEdgeSession) -> dict[str, str]:
    """Every provider's last error, once ``rogue`` and ``far`` are reported refused."""
    seen: dict[str, str] = {}
    while not {"rogue", "far"} <= seen.keys():
        status = await session.receive(ProviderStatus)
        for h in status.providers:
            if h.health == "unhealthy":
                seen[h.provider_id] = h.last_error
    return seen


def _run(session: FakeEdgeSession, provider: str) -> RunRequest:
    return RunRequest(
        stream_id=session.next_stream_id(),
        provider_id=provider,
        adapter="cli",
        target="m",
        messages=[{"role": "user", "content": "hi"}],
    )


async def _terminal(session: FakeEdgeSession, stream_id: int) -> tuple[str, RunEvent]:
    text = ""
    while True:
        ev = await session.receive(RunEvent)
        assert ev.stream_id == stream_id
        if ev.kind == "text":
            text += ev.text
        if ev.kind in ("complete", "error"):
            return text, ev


async def test_a_pushed_command_outside_consent_never_runs(tmp_path: Path) -> None:
    with trio.fail_after(GUARD):
        async with (
            FakeEdge.serve(token=NODE_TOKEN, node_config=_push(tmp_path)) as edge,
            trio.open_nursery() as nursery,
        ):
            async with run_daemon(nursery, "node", "node", _node_yaml(tmp_path, edge)) as node:
                session = await edge.accept()
                assert session.config_ack is not None and session.config_ack.ok
                errors = await _refusal_reported(session)
                assert errors["rogue"].startswith("refused by node: ")
                assert "node.allowed_commands" in errors["rogue"]
                assert "node.allowed_provider_origins" in errors["far"]
                applied = await node.wait_event("node_config_applied")
                assert applied["providers"] == "agent"
                refused = [e["provider"] for e in node.events("provider_refused")]
                assert sorted(refused) == ["far", "rogue"]

                req = _run(session, "rogue")
                await session.send(req)
                _, end = await _terminal(session, req.stream_id)
                assert (end.kind, end.code) == ("error", "provider_unreachable")  # nothing ran
                _nothing_ran(tmp_path, node)

                # The command the node allows does run: the check is not "never".
                req = _run(session, "agent")
                await session.send(req)
                text, end = await _terminal(session, req.stream_id)
                assert end.kind == "complete" and text.strip() == "consented"
                _nothing_ran(tmp_path, node)
            nursery.cancel_scope.cancel()
