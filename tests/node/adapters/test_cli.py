"""The cli adapter against real subprocesses: prompt delivery, streaming, errors, kill."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from iopd.node.adapters.base import AdapterError, CollectedRunOutput
from iopd.node.adapters.cli import STDERR_TAIL_BYTES, CliAdapter, render_prompt
from iopd.tokens import estimate_input_tokens
from tests.support.node_parts import adapter_req
from wire.messages import ProviderSpec, RunRequest

PY = sys.executable
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi"},
]


def cli(script: str, **kw: Any) -> CliAdapter:
    return CliAdapter(ProviderSpec(id="agent", type="cli", command=[PY, "-c", script], **kw))


def run_req(
    messages: list[dict[str, Any]] | None = None, workspace: str | None = None
) -> RunRequest:
    return adapter_req("agent", "cli", "agent", messages or MESSAGES, workspace=workspace)


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie nobody reaped yet)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def test_render_prompt_sections() -> None:
    messages: list[dict[str, Any]] = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}],
        },
        {"role": "tool", "content": "result"},
    ]
    assert render_prompt(messages) == (
        "system:\nYou are terse.\n\nuser:\nSay hi\n\n"
        'assistant:\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n\n'
        "tool:\nresult\n"
    )


async def test_prompt_on_stdin_and_usage() -> None:
    adapter = cli("import sys; d = sys.stdin.read(); print('got:' + d, end='')")
    out = CollectedRunOutput()
    with trio.fail_after(10):
        await adapter.run(run_req(), out)
    expected = "got:" + render_prompt(MESSAGES)
    assert out.joined_text == expected
    assert out.usage.input_tokens == estimate_input_tokens(MESSAGES)
    assert out.usage.output_tokens == math.ceil(len(expected) / 4)
    assert out.finish_reason == "stop"


async def test_prompt_as_last_arg() -> None:
    adapter = cli("import sys; print(sys.argv[-1], end='')", prompt_via="arg")
    out = CollectedRunOutput()
    with trio.fail_after(10):
        await adapter.run(run_req(), out)
    assert out.joined_text == render_prompt(MESSAGES)


async def test_stdout_streams_and_utf8_is_decoded_incrementally() -> None:
    script = (
        "import sys, time\n"
        "data = 'héllo 세계 🚀'.encode()\n"
        "for b in data:\n"
        "    sys.stdout.buffer.write(bytes([b])); sys.stdout.flush(); time.sleep(0.002)\n"
    )
    out = CollectedRunOutput()
    with trio.fail_after(10):
        await cli(script).run(run_req(), out)
    assert out.joined_text == "héllo 세계 🚀"
    assert len([k for k, _ in out.events if k == "text"]) > 1
    assert all("\ufffd" not in v for _, v in out.events)


async def test_workspace_is_cwd_and_validated(tmp_path: Path) -> None:
    adapter = cli("import os; print(os.getcwd(), end='')")
    out = CollectedRunOutput()
    with trio.fail_after(10):
        await adapter.run(run_req(workspace=str(tmp_path)), out)
    assert await trio.Path(out.joined_text).resolve() == await trio.Path(tmp_path).resolve()
    for bad in ("relative/dir", str(tmp_path / "missing")):
        with pytest.raises(AdapterError) as info:
            await adapter.run(run_req(workspace=bad), CollectedRunOutput())
        assert info.value.code == "bad_request"


async def test_nonzero_exit_quotes_bounded_stderr_tail() -> None:
    script = "import sys; sys.stderr.write('x' * 10000 + 'THE END'); sys.exit(3)"
    with trio.fail_after(10):
        with pytest.raises(AdapterError) as info:
            await cli(script).run(run_req(), CollectedRunOutput())
    assert info.value.code == "provider_error"
    assert info.value.message.startswith("exit status 3: ")
    assert info.value.message.endswith("THE END")
    assert len(info.value.message) <= STDERR_TAIL_BYTES + 32


async def test_missing_command_is_provider_unreachable() -> None:
    # The process never started: the edge may try another provider.
    adapter = CliAdapter(ProviderSpec(id="a", type="cli", command=["/nonexistent/agent-binary"]))
    with pytest.raises(AdapterError) as info:
        await adapter.run(run_req(), CollectedRunOutput())
    assert info.value.code == "provider_unreachable"


async def test_silent_process_times_out_and_is_killed() -> None:
    script = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    out = CollectedRunOutput()
    with trio.fail_after(10):
        with pytest.raises(AdapterError) as info:
            await cli(script, read_timeout=0.5, kill_grace=0.2).run(run_req(), out)
    assert info.value.code == "provider_timeout"
    assert process_gone(int(out.joined_text.split()[0]))


FORKING_AGENT = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN) if sys.argv[-1] == 'stubborn' else None
child = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])
print(os.getpid(), child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("mode", ["polite", "stubborn"])
async def test_cancel_kills_whole_process_group(mode: str) -> None:
    adapter = CliAdapter(
        ProviderSpec(
            id="agent", type="cli", command=[PY, "-c", FORKING_AGENT, mode], kill_grace=0.3
        )
    )
    pids_printed = trio.Event()

    class Watching(CollectedRunOutput):
        async def text(self, delta: str) -> None:
            await super().text(delta)
            if self.joined_text.endswith("\n"):
                pids_printed.set()

    out = Watching()
    with trio.fail_after(10):
        with trio.move_on_after(30) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(adapter.run, run_req(), out)
                await pids_printed.wait()
                scope.cancel()
    leader, child = (int(p) for p in out.joined_text.split())
    for _ in range(100):  # the orphaned child is reaped by init asynchronously
        if process_gone(leader) and process_gone(child):
            break
        await trio.sleep(0.02)
    assert process_gone(leader)
    assert process_gone(child)


async def test_probe_health_command() -> None:
    assert await cli("pass").probe() == ("healthy", "")
    ok = cli("pass", health_command=[PY, "-c", "pass"])
    assert await ok.probe() == ("healthy", "")
    bad = cli(
        "pass", health_command=[PY, "-c", "import sys; sys.stderr.write('nope'); sys.exit(2)"]
    )
    health, error = await bad.probe()
    assert health == "unhealthy" and "exit status 2" in error and "nope" in error
    missing = cli("pass", health_command=["/nonexistent/health"])
    assert (await missing.probe())[0] == "unhealthy"
