"""Provider pool: candidates, capacity leases and the global wait queue (SPEC §2).

``scheduler`` holds the pure synchronous decisions; ``pool`` is the trio layer
request handlers use (``async with pool.lease(group_id) as lease``).
"""

from .pool import Lease, ProviderPool, WaitObserver, WaitOutcome
from .scheduler import (
    GroupPolicy,
    Health,
    PoolSnapshot,
    ProviderLoad,
    ProviderSlot,
    Scheduler,
)

__all__ = [
    "GroupPolicy",
    "Health",
    "Lease",
    "PoolSnapshot",
    "ProviderLoad",
    "ProviderPool",
    "ProviderSlot",
    "Scheduler",
    "WaitObserver",
    "WaitOutcome",
]
