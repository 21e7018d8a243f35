"""Runtime controls of a provider as the pool applies them.

Why a separate overlay: the config says what a provider is (``ProviderSlot``);
an operator may override it for a while without editing the config -- take it
out of rotation (``draining``, ``disabled``) or change its ``capacity`` or
``priority``.  The pool keeps the configured snapshot and these controls
apart (``ControlTable``) and its scheduler decides on the effective snapshot
(``effective_snapshot(configured, controls)``), so a refresh (a new
configured snapshot) keeps the controls and a control change keeps the
config: either one rebuilds the effective view the same way, and the
scheduler takes it as it takes a refresh.

Draining and disabled are the same to the pool -- neither provider is a
candidate for new requests, leases already held finish normally -- and
differ only in what is shown: a draining provider reports ``drained`` once
its last lease is back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, get_args

from .candidates import PoolSnapshot, ProviderSlot

__all__ = [
    "CONTROL_STATES",
    "ControlState",
    "ControlTable",
    "ProviderControl",
    "ShownState",
    "effective_snapshot",
    "shown_state",
]

#: What an operator sets.
ControlState = Literal["active", "draining", "disabled"]
CONTROL_STATES: Final = frozenset(get_args(ControlState))
#: What ``/status`` shows: ``drained`` is a draining provider with nothing in flight.
ShownState = Literal["active", "draining", "drained", "disabled"]


@dataclass(frozen=True)
class ProviderControl:
    """A provider's runtime state and overrides; ``None`` keeps the configured value."""

    state: ControlState = "active"
    capacity: int | None = None
    priority: int | None = None

    @property
    def is_default(self) -> bool:
        """True when it changes nothing (the pool then keeps no entry for it)."""
        return self == _DEFAULT


_DEFAULT: Final = ProviderControl()


def effective_slot(slot: ProviderSlot, control: ProviderControl) -> ProviderSlot:
    """``slot`` as the pool uses it under ``control``."""
    return dataclasses.replace(
        slot,
        capacity=slot.capacity if control.capacity is None else control.capacity,
        priority=slot.priority if control.priority is None else control.priority,
        enabled=slot.enabled and control.state == "active",
        control=control.state,
    )


def effective_snapshot(
    configured: PoolSnapshot, controls: Mapping[str, ProviderControl]
) -> PoolSnapshot:
    """The configured snapshot with every control applied (itself when there are none)."""
    if not controls:
        return configured
    providers = {
        pid: effective_slot(slot, controls[pid]) if pid in controls else slot
        for pid, slot in configured.providers.items()
    }
    return dataclasses.replace(configured, providers=providers)


def shown_state(control: ProviderControl, in_flight: int) -> ShownState:
    """The state ``/status`` shows: ``drained`` once a draining provider holds no lease."""
    if control.state == "draining" and in_flight == 0:
        return "drained"
    return control.state


class ControlTable:
    """The configured snapshot and the controls over it: what the scheduler decides on.

    Holds only non-default controls, and only for providers the configured
    snapshot has: ``reconfigure`` (a refresh) drops those of removed providers.
    """

    def __init__(self, configured: PoolSnapshot) -> None:
        self.configured = configured
        self._controls: dict[str, ProviderControl] = {}

    def get(self, provider_id: str) -> ProviderControl:
        """The provider's control (the default when it has none)."""
        return self._controls.get(provider_id, _DEFAULT)

    def set(self, provider_id: str, control: ProviderControl) -> None:
        """``KeyError`` for a provider not configured; ``ValueError`` for a capacity < 0."""
        if provider_id not in self.configured.providers:
            raise KeyError(provider_id)
        if control.capacity is not None and control.capacity < 0:
            raise ValueError(f"capacity override must be >= 0 (got {control.capacity})")
        if control.is_default:
            self._controls.pop(provider_id, None)
        else:
            self._controls[provider_id] = control

    def reconfigure(self, configured: PoolSnapshot) -> None:
        """A new configured snapshot: controls kept, except for providers it lacks."""
        self.configured = configured
        for pid in [p for p in self._controls if p not in configured.providers]:
            del self._controls[pid]

    def effective(self) -> PoolSnapshot:
        """The configured snapshot under the controls."""
        return effective_snapshot(self.configured, self._controls)
