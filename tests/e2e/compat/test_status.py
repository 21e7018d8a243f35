"""Truthful status: a provider whose node is gone shows ``disconnected``.

A real edge and node over loopback (tests/support/gateway.py) front a mock OpenAI
server whose health route fails, so the node's last probe says
``unhealthy``.  When the node stops, ``/status``, ``iopd status`` and the
``iop_provider_health`` gauge must say ``disconnected`` (-1), not repeat that
stale probe; when it reconnects, the probe is shown again.
"""

from __future__ import annotations

import sys

import trio

from tests.support.configs import served_edge_yaml
from tests.support.gateway import (
    Gateway,
    provider_health_gauge,
    running_gateway,
    wait_provider_health,
)
from tests.support.mock_providers import MockOpenAIServer


async def _iopd_status(gw: Gateway) -> str:
    proc = await trio.run_process(
        [sys.executable, "-m", "iopd", "status", "--admin", gw.admin_url],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return str(proc.stdout.decode())


def _row(table: str, provider: str) -> list[str]:
    return next(ln.split() for ln in table.splitlines() if f" {provider} " in ln)


async def test_a_stopped_node_shows_disconnected_and_its_probe_again_on_reconnect() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = MockOpenAIServer()
            mock.healthy = False
            await n.start(mock.serve)
            yaml_text = served_edge_yaml(mock.base_url, edge_id="edge-status")
            async with running_gateway(yaml_text) as gw:
                probed = await wait_provider_health(gw, "unhealthy")
                assert probed["last_error"]
                assert await provider_health_gauge(gw) == 0

                gw.kill_node("node-a")
                gone = await wait_provider_health(gw, "disconnected")
                # The stale probe error is not shown as if it were current.
                assert gone["last_error"] == ""
                assert await provider_health_gauge(gw) == -1
                row = _row(await _iopd_status(gw), "vllm-a")
                assert row[:7] == [
                    "node-a",
                    "vllm-a",
                    "openai",
                    "local_inference",
                    "yes",
                    "active",
                    "disconnected",
                ]
                assert "!" not in row  # no last error on the row

                await gw.start_node("node-a")
                back = await wait_provider_health(gw, "unhealthy")
                assert back["last_error"]
                assert await provider_health_gauge(gw) == 0
                assert _row(await _iopd_status(gw), "vllm-a")[6] == "unhealthy"

                mock.healthy = True
                await wait_provider_health(gw, "healthy")
                assert await provider_health_gauge(gw) == 2
            n.cancel_scope.cancel()
