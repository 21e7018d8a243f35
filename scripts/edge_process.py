"""A real ``python -m iopd edge`` for the measurement scripts: started on free
loopback ports from a YAML text, its bound ports read from its
``event=edge_started`` log line, and stopped (TERM, then KILL) on leaving.

    async with running_edge(yaml_text) as edge:
        ... edge.openai_port, edge.admin_port, edge.pid, edge.log_text() ...
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

_STARTED = re.compile(r"event=edge_started .*")


@dataclass(frozen=True)
class EdgeProcess:
    pid: int
    openai_port: int
    admin_port: int
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _port(line: str, name: str) -> int:
    found = re.search(rf"\b{name}=\S+:(\d+)", line)
    return int(found.group(1)) if found else 0


@asynccontextmanager
async def running_edge(
    yaml_text: str, *, start_timeout: float = 30.0
) -> AsyncIterator[EdgeProcess]:
    """The edge of ``yaml_text`` (listeners on port 0), up and listening."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "edge.yaml"
        config.write_text(yaml_text)
        log = Path(tmp) / "edge.log"
        with log.open("wb") as out:
            proc = await trio.lowlevel.open_process(
                [
                    sys.executable,
                    "-m",
                    "iopd",
                    "edge",
                    "--config",
                    str(config),
                    "--log-level",
                    "info",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        try:
            line = None
            with trio.fail_after(start_timeout):
                while line is None:
                    await trio.sleep(0.05)
                    found = _STARTED.search(log.read_text(errors="replace"))
                    line = found.group(0) if found else None
            yield EdgeProcess(proc.pid, _port(line, "openai"), _port(line, "admin"), log)
        finally:
            proc.terminate()
            with trio.move_on_after(10):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
