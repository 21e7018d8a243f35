"""The translating responder of ``/v1/responses`` on a chat-only provider:
chat bytes in, Responses bytes out, in front of the caller's responder.

The relay (with its wire-reader writer) writes to it as to any
``Responder``: a ``chat.completion``, the chunk stream, or a provider's
error; it writes their translation (``chat_reply.py``) to the caller's.  Per
relayed attempt, :meth:`Translating.upstream` picks what the leased provider
is sent: the caller's body (``model`` rewritten) to a provider that serves
the Responses API, passed back untranslated; the chat translation
(``chat_request.py``) on ``/v1/chat/completions`` to one declared
``openai_responses: false``.  A provider's error (status 400 or more) is
OpenAI's envelope on both APIs: it passes as it is.  Whole answers are held
to translate them, bounded (``MAX_WHOLE_BYTES``); streams are translated
line by line (``SseLines``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from iopd import errors
from iopd.edge.openai.incoming.request_fields import rewrite_model
from iopd.edge.openai.incoming.requests import ResponsesRequest
from iopd.edge.openai.outgoing.messages_reply import SseLines
from iopd.edge.openai.outgoing.responses import ResponseEvents
from iopd.edge.openai.prepare import LeasedRequest
from iopd.edge.openai.responses_api.chat_reply import ChunkEvents, response_from_completion
from iopd.edge.openai.responses_api.chat_request import chat_body
from iopd.edge.runtime.edge_runtime import Snapshot
from iopd.http.responder import RewritingResponder, json_typed
from iopd.http.server import Responder

__all__ = ["CHAT_PATH", "Translating", "chat_only"]

#: Where a chat-only provider gets the translation.
CHAT_PATH = "/v1/chat/completions"
JSON = "application/json"
#: The most of a whole answer held to translate it.
MAX_WHOLE_BYTES = 32 * 1024 * 1024

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def chat_only(snap: Snapshot, provider_id: str) -> bool:
    """The provider speaks Chat Completions only (``openai_responses: false``)."""
    ref = snap.catalog.providers.get(provider_id)
    return ref is not None and not ref.config.openai_responses


class Translating(RewritingResponder):
    """A responder in front of the caller's: chat bytes in, Responses bytes out.

    State (``started``, ``finished``) is the caller's responder's, so the
    request's error handling sees one response.  ``translate`` False passes
    bytes through (a provider that serves Responses, or an error).
    ``announce``: called once with the built-in tool types a translated
    request was sent without (``openai.unsupported_tools: drop``).
    """

    __slots__ = (
        "_body",
        "_id",
        "_created",
        "_chunks",
        "_announce",
        "_mode",
        "_buf",
        "_lines",
        "translate",
    )

    def __init__(
        self,
        inner: Responder,
        body: ResponsesRequest,
        *,
        response_id: str,
        announce: Callable[[tuple[str, ...]], None],
    ) -> None:
        super().__init__(inner)
        self._body = body
        self._id = response_id
        self._created = int(time.time())
        self._chunks = ChunkEvents(
            ResponseEvents(
                response_id=response_id,
                model=body.model,
                created_at=self._created,
                metadata=_metadata(body),
                tools=body.tools,
            )
        )
        self._announce: Callable[[tuple[str, ...]], None] | None = announce
        self._mode = ""  # "sse", "json", "raw" once the head is known
        self._buf = bytearray()
        self._lines = SseLines()
        self.translate = False

    def upstream(
        self, leased: LeasedRequest[ResponsesRequest]
    ) -> tuple[str, bytes, list[tuple[str, str]]]:
        """This attempt's path, body and added headers (the relay's ``upstream``)."""
        body, target = leased.body, leased.lease.target
        if not chat_only(leased.snap, leased.lease.provider_id):
            self.translate = False
            return leased.request.path, rewrite_model(body.raw, target), []
        policy = leased.snap.config.openai.unsupported_tools
        made = chat_body(body, target, unsupported_tools=policy)
        if made.dropped_tools and self._announce is not None:
            self._announce(made.dropped_tools)
            self._announce = None
        self.translate = True
        return CHAT_PATH, _encode(made.body), []

    # -- whole responses

    async def send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        if self.translate and status < 400:
            headers = json_typed(headers)
            body = self._whole(body)
        await self._inner.send(status, headers, body)

    # -- streamed responses

    def start_held(self, status: int, headers: list[tuple[str, str]]) -> None:
        ctype = next((v for k, v in headers if k.lower() == "content-type"), "")
        if not self.translate or status >= 400:
            self._mode = "raw"
        elif ctype.startswith("text/event-stream"):
            self._mode = "sse"
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
        else:
            self._mode = "json"
            headers = json_typed(headers)
        self._inner.start_held(status, headers)

    # -- translation

    def rewrite(self, data: bytes) -> bytes:
        if self._mode == "sse":
            return b"".join(self._chunks.data(p) for p in self._lines.feed(data))
        if self._mode != "json":
            return data
        if len(self._buf) + len(data) > MAX_WHOLE_BYTES:
            raise errors.ProviderError("the provider's answer is too large to translate")
        self._buf += data
        return b""

    def rewrite_end(self) -> bytes:
        if self._mode == "sse":
            return self._chunks.finish()
        if self._mode != "json":
            return b""
        body, self._buf = bytes(self._buf), bytearray()
        self._mode = "raw"  # translated once
        return self._whole(body)

    def _whole(self, body: bytes) -> bytes:
        """A whole ``chat.completion`` as the ``response`` object."""
        try:
            doc = _decode(body)
        except msgspec.DecodeError:
            doc = None
        if not isinstance(doc, dict):
            raise errors.ProviderError("the provider's answer is not a chat completion")
        req = self._body
        return _encode(
            response_from_completion(
                doc,
                response_id=self._id,
                model=req.model,
                created_at=self._created,
                metadata=_metadata(req),
                tools=req.tools,
            )
        )


def _metadata(body: ResponsesRequest) -> dict[str, str]:
    return {k: v for k, v in body.metadata.items() if k != "workspace"}
