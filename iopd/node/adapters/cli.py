"""The ``cli`` adapter: runs a command-line agent per request.

The process starts in a NEW session (``start_new_session=True``) so the
whole tree it spawns is one process group: on cancel (or any exit of the
run) the group gets SIGTERM, then SIGKILL after ``kill_grace`` seconds, and
the child is reaped — nothing is left behind.

The prompt is the messages rendered as text (``system:`` / ``user:`` /
``assistant:`` / ``tool:`` sections; the edge already put any tool
instructions into the messages), sent on stdin (``prompt_via: stdin``) or as
the last argv item (``arg``).  stdout is streamed as text deltas (UTF-8
decoded incrementally); a gap of more than ``read_timeout`` seconds without
output is a ``provider_timeout``.  The answer ends at stdout's EOF, or once
the command has exited and stdout stays quiet for ``EXIT_DRAIN_SECONDS`` (a
helper it left running may hold stdout open).  A non-zero exit is a
``provider_error`` quoting the tail of stderr (bounded).

Usage is estimated, since a CLI reports none: input = the input-token estimate (``iopd.tokens``)
over the messages, output = ceil(characters of stdout / 4).
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import signal
import subprocess

import trio

from iopd.json_types import JSONObject
from iopd.node.adapters.base import Adapter, AdapterError, RunOutput
from iopd.tokens import content_text, estimate_input_tokens, estimate_tokens_from_chars
from wire.messages import Health, RunRequest

log = logging.getLogger(__name__)

#: Bytes of stderr kept (the tail) for error messages.
STDERR_TAIL_BYTES = 2048
#: Seconds allowed for reaping after SIGKILL.
REAP_SECONDS = 5.0
#: After the command exited: seconds of stdout silence that end the answer.
EXIT_DRAIN_SECONDS = 1.0


def render_prompt(messages: list[JSONObject]) -> str:
    """Messages as plain text: one ``role:`` section per message."""
    sections: list[str] = []
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        role = str(msg.get("role", "user"))
        text = content_text(msg.get("content"))
        calls = msg.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict):
                    function = {}
                args = function.get("arguments", "{}")
                try:
                    parsed = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    parsed = args
                block = json.dumps({"name": function.get("name", ""), "arguments": parsed})
                text += ("\n" if text else "") + f"<tool_call>{block}</tool_call>"
        sections.append(f"{role}:\n{text}")
    return "\n\n".join(sections) + "\n"


class _ExitWatch:
    """Notices the command's exit, and shortens a stdout read in progress then."""

    def __init__(self) -> None:
        self.exited = False
        self.read_scope: trio.CancelScope | None = None

    async def watch(self, proc: trio.Process) -> None:
        await proc.wait()
        self.exited = True
        if self.read_scope is not None:
            self.read_scope.deadline = min(
                self.read_scope.deadline, trio.current_time() + EXIT_DRAIN_SECONDS
            )


class _StderrTail:
    """Keeps the last STDERR_TAIL_BYTES of a process's stderr."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.done = trio.Event()

    async def collect(self, stream: trio.abc.ReceiveStream) -> None:
        try:
            async for chunk in stream:
                self.data += chunk
                if len(self.data) > STDERR_TAIL_BYTES:
                    del self.data[: len(self.data) - STDERR_TAIL_BYTES]
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        self.done.set()

    def text(self) -> str:
        return self.data.decode("utf-8", "replace").strip()


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when the group is gone."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - not our group any more
        return False
    return True


async def terminate_group(proc: trio.Process, grace: float) -> None:
    """SIGTERM the process group, SIGKILL after ``grace`` s, reap the leader.

    Runs shielded: it is what happens *because* of a cancel.
    """
    pgid = proc.pid
    with trio.CancelScope(shield=True):
        if proc.returncode is None:
            _signal_group(pgid, signal.SIGTERM)
            with trio.move_on_after(grace):
                await proc.wait()
        # Anything still in the group (the leader or children it left behind).
        _signal_group(pgid, signal.SIGKILL)
        with trio.move_on_after(REAP_SECONDS):
            await proc.wait()


class CliAdapter(Adapter):
    """One process per request; stdout is the answer."""

    def _argv(self, prompt: str) -> list[str]:
        command = list(self.spec.command or [])
        if not command:
            raise AdapterError("bad_request", f"provider {self.spec.id!r} has no command")
        if self.spec.prompt_via == "arg":
            command.append(prompt)
        return command

    @staticmethod
    def _workspace(req: RunRequest) -> str | None:
        if req.workspace is None or req.workspace == "":
            return None
        if not os.path.isabs(req.workspace) or not os.path.isdir(req.workspace):
            raise AdapterError("bad_request", "workspace must be an absolute existing directory")
        return req.workspace

    async def run(self, req: RunRequest, out: RunOutput) -> None:
        cwd = self._workspace(req)
        prompt = render_prompt(req.messages)
        argv = self._argv(prompt)
        out.usage.input_tokens = estimate_input_tokens(req.messages)
        out.usage.output_tokens = 0
        via_stdin = self.spec.prompt_via == "stdin"
        try:
            proc = await trio.lowlevel.open_process(
                argv,
                stdin=subprocess.PIPE if via_stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                start_new_session=True,
            )
        except OSError as exc:
            raise AdapterError(  # the process never ran: safe to try elsewhere
                "provider_unreachable",
                f"cannot start {os.path.basename(argv[0])}: {exc.strerror}",
            ) from None
        stderr = _StderrTail()
        timeout_error: AdapterError | None = None
        status: int | None = None
        try:
            # Nothing is raised inside the nursery body (trio would wrap it in
            # an ExceptionGroup): failures are recorded and raised after it.
            async with trio.open_nursery() as nursery:
                assert proc.stdout is not None and proc.stderr is not None
                if via_stdin:
                    assert proc.stdin is not None
                    nursery.start_soon(self._feed_stdin, proc.stdin, prompt.encode())
                nursery.start_soon(stderr.collect, proc.stderr)
                exit_watch = _ExitWatch()
                nursery.start_soon(exit_watch.watch, proc)
                timeout_error = await self._stream_stdout(proc.stdout, out, exit_watch)
                if timeout_error is None:
                    with trio.move_on_after(self.spec.read_timeout):
                        status = await proc.wait()
                    if status is None:
                        timeout_error = AdapterError(
                            "provider_timeout", "process did not exit after closing stdout"
                        )
                    else:
                        # stderr normally hits EOF with the exit; a child that
                        # inherited it must not hold the run open.
                        with trio.move_on_after(1.0):
                            await stderr.done.wait()
                nursery.cancel_scope.cancel()
        finally:
            await terminate_group(proc, self.spec.kill_grace)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    with trio.CancelScope(shield=True):
                        await pipe.aclose()
        if timeout_error is not None:
            raise timeout_error
        assert status is not None
        if status != 0:
            reason = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
            tail = stderr.text()
            raise AdapterError("provider_error", f"{reason}: {tail}" if tail else reason)
        out.finish_reason = "stop"

    async def _stream_stdout(
        self, stdout: trio.abc.ReceiveStream, out: RunOutput, exit_watch: _ExitWatch
    ) -> AdapterError | None:
        """Relay stdout as text deltas until EOF (or quiet after the exit); an error
        when output stalls while the command runs."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        chars = 0
        while True:
            chunk = b""
            silence = EXIT_DRAIN_SECONDS if exit_watch.exited else self.spec.read_timeout
            with trio.move_on_after(silence) as stall:
                exit_watch.read_scope = stall
                chunk = bytes(await stdout.receive_some(65536))
            exit_watch.read_scope = None
            if stall.cancelled_caught and not exit_watch.exited:
                return AdapterError(
                    "provider_timeout", f"no output for {self.spec.read_timeout:g}s"
                )
            text = decoder.decode(chunk, final=not chunk)
            if text:
                chars += len(text)
                out.usage.output_tokens = estimate_tokens_from_chars(chars)
                await out.text(text)
            if not chunk:
                return None

    @staticmethod
    async def _feed_stdin(stdin: trio.abc.SendStream, data: bytes) -> None:
        try:
            await stdin.send_all(data)
            await stdin.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the command does not read its stdin: fine

    async def probe(self) -> tuple[Health, str]:
        if not self.spec.health_command:
            return "healthy", ""
        timeout = self.spec.connect_timeout + 5.0
        try:
            with trio.fail_after(timeout):
                result = await trio.run_process(
                    self.spec.health_command,
                    check=False,
                    capture_stdout=True,
                    capture_stderr=True,
                    start_new_session=True,
                )
        except trio.TooSlowError:
            return "unhealthy", f"health_command timed out after {timeout:g}s"
        except OSError as exc:
            return "unhealthy", f"health_command cannot start: {exc.strerror}"
        if result.returncode == 0:
            return "healthy", ""
        tail = result.stderr[-512:].decode("utf-8", "replace").strip()
        return "unhealthy", f"health_command exit status {result.returncode}" + (
            f": {tail}" if tail else ""
        )
