"""Provider pool: candidates, capacity leases and the fair wait queue (SPEC §2).

``candidates`` chooses among a request's live candidates (outlier-aware),
``fair_queue`` orders the waiters (weighted fair across principals),
``scheduler`` makes every decision with them, synchronously; ``pool`` is the
trio layer request handlers use (``async with pool.lease(group_id) as lease``).
``outliers``, ``retry_rules`` and ``retry_budget`` are the pure cores of
routing around failing providers.
"""

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
    "GroupPolicy",
    "Lease",
    "PoolSnapshot",
    "PrincipalPolicy",
    "ProviderLoad",
    "ProviderPool",
    "ProviderSlot",
    "Scheduler",
    "WaitObserver",
]
