"""Shared plumbing of the HTTP adapters (openai, ollama): raw relay, errors, probes.

The relay forwards the edge's request to the provider and the provider's
response back chunk by chunk — no re-buffering — while a usage scanner
(``iopd.node.usage_extract``) reads along in bounded memory.  Hop-by-hop
headers are dropped both ways; framing (content-length / chunked) is the
HTTP client's job upstream and the edge's job downstream.

``Accept-Encoding`` is not forwarded, so the provider answers uncompressed
and usage can be read from the body.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Iterator

import trio

from iopd.http.client import (
    EarlyStart,
    ProviderConnectError,
    ProviderHTTPClient,
    ProviderHTTPError,
    ProviderResetError,
    ProviderResponse,
    ProviderTimeoutError,
)
from iopd.node.adapters.base import Adapter, AdapterError, TunnelOutput
from iopd.node.served_models import MAX_LIST_BYTES, listed_names, model_infos, not_served
from iopd.node.usage_extract import scanner_for
from iopd.vocabulary import HOP_BY_HOP, NEVER_REACHED
from wire.messages import Health, ProviderErrorCode, ProviderSpec, ProviderTunnelRequest

# Dropped from requests: framing/routing owned by the client, and encodings we
# could not scan for usage.
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "accept-encoding"}
# Dropped from responses: the edge frames the body itself.
_RESPONSE_DROP = HOP_BY_HOP | {"content-length"}
#: Bytes of a provider's error body quoted in an error message.
ERROR_SNIPPET_BYTES = 512
PROBE_EXTRA_SECONDS = 5.0
#: Bytes of the probe's body kept: one past what is checked, to tell a longer list.
LIST_CAP = MAX_LIST_BYTES + 1


def _is_hop(name: str, drop: frozenset[str]) -> bool:
    lname = name.lower()
    return lname in drop or lname.startswith("proxy-")


def _connection_tokens(headers: Iterable[tuple[str, str]]) -> set[str]:
    """Header names listed in ``Connection:`` are hop-by-hop too (RFC 9110 §7.6.1)."""
    names: set[str] = set()
    for name, value in headers:
        if name.lower() == "connection":
            names.update(t.strip().lower() for t in value.split(",") if t.strip())
    return names


def end_to_end(headers: Iterable[tuple[str, str]], *, request: bool) -> list[tuple[str, str]]:
    """Drop hop-by-hop headers (and framing headers) from ``headers``."""
    headers = list(headers)
    drop = frozenset((_REQUEST_DROP if request else _RESPONSE_DROP) | _connection_tokens(headers))
    return [(k, v) for k, v in headers if not _is_hop(k, drop)]


#: The HTTP client's errors and the wire code each is sent as, most specific
#: first (a reset is a protocol error); the message of the two that never
#: reached the provider is fixed (``NEVER_REACHED``), the client's text is for
#: the node's log.
_CODES: tuple[tuple[type[ProviderHTTPError], ProviderErrorCode], ...] = (
    (ProviderTimeoutError, "provider_timeout"),
    (ProviderConnectError, "provider_unreachable"),
    (ProviderResetError, "provider_reset"),
    (ProviderHTTPError, "provider_error"),
)


class _AdapterErrors:
    """Map the HTTP client's errors to AdapterError (messages carry no secrets).

    The code says how far the request got, because that decides whether the
    edge may retry it elsewhere: ``provider_unreachable`` (never connected),
    ``provider_reset`` (lost while the request was written),
    ``provider_timeout`` (sent, no answer), ``provider_error`` (anything
    after the provider may have read the request).

    A connect or reset error names the provider's address (trio's "all
    attempts to connect to HOST:PORT failed"): the message the caller gets
    says only what happened, and the address goes to the node's log as the
    error's ``detail``.

    A class-based context manager (one instance serves every use): it wraps
    every relayed request, and ``@contextmanager`` costs several times more.
    """

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if not isinstance(exc, ProviderHTTPError):
            return
        for kind, code in _CODES:
            if isinstance(exc, kind):
                fixed = NEVER_REACHED.get(code)
                if fixed is None:
                    raise AdapterError(code, str(exc)) from None
                raise AdapterError(code, fixed, detail=str(exc)) from None


_ADAPTER_ERRORS = _AdapterErrors()


def adapter_errors() -> _AdapterErrors:
    """The context manager mapping the HTTP client's errors to ``AdapterError``."""
    return _ADAPTER_ERRORS


def error_snippet(body: bytes) -> str:
    """A short, printable quote of a provider's error body."""
    text = body[:ERROR_SNIPPET_BYTES].decode("utf-8", "replace")
    return " ".join(text.split())


class HTTPAdapter(Adapter):
    """An adapter that talks HTTP to ``spec.base_url`` through one pooled client."""

    #: Which usage flavour the relayed bodies have (``openai`` or ``ollama``).
    usage_flavour = "openai"
    #: Path of the health probe (GET, 200 = healthy when it lists every served model).
    probe_path = "/"

    def __init__(self, spec: ProviderSpec) -> None:
        super().__init__(spec)
        if not spec.base_url:
            raise ValueError(f"provider {spec.id!r}: base_url is required for type {spec.type}")
        self.client = ProviderHTTPClient(
            spec.base_url,
            connect_timeout=spec.connect_timeout,
            read_timeout=spec.read_timeout,
            first_byte_timeout=spec.first_byte_timeout,
            # Keep as many idle connections as the edge may run requests at
            # once (+1 for the health probe): a smaller pool closes and
            # re-dials a connection per request under full load.
            max_idle_connections=max(8, spec.capacity + 1),
        )

    def auth_headers(self, existing: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
        """``Authorization: Bearer <api_key>`` unless one is already present."""
        if not self.spec.api_key:
            return []
        if any(name.lower() == "authorization" for name, _ in existing):
            return []
        return [("Authorization", f"Bearer {self.spec.api_key}")]

    @contextlib.asynccontextmanager
    async def post_json(
        self, path: str, payload: bytes, *, accept: str | None = None
    ) -> AsyncIterator[ProviderResponse]:
        """POST a JSON body for the normalized path; yields a 200 response to stream.

        Any other status is a ``provider_error`` carrying a snippet of its body,
        but a 429 is ``provider_saturated`` with the provider's ``Retry-After``
        (the edge then rests the provider instead of counting a failure);
        client errors inside the block map to adapter errors as on the relay.
        """
        headers = [("Content-Type", "application/json")]
        if accept is not None:
            headers.append(("Accept", accept))
        headers += self.auth_headers()
        with adapter_errors():
            async with self.client.stream("POST", path, headers, payload) as resp:
                if resp.status != 200:
                    snippet = error_snippet(await resp.read(4096))
                    message = f"provider returned status {resp.status}: {snippet}"
                    if resp.status == 429:
                        raise AdapterError(
                            "provider_saturated", message, retry_after=resp.header("retry-after")
                        )
                    raise AdapterError("provider_error", message)
                yield resp

    def _tunnel_headers(self, req: ProviderTunnelRequest) -> list[tuple[str, str]]:
        headers = end_to_end(req.headers, request=True)
        return headers + self.auth_headers(headers)

    def _lazy_tunnel_headers(self, req: ProviderTunnelRequest) -> Iterator[tuple[str, str]]:
        """The same, built only when iterated: the client needs no headers for a
        request ``start_early`` already wrote (it does on a retry)."""
        yield from self._tunnel_headers(req)

    def start_early(self, req: ProviderTunnelRequest) -> EarlyStart | None:
        return self.client.start_early(req.method, req.path, self._tunnel_headers(req), req.body)

    async def tunnel(
        self, req: ProviderTunnelRequest, out: TunnelOutput, early: EarlyStart | None = None
    ) -> None:
        with adapter_errors():
            async with self.client.stream(
                req.method, req.path, self._lazy_tunnel_headers(req), req.body, early=early
            ) as resp:
                # A head that arrived with the first body bytes leaves with them.
                await out.head(
                    resp.status,
                    end_to_end(resp.headers, request=False),
                    body_follows=resp.body_ready(),
                )
                scanner = scanner_for(resp.header("content-type"), flavour=self.usage_flavour)
                try:
                    async for chunk in resp.aiter_bytes():
                        await out.body(chunk)
                        scanner.feed(chunk)
                finally:
                    # Usage seen before a cancel or a broken stream still counts.
                    scanner.finish()
                    out.usage = scanner.usage
                    out.reasoning_chars = scanner.reasoning_chars

    async def probe(self) -> tuple[Health, str]:
        try:
            with trio.fail_after(self.spec.connect_timeout + PROBE_EXTRA_SECONDS):
                with adapter_errors():
                    resp = await self.client.request(
                        "GET", self.probe_path, self.auth_headers(), max_body_bytes=LIST_CAP
                    )
        except trio.TooSlowError:
            return "unhealthy", "health probe timed out"
        except AdapterError as exc:  # for the operator (/status, the logs): with the address
            return "unhealthy", f"{exc.message}: {exc.detail}" if exc.detail else exc.message
        if resp.status != 200:
            return "unhealthy", f"{self.probe_path} returned status {resp.status}"
        if len(resp.body) > MAX_LIST_BYTES:
            return "healthy", ""  # a list this long is not checked
        listed = listed_names(resp.body, self.usage_flavour)
        if self.usage_flavour == "ollama":
            self.model_infos = model_infos(resp.body, self.spec.models)
        if listed is not None:
            wrong = not_served(self.spec.models, listed, self.usage_flavour, self.probe_path)
            if wrong is not None:
                return "unhealthy", wrong
        return "healthy", ""

    async def aclose(self) -> None:
        await self.client.aclose()
        await super().aclose()


#: Longest line accepted from a provider's SSE/NDJSON stream on the normalized path.
MAX_LINE_BYTES = 4 * 1024 * 1024


async def iter_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Split a byte stream into lines (without ``\\r\\n``), bounded by MAX_LINE_BYTES."""
    buf = bytearray()
    async for chunk in chunks:
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                buf += chunk[start:]
                if len(buf) > MAX_LINE_BYTES:
                    raise AdapterError("provider_error", "provider sent an overlong line")
                break
            buf += chunk[start:nl]
            line = bytes(buf).rstrip(b"\r")
            buf.clear()
            start = nl + 1
            yield line
    if buf:
        yield bytes(buf).rstrip(b"\r")
