"""Runtime controls of the providers: drain, disable, enable, override, reset.

Why a module of its own, free of any HTTP framework: the admin routes only
read the path's id and the body's bytes and hand both here; validation,
applying the change to the pool, the log line, the counter and the list of
recent events all live in ``RuntimeControls``.  So the routes stay the same
few lines on whichever server serves the admin side, and the behaviour is
tested without one.

What the pool does with a control is in ``iopd.edge.pool.controls``.
Where a control lives: in the memory of the provider's node.  A
change is sent to the node (``ControlUpdate``; 409 ``node_disconnected``
while the node is away) and applied to this edge's pool at once; the node
keeps the last write of any edge and sends its whole table to every edge
(``EdgeRuntime.node_controls`` applies it), at each change and at the start
of each session.  So every edge sees every control, an edge restart gets
them back from the node, and a node restart clears them.  They survive
``POST /refresh`` (a provider the refresh removes loses its own).
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Annotated, Final, TypedDict, TypeVar

import msgspec

from iopd import errors
from iopd.edge.metering.metrics import GatewayMetrics
from iopd.edge.pool import ControlState, ProviderControl, ProviderPool, ShownState
from iopd.vocabulary import AdminAction
from wire.messages import ControlUpdate, ProviderControlSpec

log = logging.getLogger("iopd.edge.controls")

#: How many control events ``recent_events`` keeps (oldest dropped first).
RECENT_EVENTS: Final = 50
#: Longest id echoed in an error message (the id comes from the request path).
_ID_SHOWN = 80

_Body = TypeVar("_Body", bound=msgspec.Struct)
#: Largest capacity or priority override (a 32-bit int: the config has no
#: bound, but an override beyond this is a typo, not an intent).
MAX_OVERRIDE: Final = 2**31 - 1
_NonNegative = Annotated[int, msgspec.Meta(ge=0, le=MAX_OVERRIDE)]

#: The action counted for each state an operator sets.
_STATE_ACTIONS: Final[dict[ControlState, AdminAction]] = {
    "active": "enable",
    "draining": "drain",
    "disabled": "disable",
}


class _StateBody(msgspec.Struct, forbid_unknown_fields=True):
    state: ControlState


class _OverrideBody(msgspec.Struct, forbid_unknown_fields=True):
    """A missing key keeps the override as it is; ``null`` clears it."""

    capacity: _NonNegative | None | msgspec.UnsetType = msgspec.UNSET
    priority: _NonNegative | None | msgspec.UnsetType = msgspec.UNSET


class _EmptyBody(msgspec.Struct, forbid_unknown_fields=True):
    pass


class OverrideView(TypedDict):
    """The raw overrides (``None``: the configured value is in force)."""

    capacity: int | None
    priority: int | None


class ProviderControlView(TypedDict):
    """A provider as the controls leave it: effective values, raw overrides."""

    id: str
    node_id: str
    state: ShownState
    capacity: int
    priority: int
    override: OverrideView
    in_flight: int


class NodeControlView(TypedDict):
    """A node's providers after ``POST /nodes/{id}/drain``."""

    id: str
    providers: list[ProviderControlView]


class ControlValues(TypedDict):
    """A provider's control before or after an action (raw, as set)."""

    state: ControlState
    capacity: int | None
    priority: int | None


class ControlEvent(TypedDict):
    """One applied control, for the console's list of recent changes."""

    at: float  # Unix time
    action: AdminAction
    node_id: str
    provider_id: str
    old: ControlValues
    new: ControlValues


def _values(control: ProviderControl) -> ControlValues:
    return {"state": control.state, "capacity": control.capacity, "priority": control.priority}


def _shown(value: object) -> str:
    return "none" if value is None else str(value)


#: The JSON path at the end of a msgspec validation message: ``... - at `$.capacity```.
_AT_FIELD = re.compile(r" - at `\$\.([A-Za-z_]+)[^`]*`$")


def _decode(body: bytes, kind: type[_Body], shape: str, *, empty_ok: bool) -> _Body:
    """``body`` as ``kind``; a 400 naming the field and the expected ``shape`` otherwise."""
    if not body.strip():
        if empty_ok:
            return kind()
        raise errors.InvalidRequest(f"the body must be a JSON object {shape}")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        found = _AT_FIELD.search(text)
        raise errors.InvalidRequest(
            f"the body must be a JSON object {shape}: {text[:200]}",
            param=found.group(1) if found else None,
        ) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise errors.InvalidRequest(f"the body is not JSON ({shape}): {exc}"[:300]) from None


class RuntimeControls:
    """The operator's runtime controls of one edge (``runtime.controls``).

    Every method takes the id from the route's path and the request body's
    bytes, validates them, applies the change to the pool (which re-examines
    its waiters at once), logs one ``event=admin_action`` line per provider
    changed, counts ``iop_admin_actions_total{action}`` and answers the new
    effective view.  Raises ``ResourceNotFound`` (404) for an id the running
    config does not have and ``InvalidRequest`` (400, ``param`` naming the
    field) for a bad body.
    """

    def __init__(
        self,
        pool: ProviderPool,
        metrics: GatewayMetrics,
        known_nodes: Callable[[], Collection[str]],
        *,
        send: Callable[[str, ControlUpdate], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``send(node_id, update)`` hands a change to the node that holds it
        (``NodeHub.send_controls``); it raises ``NodeDisconnected`` (409) while
        the node is away, and then nothing changes."""
        self._pool = pool
        self._send = send
        self._metrics = metrics
        self._known_nodes = known_nodes
        self._clock = clock
        self._events: deque[ControlEvent] = deque(maxlen=RECENT_EVENTS)

    # ------------------------------------------------------------ actions

    def set_state(self, provider_id: str, body: bytes) -> ProviderControlView:
        """``POST /providers/{id}/state`` with ``{"state": "active"|"draining"|"disabled"}``."""
        self._check_provider(provider_id)
        shape = '{"state": "active" | "draining" | "disabled"}'
        state = _decode(body, _StateBody, shape, empty_ok=False).state
        old = self._pool.control(provider_id)
        new = ProviderControl(state, old.capacity, old.priority)
        self._apply(_STATE_ACTIONS[state], {provider_id: new})
        self._metrics.count_admin_action(_STATE_ACTIONS[state])
        return self.view(provider_id)

    def set_override(self, provider_id: str, body: bytes) -> ProviderControlView:
        """``POST /providers/{id}/override`` with ``{"capacity": N|null, "priority": N|null}``.

        A missing key keeps that override; ``null`` clears it (the configured
        value is in force again).  Both are integers >= 0 (as in the config, up
        to ``MAX_OVERRIDE``);
        capacity 0 keeps the provider a candidate that takes nothing, so its
        requests wait (``draining`` or ``disabled`` send them elsewhere).
        """
        self._check_provider(provider_id)
        shape = '{"capacity": integer >= 0 | null, "priority": integer >= 0 | null}'
        asked = _decode(body, _OverrideBody, shape, empty_ok=False)
        old = self._pool.control(provider_id)
        new = ProviderControl(
            old.state,
            old.capacity if asked.capacity is msgspec.UNSET else asked.capacity,
            old.priority if asked.priority is msgspec.UNSET else asked.priority,
        )
        self._apply("override", {provider_id: new})
        self._metrics.count_admin_action("override")
        return self.view(provider_id)

    def reset(self, provider_id: str, body: bytes = b"") -> ProviderControlView:
        """``POST /providers/{id}/reset``: back to ``active``, every override cleared."""
        self._check_provider(provider_id)
        _decode(body, _EmptyBody, "{} (or no body)", empty_ok=True)
        self._apply("reset", {provider_id: ProviderControl()})
        self._metrics.count_admin_action("reset")
        return self.view(provider_id)

    def drain_node(self, node_id: str, body: bytes = b"") -> NodeControlView:
        """``POST /nodes/{id}/drain``: every provider of the node drains (overrides kept)."""
        if node_id not in self._known_nodes():
            raise errors.ResourceNotFound(
                f"no node {node_id[:_ID_SHOWN]!r} in the running config", param="node_id"
            )
        _decode(body, _EmptyBody, "{} (or no body)", empty_ok=True)
        pids = self._providers_of(node_id)
        drained = {}
        for pid in pids:
            old = self._pool.control(pid)
            drained[pid] = ProviderControl("draining", old.capacity, old.priority)
        self._apply("node_drain", drained, node_id=node_id)
        self._metrics.count_admin_action("node_drain")
        return {"id": node_id, "providers": [self.view(pid) for pid in pids]}

    # ------------------------------------------------------------ views

    def view(self, provider_id: str) -> ProviderControlView:
        """A provider's state, effective capacity and priority, and raw overrides."""
        self._check_provider(provider_id)
        pool = self._pool
        slot = pool.snapshot.providers[provider_id]
        control = pool.control(provider_id)
        return {
            "id": provider_id,
            "node_id": slot.node_id,
            "state": pool.shown_state(provider_id),
            "capacity": slot.capacity,
            "priority": slot.priority,
            "override": {"capacity": control.capacity, "priority": control.priority},
            "in_flight": pool.scheduler.in_flight(provider_id)[0],
        }

    def recent_events(self) -> list[ControlEvent]:
        """The last ``RECENT_EVENTS`` controls applied, oldest first."""
        return list(self._events)

    # ------------------------------------------------------------ internals

    def _check_provider(self, provider_id: str) -> None:
        if provider_id not in self._pool.configured.providers:
            raise errors.ResourceNotFound(
                f"no provider {provider_id[:_ID_SHOWN]!r} in the running config",
                param="provider_id",
            )

    def _providers_of(self, node_id: str) -> list[str]:
        return [p for p, s in self._pool.configured.providers.items() if s.node_id == node_id]

    def _apply(
        self, action: AdminAction, changes: dict[str, ProviderControl], *, node_id: str = ""
    ) -> None:
        """Send ``changes`` (providers of one node) to their node, then set them on
        the pool; one log line and one recent event per provider.

        The node answers with its whole table, which every edge applies (this
        one included: the same values, unless another edge wrote meanwhile,
        and then the last write wins everywhere).
        """
        configured = self._pool.configured.providers
        node_id = node_id or configured[next(iter(changes))].node_id
        self._send(
            node_id,
            ControlUpdate(
                controls=[
                    ProviderControlSpec(
                        provider_id=pid, state=c.state, capacity=c.capacity, priority=c.priority
                    )
                    for pid, c in changes.items()
                ]
            ),
        )
        for provider_id, new in changes.items():
            self._set(action, node_id, provider_id, new)

    def _set(self, action: AdminAction, node_id: str, provider_id: str, new: ProviderControl) -> None:
        old = self._pool.control(provider_id)
        self._pool.set_control(provider_id, new)
        log.info(
            "event=admin_action action=%s node=%s provider=%s state=%s->%s "
            "capacity=%s->%s priority=%s->%s",
            action,
            node_id,
            provider_id,
            old.state,
            new.state,
            _shown(old.capacity),
            _shown(new.capacity),
            _shown(old.priority),
            _shown(new.priority),
        )
        self._events.append(
            {
                "at": round(self._clock(), 3),
                "action": action,
                "node_id": node_id,
                "provider_id": provider_id,
                "old": _values(old),
                "new": _values(new),
            }
        )
