"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

The path is the leased provider's, never the caller's choice:

* a provider declared ``anthropic_messages: true`` (an ``openai`` provider
  whose server speaks Messages itself) gets the caller's body as sent, its
  ``model`` rewritten to the served name and the caller's ``anthropic-*``
  headers added to the relay's allow-list; its answer comes back byte for
  byte, as every relay's;
* any other ``openai`` provider gets the Chat Completions translation
  (``incoming/messages_request.py``) on ``/v1/chat/completions``, and its answer
  (a ``chat.completion``, the chunk stream or an error) is translated back
  (``outgoing/messages_reply.py``) on the way to the caller;
* a normalized provider (``ollama``, ``cli``, ``echo``) runs the translation
  on the normalized chat path (``normalized.chat_once`` / ``chat_stream``),
  whose chat output is translated back the same way.

The last two share ``translating.Translating``, a responder in front of the
caller's that turns chat bytes into Messages bytes; the relay decides per
attempt (a retry may lease the other kind of provider) through its
``upstream`` callable, which also sets whether the answer is translated.
Everything else is the chat route's: ``prepare`` (limits, fair share, the
lease), retries, metering (``endpoint="messages"``), cancel on disconnect.

``count_tokens`` is relayed to a Messages-native provider of the group; a
group without one is answered from the input-token estimate
(``iopd.tokens``), without a lease.
"""

from __future__ import annotations

import msgspec

from iopd import errors
from iopd.edge.openai.anthropic_api.translating import (
    Translating,
    UpstreamRequest,
    anthropic_headers,
    messages_body,
    native,
    refuse_untranslatable,
)
from iopd.edge.openai.incoming.json_body import parse_json_object
from iopd.edge.openai.incoming.messages_request import CountTokensBody, MessagesBody
from iopd.edge.openai.incoming.request_fields import rewrite_model
from iopd.edge.openai.incoming.requests import ChatRequest
from iopd.edge.openai.lifecycle import Call
from iopd.edge.openai.normalized import chat_once, chat_stream
from iopd.edge.openai.prepare import LeasedRequest, model_not_found, prepare
from iopd.edge.openai.relay import relay
from iopd.edge.openai.routes import Host, Serves
from iopd.edge.principals.authenticator import Principal
from iopd.edge.runtime.edge_runtime import Snapshot
from iopd.http.server import Request, Responder
from iopd.tokens import estimate_input_tokens

__all__ = ["api_key", "count_tokens", "serve"]

JSON = "application/json"
_encode = msgspec.json.Encoder().encode


def api_key(snap: Snapshot, headers: list[tuple[str, str]]) -> Principal:
    """The Messages routes' auth: ``Authorization: Bearer`` as on every route,
    or, without it, ``x-api-key`` (how Anthropic's clients send the token)."""
    authorization = next((v for k, v in headers if k == "authorization"), None)
    key = None
    if authorization is None:
        key = next((v for k, v in headers if k == "x-api-key"), None)
    return snap.auth.authenticate(authorization, key)


async def serve(host: Host, call: Call, request: Request, responder: Responder) -> None:
    """``POST /v1/messages`` (its route's handler)."""
    serves = Serves.RELAY_OR_NORMALIZED
    async with prepare(host.rt, call, request, MessagesBody, serves) as leased:
        body = messages_body(leased)
        translating = Translating(
            responder,
            message_id=host.ids.new("msg"),
            model=body.model,
            input_estimate=leased.estimate,
        )
        if leased.decision.relay:
            await relay(leased, translating.as_responder(), call.out, upstream=translating.upstream)
        else:
            refuse_untranslatable(body)
            if body.stream:
                await chat_stream(leased, translating.as_responder(), call, host.ids)
            else:
                await chat_once(leased, translating.as_responder(), call, host.ids)


# ------------------------------------------------------------- count_tokens


async def count_tokens(host: Host, call: Call, request: Request, responder: Responder) -> None:
    """``POST /v1/messages/count_tokens`` (its route's handler)."""
    snap, out = call.snap, call.out
    body = CountTokensBody.parse(parse_json_object(request.body))
    group = snap.catalog.resolve(body.model)
    if group is None:
        raise model_not_found(snap, body.model)
    out.group = group.id
    if any(native(snap, pid) for pid, _ in group.providers):
        serves = Serves.RELAY_OR_NORMALIZED
        async with prepare(host.rt, call, request, CountTokensBody, serves) as leased:
            if leased.decision.relay and native(snap, leased.lease.provider_id):

                def upstream(attempt: LeasedRequest[ChatRequest]) -> UpstreamRequest:
                    if not native(snap, attempt.lease.provider_id):
                        raise errors.ProviderError("the retried provider does not count tokens")
                    served = rewrite_model(body.anthropic, attempt.lease.target)
                    return request.path, served, anthropic_headers(request)

                await relay(leased, responder, out, upstream=upstream)
                return
    out.mode = "normalized"  # the edge answers it, no provider relayed
    answer = {"input_tokens": estimate_input_tokens(body.messages)}
    out.answered(200)
    await responder.send(200, [("content-type", JSON)], _encode(answer))
