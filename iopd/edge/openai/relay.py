"""The passthrough relay: the caller's body to an OpenAI-compatible (or Ollama)
provider, the provider's response back byte for byte.

The body is the caller's JSON as the edge parsed it, encoded again with
``model`` rewritten to the provider's served name (what that changes of its
spelling: ``docs/compatibility.md``); the caller's headers pass an
allow-list (``upstream_headers``) and the caller's provider credentials
travel under ``provider_auth.target_header``.
The response keeps its status, end-to-end headers and body bytes; only usage
is read on the way (from the node's ``usage`` frames).  Once the head went
out, a failure can only cut the connection (``lifecycle.fail``).

Two header rules make a relayed response read like one HTTP response, not
two stacked: the provider's ``Date`` and ``Server`` are dropped (the edge's
server writes its own on every response, so a caller used to see both,
merged by its client into ``"Mon..., Mon..."``; the edge is the origin the
caller talks to, and the backend's software stays private), and a relayed
error (status 400 or more) carries ``X-Iopd-Upstream-Status`` with the
provider's status, so a provider's own error is told from the edge's (whose
responses never carry it) while the body stays byte-exact.  Like every
response of the edge, a relayed one carries the edge's ``x-request-id``
(the id of its log line), in place of a provider's own.

Most frames never reach the loop below: while it waits, the edge's wire
reader writes them to the caller's socket itself (``_Reply``, the stream's
``NodeStream.direct`` writer): a head whose status cannot be retried, the
body, the end, each read's worth in one write, and notes the usage.  A whole
non-streaming reply (one ``whole`` frame from the node: head, body, usage
and end) then leaves the edge in the reader's task step, without waking
this handler first; it wakes for the terminal and finishes the request
(the attempt's verdict, the outcome) after the caller has its answer.  What
the reader does not take (a 429/5xx head, an error, anything once a frame
is buffered or while the handler is busy), and bytes the socket does not
take at once, come to the loop as before.

Retries: the head is looked at before anything is written.  A
429, 502 or 503 head, or an error frame before any head that says the
provider was never reached (``provider_unreachable``, ``provider_reset``),
is reported to the request's retry policy (``leased.attempts.failed``);
when it answers ``RETRY``, the stream is left (the node cancels it) and the
same body bytes go to the next candidate (``prepare.until_done``).
Otherwise the head is written and the response relayed as it is.  Once the
head went out, nothing is retried: the caller already has the first
provider's status line, and a second answer cannot be spliced behind it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from iopd.edge.metering.usage import tunnel_usage
from iopd.edge.nodes.node_session import NodeSession, NodeStream
from iopd.edge.openai.attempts import Attempts, AttemptVerdict
from iopd.edge.openai.incoming import requests as rq
from iopd.edge.openai.incoming.upstream_headers import upstream_headers
from iopd.edge.openai.lifecycle import HOP_BY_HOP, Outcome
from iopd.edge.openai.outgoing.stream_end import StreamEnd
from iopd.edge.openai.prepare import Body, LeasedRequest, until_done
from iopd.edge.openai.run_errors import provider_error, tunnel_failure
from iopd.edge.pool.outliers import saturation_seconds
from iopd.edge.pool.retry_rules import RETRYABLE_STATUSES, AttemptFailure, FailureKind
from iopd.edge.runtime.edge_runtime import Snapshot
from iopd.errors import NodeDispatchError
from iopd.http.server import Request, Responder
from iopd.tokens import RelayedOutput
from wire.messages import ProviderTunnelFrame, ProviderTunnelRequest, Usage

__all__ = ["UPSTREAM_STATUS_HEADER", "Upstream", "relay"]

JSON = "application/json"
_STREAMING_TYPES = ("text/event-stream", "application/x-ndjson")
#: Provider headers not relayed: hop-by-hop ones, and those the edge's server
#: writes on every response itself (a second copy would be merged by clients).
_NOT_RELAYED = HOP_BY_HOP | {"date", "server"}
#: On a relayed error response: the provider's status (absent on the edge's own
#: answers and on relayed successes).
UPSTREAM_STATUS_HEADER = "X-Iopd-Upstream-Status"
#: Seconds the node's last frames (usage, end) are waited for once the caller
#: closed after its whole answer.
END_GRACE = 2.0


#: What one attempt sends instead of the caller's path and body: (path, body,
#: headers added to the allow-listed ones), decided per leased provider.
Upstream = Callable[[LeasedRequest[Body]], tuple[str, bytes, list[tuple[str, str]]]]


async def relay(
    leased: LeasedRequest[Body],
    responder: Responder,
    out: Outcome,
    *,
    upstream: Upstream[Body] | None = None,
) -> None:
    """Relay the caller's request to the leased provider, ``model`` rewritten;
    on a failure the attempt loop says is safe to retry, to the next one.
    ``upstream`` (the Messages route's): each attempt's path, body and extra headers."""
    headers = tunnel_headers(leased.snap, leased.request, leased.provider_auth)
    await until_done(leased, _relay, headers, responder, out, upstream)


def tunnel_headers(
    snap: Snapshot, request: Request, provider_auth: str | None
) -> list[tuple[str, str]]:
    """The allow-listed caller headers (``upstream_headers``), the provider's
    credentials under ``provider_auth.target_header``, and the JSON type."""
    pa = snap.config.openai.provider_auth
    headers = upstream_headers(
        request.headers,
        extra=snap.config.openai.forward_headers,
        provider_auth_header=pa.header,
    )
    if provider_auth:
        headers.append((pa.target_header, provider_auth))
    headers.append(("content-type", JSON))
    return headers


async def _relay(
    leased: LeasedRequest[Body],
    headers: list[tuple[str, str]],
    responder: Responder,
    out: Outcome,
    upstream: Upstream[Body] | None = None,
) -> bool:
    """One attempt: the caller's body to the leased provider (``model``
    rewritten; or what ``upstream`` makes of the request for it), its raw
    response back: status, end-to-end headers, body bytes.

    True: done.  False: the attempt failed before anything was written and
    the policy said retry (the stream is left; nothing reached the caller).
    """
    lease = leased.lease
    if upstream is None:
        path, body = leased.request.path, rq.rewrite_model(leased.body.raw, lease.target)
    else:
        path, body, extra = upstream(leased)
        present = {k for k, _ in headers}  # a name the allow-list sent goes once
        headers = headers + [(k, v) for k, v in extra if k not in present]
    treq = ProviderTunnelRequest(
        stream_id=0,
        provider_id=lease.provider_id,
        method="POST",
        path=path,
        headers=headers,
        body=body,
        long_context=lease.long,
    )
    session: NodeSession = leased.session
    attempts = leased.attempts
    reply = _Reply(responder, out, count_output=leased.snap.rates_limited)
    try:
        async with session.open_stream(treq) as frames:
            frames.direct = reply
            try:
                return await _relay_frames(frames, reply, attempts, responder, out)
            except trio.Cancelled:
                if reply.delivered:  # the caller had it all, then went: a success
                    await _finish_delivered(frames, reply, attempts, out)
                raise
        return True  # (the node ends every stream with end or error)
    finally:
        out.usage = tunnel_usage(reply.body_usage, reply.frame_usage)
        out.reasoning_reported = bool(
            (reply.body_usage and reply.body_usage.reasoning_tokens)
            or (reply.frame_usage and reply.frame_usage.reasoning_tokens)
        )
        if reply.output is not None:
            out.output_estimate = reply.output.tokens


async def _relay_frames(
    frames: NodeStream[ProviderTunnelFrame],
    reply: _Reply,
    attempts: Attempts,
    responder: Responder,
    out: Outcome,
) -> bool:
    """The frames of one attempt to the caller (see :func:`_relay`)."""
    async for fr in frames:
        kind = fr.kind
        # hold: the next frame is already here, so write both at once.
        if kind == "body":
            if fr.data:
                reply.relayed(fr.data)
                await responder.write(fr.data, hold=frames.buffered() > 0)
        elif kind == "head":
            if _retry_on_head(attempts, fr):
                return False
            reply.start(fr)
            if not frames.buffered():
                await responder.flush()
        elif kind == "usage":
            reply.note_usage(fr)
        elif kind == "end" or kind == "whole":
            if kind == "whole" and not reply.took_whole:
                if _retry_on_head(attempts, fr):
                    return False
                reply.take_whole(fr)
                await responder.flush()
            attempts.succeeded()
            reply.ended = True
            out.answered(out.http_status)
            await responder.end()  # (already written when the reader took the end)
            return True
        else:  # error
            # A retry only while nothing went out: after the head, the
            # caller holds this provider's status and a cut is all that is left.
            failure = tunnel_failure(fr.code, responder.started)  # (the one error map)
            verdict = attempts.failed(failure, caller_saw_bytes=responder.started)
            if verdict is AttemptVerdict.RETRY:
                return False
            raise provider_error(fr.code, fr.message)
    return True


async def _finish_delivered(
    frames: NodeStream[ProviderTunnelFrame],
    reply: _Reply,
    attempts: Attempts,
    out: Outcome,
) -> None:
    """The caller closed once the whole answer (or the stream's terminal
    event) was out: the attempt succeeded.  The node's last frames (the
    usage it read at the provider's end, then the end) are waited for a
    moment, shielded and bounded, so the request is metered with them."""
    frames.direct = None  # nothing more is written to the caller
    if not reply.ended:
        with trio.CancelScope(shield=True, deadline=trio.current_time() + END_GRACE):
            try:
                async for fr in frames:
                    if fr.kind == "usage" or (fr.kind == "whole" and not reply.took_whole):
                        reply.note_usage(fr)
                    if fr.kind in ("end", "whole", "error"):
                        break
            except NodeDispatchError:
                pass  # the node went away: the usage seen so far is what there is
        attempts.succeeded()
    out.answered(out.http_status)


class _Reply:
    """The relayed response, written by whichever task has the frame: the
    handler's loop above, or the edge's wire reader while the loop waits
    (``NodeStream.direct``).

    The reader takes a head that needs no retry decision (below 500, not
    429), body frames of a started response and usage frames, holding the
    bytes; it appends the end's last bytes but leaves the end frame itself
    to the loop (the request is finished there).  A ``whole`` frame (head,
    body, usage and end in one) it writes all of under the same rule, and
    leaves to the loop like an end; ``flush_now``, at the end
    of the read, writes what is held in one non-blocking write.  When the
    socket takes nothing, or only part, ``pending`` makes the loop ``settle``
    it (under ``send_timeout``) before it looks at the next frame.

    Why two writers never collide: trio runs one task at a time, and the
    reader writes only while the handler is parked in its read with nothing
    buffered and nothing pending, so the handler is inside no write of its
    own; every reader write is synchronous (held bytes, one non-blocking
    flush), so it cannot be interrupted half-way either.  Order holds because
    the reader takes a frame only when none is buffered before it: once one
    is, every later frame is buffered behind it until the handler reads.
    What decides the request stays with the handler: a head that may be
    retried, an error frame and every terminal are never taken, so a retry
    is decided before any byte of that attempt is written, and the attempt's
    verdict and outcome are recorded by the handler alone.  A handler that is
    cancelled (deadline, caller gone) stops being parked at once, and leaving
    the stream drops its writer, so nothing more is written for it.
    """

    __slots__ = (
        "_count",
        "_end",
        "_end_written",
        "_out",
        "_responder",
        "_stuck",
        "body_usage",
        "ended",
        "frame_usage",
        "output",
        "took_whole",
    )

    def __init__(self, responder: Responder, out: Outcome, *, count_output: bool = False) -> None:
        self._responder = responder
        self._out = out
        self._count = count_output  # the principal's token limits settle by what was relayed
        #: The output text relayed to the caller (counted when ``count_output``).
        self.output: RelayedOutput | None = None
        self._stuck = False  # flush_now wrote nothing: held bytes wait for the loop
        self.body_usage: Usage | None = None
        self.frame_usage: Usage | None = None
        self.took_whole = False  # the reader wrote a ``whole`` frame (the loop ends it)
        self.ended = False  # the loop saw the end: the attempt's verdict is in
        self._end_written = False  # the reader wrote the end's bytes
        #: A streamed body's terminal event, looked for in what is relayed.
        self._end: StreamEnd | None = None

    @property
    def delivered(self) -> bool:
        """The caller was handed its whole answer: the body and its end, or a
        stream's terminal event (``StreamEnd``; what follows it is only the
        provider's end)."""
        return (
            self.ended
            or self.took_whole
            or self._end_written
            or (self._end is not None and self._end.seen)
        )

    def start(self, fr: ProviderTunnelFrame) -> None:
        """Hold the response's head: the provider's status and end-to-end headers."""
        headers = [(k, v) for k, v in fr.headers if k.lower() not in _NOT_RELAYED]
        if fr.status >= 400:  # a provider's own error, told from the edge's
            headers.append((UPSTREAM_STATUS_HEADER, str(fr.status)))
        ctype = next((v for k, v in headers if k.lower() == "content-type"), "")
        if ctype.startswith(_STREAMING_TYPES):
            headers.append(("X-Accel-Buffering", "no"))
            self._end = StreamEnd()
        self._responder.start_held(fr.status, headers)
        self._out.http_status = fr.status
        if self._count:
            self.output = RelayedOutput(ctype)

    def relayed(self, data: bytes) -> None:
        """Body bytes going to the caller: their output text is counted, and
        a stream's terminal event looked for."""
        if self.output is not None:
            self.output.feed(data)
        if self._end is not None:
            self._end.feed(data)

    def take_whole(self, fr: ProviderTunnelFrame) -> None:
        """Hold a ``whole`` frame's response: head, body and end (the next
        flush writes them) and note its usage."""
        self.start(fr)
        self.note_usage(fr)
        self.relayed(fr.data)
        self._responder.write_held(fr.data)
        self._responder.end_held()
        self.took_whole = True

    def note_usage(self, fr: ProviderTunnelFrame) -> None:
        self.body_usage = fr.body_usage or self.body_usage
        self.frame_usage = fr.usage or self.frame_usage
        self._out.reasoning_chars += fr.reasoning_chars

    # -- DirectWriter (the wire reader, synchronous)

    @property
    def pending(self) -> bool:
        return self._stuck or self._responder.unsent

    def write_now(self, msg: ProviderTunnelFrame) -> bool:
        kind = msg.kind
        responder = self._responder
        if kind == "body":
            if not responder.write_held(msg.data):
                return False
            self.relayed(msg.data)
            return True
        if kind == "usage":
            self.note_usage(msg)
            return True
        if kind == "head":
            if responder.started or _may_retry(msg.status):
                return False
            self.start(msg)
            return True
        if kind == "end":
            responder.end_held()
            self._end_written = True
        elif kind == "whole" and not responder.started and not _may_retry(msg.status):
            self.take_whole(msg)
        return False

    def flush_now(self) -> None:
        self._stuck = not self._responder.flush_nowait()

    async def settle(self) -> None:
        self._stuck = False
        await self._responder.send_unsent()
        await self._responder.flush()


def _may_retry(status: int) -> bool:
    """A head the attempt loop must see before anything is written (429, 5xx)."""
    return status >= 500 or status == 429


def _retry_on_head(attempts: Attempts, fr: ProviderTunnelFrame) -> bool:
    """A provider error status, before the head is written: report it; True to retry."""
    status = fr.status
    if not _may_retry(status):
        return False  # a success, or the caller's own 4xx: relayed (success at its end)
    retry_after = 0.0
    if status == 429:
        value = next((v for k, v in fr.headers if k.lower() == "retry-after"), None)
        retry_after = saturation_seconds(value, wall_now=time.time())
    failure = AttemptFailure(FailureKind.PROVIDER_STATUS, status)
    verdict = attempts.failed(failure, caller_saw_bytes=False, retry_after=retry_after)
    return verdict is AttemptVerdict.RETRY and status in RETRYABLE_STATUSES

