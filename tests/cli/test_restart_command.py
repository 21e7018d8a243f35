"""``iopd restart`` as a real subprocess: against a real edge process it hands over and
prints the new pid; against an edge that cannot, it says why in one line, exit 1.

The edge under test is found by its config (``--config``), as an operator would:
the CLI reads ``edge.admin_listen`` there.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import trio

from tests.support.cli import edge_from_file, iopd
from tests.support.daemons import cluster

EDGE = "edge:\n  id: e\n  admin_listen: 127.0.0.1:{port}\n"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def test_restart_hands_over_to_a_new_process(tmp_path: Path) -> None:
    successor: int | None = None
    try:
        with trio.fail_after(90):
            async with cluster(tmp_path) as c:
                config = tmp_path / "found.yaml"
                config.write_text(EDGE.format(port=c.admin[1]))
                code, out, err = await iopd("restart", "--config", str(config))
                assert (code, err) == (0, ""), err
                done = await c.edge.wait_event("handover_done")
                successor = int(done["successor_pid"])
                assert out == (
                    f"handed over: the new edge process (pid {successor}) serves; "
                    "the old one drains and exits\n"
                )
                assert await c.edge.wait_exit() == 0
    finally:
        if successor is not None:
            _kill(successor)


async def test_an_edge_that_cannot_hand_over_says_so(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with edge_from_file(tmp_path) as (gw, _):  # in a test process: no successor
            code, out, err = await iopd("restart", "--admin", gw.admin_url)
    assert (code, out) == (1, "")
    assert err == (
        "iopd restart: admin API answered 409: 'no restart: this edge cannot start a successor'"
        "; the running edge goes on serving\n"
    )
