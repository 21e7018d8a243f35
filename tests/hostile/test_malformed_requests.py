"""End to end: malformed requests over raw sockets get exact OpenAI error envelopes.

Each case is the literal bytes a broken or hostile client could send to a
real edge (with a real echo node behind it): bad JSON, wrong types, missing
fields, bad roles, wrong content types, oversized bodies and headers,
invalid HTTP, wrong methods, unknown routes, bad auth header shapes, chunked
bodies, NUL bytes, invalid UTF-8.  Every answer must be
``{"error": {"message", "type", "code", "param"}}`` with the status, type and
code of docs/troubleshooting.md, "Errors callers see" — never a 5xx, never a
traceback, a file path or a module
name, never the caller's token echoed back.

The cases run on one gateway (starting one per case would cost more than the
cases); failures are collected and reported together, by case name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import trio

from tests.support.configs import echo_provider, edge_yaml, node, principal_token
from tests.support.gateway import Gateway, running_gateway

TOKEN = "sk-canary-malformed-7777"
AUTH = f"Bearer {TOKEN}".encode()
MAX_BODY = 4096
MAX_HEADERS = 2048

YAML = edge_yaml(
    edge_id="edge-malformed",
    openai={
        "principal_tokens": [principal_token(TOKEN)],
        "max_body_bytes": MAX_BODY,
        "max_header_bytes": MAX_HEADERS,
        "header_timeout": 0.3,
        "body_timeout": 0.3,
    },
    nodes=[node(providers=[echo_provider(category=None, capacity=8)])],
)

# status -> the OpenAI ``type`` the error table gives every code at that status here
BAD_REQUEST = (400, "invalid_request_error", "invalid_request_error")
UNAUTHORIZED = (401, "authentication_error", "invalid_api_key")
NOT_FOUND = (404, "invalid_request_error", "not_found")
MODEL_NOT_FOUND = (404, "invalid_request_error", "model_not_found")
NOT_ALLOWED = (405, "invalid_request_error", "method_not_allowed")
TIMEOUT = (408, "invalid_request_error", "request_timeout")
TOO_LARGE = (413, "invalid_request_error", "request_too_large")
HEADERS_TOO_LARGE = (431, "invalid_request_error", "headers_too_large")
NOT_IMPLEMENTED = (501, "invalid_request_error", "not_implemented")

CHAT = b"/v1/chat/completions"
OK_MESSAGES = [{"role": "user", "content": "hi"}]


def http(
    method: bytes,
    path: bytes,
    body: bytes | None = None,
    *,
    headers: list[tuple[bytes, bytes]] | None = None,
    auth: bytes | None = AUTH,
    content_type: bytes | None = b"application/json",
    length: bool = True,
) -> bytes:
    """A request's bytes; ``Connection: close`` so the edge ends the connection."""
    lines = [method + b" " + path + b" HTTP/1.1", b"Host: edge", b"Connection: close"]
    if auth is not None:
        lines.append(b"Authorization: " + auth)
    if body is not None and content_type is not None:
        lines.append(b"Content-Type: " + content_type)
    if body is not None and length:
        lines.append(b"Content-Length: " + str(len(body)).encode())
    lines += [k + b": " + v for k, v in headers or []]
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")


def post(path: bytes, doc: Any, **kw: Any) -> bytes:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return http(b"POST", path, body, **kw)


def chat(**fields: Any) -> bytes:
    """A chat request: ``model``/``messages`` default to valid values; ``None`` drops one."""
    doc: dict[str, Any] = {"model": "echo", "messages": OK_MESSAGES}
    for key, value in fields.items():
        if value is _DROP:
            doc.pop(key, None)
        else:
            doc[key] = value
    return post(CHAT, doc)


_DROP = object()


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def chunked_post(path: bytes, body: bytes) -> bytes:
    return http(b"POST", path, body, headers=[(b"Transfer-Encoding", b"chunked")], length=False)


_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nAuthorization: " + AUTH
         + b"\r\nContent-Type: application/json\r\n")
_TE_HEAD = _HEAD + b"Transfer-Encoding: chunked\r\n\r\n"

#: Framings the parser once accepted that h11 and llhttp both refuse
#: (a front end could split them elsewhere): each is a 400 now, and the connection closes.
FRAMINGS = {
    "TE chunked + NBSP": _HEAD + b"Transfer-Encoding: chunked\xa0\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "TE NBSP + chunked": _HEAD + b"Transfer-Encoding: \xa0chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "TE chunked + NEL": _HEAD + b"Transfer-Encoding: chunked\x85\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "CL 2 + NBSP": _HEAD + b"Content-Length: 2\xa0\r\n\r\n{}",
    "CL NBSP + 2": _HEAD + b"Content-Length: \xa02\r\n\r\n{}",
    "SP before chunk size": _TE_HEAD + b" 2\r\n{}\r\n0\r\n\r\n",
    "HTAB before chunk size": _TE_HEAD + b"\t2\r\n{}\r\n0\r\n\r\n",
    "SP before extension": _TE_HEAD + b"2 ;a\r\n{}\r\n0\r\n\r\n",
    "chunk-size line ends in LF": _TE_HEAD + b"2\n{}\r\n0\r\n\r\n",
    "last-chunk line ends in LF": _TE_HEAD + b"2\r\n{}\r\n0\n\r\n",
    "LF inside an extension": _TE_HEAD + b"2;a\n{}\r\n0\r\n\r\n",
    "trailer ends in CR CR LF": _TE_HEAD + b"2\r\n{}\r\n0\r\nX: 1\r\r\n\r\n",
    "header ends in CR CR LF": _HEAD + b"X-A: 1\r\r\nContent-Length: 2\r\n\r\n{}",
    "request line ends in CR CR LF": _HEAD.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\r\n", 1)
    + b"Content-Length: 2\r\n\r\n{}",
}


@dataclass
class Case:
    name: str
    data: bytes
    expect: tuple[int, str, str]
    param: str | None = None


def cases() -> list[Case]:
    nested = b"[" * 2000 + b"]" * 2000  # under MAX_BODY: reaches the JSON parser
    big = b"x" * (MAX_BODY + 1)
    big_chat = json.dumps(
        {"model": "echo", "messages": [{"role": "user", "content": "y" * MAX_BODY}]}
    )
    seventeen = {f"k{i}": "v" for i in range(17)}
    c = Case
    return [
        # ---- bad JSON
        c("json: not json", post(CHAT, b"{not json"), BAD_REQUEST),
        c("json: empty body", post(CHAT, b""), BAD_REQUEST),
        c("json: no body at all", http(b"POST", CHAT), BAD_REQUEST),
        c("json: array", post(CHAT, b"[]"), BAD_REQUEST),
        c("json: string", post(CHAT, b'"hello"'), BAD_REQUEST),
        c("json: null", post(CHAT, b"null"), BAD_REQUEST),
        c("json: number", post(CHAT, b"42"), BAD_REQUEST),
        c("json: truncated", post(CHAT, b'{"model": "echo", "messages": ['), BAD_REQUEST),
        c("json: trailing garbage", post(CHAT, b'{"model": "echo"} xyz'), BAD_REQUEST),
        c("json: invalid utf-8", post(CHAT, b'{"model": "\xff\xfe", "messages": []}'), BAD_REQUEST),
        c("json: lone surrogate bytes", post(CHAT, b'{"model": "\xed\xa0\x80"}'), BAD_REQUEST),
        c(
            "json: raw NUL in string",
            post(CHAT, b'{"model": "ec\x00ho", "messages": []}'),
            BAD_REQUEST,
        ),
        c("json: NUL bytes only", post(CHAT, b"\x00\x00\x00\x00"), BAD_REQUEST),
        c("json: deeply nested", post(CHAT, nested), BAD_REQUEST),
        c("json: NaN literal", post(CHAT, b'{"model": "echo", "temperature": NaN}'), BAD_REQUEST),
        c("json: single quotes", post(CHAT, b"{'model': 'echo'}"), BAD_REQUEST),
        # ---- missing fields, wrong types, bad values
        c("field: model missing", chat(model=_DROP), BAD_REQUEST, "model"),
        c("field: model number", chat(model=7), BAD_REQUEST, "model"),
        c("field: model null", chat(model=None), BAD_REQUEST, "model"),
        c("field: model object", chat(model={"id": "echo"}), BAD_REQUEST, "model"),
        c("field: unknown model", chat(model="no-such-model"), MODEL_NOT_FOUND, "model"),
        c("field: messages missing", chat(messages=_DROP), BAD_REQUEST, "messages"),
        c("field: messages string", chat(messages="hi"), BAD_REQUEST, "messages"),
        c("field: messages object", chat(messages={"role": "user"}), BAD_REQUEST, "messages"),
        c("field: message not object", chat(messages=["hi"]), BAD_REQUEST, "messages[0]"),
        c("field: role missing", chat(messages=[{"content": "hi"}]), BAD_REQUEST),
        c("field: bad role", chat(messages=[{"role": "wizard", "content": "hi"}]), BAD_REQUEST),
        c("field: role number", chat(messages=[{"role": 1, "content": "hi"}]), BAD_REQUEST),
        c("field: content number", chat(messages=[{"role": "user", "content": 5}]), BAD_REQUEST),
        c(
            "field: content part without type",
            chat(messages=[{"role": "user", "content": [{"text": "hi"}]}]),
            BAD_REQUEST,
        ),
        c(
            "field: text part text number",
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}]),
            BAD_REQUEST,
        ),
        c("field: stream string", chat(stream="yes"), BAD_REQUEST, "stream"),
        c("field: temperature string", chat(temperature="hot"), BAD_REQUEST, "temperature"),
        c("field: temperature too high", chat(temperature=5), BAD_REQUEST, "temperature"),
        c("field: top_p too high", chat(top_p=2), BAD_REQUEST, "top_p"),
        c("field: max_tokens zero", chat(max_tokens=0), BAD_REQUEST, "max_tokens"),
        c("field: max_tokens negative", chat(max_tokens=-5), BAD_REQUEST, "max_tokens"),
        c("field: max_tokens float", chat(max_tokens=1.5), BAD_REQUEST, "max_tokens"),
        c("field: max_tokens bool", chat(max_tokens=True), BAD_REQUEST, "max_tokens"),
        c("field: n=0", chat(n=0), BAD_REQUEST, "n"),
        c("field: n over the normalized cap", chat(n=9), BAD_REQUEST, "n"),
        c("field: stop number", chat(stop=3), BAD_REQUEST, "stop"),
        c("field: tools object", chat(tools={"type": "function"}), BAD_REQUEST, "tools"),
        c("field: tool without function", chat(tools=[{"type": "function"}]), BAD_REQUEST),
        c("field: tool_choice number", chat(tool_choice=3), BAD_REQUEST, "tool_choice"),
        c("field: stream_options list", chat(stream_options=[1]), BAD_REQUEST, "stream_options"),
        c("field: metadata list", chat(metadata=["a"]), BAD_REQUEST, "metadata"),
        c("field: metadata value number", chat(metadata={"a": 1}), BAD_REQUEST),
        c("field: metadata 17 entries", chat(metadata=seventeen), BAD_REQUEST, "metadata"),
        c(
            "field: relative workspace is fine for echo, but not a number",
            chat(metadata={"workspace": 5}),
            BAD_REQUEST,
        ),
        # ---- /v1/responses and /api/*
        c("responses: bad json", post(b"/v1/responses", b"{"), BAD_REQUEST),
        c("responses: model missing", post(b"/v1/responses", {"input": "x"}), BAD_REQUEST, "model"),
        c(
            "responses: input number",
            post(b"/v1/responses", {"model": "echo", "input": 5}),
            BAD_REQUEST,
            "input",
        ),
        c(
            "responses: an item reference on a normalized group",
            post(b"/v1/responses", {"model": "echo", "input": [{"type": "item_reference"}]}),
            BAD_REQUEST,
            "input[0].type",
        ),
        c(
            "responses: previous_response_id on a normalized group",
            post(b"/v1/responses", {"model": "echo", "input": "x", "previous_response_id": "r"}),
            BAD_REQUEST,
            "previous_response_id",
        ),
        c("api: chat bad json", post(b"/api/chat", b"{{"), BAD_REQUEST),
        c("api: generate model number", post(b"/api/generate", {"model": 3}), BAD_REQUEST, "model"),
        c(
            "api: chat options list",
            post(b"/api/chat", {"model": "echo", "options": [1]}),
            BAD_REQUEST,
            "options",
        ),
        c(
            "api: chat on a group without ollama",
            post(b"/api/chat", {"model": "echo"}),
            BAD_REQUEST,
            "model",
        ),
        # ---- wrong content types (the body must be JSON whatever the label)
        c(
            "ctype: form-urlencoded",
            post(
                CHAT, b"model=echo&messages=hi", content_type=b"application/x-www-form-urlencoded"
            ),
            BAD_REQUEST,
        ),
        c(
            "ctype: multipart",
            post(
                CHAT,
                b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\necho\r\n--b--\r\n',
                content_type=b"multipart/form-data; boundary=b",
            ),
            BAD_REQUEST,
        ),
        c(
            "ctype: text/plain prose",
            post(CHAT, b"hello there", content_type=b"text/plain"),
            BAD_REQUEST,
        ),
        # ---- sizes
        c(
            "size: content-length over the limit (body not sent)",
            http(b"POST", CHAT, None, headers=[(b"Content-Length", str(MAX_BODY + 1).encode())]),
            TOO_LARGE,
        ),
        c("size: body over the limit", post(CHAT, big), TOO_LARGE),
        c("size: valid JSON over the limit", post(CHAT, big_chat.encode()), TOO_LARGE),
        c(
            "size: chunked body over the limit",
            chunked_post(CHAT, chunked(big[:3000], big[3000:])),
            TOO_LARGE,
        ),
        c(
            "size: one huge header",
            http(b"GET", b"/v1/models", headers=[(b"X-Big", b"a" * (MAX_HEADERS + 10))]),
            HEADERS_TOO_LARGE,
        ),
        c(
            "size: many headers",
            http(b"GET", b"/v1/models", headers=[(b"X-H%d" % i, b"v" * 40) for i in range(100)]),
            HEADERS_TOO_LARGE,
        ),
        c(
            "size: huge URL",
            http(b"GET", b"/v1/models?" + b"q" * (MAX_HEADERS + 10)),
            HEADERS_TOO_LARGE,
        ),
        # ---- chunked bodies
        c(
            "chunked: bad JSON in chunks",
            chunked_post(CHAT, chunked(b'{"model":', b" nope")),
            BAD_REQUEST,
        ),
        c(
            "chunked: bad chunk size",
            chunked_post(CHAT, b"zz\r\n{}\r\n0\r\n\r\n"),
            BAD_REQUEST,
        ),
        c(
            "chunked: and content-length both",
            http(
                b"POST",
                CHAT,
                chunked(b"{}"),
                headers=[(b"Transfer-Encoding", b"chunked")],
            ),
            BAD_REQUEST,
        ),
        # ---- invalid HTTP
        c("http: garbage request line", b"HELLO\r\n\r\n", BAD_REQUEST),
        c(
            "http: binary garbage",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40 + b"\r\n\r\n",
            BAD_REQUEST,
        ),
        c(
            "http: missing Host",
            b"GET /v1/models HTTP/1.1\r\nAuthorization: " + AUTH + b"\r\n\r\n",
            BAD_REQUEST,
        ),
        c(
            "http: header without colon",
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n",
            BAD_REQUEST,
        ),
        c("http: space before colon", b"GET /v1/models HTTP/1.1\r\nHost : x\r\n\r\n", BAD_REQUEST),
        c(
            "http: NUL in header value",
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
            BAD_REQUEST,
        ),
        c(
            "http: bad content-length",
            http(b"POST", CHAT, None, headers=[(b"Content-Length", b"abc")]),
            BAD_REQUEST,
        ),
        c(
            "http: negative content-length",
            http(b"POST", CHAT, None, headers=[(b"Content-Length", b"-1")]),
            BAD_REQUEST,
        ),
        c(
            "http: two different content-lengths",
            http(b"POST", CHAT, b"{}", headers=[(b"Content-Length", b"3")]),
            BAD_REQUEST,
        ),
        c("http: bad method token", b"G(T /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", BAD_REQUEST),
        c(
            "http: bad header name",
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX(A): b\r\n\r\n",
            BAD_REQUEST,
        ),
        c(
            "http: folded line first",
            b"GET /v1/models HTTP/1.1\r\n  Host: x\r\n\r\n",
            BAD_REQUEST,
        ),
        c("http: bad version", b"GET /v1/models HTTP/x.y\r\nHost: x\r\n\r\n", BAD_REQUEST),
        *[c(f"framing: {name}", data, BAD_REQUEST) for name, data in FRAMINGS.items()],
        c(
            "http: trailer section over 8 KiB",
            _TE_HEAD + b"2\r\n{}\r\n0\r\n" + b"X-T: vvvvvvvvvvvv\r\n" * 500 + b"\r\n",
            BAD_REQUEST,
        ),
        c(
            "http: transfer-coding not implemented",
            _HEAD + b"Transfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            NOT_IMPLEMENTED,
        ),
        c("http: CONNECT", b"CONNECT edge:443 HTTP/1.1\r\nHost: edge:443\r\n\r\n", NOT_ALLOWED),
        c(
            "http: unsupported transfer-encoding",
            http(b"POST", CHAT, b"{}", headers=[(b"Transfer-Encoding", b"gzip")], length=False),
            BAD_REQUEST,
        ),
        # ---- wrong methods
        c("method: GET chat", http(b"GET", CHAT), NOT_ALLOWED),
        c(
            "method: PUT chat",
            post(CHAT, {"model": "echo"}).replace(b"POST", b"PUT", 1),
            NOT_ALLOWED,
        ),
        c("method: DELETE models", http(b"DELETE", b"/v1/models"), NOT_ALLOWED),
        c("method: POST models", post(b"/v1/models", {}), NOT_ALLOWED),
        c("method: GET responses", http(b"GET", b"/v1/responses"), NOT_ALLOWED),
        c("method: PATCH api chat", http(b"PATCH", b"/api/chat"), NOT_ALLOWED),
        c("method: GET api generate", http(b"GET", b"/api/generate"), NOT_ALLOWED),
        c("method: POST healthz", post(b"/healthz", {}), NOT_ALLOWED),
        c("method: made-up method", http(b"BREW", CHAT), NOT_IMPLEMENTED),
        # ---- relay-only routes on a group with no passthrough provider
        c(
            "route: /v1/completions on echo",
            post(b"/v1/completions", {"model": "echo", "prompt": "x"}),
            BAD_REQUEST,
            param="model",
        ),
        c(
            "route: /v1/embeddings on echo",
            post(b"/v1/embeddings", {"model": "echo", "input": "x"}),
            BAD_REQUEST,
            param="model",
        ),
        # ---- unknown routes
        c(
            "route: /v1/images/generations",
            post(b"/v1/images/generations", {"model": "echo", "prompt": "x"}),
            NOT_FOUND,
        ),
        c("route: empty model id", http(b"GET", b"/v1/models/"), NOT_FOUND),
        c("route: root", http(b"GET", b"/"), NOT_FOUND),
        c("route: trailing slash", post(CHAT + b"/", {}), NOT_FOUND),
        c("route: wrong case", http(b"GET", b"/V1/MODELS"), NOT_FOUND),
        c("route: dot segments", http(b"GET", b"/v1/models/../../status"), NOT_FOUND),
        c("route: admin status", http(b"GET", b"/status"), NOT_FOUND),
        c("route: admin metrics", http(b"GET", b"/metrics"), NOT_FOUND),
        c("route: unknown ollama api", post(b"/api/pull", {"model": "echo"}), NOT_FOUND),
        c("route: percent-encoded NUL", http(b"GET", b"/v1/models%00"), NOT_FOUND),
        c("route: asterisk", http(b"OPTIONS", b"*"), NOT_FOUND),
        c("route: absolute-form target", http(b"GET", b"http://edge/v1/models"), NOT_FOUND),
        # ---- auth header shapes (every route but /healthz needs a token)
        c("auth: missing", http(b"GET", b"/v1/models", auth=None), UNAUTHORIZED),
        c("auth: scheme only", http(b"GET", b"/v1/models", auth=b"Bearer"), UNAUTHORIZED),
        c("auth: empty token", http(b"GET", b"/v1/models", auth=b"Bearer "), UNAUTHORIZED),
        c("auth: basic", http(b"GET", b"/v1/models", auth=b"Basic dXNlcjpwYXNz"), UNAUTHORIZED),
        c("auth: wrong token", http(b"GET", b"/v1/models", auth=b"Bearer sk-wrong"), UNAUTHORIZED),
        c(
            "auth: token without scheme",
            http(b"GET", b"/v1/models", auth=TOKEN.encode()),
            UNAUTHORIZED,
        ),
        c("auth: token with suffix", http(b"GET", b"/v1/models", auth=AUTH + b"x"), UNAUTHORIZED),
        c(
            "auth: non-ascii token",
            http(b"GET", b"/v1/models", auth=b"Bearer \xe2\x82\xac\xff"),
            UNAUTHORIZED,
        ),
        c("auth: missing on chat", post(CHAT, {"model": "echo"}, auth=None), UNAUTHORIZED),
        c("auth: missing on api tags", http(b"GET", b"/api/tags", auth=None), UNAUTHORIZED),
    ]


# ------------------------------------------------------------------ client


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


async def exchange(host_port: tuple[str, int], data: bytes) -> Reply:
    """Send raw bytes, read one response (by Content-Length, or until EOF)."""
    stream = await trio.open_tcp_stream(*host_port)
    async with stream:
        try:
            await stream.send_all(data)
        except trio.BrokenResourceError:
            pass  # the edge answered and closed before reading everything
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = await stream.receive_some(65536)
            assert chunk, f"connection closed without a response (got {buf!r})"
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for line in lines[1:]:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        length = headers.get("content-length")
        while length is None or len(body) < int(length):
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                break
            if not chunk:
                break
            body += chunk
        return Reply(status, headers, body)


LEAKS = ("Traceback", 'File "', ".py", "iopd/", "iopd.", "wire/", "msgspec", "h11", TOKEN)


def problems(case: Case, reply: Reply) -> list[str]:
    """What is wrong with ``reply`` for ``case`` (empty when all is well)."""
    out: list[str] = []
    status, etype, code = case.expect
    if reply.status >= 500 and reply.status != status:
        out.append(f"5xx: {reply.status}")
    if reply.status != status:
        out.append(f"status {reply.status} != {status}")
    text = reply.body.decode("utf-8", "replace")
    for leak in LEAKS:
        if leak in text:
            out.append(f"body leaks {leak!r}")
    if not reply.headers.get("content-type", "").startswith("application/json"):
        out.append(f"content-type {reply.headers.get('content-type')!r}")
    try:
        doc = json.loads(reply.body)
    except ValueError:
        return [*out, f"not JSON: {reply.body[:200]!r}"]
    err = doc.get("error") if isinstance(doc, dict) else None
    if b" /api/" in case.data.split(b"\r\n", 1)[0]:
        # Ollama's routes answer in Ollama's shape: {"error": "<message>"}.
        if not isinstance(err, str) or not err or set(doc) != {"error"}:
            out.append(f"not Ollama's error shape: {doc!r}")
        return out
    if not isinstance(err, dict) or set(err) != {"message", "type", "code", "param"}:
        return [*out, f"not an envelope: {doc!r}"]
    if not isinstance(err["message"], str) or not err["message"]:
        out.append("empty message")
    if (err["type"], err["code"]) != (etype, code):
        out.append(f"type/code {err['type']}/{err['code']} != {etype}/{code}")
    if case.param is not None and err["param"] != case.param:
        out.append(f"param {err['param']!r} != {case.param!r}")
    return out


async def check_all(gw: Gateway, all_cases: list[Case]) -> None:
    failures = []
    for case in all_cases:
        with trio.fail_after(10):
            reply = await exchange(gw.host_port, case.data)
        bad = problems(case, reply)
        if bad:
            failures.append(f"{case.name}: {'; '.join(bad)} -- {reply.body[:300]!r}")
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------- tests


async def test_malformed_requests_get_exact_envelopes() -> None:
    all_cases = cases()
    assert len(all_cases) >= 60
    assert len({c.name for c in all_cases}) == len(all_cases)
    with trio.fail_after(120):
        async with running_gateway(YAML) as gw:
            # Controls: the same client and edge accept well-formed requests.
            ok = await exchange(gw.host_port, chat())
            assert ok.status == 200, ok.body
            assert json.loads(ok.body)["choices"][0]["message"]["content"] == "hi"
            ok = await exchange(
                gw.host_port,
                chunked_post(
                    CHAT,
                    chunked(
                        b'{"model": "echo", ', json.dumps({"messages": OK_MESSAGES}).encode()[1:]
                    ),
                ),
            )
            assert ok.status == 200, ok.body
            ok = await exchange(gw.host_port, http(b"GET", b"/healthz", auth=None))
            assert ok.status == 200
            await check_all(gw, all_cases)
            # Still serving after all that.
            ok = await exchange(gw.host_port, chat())
            assert ok.status == 200


async def test_checker_flags_bad_replies() -> None:
    """The checker itself: a wrong status, a 5xx, a leak or a bare body are caught."""
    case = Case("x", b"", BAD_REQUEST)
    good = json.dumps(
        {
            "error": {
                "message": "m",
                "type": "invalid_request_error",
                "code": "invalid_request_error",
                "param": None,
            }
        }
    ).encode()
    ctype = {"content-type": "application/json"}
    assert problems(case, Reply(400, ctype, good)) == []
    assert problems(case, Reply(404, ctype, good))
    assert problems(case, Reply(500, ctype, good))
    assert problems(case, Reply(400, ctype, good.replace(b'"m"', b'"Traceback: iopd/x.py"')))
    assert problems(case, Reply(400, ctype, b"bad request"))
    assert problems(case, Reply(400, ctype, b'{"error": "bad"}'))
    assert problems(Case("y", b"", BAD_REQUEST, "model"), Reply(400, ctype, good))


async def test_slow_clients_get_408() -> None:
    with trio.fail_after(30):
        async with running_gateway(YAML) as gw:
            for name, data in (
                ("head never finished", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"),
                (
                    "body never finished",
                    http(b"POST", CHAT, b"{}", headers=[])[:-2].replace(
                        b"Content-Length: 2", b"Content-Length: 50"
                    ),
                ),
            ):
                reply = await exchange(gw.host_port, data)
                bad = problems(Case(name, data, TIMEOUT), reply)
                assert not bad, (name, bad)


async def test_a_smuggled_request_gets_no_answer_of_its_own() -> None:
    """One request to a front end that reads a chunk extension up to CRLF, two
    to a parser that ends the line at a bare LF: the edge answers one 400 and
    closes, the request hidden in the body is never served."""
    hidden = b"GET /v1/models HTTP/1.1\r\nHost: edge\r\nAuthorization: " + AUTH + b"\r\n\r\n"
    data = _TE_HEAD + b"2;a\n{}\r\n0\r\n\r\n" + hidden
    with trio.fail_after(30):
        async with running_gateway(YAML) as gw:
            stream = await trio.open_tcp_stream(*gw.host_port)
            async with stream:
                await stream.send_all(data)
                received = b""
                while chunk := await stream.receive_some(65536):
                    received += chunk
    assert received.startswith(b"HTTP/1.1 400 ")
    assert received.count(b"HTTP/1.1 ") == 1, received
