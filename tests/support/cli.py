"""The CLI's tests: an edge started from a config file, iopd as a subprocess, a table row."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from tests.support.configs import echo_entry, provider_entry, two_node_yaml
from tests.support.gateway import Gateway, running_gateway


def edge_yaml(cap1: int = 2, remote_base: str = "http://127.0.0.1:9", delay_ms: int = 0) -> str:
    """node-a: echo-1 and the OpenAI-compatible remote-1 at ``remote_base``; node-b: echo-2."""
    remote = provider_entry(
        "remote-1",
        "openai",
        category="api",
        base_url=remote_base,
        models=["remote-model"],
        health_interval=1,
    )
    return two_node_yaml(
        edge_id="edge-cli",
        max_queue=12,
        queue_timeout=30,
        node_a=echo_entry(capacity=cap1, delay_ms=delay_ms) + remote,
        node_b=echo_entry("echo-2", category="local_inference", long_context_capacity=1),
    )


@asynccontextmanager
async def edge_from_file(tmp_path: Path, **kw: Any) -> AsyncIterator[tuple[Gateway, Path]]:
    """A gateway running from a config file, with node-a connected and node-b not."""
    path = tmp_path / "edge.yaml"
    path.write_text(edge_yaml(**kw))
    async with running_gateway(path.read_text(), nodes=["node-a"], config_path=str(path)) as gw:
        yield gw, path


async def iopd(
    *args: str, admin_token: str | None = None, admin_url: str | None = None
) -> tuple[int, str, str]:
    """Run ``python -m iopd ARGS`` (``IOP_ADMIN_TOKEN`` = ``admin_token`` and
    ``IOP_ADMIN_URL`` = ``admin_url``, each unset if None); return (exit code,
    stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("IOP_ADMIN_TOKEN", "IOP_ADMIN_URL")}
    if admin_token is not None:
        env["IOP_ADMIN_TOKEN"] = admin_token
    if admin_url is not None:
        env["IOP_ADMIN_URL"] = admin_url
    proc = await trio.run_process(
        [sys.executable, "-m", "iopd", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=env,
    )
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


def row_of(out: str, provider: str) -> list[str]:
    for line in out.splitlines():
        fields = line.split()
        if len(fields) > 1 and fields[1] == provider:
            return fields
    raise AssertionError(f"no table row for {provider}:\n{out}")
