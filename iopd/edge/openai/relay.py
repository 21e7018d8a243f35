"""The passthrough relay: the caller's body to an OpenAI-compatible (or Ollama)
provider, the provider's response back byte for byte (SPEC §3, §4).

The body is the caller's with ``model`` rewritten to the provider's served
name; the caller's headers pass an allow-list (``upstream_headers``) and the
caller's provider credentials travel under ``provider_auth.target_header``.
The response keeps its status, end-to-end headers and body bytes; only usage
is read on the way (from the node's ``usage`` frames).  Once the head went
out, a failure can only cut the connection (``lifecycle.fail``).

Two header rules make a relayed response read like one HTTP response, not
two stacked: the provider's ``Date`` and ``Server`` are dropped (the edge's
server writes its own on every response, so a caller used to see both,
merged by its client into ``"Mon..., Mon..."``; the edge is the origin the
caller talks to, and the backend's software stays private), and
``X-Iopd-Upstream-Status`` carries the provider's status, so a provider's
own error is told from the edge's (whose responses never carry it) while
the body stays byte-exact.

A streamed body's chunks mostly never reach the loop below: while it waits,
the edge's wire reader writes each body frame to the caller's socket itself
(``_BodyWriter``, ``NodeStream.direct``), falling back to the loop for a
frame the socket does not take at once.

Retries (issue #16): the head is looked at before anything is written.  A
429, 502 or 503 head, or an error frame before any head that says the
provider was never reached (``provider_unreachable``, ``provider_reset``),
is reported to the request's attempt loop (``leased.leasing.failed``);
when it says retry, the stream is left (the node cancels it) and the same
body bytes go to the next candidate.  Otherwise the head is written and the
response relayed as it is.  Once the head went out, nothing is retried.
"""

from __future__ import annotations

import time

from iopd.edge.node_session import NODE_BUSY, NodeSession
from iopd.edge.openai import requests as rq
from iopd.edge.openai.lifecycle import HOP_BY_HOP, Outcome
from iopd.edge.openai.prepare import Body, LeasedRequest, Leasing
from iopd.edge.openai.run_errors import provider_error
from iopd.edge.openai.upstream_headers import upstream_headers
from iopd.edge.pool.outliers import saturation_seconds
from iopd.edge.pool.retry_rules import RETRYABLE_STATUSES, AttemptFailure, FailureKind
from iopd.edge.runtime import Snapshot
from iopd.edge.usage import tunnel_usage
from iopd.http.server import Request, Responder
from wire.messages import ProviderTunnelFrame, ProviderTunnelRequest, Usage

__all__ = ["UPSTREAM_STATUS_HEADER", "relay"]

JSON = "application/json"
_STREAMING_TYPES = ("text/event-stream", "application/x-ndjson")
#: Provider headers not relayed: hop-by-hop ones, and those the edge's server
#: writes on every response itself (a second copy would be merged by clients).
_NOT_RELAYED = HOP_BY_HOP | {"date", "server"}
#: On every relayed response: the provider's status (absent on the edge's own).
UPSTREAM_STATUS_HEADER = "X-Iopd-Upstream-Status"


async def relay(leased: LeasedRequest[Body], responder: Responder, out: Outcome) -> None:
    """Relay the caller's request to the leased provider, ``model`` rewritten;
    on a failure the attempt loop says is safe to retry, to the next one."""
    request = leased.request
    headers = tunnel_headers(leased.snap, request, leased.provider_auth)
    while True:
        treq = ProviderTunnelRequest(
            stream_id=0,
            provider_id=leased.lease.provider_id,
            method="POST",
            path=request.path,
            headers=headers,
            body=rq.rewrite_model(leased.body.raw, leased.lease.target),
            long_context=leased.lease.long,
        )
        if not await _relay(leased, treq, responder, out):
            return
        leased = await leased.leasing.next_attempt()


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
    treq: ProviderTunnelRequest,
    responder: Responder,
    out: Outcome,
) -> bool:
    """Relay a provider's raw response: status, end-to-end headers, body bytes.

    True: the attempt failed before anything was written and is to be
    retried (the stream is left; nothing reached the caller).
    """
    session: NodeSession = leased.session
    leasing = leased.leasing
    body_usage: Usage | None = None
    frame_usage: Usage | None = None
    try:
        async with session.open_stream(treq) as frames:
            async for fr in frames:
                kind = fr.kind
                # hold: the next frame is already here, so write both at once.
                if kind == "body":
                    if fr.data:
                        await responder.write(fr.data, hold=frames.buffered() > 0)
                elif kind == "head":
                    if _retry_on_head(leasing, fr):
                        return True
                    headers = [(k, v) for k, v in fr.headers if k.lower() not in _NOT_RELAYED]
                    headers.append((UPSTREAM_STATUS_HEADER, str(fr.status)))
                    ctype = next((v for k, v in headers if k.lower() == "content-type"), "")
                    if ctype.startswith(_STREAMING_TYPES):
                        headers.append(("X-Accel-Buffering", "no"))
                    await responder.start(fr.status, headers, hold=frames.buffered() > 0)
                    out.http_status = fr.status
                    frames.direct = _BodyWriter(responder)
                elif kind == "usage":
                    body_usage = fr.body_usage or body_usage
                    frame_usage = fr.usage or frame_usage
                    out.reasoning_chars += fr.reasoning_chars
                elif kind == "end":
                    leasing.succeeded()
                    await responder.end()
                    out.answered(out.http_status)
                    return False
                else:  # error
                    if leasing.failed(_failure_of(fr, responder.started), responder.started):
                        return True
                    raise provider_error(fr.code, fr.message)
        return False  # (the node ends every stream with end or error)
    finally:
        out.usage = tunnel_usage(body_usage, frame_usage)
        out.reasoning_reported = bool(
            (body_usage and body_usage.reasoning_tokens)
            or (frame_usage and frame_usage.reasoning_tokens)
        )


class _BodyWriter:
    """Body frames written to the caller by the edge's wire reader itself while
    this relay waits (``NodeStream.direct``): a streamed chunk then costs the
    edge one task step, not a second one in this handler.  Only data of a
    started response with nothing held back; a frame the socket does not take
    at once (or anything else) comes to the loop above as before."""

    __slots__ = ("_responder",)

    def __init__(self, responder: Responder) -> None:
        self._responder = responder

    @property
    def pending(self) -> bool:
        return self._responder.unsent

    def write_now(self, msg: ProviderTunnelFrame) -> bool:
        return msg.kind == "body" and self._responder.write_nowait(msg.data)

    async def settle(self) -> None:
        await self._responder.send_unsent()


def _retry_on_head(leasing: Leasing[Body], fr: ProviderTunnelFrame) -> bool:
    """A provider error status, before the head is written: report it; True to retry."""
    status = fr.status
    if status < 500 and status != 429:
        return False  # a success, or the caller's own 4xx: relayed (success at its end)
    retry_after = 0.0
    if status == 429:
        value = next((v for k, v in fr.headers if k.lower() == "retry-after"), None)
        retry_after = saturation_seconds(value, wall_now=time.time())
    failure = AttemptFailure(FailureKind.PROVIDER_STATUS, status)
    return leasing.failed(failure, False, retry_after=retry_after) and status in RETRYABLE_STATUSES


#: The node's error codes that say how far a relayed request got (before any head).
_CODE_FAILURES: dict[str, FailureKind] = {
    "provider_unreachable": FailureKind.CONNECT_FAILED,
    "provider_reset": FailureKind.RESET_BEFORE_SEND,
    "provider_timeout": FailureKind.READ_TIMEOUT,
}


def _failure_of(fr: ProviderTunnelFrame, head_sent: bool) -> AttemptFailure:
    """What a tunnel's error frame says happened; anything the node does not name
    (or anything after the head) is a failure after the provider had the request."""
    if fr.code == "bad_request":
        return AttemptFailure(FailureKind.PROVIDER_STATUS, 400)
    if fr.code == NODE_BUSY:  # not admitted: nothing ran (see Leasing.failed)
        return AttemptFailure(FailureKind.NODE_BUSY)
    if head_sent:
        kind = FailureKind.READ_TIMEOUT if fr.code == "provider_timeout" else FailureKind.RESET_AFTER_SEND
        return AttemptFailure(kind)
    return AttemptFailure(_CODE_FAILURES.get(fr.code, FailureKind.RESET_AFTER_SEND))
