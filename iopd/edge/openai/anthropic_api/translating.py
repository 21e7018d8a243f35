"""The translating responder of the Messages route: chat bytes in, Anthropic
Messages bytes out, in front of the caller's responder.

The relay (with its wire-reader writer) and the normalized chat paths write
to it as to any ``Responder``: a ``chat.completion``, the chunk stream, or a
provider's error; it writes their translation (``outgoing/messages_reply.py``)
to the caller's.  Per relayed attempt, :meth:`Translating.upstream` picks
what the leased provider is sent (the caller's body to a Messages-native
provider, passed through untranslated; the chat translation to any other).
Whole answers are held to translate them, bounded (``MAX_WHOLE_BYTES``);
streams are translated line by line (``SseLines``).
"""

from __future__ import annotations

import msgspec

from iopd import errors
from iopd.edge.openai.incoming.messages_request import MessagesBody
from iopd.edge.openai.incoming.request_fields import rewrite_model
from iopd.edge.openai.incoming.requests import ChatRequest
from iopd.edge.openai.outgoing import messages_reply as out_msgs
from iopd.edge.openai.prepare import LeasedRequest
from iopd.edge.runtime.edge_runtime import Snapshot
from iopd.http.responder import RewritingResponder, json_typed
from iopd.http.server import Request, Responder

__all__ = [
    "Translating",
    "UpstreamRequest",
    "anthropic_headers",
    "messages_body",
    "native",
    "refuse_untranslatable",
]

#: Where an OpenAI-compatible provider gets the translation.
CHAT_PATH = "/v1/chat/completions"
JSON = "application/json"
#: The most of a whole answer (or an error body) held to translate it.
MAX_WHOLE_BYTES = 32 * 1024 * 1024
MAX_ERROR_BYTES = 64 * 1024

#: One attempt's (path, body, added headers): what the relay's ``upstream`` returns.
UpstreamRequest = tuple[str, bytes, list[tuple[str, str]]]

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def messages_body(leased: LeasedRequest[ChatRequest]) -> MessagesBody:
    body = leased.body
    assert isinstance(body, MessagesBody)  # prepare parsed it with MessagesBody
    return body


def native(snap: Snapshot, provider_id: str) -> bool:
    """The provider speaks Messages itself (``anthropic_messages: true``)."""
    ref = snap.catalog.providers.get(provider_id)
    return ref is not None and ref.config.anthropic_messages


def anthropic_headers(request: Request) -> list[tuple[str, str]]:
    """The caller's ``anthropic-*`` headers (``anthropic-version``,
    ``anthropic-beta``, …): a native provider needs them; none carries a credential."""
    return [(k, v) for k, v in request.headers if k.startswith("anthropic-")]


def refuse_untranslatable(body: MessagesBody) -> None:
    if body.untranslatable is not None:
        raise errors.InvalidRequest(
            f"{body.untranslatable}; this model's provider speaks chat, not Messages"
        )


class Translating(RewritingResponder):
    """A responder in front of the caller's: chat bytes in, Messages bytes out.

    It has the methods the relay (with its wire-reader writer) and the
    normalized chat paths call.  State (``started``, ``finished``) is the
    caller's responder's, so the request's error handling sees one response.
    ``translate`` False passes bytes through (a native provider's answer).
    """

    __slots__ = (
        "_events",
        "_message_id",
        "_model",
        "_estimate",
        "_mode",
        "_buf",
        "_lines",
        "_status",
        "translate",
    )

    def __init__(
        self, inner: Responder, *, message_id: str, model: str, input_estimate: int
    ) -> None:
        super().__init__(inner)
        self._message_id = message_id
        self._model = model
        self._estimate = input_estimate
        self._events = out_msgs.MessageEvents(
            message_id=message_id, model=model, input_estimate=input_estimate
        )
        self._mode = ""  # "sse", "json", "error" once the head is known
        self._buf = bytearray()
        self._lines = out_msgs.SseLines()
        self._status = 0
        self.translate = True

    def upstream(self, leased: LeasedRequest[ChatRequest]) -> UpstreamRequest:
        """This attempt's path, body and added headers (the relay's ``upstream``)."""
        body = messages_body(leased)
        target = leased.lease.target
        if native(leased.snap, leased.lease.provider_id):
            self.translate = False
            served = rewrite_model(body.anthropic, target)
            return leased.request.path, served, anthropic_headers(leased.request)
        refuse_untranslatable(body)
        self.translate = True
        return CHAT_PATH, rewrite_model(body.raw, target), []

    # -- whole responses

    async def send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        if self.translate:
            headers = json_typed(headers)
            body = self._whole(status, body)
        await self._inner.send(status, headers, body)

    # -- streamed responses

    def start_held(self, status: int, headers: list[tuple[str, str]]) -> None:
        if not self.translate:
            self._inner.start_held(status, headers)
            return
        self._status = status
        ctype = next((v for k, v in headers if k.lower() == "content-type"), "")
        if status >= 400:
            self._mode = "error"
            headers = json_typed(headers)
        elif ctype.startswith("text/event-stream"):
            self._mode = "sse"
            headers = [(k, v) for k, v in headers if k.lower() != "content-type"]
            headers = [*out_msgs.MESSAGES_SSE_HEADERS[:1], *headers]
        else:
            self._mode = "json"
            headers = json_typed(headers)
        self._inner.start_held(status, headers)

    # -- translation

    def rewrite(self, data: bytes) -> bytes:
        if not self.translate:  # a native provider's answer, as it is
            return data
        if self._mode == "sse":
            return b"".join(self._events.data(p) for p in self._lines.feed(data))
        limit = MAX_ERROR_BYTES if self._mode == "error" else MAX_WHOLE_BYTES
        if len(self._buf) + len(data) > limit:
            if self._mode == "error":
                return b""  # the start of the error is enough to say it
            raise errors.ProviderError("the provider's answer is too large to translate")
        self._buf += data
        return b""

    def rewrite_end(self) -> bytes:
        if not self.translate:
            return b""
        if self._mode == "sse":
            return self._events.finish()
        body, self._buf = bytes(self._buf), bytearray()
        return self._whole(self._status, body)

    def _whole(self, status: int, body: bytes) -> bytes:
        """A whole chat answer as a whole Messages answer (a message or an error)."""
        if status >= 400:
            return _encode(out_msgs.error_envelope(status, _error_message(body)))
        try:
            doc = _decode(body)
        except msgspec.DecodeError:
            doc = None
        if not isinstance(doc, dict):
            raise errors.ProviderError("the provider's answer is not a chat completion")
        return _encode(
            out_msgs.message_from_completion(
                doc,
                message_id=self._message_id,
                model=self._model,
                input_estimate=self._estimate,
            )
        )


def _error_message(body: bytes) -> str:
    """The message of a provider's error body (OpenAI's, Ollama's, or text)."""
    try:
        doc = _decode(body)
    except msgspec.DecodeError:
        doc = None
    if isinstance(doc, dict):
        error = doc.get("error", doc.get("message"))
        if isinstance(error, dict):
            error = error.get("message")
        if isinstance(error, str) and error:
            return error[:2000]
    text = body.decode("utf-8", "replace").strip()
    return text[:2000] or "the provider answered with an error"
