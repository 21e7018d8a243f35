"""``POST /v1/responses``: the OpenAI Responses API on every provider.

The path is the leased provider's, never the caller's choice:

* an ``openai`` provider that serves the Responses API (``openai_responses:
  true``, the default) gets the caller's body as sent, ``model`` rewritten;
  its answer comes back byte for byte, as every relay's;
* an ``openai`` provider declared ``openai_responses: false`` (a server that
  speaks only Chat Completions) gets the chat translation
  (``chat_request.py``) on ``/v1/chat/completions``, and its answer (a
  ``chat.completion`` or the chunk stream) is translated back
  (``chat_reply.py``) into the ``response`` object and the Responses event
  stream the normalized path emits;
* a normalized provider (``ollama``, ``cli``, ``echo``) runs the request on
  the normalized path (``normalized.responses_once`` / ``responses_stream``).

The two relayed kinds share one relay: ``translating.Translating`` decides
per attempt (a retry may lease the other kind) through the relay's
``upstream`` callable.  A request whose group (and fallbacks) holds no
chat-only provider is relayed with no translator in front.  Everything else
is the route's as before: ``prepare`` (limits, fair share, the lease),
retries, metering (``endpoint="responses"``, usage from the provider's
chat usage when translated), cancel on disconnect.
"""

from __future__ import annotations

from iopd.config.catalog import GroupSpec
from iopd.edge.openai.incoming.requests import ResponsesRequest
from iopd.edge.openai.lifecycle import Call
from iopd.edge.openai.needs import announce_dropped_tools
from iopd.edge.openai.normalized import responses_once, responses_stream
from iopd.edge.openai.prepare import prepare
from iopd.edge.openai.relay import relay
from iopd.edge.openai.responses_api.translating import Translating, chat_only
from iopd.edge.openai.routes import Host, Serves
from iopd.edge.runtime.edge_runtime import Snapshot
from iopd.http.server import Request, Responder

__all__ = ["serve"]


async def serve(host: Host, call: Call, request: Request, responder: Responder) -> None:
    """``POST /v1/responses`` (its route's handler)."""
    serves = Serves.RELAY_OR_NORMALIZED
    async with prepare(host.rt, call, request, ResponsesRequest, serves) as leased:
        if leased.decision.relay:
            if not _may_translate(leased.snap, leased.decision.group):
                await relay(leased, responder, call.out)
                return
            group_id = leased.decision.group.id

            def announce(dropped: tuple[str, ...]) -> None:
                announce_dropped_tools(host.rt, request, group_id, dropped)

            translating = Translating(
                responder, leased.body, response_id=host.ids.new("resp"), announce=announce
            )
            await relay(leased, translating.as_responder(), call.out, upstream=translating.upstream)
        elif leased.body.stream:
            await responses_stream(leased, responder, call, host.ids)
        else:
            await responses_once(leased, responder, call, host.ids)


def _may_translate(snap: Snapshot, group: GroupSpec) -> bool:
    """A provider of ``group`` or of its fallback groups speaks only chat."""
    catalog = snap.catalog
    for group_id in (group.id, *catalog.fallback_chain(group.id)):
        spec = catalog.group(group_id)
        if spec is not None and any(chat_only(snap, pid) for pid, _ in spec.providers):
            return True
    return False
