"""Provider pool: candidates, capacity leases and the fair wait queue.

``candidates`` chooses among a request's live candidates (outlier-aware),
``fair_queue`` orders the waiters (weighted fair across principals),
``scheduler`` makes every decision with them, synchronously; ``pool`` is the
trio layer request handlers use (``async with pool.lease(group_id) as lease``).
``controls`` overlays an operator's runtime state and overrides on the
configured providers.  ``outliers``, ``retry_rules`` and ``retry_budget``
are the pure cores of routing around failing providers.
"""

from .controls import CONTROL_STATES, ControlState, ProviderControl, ShownState
from .pool import Lease, ProviderPool, WaitObserver
from .scheduler import (
    GroupPolicy,
    PoolSnapshot,
    PrincipalPolicy,
    ProviderLoad,
    ProviderSlot,
    Scheduler,
)

__all__ = [
    "CONTROL_STATES",
    "ControlState",
    "GroupPolicy",
    "Lease",
    "PoolSnapshot",
    "PrincipalPolicy",
    "ProviderControl",
    "ProviderLoad",
    "ProviderPool",
    "ProviderSlot",
    "Scheduler",
    "ShownState",
    "WaitObserver",
]
