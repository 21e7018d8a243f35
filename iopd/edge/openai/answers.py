"""The routes the edge answers itself, from the snapshot and the pool: no
provider is involved (``Serves.EDGE``).

``/healthz`` (503 while draining), the model list and ``/v1/models/{id}``,
and Ollama's ``/api/tags``, ``/api/ps`` and ``/api/version``.  Each is a
:data:`~iopd.edge.openai.routes.Handler` named by ``app.py``'s route table.
"""

from __future__ import annotations

from urllib.parse import unquote

import msgspec

from iopd import __version__, errors
from iopd.config.catalog import GroupSpec
from iopd.edge.openai.lifecycle import Call
from iopd.edge.openai.prepare import model_not_found
from iopd.edge.openai.routes import Host
from iopd.edge.runtime.edge_runtime import EdgeRuntime, Snapshot
from iopd.http.server import Request, Responder
from wire.messages import ModelInfo

__all__ = [
    "MODEL_PREFIX",
    "health",
    "model",
    "models",
    "not_found",
    "ollama_ps",
    "ollama_tags",
    "ollama_version",
]

JSON = "application/json"
_json_encode = msgspec.json.Encoder().encode
_JSON_HEADERS = (("content-type", JSON),)

#: ``GET /v1/models/{id}``: the one route with a parameter (the id may hold ``/``).
MODEL_PREFIX = "/v1/models/"


async def _answer(call: Call, responder: Responder, body: bytes) -> None:
    call.out.answered(200)
    await responder.send(200, list(_JSON_HEADERS), body)


async def health(host: Host, call: Call, request: Request, responder: Responder) -> None:
    """``/healthz``: 200, or 503 while draining (out of the load balancer)."""
    if host.draining:  # take this instance out of the load balancer
        raise errors.ShuttingDown("the edge is shutting down")
    await _answer(call, responder, b'{"status":"ok"}')


async def models(host: Host, call: Call, request: Request, responder: Responder) -> None:
    """``GET /v1/models``: the listed groups."""
    data = [_model_object(g.id) for g in host.rt.snapshot.catalog.listed()]
    await _answer(call, responder, _json_encode({"object": "list", "data": data}))


async def model(host: Host, call: Call, request: Request, responder: Responder) -> None:
    """``GET /v1/models/{id}`` (the SDK's ``models.retrieve``)."""
    await _answer(call, responder, _json_encode(_retrieve_model(host.rt.snapshot, request.path)))


async def ollama_tags(host: Host, call: Call, request: Request, responder: Responder) -> None:
    """``/api/tags``: the groups with an ``ollama`` provider, each with what its
    node's last probe said of the served model (``_ollama_model``)."""
    rt = host.rt
    tags = [_ollama_model(g.id, _served_info(rt, g)) for g in _ollama_groups(rt.snapshot)]
    await _answer(call, responder, _json_encode({"models": tags}))


async def ollama_ps(host: Host, call: Call, request: Request, responder: Responder) -> None:
    """``/api/ps``: those of them with a request in flight."""
    running = [_ollama_model(g, None) for g in _running_ollama_groups(host.rt)]
    await _answer(call, responder, _json_encode({"models": running}))


async def ollama_version(host: Host, call: Call, request: Request, responder: Responder) -> None:
    """``/api/version``: the edge's own (no single provider speaks for the gateway)."""
    await _answer(call, responder, _json_encode({"version": __version__}))


async def not_found(host: Host, call: Call, request: Request, responder: Responder) -> None:
    """A route without methods (an unknown ``/api/*`` path) never gets here:
    the head hook answers it 404; this is for the table's completeness."""
    raise errors.RouteNotFound(f"no route for {request.method} {request.path}")


def _model_object(group_id: str) -> dict[str, str | int]:
    return {"id": group_id, "object": "model", "created": 0, "owned_by": "iopd"}


def _retrieve_model(snap: Snapshot, path: str) -> dict[str, str | int]:
    """``GET /v1/models/{id}``: exactly a listed id.

    The id is percent-decoded (an SDK quotes ``/`` in ``org/model``); the
    fallback group answers for its own id only, not for every unknown name.
    """
    name = unquote(path[len(MODEL_PREFIX) :])
    group = snap.catalog.group(name)
    if group is None:
        raise model_not_found(snap, name)
    return _model_object(group.id)


def _ollama_groups(snap: Snapshot) -> list[GroupSpec]:
    """The groups ``/api/*`` serves: those with an ``ollama`` provider."""
    return [g for g in snap.catalog.listed() if snap.catalog.has_type(g.id, "ollama")]


def _running_ollama_groups(rt: EdgeRuntime) -> list[str]:
    """``/api/ps``: the Ollama groups with a request in flight on one of their ollama providers."""
    snap, loads = rt.snapshot, rt.pool.provider_loads()
    running = []
    for group in _ollama_groups(snap):
        for pid, _served in group.providers:
            load = loads.get(pid)
            ref = snap.catalog.providers.get(pid)
            if load is not None and load.in_flight and ref is not None and ref.config.type == "ollama":
                running.append(group.id)
                break
    return running


def _served_info(rt: EdgeRuntime, group: GroupSpec) -> ModelInfo | None:
    """The first of ``group``'s ollama providers' served models its node described."""
    snap = rt.snapshot
    for pid, served in group.providers:
        ref = snap.catalog.providers.get(pid)
        state = rt.health.get(pid)
        if ref is not None and ref.config.type == "ollama" and state is not None:
            info = state.models.get(served)
            if info is not None:
                return info
    return None


def _ollama_model(name: str, info: ModelInfo | None) -> dict[str, object]:
    """An ``/api/tags`` entry named ``name`` (the caller's model): the provider's
    entry as the node reported it, or placeholders when nothing is known."""
    if info is None:
        return {
            "name": name,
            "model": name,
            "modified_at": "1970-01-01T00:00:00Z",
            "size": 0,
            "digest": "",
            "details": {},
        }
    return {
        "name": name,
        "model": name,
        "modified_at": info.modified_at or "1970-01-01T00:00:00Z",
        "size": info.size,
        "digest": info.digest,
        "details": {f: getattr(info.details, f) for f in info.details.__struct_fields__},
    }
