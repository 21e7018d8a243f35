"""Provider pool: candidates, capacity leases and the global wait queue (SPEC §2).

``scheduler`` holds the pure synchronous decisions; ``pool`` is the trio layer
request handlers use (``async with pool.lease(group_id) as lease``).
"""

from .pool import Lease, ProviderPool, WaitObserver
from .scheduler import (
    GroupPolicy,
    PoolSnapshot,
    ProviderLoad,
    ProviderSlot,
    Scheduler,
)

__all__ = [
    "GroupPolicy",
    "Lease",
    "PoolSnapshot",
    "ProviderLoad",
    "ProviderPool",
    "ProviderSlot",
    "Scheduler",
    "WaitObserver",
]
