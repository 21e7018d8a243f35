"""What a route of the OpenAI listener is: the one shape of an entry of the
route table (``app.py``'s ``ROUTES``) and of the handlers it names.

A :class:`Route` says everything the listener needs of an endpoint, once:

* ``methods`` and the metric ``endpoint`` (None: not an API request);
* ``handler``: the coroutine that serves an admitted request (see
  :data:`Handler`); a route a provider serves names ``app.Provided``, which
  says *which providers* serve it (:class:`Serves`);
* ``errors``: the caller's error shape (:class:`ErrorShape`: the OpenAI
  envelope, Ollama's ``{"error": "..."}``, or a shape of the route's own);
* ``auth``: how its callers authenticate (:data:`Authenticate`, reading the
  head's headers), or None for an open route (``/healthz``);
* ``quiet``: no request line per request (load balancers poll ``/healthz``).

Nothing here depends on a handler module: the table that joins routes to
handlers is ``app.py``'s, and handler modules import this one.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import NamedTuple, Protocol

from iopd.edge.openai.lifecycle import Call, RequestIds
from iopd.edge.openai.outgoing.error_envelope import OPENAI_ERRORS, ErrorShape
from iopd.edge.principals.authenticator import Principal
from iopd.edge.runtime.edge_runtime import EdgeRuntime, Snapshot
from iopd.http.server import Request, Responder
from iopd.vocabulary import Endpoint

__all__ = [
    "GET",
    "POST",
    "Authenticate",
    "Handler",
    "Host",
    "Route",
    "Serves",
    "bearer",
]

GET = frozenset({"GET"})
POST = frozenset({"POST"})

Headers = list[tuple[str, str]]


class Host(Protocol):
    """What a handler may use of the app that runs it."""

    @property
    def rt(self) -> EdgeRuntime: ...

    @property
    def ids(self) -> RequestIds: ...

    @property
    def draining(self) -> bool: ...


#: Serves one admitted request (its route, method and caller are known).
Handler = Callable[[Host, Call, Request, Responder], Awaitable[None]]

#: The caller of a request from its head's headers; raises
#: ``AuthenticationError`` to refuse it (before any body byte is read).
Authenticate = Callable[[Snapshot, Headers], Principal]


def bearer(snap: Snapshot, headers: Headers) -> Principal:
    """``Authorization: Bearer <token>``: the OpenAI and Ollama routes' auth."""
    authorization = next((v for k, v in headers if k == "authorization"), None)
    return snap.auth.authenticate(authorization)


class Serves(enum.Enum):
    """Which providers serve a route, and so which paths its requests may take."""

    #: The edge answers it itself (health, the model lists): no provider.
    EDGE = "edge"
    #: Relayed raw to a passthrough (type ``openai``) provider, whatever else
    #: the group holds (``/v1/embeddings``, ``/v1/completions``; embeddings
    #: go to an ``ollama`` provider in a group without one: ``needs``).
    PASSTHROUGH = "passthrough"
    #: Relayed raw to an ``ollama`` provider (``/api/chat`` and its kin).
    OLLAMA = "ollama"
    #: Relayed to a passthrough provider, run normalized on any other: the
    #: leased provider decides (``/v1/chat/completions``, ``/v1/responses``).
    RELAY_OR_NORMALIZED = "relay_or_normalized"


class Route(NamedTuple):
    """One route of the listener (see the module docstring)."""

    methods: frozenset[str]
    #: The metric ``endpoint`` (None: not an API request, e.g. the model list).
    endpoint: Endpoint | None
    handler: Handler
    #: The caller's error shape on this route.
    errors: ErrorShape = OPENAI_ERRORS
    #: How its callers authenticate (None: an open route).
    auth: Authenticate | None = bearer
    #: Not logged or counted per request (health probes).
    quiet: bool = False
