"""What every provider adapter implements, and what it writes its output to.

An adapter never talks to the wire.  The executor hands it an output object
(``RunOutput`` for the normalized path, ``TunnelOutput`` for passthrough) and
turns the calls into ``RunEvent``/``ProviderTunnelFrame`` messages; the
executor also sends every terminal message.  An adapter reports failure by
raising ``AdapterError(code, message)``; cancellation arrives as
``trio.Cancelled`` and the adapter only has to clean up (close the upstream
connection, kill the process group) — the usage it recorded so far on
``out.usage`` is still reported.
"""

from __future__ import annotations

from iopd.http.client import EarlyStart
from iopd.json_types import JSONObject
from wire.messages import (
    Health,
    ModelInfo,
    ProviderErrorCode,
    ProviderSpec,
    ProviderTunnelRequest,
    RunRequest,
    Usage,
)

__all__ = [
    "Adapter",
    "AdapterError",
    "CollectedRunOutput",
    "CollectedTunnelOutput",
    "RunOutput",
    "TunnelOutput",
]

#: The codes an adapter raises are the wire's ``ProviderErrorCode``: the edge
#: retries ``provider_unreachable``, ``provider_reset`` and ``provider_saturated``
#: (its ``Retry-After`` in ``AdapterError.retry_after``) on another provider
#: (a 429 is no failure of the provider, it is saturated for a while); an
#: older edge reads them as ``provider_error``.


class AdapterError(Exception):
    """A run failed in a way the edge should report; ``message`` never holds secrets.

    ``message`` goes to the edge and on to the caller; ``detail`` only into the
    node's log: what the operator needs and the caller must not see (the
    provider's address, the OS error of a failed connect).
    """

    def __init__(
        self,
        code: ProviderErrorCode,
        message: str,
        *,
        retry_after: str | None = None,
        detail: str = "",
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code: ProviderErrorCode = code
        self.message = message
        self.detail = detail
        #: ``provider_saturated``: the provider's ``Retry-After`` as it sent it (the
        #: edge bounds it); it travels in the error event's ``metadata``.
        self.retry_after = retry_after


class RunOutput:
    """Where a normalized run writes its results.

    ``usage`` is mutable: the adapter fills in totals as it learns them.
    ``finish_reason`` is what the run ended with (``stop``, ``length``,
    ``tool_calls``); None means ``stop``.
    """

    def __init__(self) -> None:
        self.usage = Usage()
        self.finish_reason: str | None = None

    async def text(self, delta: str) -> None:
        """A piece of the answer."""
        raise NotImplementedError

    async def reasoning(self, delta: str) -> None:
        """A piece of reasoning ("thinking") text."""
        raise NotImplementedError

    async def tool_call(self, call: JSONObject) -> None:
        """One complete tool call, OpenAI shape ``{id, type, function{name, arguments}}``."""
        raise NotImplementedError


class CollectedRunOutput(RunOutput):
    """A RunOutput that keeps everything in lists (tests, non-streaming callers)."""

    def __init__(self) -> None:
        super().__init__()
        #: ``("text"|"reasoning", str)`` or ``("tool_call", JSONObject)``, in order.
        self.events: list[tuple[str, str | JSONObject]] = []

    async def text(self, delta: str) -> None:
        self.events.append(("text", delta))

    async def reasoning(self, delta: str) -> None:
        self.events.append(("reasoning", delta))

    async def tool_call(self, call: JSONObject) -> None:
        self.events.append(("tool_call", call))

    @property
    def joined_text(self) -> str:
        return "".join(v for k, v in self.events if k == "text" and isinstance(v, str))

    @property
    def joined_reasoning(self) -> str:
        return "".join(v for k, v in self.events if k == "reasoning" and isinstance(v, str))

    @property
    def tool_calls(self) -> list[JSONObject]:
        return [v for k, v in self.events if k == "tool_call" and isinstance(v, dict)]


class TunnelOutput:
    """Where a passthrough relay writes the provider's response.

    ``usage`` is the usage extracted from the provider's body (None when the
    body carried none); ``reasoning_chars`` counts reasoning text seen in it.
    """

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self.reasoning_chars = 0

    async def head(
        self, status: int, headers: list[tuple[str, str]], *, body_follows: bool = False
    ) -> None:
        """The provider's status and end-to-end headers (sent once, first).

        ``body_follows``: the body's first bytes (or its end) are already in
        hand and come right after, so the head may wait to leave with them.
        """
        raise NotImplementedError

    async def body(self, data: bytes) -> None:
        """Body bytes, as they arrived from the provider."""
        raise NotImplementedError


class CollectedTunnelOutput(TunnelOutput):
    """A TunnelOutput that keeps everything (tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.status: int | None = None
        self.headers: list[tuple[str, str]] = []
        self.chunks: list[bytes] = []

    async def head(
        self, status: int, headers: list[tuple[str, str]], *, body_follows: bool = False
    ) -> None:
        self.status = status
        self.headers = headers

    async def body(self, data: bytes) -> None:
        self.chunks.append(data)

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)


class Adapter:
    """Base of every provider adapter; one instance per provider per registry."""

    def __init__(self, spec: ProviderSpec) -> None:
        self.spec = spec
        self.closed = False
        #: What the last probe's model list said of the served models (Ollama's details).
        self.model_infos: list[ModelInfo] = []

    async def run(self, req: RunRequest, out: RunOutput) -> None:
        """Run a normalized request, writing to ``out``; raise AdapterError on failure."""
        raise AdapterError(
            "bad_request", f"provider type {self.spec.type!r} has no normalized path"
        )

    def start_early(self, req: ProviderTunnelRequest) -> EarlyStart | None:
        """Begin sending ``req`` to the provider right now, synchronously; or None.

        Best effort, never blocking, never raising (the node's wire reader
        calls it, so the request leaves before a scheduler round).  The
        executor owns the result and hands it to ``tunnel(req, out, early)``.
        """
        return None

    async def tunnel(
        self, req: ProviderTunnelRequest, out: TunnelOutput, early: EarlyStart | None = None
    ) -> None:
        """Relay a raw HTTP request; raise AdapterError on failure.

        ``early``: what ``start_early`` returned for ``req``, to be handed to
        the HTTP client's ``stream``; an adapter that cannot use it leaves it
        alone (the executor abandons it when the stream ends).
        """
        raise AdapterError(
            "bad_request", f"provider type {self.spec.type!r} has no passthrough path"
        )

    async def probe(self) -> tuple[Health, str]:
        """One active health check: (health, last_error)."""
        return "healthy", ""

    async def aclose(self) -> None:
        """Release connections and other resources; called once, after runs drained."""
        self.closed = True
