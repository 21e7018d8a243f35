"""The node's executor: runs what the edge sends and owns every terminal message.

``NodeExecutor`` implements ``iopd.node.handler.NodeHandler``.  For each
stream it looks the provider up in the current adapter registry, runs the
adapter inside a cancel scope registered under the stream id, turns the
adapter's output calls into ``RunEvent`` / ``ProviderTunnelFrame`` messages,
and always ends the stream with exactly one terminal message:

==============  ==================================================
outcome         messages sent after the adapter's output
==============  ==================================================
success         usage (if any usage is known), ``complete`` / ``end``
AdapterError    usage (if any), ``error`` with the adapter's code
``cancel()``    usage so far (if any), ``error`` code ``cancelled``
==============  ==================================================

Stream ids are the edge's, so with several edges (``node.edges``) they
collide: streams are kept per ``(edge, stream_id)``, and each edge's session
talks to the executor through its own ``EdgeStreams`` view (``for_edge``).

After a ``cancel()`` the terminal is sent shielded with a short timeout (it
may wait for credit).  A ``trio.Cancelled`` from *outside* (the link is gone,
the daemon stops) is never swallowed: nothing more can be sent, the stream
just ends.  A send that fails because the link broke cancels the stream's
own scope and ends it quietly.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from iopd.http.client import EarlyStart
from iopd.node.adapters.base import Adapter, AdapterError, RunOutput, TunnelOutput
from iopd.node.handler import StreamSender
from iopd.node.health import HealthMonitor
from iopd.node.registry import AdapterRegistry, RegistryError
from iopd.node.shared_state import SharedState
from iopd.redact import Scrubber
from wire.messages import (
    ControlState,
    ControlUpdate,
    NodeConfig,
    NodeConfigAck,
    NodeConfigState,
    ProviderStatus,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    RunEvent,
    RunRequest,
    Usage,
)

log = logging.getLogger(__name__)

#: Seconds allowed for sending the terminal messages of a cancelled stream.
CANCEL_TERMINAL_TIMEOUT = 5.0
#: Cancels kept for streams whose task has not started yet (see ``cancel``).
MAX_EARLY_CANCELS = 1024


def _has_usage(usage: Usage | None) -> bool:
    return usage is not None and any(
        v is not None
        for v in (
            usage.input_tokens,
            usage.output_tokens,
            usage.reasoning_tokens,
            usage.cached_input_tokens,
        )
    )


def _find_adapter_error(exc: BaseException) -> AdapterError | None:
    """The AdapterError in ``exc`` (also inside an exception group), if any."""
    if isinstance(exc, AdapterError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _find_adapter_error(inner)
            if found is not None:
                return found
    return None


#: A non-streamed body is held back (to leave with the terminal in one write)
#: up to this many bytes; beyond, it is written as it arrives.
MAX_HELD_BODY_BYTES = 256 * 1024
#: Content types relayed piece by piece (never held).
_STREAMED_TYPES = ("text/event-stream", "application/x-ndjson")


@dataclass
class _Stream:
    """One stream in flight: its cancel scope and how it is being told to stop."""

    stream_id: int
    sender: StreamSender
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    cancel_reason: str | None = None
    link_gone: bool = False

    def __post_init__(self) -> None:
        # ``send_held`` (the node link's sender has it) lets a frame that another
        # follows at once leave in the same write: fewer syscalls and wakeups.
        # Looked up once per stream, not per frame.
        self._send_held: Callable[[RunEvent | ProviderTunnelFrame], Awaitable[None]] = getattr(
            self.sender, "send_held", self.sender.send
        )
        # ``send_soon``: a frame may leave at the end of the scheduler round,
        # in one write with the other streams' frames of that round.
        self._send_soon: Callable[[RunEvent | ProviderTunnelFrame], Awaitable[None]] = getattr(
            self.sender, "send_soon", self.sender.send
        )

    async def send(self, msg: RunEvent | ProviderTunnelFrame, *, hold: bool = False) -> None:
        """Send an output message; a broken link ends the stream's work.

        ``hold=True``: the caller sends another frame right after this one.
        """
        try:
            await (self._send_held if hold else self._send_soon)(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.link_gone = True
            self.scope.cancel()
            await trio.lowlevel.checkpoint()  # raises Cancelled for our own scope
            raise  # pragma: no cover - unreachable: the scope is cancelled

    async def send_terminal(self, *msgs: RunEvent | ProviderTunnelFrame) -> None:
        """Send the closing messages (in one write); a broken link is not an error here."""
        if self.link_gone:
            return
        try:
            last = len(msgs) - 1
            for i, msg in enumerate(msgs):
                await (self._send_held if i < last else self.sender.send)(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.link_gone = True


class _WireRunOutput(RunOutput):
    def __init__(self, stream: _Stream) -> None:
        super().__init__()
        self._stream = stream

    async def text(self, delta: str) -> None:
        await self._stream.send(RunEvent(stream_id=self._stream.stream_id, kind="text", text=delta))

    async def reasoning(self, delta: str) -> None:
        await self._stream.send(
            RunEvent(stream_id=self._stream.stream_id, kind="reasoning", text=delta)
        )

    async def tool_call(self, call: dict[str, Any]) -> None:
        await self._stream.send(
            RunEvent(stream_id=self._stream.stream_id, kind="tool_call", tool_call=call)
        )


class _WireTunnelOutput(TunnelOutput):
    def __init__(self, stream: _Stream) -> None:
        super().__init__()
        self._stream = stream
        self.head_sent = False
        self._hold = False
        self._held_bytes = 0

    async def head(
        self, status: int, headers: list[tuple[str, str]], *, body_follows: bool = False
    ) -> None:
        self.head_sent = True
        # A whole (not streamed) body follows at once: hold the head and the
        # body so that, with the terminal, they leave in one write.  SSE and
        # NDJSON are written piece by piece as they arrive.
        self._hold = not any(
            k.lower() == "content-type" and v.lower().startswith(_STREAMED_TYPES)
            for k, v in headers
        )
        await self._stream.send(
            ProviderTunnelFrame(
                stream_id=self._stream.stream_id, kind="head", status=status, headers=headers
            ),
            # Held too when the first body bytes are already here (SSE included):
            # one write, and the edge writes the caller's head with the first chunk.
            hold=self._hold or body_follows,
        )

    async def body(self, data: bytes) -> None:
        if data:
            self._held_bytes += len(data)
            hold = self._hold and self._held_bytes <= MAX_HELD_BODY_BYTES
            if not hold:
                self._held_bytes = 0
            await self._stream.send(
                ProviderTunnelFrame(stream_id=self._stream.stream_id, kind="body", data=data),
                hold=hold,
            )


class NodeExecutor:
    """Runs streams on the current adapter registry (``NodeHandler``)."""

    def __init__(self, *, health: HealthMonitor | None = None, secrets: Iterable[str] = ()) -> None:
        """``secrets``: the node's own (its token), scrubbed with every provider key."""
        self.registry: AdapterRegistry | None = None
        self._own_secrets = tuple(secrets)
        self._secrets = Scrubber(())
        self._secrets_of: AdapterRegistry | None = None
        self._scrub_secrets_of(None)
        self.health = health if health is not None else HealthMonitor()
        self.draining = False
        self._streams: dict[tuple[str, int], _Stream] = {}  # by (edge, stream id)
        # Cancels that arrived before their stream's task started (the link
        # reads a request and its Cancel in one go and spawns the task after).
        self._early_cancels: dict[tuple[str, int], str] = {}
        self._idle = trio.Event()
        self._idle.set()
        self._config_lock = trio.Lock()
        #: What every edge must agree on (issue #20): the config revision in
        #: force and the runtime controls.
        self.shared = SharedState()

    # ------------------------------------------------------------ config

    async def on_config(self, msg: NodeConfig, *, edge: str = "") -> NodeConfigAck:
        """Build a registry for ``edge``'s push ``msg`` and swap it in; the old one
        drains, then closes.

        A push that ``ConfigInForce`` does not admit (a lower revision, or
        another edge's different config at the same revision) is acknowledged
        and not applied: the edge learns from ``NodeConfigState`` that it differs.
        """
        shared = self.shared
        async with self._config_lock:
            current = self.registry
            ack = NodeConfigAck(stream_id=msg.stream_id, version=msg.version)
            if current is not None and not shared.config.admits(edge, msg):
                log.warning(
                    "event=node_config_not_applied edge=%s revision=%d in_force=%d source=%s",
                    edge,
                    msg.revision,
                    shared.config.revision,
                    shared.config.source,
                )
                return ack
            if current is not None and current.specs == list(msg.providers):
                if shared.config.applied(edge, msg):
                    shared.broadcast(shared.config.state())
                return ack
            try:
                new = AdapterRegistry.build(msg.providers, version=msg.version)
            except RegistryError as exc:
                log.warning(
                    "event=node_config_rejected version=%d reason=%r", msg.version, str(exc)
                )
                return NodeConfigAck(
                    stream_id=msg.stream_id, version=msg.version, ok=False, error=str(exc)
                )
            self.registry = new
            self._scrub_secrets_of(new)
            self.health.set_registry(new)
            shared.config.applied(edge, msg)
            shared.controls.retain(new.adapters)
            log.info(
                "event=node_config_applied version=%d revision=%d edge=%s providers=%s",
                msg.version,
                msg.revision,
                edge,
                ",".join(new.adapters) or "-",
            )
            shared.broadcast(shared.config.state())
            shared.broadcast(shared.controls.state())
            if current is not None:
                await current.retire()
            return ack

    @property
    def secrets(self) -> Scrubber:
        """Scrubs the node's token and the current providers' keys from text."""
        if self._secrets_of is not self.registry:
            self._scrub_secrets_of(self.registry)
        return self._secrets

    def _scrub_secrets_of(self, registry: AdapterRegistry | None) -> None:
        self._secrets_of = registry
        keys = (s.api_key for s in registry.specs) if registry is not None else ()
        self._secrets = Scrubber([*self._own_secrets, *keys])

    def current_status(self) -> ProviderStatus:
        """Health of every provider (``unknown`` before its first probe)."""
        return self.health.current_status()

    # ------------------------------------------------------------ streams

    @property
    def active_streams(self) -> int:
        return len(self._streams)

    def for_edge(self, edge: str) -> EdgeStreams:
        """The ``NodeHandler`` for the session with ``edge`` (its streams apart)."""
        return EdgeStreams(self, edge)

    def cancel(self, stream_id: int, reason: str, *, edge: str = "") -> None:
        """Stop ``edge``'s stream ``stream_id`` at once; it still sends its terminal
        ``cancelled``."""
        key = (edge, stream_id)
        stream = self._streams.get(key)
        if stream is None:
            # Its serve_stream is spawned but has not run yet: it picks this up.
            # (The link only forwards a Cancel for a stream it has spawned, so
            # entries do not pile up; the cap guards against other callers.)
            if len(self._early_cancels) < MAX_EARLY_CANCELS:
                self._early_cancels.setdefault(key, reason or "cancelled")
        elif stream.cancel_reason is None:
            stream.cancel_reason = reason or "cancelled"
            stream.scope.cancel()

    def cancel_all(self, reason: str) -> None:
        """Cancel every stream in flight (drain deadline)."""
        for edge, stream_id in list(self._streams):
            self.cancel(stream_id, reason, edge=edge)

    def begin_drain(self) -> None:
        """Take no new streams from now on (in-flight ones continue).

        The providers are reported unhealthy, so the edge stops sending work here.
        """
        self.draining = True
        self.health.begin_drain()

    async def wait_idle(self) -> None:
        """Wait until no stream is in flight."""
        while self._streams:
            await self._idle.wait()

    def start_early(self, req: RunRequest | ProviderTunnelRequest) -> EarlyStart | None:
        """Begin a passthrough request now, from the link's reader (see ``NodeHandler``).

        Only when the adapter can do it without waiting (an idle provider
        connection); anything else, or any error, is None and ``serve_stream``
        does it all as usual.
        """
        if not isinstance(req, ProviderTunnelRequest) or self.draining:
            return None
        registry = self.registry
        adapter = registry.get(req.provider_id) if registry is not None else None
        if adapter is None or registry is None or registry.retired:
            return None
        try:
            return adapter.start_early(req)
        except Exception:
            log.exception("event=early_start_failed provider=%s", req.provider_id)
            return None

    async def serve_stream(
        self,
        req: RunRequest | ProviderTunnelRequest,
        sender: StreamSender,
        early: EarlyStart | None = None,
        *,
        edge: str = "",
    ) -> None:
        """Run ``edge``'s request to completion, sending every reply incl. exactly one
        terminal.

        ``early``: what ``start_early`` returned for ``req``, owned here: it
        goes to the adapter's ``tunnel`` and is abandoned when the stream ends
        (a no-op once the adapter's HTTP client took it).
        """
        try:
            await self._serve_stream(req, sender, early, edge)
        finally:
            if early is not None:
                early.abandon()

    async def _serve_stream(
        self,
        req: RunRequest | ProviderTunnelRequest,
        sender: StreamSender,
        early: EarlyStart | None,
        edge: str,
    ) -> None:
        stream = _Stream(req.stream_id, sender)
        key = (edge, req.stream_id)
        early_cancel = self._early_cancels.pop(key, None)
        tunnel = isinstance(req, ProviderTunnelRequest)
        registry = self.registry
        adapter = registry.get(req.provider_id) if registry is not None else None
        if self.draining or registry is None or adapter is None:
            code = "provider_error" if self.draining else "bad_request"
            message = (
                "node is shutting down"
                if self.draining
                else f"unknown provider {req.provider_id!r} on this node"
            )
            await stream.send_terminal(self._error(req, code, message))
            return
        self._streams[key] = stream
        self._idle = trio.Event()
        if early_cancel is not None:
            self.cancel(req.stream_id, early_cancel, edge=edge)
        start = trio.current_time()
        try:
            async with registry.use():
                if isinstance(req, ProviderTunnelRequest):
                    await self._tunnel(adapter, req, stream, early)
                else:
                    await self._run(adapter, req, stream)
        finally:
            if self._streams.get(key) is stream:
                del self._streams[key]
            if not self._streams:
                self._idle.set()
            log.debug(
                "event=stream_end stream=%d provider=%s path=%s ms=%d",
                req.stream_id,
                req.provider_id,
                "tunnel" if tunnel else "run",
                int((trio.current_time() - start) * 1000),
            )

    @staticmethod
    def _error(
        req: RunRequest | ProviderTunnelRequest, code: str, message: str
    ) -> RunEvent | ProviderTunnelFrame:
        if isinstance(req, ProviderTunnelRequest):
            return ProviderTunnelFrame(
                stream_id=req.stream_id, kind="error", code=code, message=message
            )
        return RunEvent(stream_id=req.stream_id, kind="error", code=code, message=message)

    async def _execute(self, stream: _Stream, work: Any, adapter: Adapter) -> AdapterError | None:
        """Run ``work()`` in the stream's scope; the failure to report, if any.

        Every piece (8+ characters) of every secret the node holds is scrubbed
        from the message here, the one boundary every adapter error passes (a
        provider may echo its key back, and a quote of its body may cut it).
        """
        provider_id = adapter.spec.id
        error: AdapterError | None = None
        with stream.scope:
            try:
                await work()
            except Exception as exc:
                error = _find_adapter_error(exc)
                if error is None:
                    log.warning(
                        "event=adapter_crashed provider=%s error=%s",
                        provider_id,
                        type(exc).__name__,
                    )
                    error = AdapterError("provider_error", "internal error in the node adapter")
        if error is not None:
            clean = self.secrets.scrub(error.message)
            if clean is not error.message:
                error = AdapterError(error.code, clean, retry_after=error.retry_after)
        if error is not None and error.code != "bad_request":
            log.info(
                "event=provider_error provider=%s code=%s message=%r",
                provider_id,
                error.code,
                error.message,
            )
        return error

    async def _run(self, adapter: Adapter, req: RunRequest, stream: _Stream) -> None:
        out = _WireRunOutput(stream)
        error = await self._execute(stream, lambda: adapter.run(req, out), adapter)
        if stream.link_gone:
            return
        sid = req.stream_id
        usage = (
            [RunEvent(stream_id=sid, kind="usage", usage=out.usage)]
            if _has_usage(out.usage)
            else []
        )
        await _end_stream(
            stream,
            usage,
            error,
            lambda code, message: RunEvent(
                stream_id=sid,
                kind="error",
                code=code,
                message=message,
                metadata=_error_metadata(error) if code != "cancelled" else {},
            ),
            RunEvent(stream_id=sid, kind="complete", finish_reason=out.finish_reason or "stop"),
        )

    async def _tunnel(
        self,
        adapter: Adapter,
        req: ProviderTunnelRequest,
        stream: _Stream,
        early: EarlyStart | None,
    ) -> None:
        out = _WireTunnelOutput(stream)
        error = await self._execute(stream, lambda: adapter.tunnel(req, out, early), adapter)
        if stream.link_gone:
            return
        sid = req.stream_id
        usage: list[ProviderTunnelFrame] = []
        if _has_usage(out.usage) or out.reasoning_chars:
            usage.append(
                ProviderTunnelFrame(
                    stream_id=sid,
                    kind="usage",
                    body_usage=out.usage if _has_usage(out.usage) else None,
                    reasoning_chars=out.reasoning_chars,
                )
            )
        if error is None and not out.head_sent:
            error, usage = AdapterError("provider_error", "no response head"), []
        await _end_stream(
            stream,
            usage,
            error,
            lambda code, message: ProviderTunnelFrame(
                stream_id=sid, kind="error", code=code, message=message
            ),
            ProviderTunnelFrame(stream_id=sid, kind="end"),
        )


class EdgeStreams:
    """``NodeHandler`` for one edge's session: the shared executor, this edge's streams.

    Config, early starts and status are the node's (shared); streams and
    their cancels are keyed by this edge, whose stream ids may equal
    another edge's.
    """

    def __init__(self, executor: NodeExecutor, edge: str) -> None:
        self.executor = executor
        self.edge = edge

    async def on_config(self, msg: NodeConfig) -> NodeConfigAck:
        return await self.executor.on_config(msg, edge=self.edge)

    def on_controls(self, msg: ControlUpdate) -> None:
        registry = self.executor.registry
        providers = registry.adapters if registry is not None else {}
        self.executor.shared.set_controls(msg, providers, self.edge)

    def config_state(self) -> NodeConfigState:
        return self.executor.shared.config.state()

    def control_state(self) -> ControlState:
        return self.executor.shared.controls.state()

    def start_early(self, req: RunRequest | ProviderTunnelRequest) -> EarlyStart | None:
        return self.executor.start_early(req)

    async def serve_stream(
        self,
        req: RunRequest | ProviderTunnelRequest,
        sender: StreamSender,
        early: EarlyStart | None,
    ) -> None:
        await self.executor.serve_stream(req, sender, early, edge=self.edge)

    def cancel(self, stream_id: int, reason: str) -> None:
        self.executor.cancel(stream_id, reason, edge=self.edge)

    def current_status(self) -> ProviderStatus:
        return self.executor.current_status()


def _error_metadata(error: AdapterError | None) -> dict[str, str]:
    """What a run's error event carries besides its code: a 429's ``Retry-After``."""
    if error is None or error.retry_after is None:
        return {}
    return {"retry_after": error.retry_after[:64]}


async def _end_stream(
    stream: _Stream,
    usage: Sequence[RunEvent | ProviderTunnelFrame],
    error: AdapterError | None,
    error_msg: Callable[[str, str], RunEvent | ProviderTunnelFrame],
    done: RunEvent | ProviderTunnelFrame,
) -> None:
    """Send the usage gathered so far, then the one terminal message of the stream.

    A cancelled stream ends with code ``cancelled`` (shielded and bounded: the
    edge is waiting for it); an adapter error with its code; otherwise ``done``.
    """
    if stream.cancel_reason is not None:
        with trio.move_on_after(CANCEL_TERMINAL_TIMEOUT, shield=True):
            await stream.send_terminal(*usage, error_msg("cancelled", stream.cancel_reason))
    elif error is not None:
        await stream.send_terminal(*usage, error_msg(error.code, error.message))
    else:
        await stream.send_terminal(*usage, done)
