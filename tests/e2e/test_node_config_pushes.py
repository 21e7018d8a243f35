"""Config pushes a node rejects or never acknowledges, end to end.

A node that rejects its *first* ``NodeConfig`` (its adapters could not be built) is not
announced: the edge closes its session, logs why, and ``/status`` shows it disconnected.  A
refresh whose push a node rejects (or never acknowledges) stays ``applied: true`` (the edge's
own swap is done) but says so in the report's ``errors`` (never with a secret in it), and
``iopd refresh`` exits 1.

Everything runs a real edge (``tests/support/edges.py``) over loopback; scripted nodes are
``FakeNode`` subclasses that answer config pushes as told.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from iopd.admin_client import refresh_main
from iopd.edge.nodes.node_text import safe_node_reason
from tests.support.edges import running_edge
from tests.support.gateway import metric, wait_until
from tests.support.wire_peers import FakeNode
from wire.messages import Message, NodeConfig, NodeConfigAck, ProviderSpec

# ---------------------------------------- config pushes a node rejects or ignores


class ScriptedAckNode(FakeNode):
    """A FakeNode answering its n-th NodeConfig with ``ACKS[n]`` (the last one repeats):
    ``True`` = ok, a string = rejected with that reason, ``None`` = never answered."""

    ACKS: tuple[bool | str | None, ...] = (True,)
    pushes = 0

    def _dispatch(self, msg: Message) -> None:
        if not isinstance(msg, NodeConfig):
            super()._dispatch(msg)
            return
        answer = self.ACKS[min(self.pushes, len(self.ACKS) - 1)]
        self.pushes += 1
        self.config = msg
        self.received.append(msg)
        if answer is None:
            return
        ok = answer is True
        error = "" if ok else str(answer)
        self.channel.post(
            NodeConfigAck(stream_id=msg.stream_id, version=msg.version, ok=ok, error=error)
        )


BUILD_ERROR = "provider 'echo-2': cannot build the adapter"


class RejectsEverything(ScriptedAckNode):
    ACKS = (BUILD_ERROR,)


class RejectsLaterPushes(ScriptedAckNode):
    ACKS = (True, BUILD_ERROR)


class IgnoresLaterPushes(ScriptedAckNode):
    ACKS = (True, None)


# ---------------------------------------- a node that rejects its first config


async def test_node_rejecting_its_first_config_is_closed_and_not_connected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(60):
        async with running_edge(tmp_path, nodes=["node-a"]) as edge:
            caplog.clear()
            async with edge.fake_node(cls=RejectsEverything) as fake:
                await fake.wait_closed()  # the edge ends the session
                assert isinstance(fake, ScriptedAckNode) and fake.pushes == 1
                assert fake.config is not None
            assert (
                "event=node_config_push node=node-b outcome=rejected "
                f"reason={BUILD_ERROR!r}" in caplog.text
            )
            assert "event=node_connected node=node-b" not in caplog.text
            assert edge.gw.runtime.hub.session("node-b") is None
            [node_b] = [n for n in (await edge.status())["nodes"] if n["id"] == "node-b"]
            assert node_b["connected"] is False and node_b["connected_since"] is None
            assert metric(edge.gw, "iop_connected_nodes") == 1  # node-a only
            # Not routable: echo-2 never takes a lease (node-a's echo-1 serves all).
            for _ in range(4):
                assert (await edge.chat("hi")).status == 200
            assert "echo-2" not in {
                pid for pid, load in edge.gw.runtime.pool.provider_loads().items() if load.in_flight
            }


# ---------------------------------- a refresh whose push is rejected or unanswered


async def test_refresh_reports_a_rejected_push_and_the_cli_exits_1(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    with trio.fail_after(60):
        async with running_edge(tmp_path, nodes=["node-a"]) as edge:
            async with edge.fake_node(cls=RejectsLaterPushes) as fake:
                await wait_until(lambda: edge.gw.runtime.hub.session("node-b") is not None)
                caplog.clear()
                edge.write(cap1=3, cap2=4)  # node-a (a real node) and node-b change
                doc = await edge.refresh("apply")
                assert doc["applied"] is True  # the edge's own swap stands
                assert doc["changed_nodes"] == ["node-a", "node-b"]
                assert doc["errors"] == [f"nodes.node-b: config push rejected: {BUILD_ERROR}"]
                assert isinstance(fake, ScriptedAckNode) and fake.pushes == 2
                assert fake.config is not None
                assert fake.config.version == edge.gw.runtime.snapshot.version
                assert "event=node_config_push node=node-b outcome=rejected" in caplog.text

                # `iopd refresh` prints the line and exits 1 although applied: yes.
                edge.write(cap1=3, cap2=5)
                capsys.readouterr()
                code = await trio.to_thread.run_sync(refresh_main, edge.gw.admin_url)
                out = capsys.readouterr().out
                assert code == 1
                assert "applied: yes" in out
                assert f"errors: nodes.node-b: config push rejected: {BUILD_ERROR}" in out

                # A clean apply (only node-a changes) exits 0 again.
                edge.write(cap1=4, cap2=5)
                code = await trio.to_thread.run_sync(refresh_main, edge.gw.admin_url)
                assert code == 0 and "errors: -" in capsys.readouterr().out


async def test_refresh_reports_an_unanswered_push(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("iopd.edge.runtime.edge_runtime.NODE_PUSH_TIMEOUT", 0.5)
    with trio.fail_after(60):
        async with running_edge(tmp_path, nodes=["node-a"]) as edge:
            async with edge.fake_node(cls=IgnoresLaterPushes):
                await wait_until(lambda: edge.gw.runtime.hub.session("node-b") is not None)
                doc = await edge.apply(cap2=4)
                version = edge.gw.runtime.snapshot.version
                assert doc["errors"] == [
                    f"nodes.node-b: config push failed: node node-b did not acknowledge "
                    f"config version {version} within 0.5s"
                ]


def test_a_push_reason_never_carries_a_secret() -> None:
    """What a node echoes back is cleaned before it reaches a report or a log."""
    pushed = NodeConfig(
        stream_id=1,
        version=2,
        providers=[
            ProviderSpec(id="api-1", type="openai", api_key="sk-live-SECRET-1"),
            ProviderSpec(id="echo-1", type="echo"),
        ],
    )
    echoed = (
        "provider 'api-1': bad key sk-live-SECRET-1 for https://user:hunter2@api.example\n"
        "bearer edge-bearer-SECRET"
    )
    reason = safe_node_reason(echoed, pushed, known_secrets=["edge-bearer-SECRET", ""])
    for secret in ("sk-live-SECRET-1", "hunter2", "edge-bearer-SECRET"):
        assert secret not in reason
    assert "\n" not in reason and reason.startswith("provider 'api-1': bad key <redacted>")
    assert len(safe_node_reason("x" * 1000, pushed)) == 200
    assert safe_node_reason("", pushed) == "no reason given"
