"""``iopd restart`` as a real subprocess against a real edge process, found by its
config (``--config``) as an operator would: it hands over and prints the new pid.
(An edge that cannot hand over: tests/cli/test_status.py.)
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import trio

from tests.support.cli import iopd
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
                    f"restarted: the new edge process (pid {successor}) serves; "
                    "the old one drains its open connections and exits\n"
                )
                assert await c.edge.wait_exit() == 0
    finally:
        if successor is not None:
            _kill(successor)
