"""The pool's policies as a config gives them (providers, groups, principals, retries).

Pure translation, kept apart from the runtime that applies it: the pool
(``iopd.edge.pool``) knows nothing of the config's schema, and the runtime
builds these at start and on every refresh.  Runtime controls
are not here: the pool overlays them on what this returns.
"""

from __future__ import annotations

from iopd.config.catalog import Catalog
from iopd.config.schema import EdgeConfig
from iopd.edge.pool.outliers import EjectionPolicy
from iopd.edge.pool.retry_budget import RetryBudgetPolicy
from iopd.edge.pool.routing import RoutingPolicy
from iopd.edge.pool.scheduler import GroupPolicy, PoolSnapshot, ProviderSlot
from iopd.edge.principals.status import principal_policies

__all__ = ["pool_snapshot", "retry_budget_policy", "routing_policy"]


def pool_snapshot(cfg: EdgeConfig, catalog: Catalog) -> PoolSnapshot:
    """The pool's view of a config: providers with their slots, groups with targets.

    Also each principal's ``share`` and ``max_concurrent`` (``limits:``; the
    pool owns the running count per principal) and the ejection policy.
    """
    providers = {
        pid: ProviderSlot(
            provider_id=pid,
            node_id=ref.node_id,
            type=ref.config.type,
            capacity=ref.config.capacity,
            long_context_capacity=ref.config.long_context_capacity,
            priority=ref.config.priority,
            enabled=ref.config.enabled,
        )
        for pid, ref in catalog.providers.items()
    }
    groups = {
        g.id: GroupPolicy(
            id=g.id, providers=g.providers, queue_timeout=g.queue_timeout, routing=g.routing
        )
        for g in catalog.listed()
    }
    default_principal, principals = principal_policies(cfg.limits)
    return PoolSnapshot(
        providers=providers,
        groups=groups,
        max_queue=cfg.provider_pool.max_queue,
        queue_timeout=cfg.provider_pool.queue_timeout,
        max_queued_bytes=cfg.provider_pool.max_queued_bytes,
        principals=principals,
        default_principal=default_principal,
        ejection=EjectionPolicy(
            after_failures=cfg.provider_pool.eject_after_failures,
            seconds=cfg.provider_pool.eject_seconds,
            principals=2 if _callers_told_apart(cfg) > 1 else 1,
        ),
        routing=routing_policy(cfg),
    )


def routing_policy(cfg: EdgeConfig) -> RoutingPolicy:
    """``provider_pool.routing`` as the pool's router takes it."""
    r = cfg.provider_pool.routing
    return RoutingPolicy(
        block_bytes=r.block_bytes,
        max_prompt_bytes=r.max_prompt_bytes,
        index_blocks=r.index_blocks,
        max_sessions=r.max_sessions,
        min_match=r.min_match,
        max_load_gap=r.max_load_gap,
        max_load_gap_ratio=r.max_load_gap_ratio,
        wait_min_tokens=r.wait_min_tokens,
        prefill_tokens_per_second=r.prefill_tokens_per_second,
    )


def _callers_told_apart(cfg: EdgeConfig) -> int:
    """How many distinct principals a caller of this config can be: each
    principal token's ``principal_ref``, plus one for everyone else (the
    legacy bearer token, or no auth at all)."""
    refs = {p.principal_ref for p in cfg.openai.principal_tokens}
    others = bool(cfg.openai.bearer_token) or not refs
    return len(refs) + (1 if others else 0)


def retry_budget_policy(cfg: EdgeConfig) -> RetryBudgetPolicy:
    """``provider_pool.retry_budget`` and ``retry_budget_min``."""
    return RetryBudgetPolicy(
        ratio=cfg.provider_pool.retry_budget, minimum=cfg.provider_pool.retry_budget_min
    )
