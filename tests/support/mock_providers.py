"""Mock model servers for tests: an OpenAI-compatible one and an Ollama-style one.

Both are real HTTP/1.1 servers (trio + h11) on 127.0.0.1 port 0, so they
exercise real sockets, keep-alive and disconnects.  Use them like this::

    async with trio.open_nursery() as nursery:
        mock = await nursery.start(MockOpenAIServer().serve)
        ... mock.base_url ...
        nursery.cancel_scope.cancel()

What can be configured:

* ``reply_text`` / ``reasoning_text`` / ``tool_calls`` / ``usage`` — the
  content of generated replies (chat, responses, ollama chat/generate);
* ``mode`` — ``"ok"`` (default), ``"error500"`` (500 with a JSON error body),
  ``"garbage"`` (bytes that are not HTTP, then close), ``"hang"`` (read the
  request, never answer), ``"hang_after_head"`` (send the head and hang),
  ``"drop"`` (close without answering), ``"reset"`` (read the request, then
  reset the connection: RST, no answer), ``"reset_unread"`` (reset every
  connection as soon as it is accepted, or a kept-alive one as soon as its
  next request starts to arrive, without reading the request: a client
  writing a body larger than the socket buffers sees the reset while it
  writes), ``"status429"`` (429 with
  ``Retry-After: <retry_after>``), ``"status502"``, ``"status503"``; and
  ``closed_port_url()`` for a provider that refuses every connection;
* ``MockReply.reset_after_chunks`` — stream the chunks, then reset the
  connection (a stream that fails after its first bytes);
* ``MockReply.drop_after`` — close the connection after the reply without a
  ``Connection: close`` header (a server dropping an idle keep-alive socket);
* ``chunk_delay`` — seconds between streamed chunks (``slow`` streams);
* ``healthy`` — whether the health route (``/v1/models`` / ``/api/tags``) says 200;
* ``listed`` — the model names that route lists; empty by default: the mocks
  answer any model name, and the node's probe checks no names against an
  empty list;
* ``handler`` — a callable ``(RecordedRequest) -> MockReply | None`` that
  overrides everything for the requests it answers.

What is recorded: ``requests`` (method, path, headers, body),
``connections_opened``, ``client_closes`` (connections the *client* closed,
incl. while a reply was hanging or streaming) with ``client_closed_at``
(trio clock times) and ``wait_client_close(n)``; ``connections_ended`` /
``wait_connections_ended(n)`` count closes by either side.  Pass
``ssl_context=`` to serve https (``base_url`` then uses host ``localhost``).
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h11
import trio

__all__ = [
    "MockOpenAIServer",
    "MockOllamaServer",
    "MockReply",
    "RecordedRequest",
    "MockHTTPServer",
    "closed_port_url",
]


def closed_port_url() -> str:
    """A base URL nothing listens on: connecting to it is refused at once."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


def _reset(stream: trio.abc.Stream) -> None:
    """Make the next close of ``stream`` a TCP reset (SO_LINGER 0)."""
    sock = getattr(stream, "socket", None)
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@dataclass
class RecordedRequest:
    """One request as the mock received it (header names lower-cased)."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name.lower():
                return value
        return None

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


@dataclass
class MockReply:
    """What the mock sends back.

    ``chunks`` (if not None) are streamed with chunked encoding, one write each,
    ``chunk_delay`` seconds apart; otherwise ``body`` is sent with a length.
    """

    status: int = 200
    headers: list[tuple[str, str]] = field(
        default_factory=lambda: [("content-type", "application/json")]
    )
    body: bytes = b""
    chunks: list[bytes] | None = None
    chunk_delay: float = 0.0
    hang_before_head: bool = False
    hang_after_head: bool = False
    hang_after_chunks: bool = False
    raw: bytes | None = None  # written verbatim instead of a response, then close
    close: bool = False
    drop_after: bool = False  # close the connection after the reply, without saying so
    reset: bool = False  # reset the connection instead of answering
    reset_after_chunks: bool = False  # stream ``chunks``, then reset the connection
    end_delay: float = 0.0  # seconds between the last chunk and the body's end


def _json_reply(obj: Any, status: int = 200) -> MockReply:
    return MockReply(status=status, body=json.dumps(obj).encode())


class MockHTTPServer:
    """Base: connection handling, recording, modes.  Subclasses route requests."""

    def __init__(self, *, ssl_context: ssl.SSLContext | None = None) -> None:
        self.ssl_context = ssl_context
        self.mode = "ok"
        self.healthy = True
        self.chunk_delay = 0.0
        self.handler: Callable[[RecordedRequest], MockReply | None] | None = None
        self.retry_after = "1"  # the Retry-After of mode "status429"
        self.requests: list[RecordedRequest] = []
        self.connections_opened = 0
        self.connections_ended = 0  # closed for any reason, by either side
        self.client_closes = 0
        self.client_closed_at: list[float] = []
        self._close_event = trio.Event()
        self.port = 0
        self.in_flight = 0  # POSTs read and not yet answered to their end
        self.peak_in_flight = 0  # the most at once (a capacity must bound it)

    @property
    def base_url(self) -> str:
        if self.ssl_context is not None:  # the test certificate is for "localhost"
            return f"https://localhost:{self.port}"
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on 127.0.0.1 port 0; ``task_status.started(self)`` once bound."""
        tcp_listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = tcp_listeners[0].socket.getsockname()[1]
        listeners: list[Any] = list(tcp_listeners)
        if self.ssl_context is not None:
            listeners = [
                trio.SSLListener(lst, self.ssl_context, https_compatible=True)
                for lst in tcp_listeners
            ]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._handle, listeners)
            task_status.started(self)

    async def wait_connections_ended(self, count: int = 1) -> None:
        """Wait until at least ``count`` connections have been closed (by anyone)."""
        while self.connections_ended < count:
            await self._close_event.wait()

    async def wait_client_close(self, count: int = 1) -> None:
        """Wait until at least ``count`` connections were closed by the client."""
        while self.client_closes < count:
            await self._close_event.wait()

    def _record_client_close(self) -> None:
        self.client_closes += 1
        self.client_closed_at.append(trio.current_time())
        self._close_event.set()
        self._close_event = trio.Event()

    # ---------------------------------------------------------- routing

    def route(self, req: RecordedRequest) -> MockReply:  # pragma: no cover - overridden
        return _json_reply({"error": {"message": "not found"}}, 404)

    def _reply_for(self, req: RecordedRequest) -> MockReply:
        if self.handler is not None:
            reply = self.handler(req)
            if reply is not None:
                return reply
        if self.mode == "error500":
            return _json_reply({"error": {"message": "boom", "type": "server_error"}}, 500)
        if self.mode == "garbage":
            return MockReply(raw=b"\x00\xffNOT HTTP AT ALL\r\n\r\n")
        if self.mode == "hang":
            return MockReply(hang_before_head=True)
        if self.mode == "drop":
            return MockReply(raw=b"")
        if self.mode == "reset":
            return MockReply(reset=True)
        if self.mode == "status429":
            return MockReply(
                status=429,
                headers=[("content-type", "application/json"), ("retry-after", self.retry_after)],
                body=b'{"error":{"message":"slow down","type":"rate_limit_error"}}',
            )
        if self.mode in ("status502", "status503"):
            return _json_reply({"error": {"message": "unavailable"}}, int(self.mode[-3:]))
        reply = self.route(req)
        if self.mode == "hang_after_head":
            reply.hang_after_head = True
        return reply

    # ---------------------------------------------------------- connections

    async def _handle(self, stream: trio.abc.Stream) -> None:
        self.connections_opened += 1
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                req = await self._read_request(conn, stream)
                if req is None:
                    return
                self.requests.append(req)
                reply = self._reply_for(req)
                work = req.method == "POST"  # (health probes are GETs)
                self.in_flight += work
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
                try:
                    sent = await self._send_reply(conn, stream, reply)
                finally:
                    self.in_flight -= work
                if not sent:
                    return
                if reply.close or reply.drop_after or conn.our_state is h11.MUST_CLOSE:
                    return
                try:
                    conn.start_next_cycle()
                except h11.LocalProtocolError:
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            self._record_client_close()
        finally:
            await trio.aclose_forcefully(stream)
            self.connections_ended += 1
            self._close_event.set()
            self._close_event = trio.Event()

    async def _read_request(
        self, conn: h11.Connection, stream: trio.abc.Stream
    ) -> RecordedRequest | None:
        request: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                if self.mode == "reset_unread":  # (a fresh connection: at once)
                    _reset(stream)
                    return None  # the close is the reset; nothing more is read
                data = await stream.receive_some(65536)
                if not data:
                    self._record_client_close()
                    return None
                if self.mode == "reset_unread" and request is None:
                    _reset(stream)  # a kept-alive connection's next request
                    return None
                conn.receive_data(bytes(data))
                continue
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                return RecordedRequest(
                    method=request.method.decode(),
                    path=request.target.decode(),
                    headers=[(k.decode().lower(), v.decode()) for k, v in request.headers],
                    body=bytes(body),
                )
            elif isinstance(event, h11.ConnectionClosed):
                self._record_client_close()
                return None

    async def _send_reply(
        self, conn: h11.Connection, stream: trio.abc.Stream, reply: MockReply
    ) -> bool:
        """Send ``reply``; False when the connection must end (closed, raw, client gone)."""
        client_gone = False

        async def watch_client(cancel_scope: trio.CancelScope) -> None:
            nonlocal client_gone
            try:
                while True:
                    data = await stream.receive_some(65536)
                    if not data:
                        break
                    conn.receive_data(bytes(data))  # pipelined bytes; h11 buffers them
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            client_gone = True
            cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_client, nursery.cancel_scope)
            try:
                await self._write_reply(conn, stream, reply)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                client_gone = True
            nursery.cancel_scope.cancel()
        if client_gone:
            self._record_client_close()
            return False
        return reply.raw is None

    async def _write_reply(
        self, conn: h11.Connection, stream: trio.abc.Stream, reply: MockReply
    ) -> None:
        if reply.reset:
            _reset(stream)
            raise trio.BrokenResourceError("mock: reset")
        if reply.raw is not None:
            if reply.raw:
                await stream.send_all(reply.raw)
            return
        if reply.hang_before_head:
            await trio.sleep_forever()
        headers = list(reply.headers)
        if reply.chunks is None:
            headers.append(("content-length", str(len(reply.body))))
        if reply.close:
            headers.append(("connection", "close"))
        await stream.send_all(conn.send(h11.Response(status_code=reply.status, headers=headers)))
        if reply.hang_after_head:
            await trio.sleep_forever()
        if reply.chunks is None:
            if reply.body:
                await stream.send_all(conn.send(h11.Data(data=reply.body)))
        else:
            delay = reply.chunk_delay or self.chunk_delay
            for chunk in reply.chunks:
                if delay:
                    await trio.sleep(delay)
                await stream.send_all(conn.send(h11.Data(data=chunk)))
            if reply.hang_after_chunks:
                await trio.sleep_forever()
            if reply.reset_after_chunks:
                _reset(stream)
                raise trio.BrokenResourceError("mock: reset")
            if reply.end_delay:
                await trio.sleep(reply.end_delay)
        await stream.send_all(conn.send(h11.EndOfMessage()))


def _words(text: str) -> list[str]:
    import re

    return re.findall(r"\S+\s*", text)


def sse(obj: Any) -> bytes:
    """One SSE ``data:`` event."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class MockOpenAIServer(MockHTTPServer):
    """An OpenAI-compatible server: /v1/models, /v1/chat/completions, /v1/responses,
    /v1/embeddings and /v1/completions."""

    def __init__(self, *, ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(ssl_context=ssl_context)
        self.listed: list[str] = []
        self.reply_text = "Hello from the mock"
        self.reasoning_text = ""
        self.tool_calls: list[dict[str, Any]] = []  # [{name, arguments(str)}]
        self.usage: dict[str, Any] = {"prompt_tokens": 11, "completion_tokens": 7}
        self.extra_fields: dict[str, Any] = {"x_unknown_field": {"kept": True}}
        #: False: a server that speaks only Chat Completions (/v1/responses is a 404).
        self.responses_api = True

    def route(self, req: RecordedRequest) -> MockReply:
        if req.method == "GET" and req.path == "/v1/models":
            if not self.healthy:
                return _json_reply({"error": {"message": "unhealthy"}}, 503)
            return _json_reply(
                {"object": "list", "data": [{"id": m, "object": "model"} for m in self.listed]}
            )
        if req.method == "POST" and req.path == "/v1/chat/completions":
            return self._chat(req.json() or {})
        if req.method == "POST" and req.path == "/v1/responses" and self.responses_api:
            return self._responses(req.json() or {})
        if req.method == "POST" and req.path == "/v1/embeddings":
            return self._embeddings(req.json() or {})
        if req.method == "POST" and req.path == "/v1/completions":
            return self._completions(req.json() or {})
        return _json_reply({"error": {"message": f"no route {req.path}"}}, 404)

    def _embeddings(self, body: dict[str, Any]) -> MockReply:
        """One 3-dimensional vector per input (a string or a list of strings)."""
        inputs = body.get("input")
        texts = inputs if isinstance(inputs, list) else [inputs]
        data = [
            {"object": "embedding", "index": i, "embedding": [0.5, -0.25, float(len(str(t)))]}
            for i, t in enumerate(texts)
        ]
        prompt = self.usage.get("prompt_tokens", 0)
        return _json_reply(
            {
                "object": "list",
                "data": data,
                "model": body.get("model", ""),
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
            }
        )

    def _completions(self, body: dict[str, Any]) -> MockReply:
        """A legacy text completion of ``reply_text``, streamed as SSE when asked."""
        model = body.get("model", "")
        base = {"id": "cmpl-mock", "object": "text_completion", "created": 1, "model": model}
        if not body.get("stream"):
            choice = {
                "index": 0,
                "text": self.reply_text,
                "finish_reason": "stop",
                "logprobs": None,
            }
            return _json_reply({**base, "choices": [choice], "usage": self.usage})
        events = [
            sse({**base, "choices": [{"index": 0, "text": w, "finish_reason": None}]})
            for w in _words(self.reply_text)
        ]
        events.append(sse({**base, "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}))
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(sse({**base, "choices": [], "usage": self.usage}))
        events.append(b"data: [DONE]\n\n")
        return MockReply(headers=[("content-type", "text/event-stream")], chunks=events)

    def _chat(self, body: dict[str, Any]) -> MockReply:
        model = body.get("model", "")
        base = {"id": "chatcmpl-mock", "created": 1, "model": model, **self.extra_fields}
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": self.reply_text}
            if self.reasoning_text:
                message["reasoning_content"] = self.reasoning_text
            finish = "stop"
            if self.tool_calls:
                finish = "tool_calls"
                message["tool_calls"] = [
                    {"id": f"call_{i}", "type": "function", "function": dict(tc)}
                    for i, tc in enumerate(self.tool_calls)
                ]
            return _json_reply(
                {
                    **base,
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": self.usage,
                }
            )
        chunk = {**base, "object": "chat.completion.chunk"}
        events = [sse({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})]
        for word in _words(self.reasoning_text):
            events.append(
                sse({**chunk, "choices": [{"index": 0, "delta": {"reasoning_content": word}}]})
            )
        for word in _words(self.reply_text):
            events.append(sse({**chunk, "choices": [{"index": 0, "delta": {"content": word}}]}))
        for i, tc in enumerate(self.tool_calls):
            args = tc.get("arguments", "")
            half = len(args) // 2
            first = {
                "index": i,
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": tc["name"], "arguments": args[:half]},
            }
            second = {"index": i, "function": {"arguments": args[half:]}}
            for part in (first, second):
                events.append(
                    sse({**chunk, "choices": [{"index": 0, "delta": {"tool_calls": [part]}}]})
                )
        finish = "tool_calls" if self.tool_calls else "stop"
        events.append(
            sse({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        )
        if (body.get("stream_options") or {}).get("include_usage", True):
            events.append(sse({**chunk, "choices": [], "usage": self.usage}))
        events.append(b"data: [DONE]\n\n")
        return MockReply(headers=[("content-type", "text/event-stream")], chunks=events)

    def _responses_usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.usage.get("prompt_tokens", 0),
            "output_tokens": self.usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 3},
            "input_tokens_details": {"cached_tokens": 2},
            "total_tokens": self.usage.get("prompt_tokens", 0)
            + self.usage.get("completion_tokens", 0),
        }

    def _responses(self, body: dict[str, Any]) -> MockReply:
        response = {
            "id": "resp_mock",
            "object": "response",
            "status": "completed",
            "model": body.get("model", ""),
            "output": [
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": self.reply_text}],
                }
            ],
            "usage": self._responses_usage(),
            **self.extra_fields,
        }
        if not body.get("stream"):
            return _json_reply(response)
        events = [
            b"event: response.created\n"
            + sse({"type": "response.created", "response": {**response, "usage": None}})
        ]
        for word in _words(self.reasoning_text):
            events.append(
                b"event: response.reasoning_text.delta\n"
                + sse({"type": "response.reasoning_text.delta", "delta": word})
            )
        for word in _words(self.reply_text):
            events.append(
                b"event: response.output_text.delta\n"
                + sse({"type": "response.output_text.delta", "delta": word})
            )
        events.append(
            b"event: response.completed\n"
            + sse({"type": "response.completed", "response": response})
        )
        return MockReply(headers=[("content-type", "text/event-stream")], chunks=events)


#: What Ollama's ``/api/tags`` says of a pulled llama model (the tests' one example).
LLAMA_TAG_DETAILS: dict[str, object] = {
    "size": 4661224676,
    "digest": "365c0bd3c000",
    "details": {
        "parent_model": "",
        "format": "gguf",
        "family": "llama",
        "families": ["llama"],
        "parameter_size": "8.0B",
        "quantization_level": "Q4_0",
    },
}


class MockOllamaServer(MockHTTPServer):
    """An Ollama-style server: /api/tags, /api/chat and /api/generate (NDJSON
    streams), /api/show and /api/embed."""

    def __init__(self, *, ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(ssl_context=ssl_context)
        self.models = ["mock:latest"]  # what /api/show knows
        self.listed: list[str] = []
        #: More fields of a listed name's /api/tags entry (size, digest, details, ...).
        self.tag_entries: dict[str, dict[str, Any]] = {}
        self.reply_text = "Hello from ollama"
        self.reasoning_text = ""
        self.tool_calls: list[dict[str, Any]] = []  # [{name, arguments(dict)}]
        self.prompt_eval_count = 13
        self.eval_count = 5
        self.done_reason = "stop"

    def route(self, req: RecordedRequest) -> MockReply:
        if req.method == "GET" and req.path == "/api/tags":
            if not self.healthy:
                return _json_reply({"error": "unhealthy"}, 503)
            listed = [{"name": m, "model": m, **self.tag_entries.get(m, {})} for m in self.listed]
            return _json_reply({"models": listed})
        if req.method == "POST" and req.path in ("/api/chat", "/api/generate"):
            return self._generate(req.json() or {}, chat=req.path == "/api/chat")
        if req.method == "POST" and req.path == "/api/show":
            return self._show(req.json() or {})
        if req.method == "POST" and req.path == "/api/embed":
            return self._embed(req.json() or {})
        if req.method == "POST" and req.path == "/api/embeddings":  # the legacy route
            prompt = (req.json() or {}).get("prompt")
            return _json_reply({"embedding": [0.5, float(len(str(prompt)))]})
        return _json_reply({"error": f"no route {req.path}"}, 404)

    def _show(self, body: dict[str, Any]) -> MockReply:
        model = body.get("model")
        if model not in self.models:
            return _json_reply({"error": f"model '{model}' not found"}, 404)
        return _json_reply(
            {
                "modelfile": f"FROM {model}",
                "parameters": "temperature 0.7",
                "template": "{{ .Prompt }}",
                "details": {"family": "mock", "parameter_size": "1B"},
                "model_info": {"general.architecture": "mock"},
                "capabilities": ["completion"],
            }
        )

    def _embed(self, body: dict[str, Any]) -> MockReply:
        inputs = body.get("input")
        texts = inputs if isinstance(inputs, list) else [inputs]
        return _json_reply(
            {
                "model": body.get("model", ""),
                "embeddings": [[0.5, float(len(str(t)))] for t in texts],
                "total_duration": 1000,
                "prompt_eval_count": self.prompt_eval_count,
            }
        )

    def _final(self, model: str, chat: bool) -> dict[str, Any]:
        final: dict[str, Any] = {
            "model": model,
            "created_at": "2026-01-01T00:00:00Z",
            "done": True,
            "done_reason": self.done_reason,
            "total_duration": 1000,
            "prompt_eval_count": self.prompt_eval_count,
            "eval_count": self.eval_count,
        }
        if chat:
            final["message"] = {"role": "assistant", "content": ""}
        else:
            final["response"] = ""
        return final

    def _generate(self, body: dict[str, Any], *, chat: bool) -> MockReply:
        model = body.get("model", "")
        stream = body.get("stream", True)

        def piece(content: str = "", thinking: str = "", tool_calls: Any = None) -> dict[str, Any]:
            obj: dict[str, Any] = {
                "model": model,
                "created_at": "2026-01-01T00:00:00Z",
                "done": False,
            }
            if chat:
                msg: dict[str, Any] = {"role": "assistant", "content": content}
                if thinking:
                    msg["thinking"] = thinking
                if tool_calls:
                    msg["tool_calls"] = tool_calls
                obj["message"] = msg
            else:
                obj["response"] = content
                if thinking:
                    obj["thinking"] = thinking
            return obj

        if not stream:
            final = self._final(model, chat)
            if chat:
                final["message"] = {"role": "assistant", "content": self.reply_text}
                if self.tool_calls:
                    final["message"]["tool_calls"] = [{"function": tc} for tc in self.tool_calls]
            else:
                final["response"] = self.reply_text
            return _json_reply(final)
        lines = [piece(thinking=w) for w in _words(self.reasoning_text)]
        lines += [piece(content=w) for w in _words(self.reply_text)]
        if self.tool_calls:
            lines.append(piece(tool_calls=[{"function": tc} for tc in self.tool_calls]))
        lines.append(self._final(model, chat))
        return MockReply(
            headers=[("content-type", "application/x-ndjson")],
            chunks=[json.dumps(obj).encode() + b"\n" for obj in lines],
        )


def anthropic_event(obj: dict[str, Any]) -> bytes:
    """One Anthropic SSE event (``event:`` named by the object's ``type``)."""
    return f"event: {obj['type']}\n".encode() + sse(obj)


class MockMessagesServer(MockOpenAIServer):
    """An OpenAI-compatible server that also speaks Anthropic's Messages API
    (``/v1/messages``, ``/v1/messages/count_tokens``), as vLLM, SGLang,
    llama.cpp and Ollama do: ``reply_text``, then ``tool_uses``, streamed when asked."""

    def __init__(self, *, ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(ssl_context=ssl_context)
        self.tool_uses: list[dict[str, Any]] = []  # [{id, name, input(dict)}]
        self.input_tokens = 17
        self.output_tokens = 9
        self.cache_read = 4

    def route(self, req: RecordedRequest) -> MockReply:
        if req.method == "POST" and req.path == "/v1/messages/count_tokens":
            return _json_reply({"input_tokens": 42})
        if req.method == "POST" and req.path == "/v1/messages":
            return self._messages(req.json() or {})
        return super().route(req)

    def _usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cache_read_input_tokens": self.cache_read,
            "cache_creation_input_tokens": 0,
        }

    def _messages(self, body: dict[str, Any]) -> MockReply:
        content: list[dict[str, Any]] = [{"type": "text", "text": self.reply_text}]
        content += [{"type": "tool_use", **tu} for tu in self.tool_uses]
        stop = "tool_use" if self.tool_uses else "end_turn"
        message = {
            "id": "msg_mock",
            "type": "message",
            "role": "assistant",
            "model": body.get("model", ""),
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": self._usage(),
        }
        if not body.get("stream"):
            return _json_reply(message)
        start = {
            **message,
            "content": [],
            "stop_reason": None,
            "usage": {**self._usage(), "output_tokens": 1},
        }
        events = [anthropic_event({"type": "message_start", "message": start})]
        events.append(anthropic_event({"type": "ping"}))
        events.append(
            anthropic_event(
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                }
            )
        )
        for word in _words(self.reply_text):
            delta = {"type": "text_delta", "text": word}
            events.append(
                anthropic_event({"type": "content_block_delta", "index": 0, "delta": delta})
            )
        events.append(anthropic_event({"type": "content_block_stop", "index": 0}))
        for i, tu in enumerate(self.tool_uses, start=1):
            block = {"type": "tool_use", "id": tu["id"], "name": tu["name"], "input": {}}
            events.append(
                anthropic_event({"type": "content_block_start", "index": i, "content_block": block})
            )
            args = json.dumps(tu["input"])
            for part in (args[: len(args) // 2], args[len(args) // 2 :]):
                delta = {"type": "input_json_delta", "partial_json": part}
                events.append(
                    anthropic_event({"type": "content_block_delta", "index": i, "delta": delta})
                )
            events.append(anthropic_event({"type": "content_block_stop", "index": i}))
        events.append(
            anthropic_event(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop, "stop_sequence": None},
                    "usage": {"output_tokens": self.output_tokens},
                }
            )
        )
        events.append(anthropic_event({"type": "message_stop"}))
        return MockReply(headers=[("content-type", "text/event-stream")], chunks=events)
