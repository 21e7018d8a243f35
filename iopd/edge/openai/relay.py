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
"""

from __future__ import annotations

from iopd import errors
from iopd.edge.node_session import NodeSession
from iopd.edge.openai import requests as rq
from iopd.edge.openai.lifecycle import HOP_BY_HOP, Outcome
from iopd.edge.openai.prepare import Body, LeasedRequest
from iopd.edge.openai.upstream_headers import upstream_headers
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
    """Relay the caller's request to the leased provider, ``model`` rewritten."""
    request = leased.request
    treq = ProviderTunnelRequest(
        stream_id=0,
        provider_id=leased.lease.provider_id,
        method="POST",
        path=request.path,
        headers=tunnel_headers(leased.snap, request, leased.provider_auth),
        body=rq.rewrite_model(leased.body.raw, leased.lease.target),
    )
    await _relay(leased.session, treq, responder, out)


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
    session: NodeSession, treq: ProviderTunnelRequest, responder: Responder, out: Outcome
) -> None:
    """Relay a provider's raw response: status, end-to-end headers, body bytes."""
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
                    headers = [(k, v) for k, v in fr.headers if k.lower() not in _NOT_RELAYED]
                    headers.append((UPSTREAM_STATUS_HEADER, str(fr.status)))
                    ctype = next((v for k, v in headers if k.lower() == "content-type"), "")
                    if ctype.startswith(_STREAMING_TYPES):
                        headers.append(("X-Accel-Buffering", "no"))
                    await responder.start(fr.status, headers, hold=frames.buffered() > 0)
                    out.http_status = fr.status
                elif kind == "usage":
                    body_usage = fr.body_usage or body_usage
                    frame_usage = fr.usage or frame_usage
                    out.reasoning_chars += fr.reasoning_chars
                elif kind == "end":
                    await responder.end()
                    out.answered(out.http_status)
                    return
                else:  # error
                    raise _tunnel_error(fr)
    finally:
        out.usage = tunnel_usage(body_usage, frame_usage)
        out.reasoning_reported = bool(
            (body_usage and body_usage.reasoning_tokens)
            or (frame_usage and frame_usage.reasoning_tokens)
        )


def _tunnel_error(fr: ProviderTunnelFrame) -> errors.GatewayError:
    msg = fr.message or "the provider failed"
    if fr.code == "provider_timeout":
        return errors.ProviderTimeout(msg)
    if fr.code == "bad_request":
        return errors.InvalidRequest(msg)
    return errors.ProviderError(msg)
