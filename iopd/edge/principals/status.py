"""Per-principal limits as the rest of the edge sees them.

``limits`` splits between two owners: the pool owns concurrency and the fair
queue (``share``, ``max_concurrent``: :func:`principal_policies` puts them in
its snapshot), the limiter owns rates and budgets (:func:`rates_in_force`
says whether a request must go through it at all).  ``/status`` shows both
views side by side, one row per principal (:func:`principal_rows`).
"""

from __future__ import annotations

from typing import TypedDict

from iopd.config.schema import EdgeConfig, LimitDefaults, LimitsSection, PrincipalLimit
from iopd.edge.pool.pool import ProviderPool
from iopd.edge.pool.scheduler import PrincipalPolicy
from iopd.edge.principals.backend import LimitsBackend
from iopd.edge.principals.decisions import Limits, WindowStatus, limits_from_config

__all__ = [
    "PrincipalRow",
    "WindowRow",
    "principal_policies",
    "principal_rows",
    "rates_in_force",
]


def rates_in_force(section: LimitsSection) -> bool:
    """True when a request must go through the limits backend: ``limits`` sets a
    rate or a budget for anyone, or a ``max_concurrent`` the store shares
    (``limits.backend: redis``)."""
    entries: list[LimitDefaults | PrincipalLimit] = [section.default, *section.principals]
    shared_slots = section.backend == "redis"
    return any(
        e.requests_per_minute
        or e.tokens_per_minute
        or e.tokens_per_day
        or (shared_slots and e.max_concurrent)
        for e in entries
    )


def principals_in_flight(cfg: EdgeConfig, pool: ProviderPool) -> dict[str, int]:
    """``iop_principal_in_flight``: every configured principal (0 when idle), and
    the unmapped caller while it runs something; counted by the pool."""
    shown = {t.principal_ref: 0 for t in cfg.openai.principal_tokens}
    shown.update({ref: running for ref, (running, _queued) in pool.principal_loads().items()})
    return shown


def principal_policies(
    section: LimitsSection,
) -> tuple[PrincipalPolicy, dict[str, PrincipalPolicy]]:
    """``limits`` as the pool sees it: each principal's ``share`` and ``max_concurrent``.

    The pool is the one owner of concurrency: it counts the slots a principal
    holds and keeps one more request waiting in its queue.  With
    ``limits.backend: redis`` the store holds ``max_concurrent`` for every
    edge (a request takes its slot there before it queues), so the pool's
    cap is off; ``share`` stays the pool's.
    """
    default, principals = limits_from_config(section)
    shared = section.backend == "redis"

    def policy(lim: Limits) -> PrincipalPolicy:
        return PrincipalPolicy(share=lim.share, max_concurrent=0 if shared else lim.max_concurrent)

    return policy(default), {ref: policy(lim) for ref, lim in principals.items()}


class WindowRow(TypedDict):
    """One limit window of a principal in ``GET /status``."""

    limit: int  # 0 = unlimited
    used: int
    remaining: int | None  # None when unlimited
    reset_s: float  # until the window is empty again


class PrincipalRow(TypedDict):
    """One principal of ``GET /status``."""

    principal_ref: str
    in_flight: int  # holding a provider slot
    queued: int  # waiting in the pool's queue
    max_concurrent: int
    share: int
    requests_per_minute: WindowRow
    tokens_per_minute: WindowRow
    tokens_per_day: WindowRow


def _window_row(w: WindowStatus) -> WindowRow:
    return {
        "limit": w.limit,
        "used": w.used,
        "remaining": w.remaining,
        "reset_s": round(max(0.0, w.reset_s), 3),
    }


def principal_rows(
    cfg: EdgeConfig, pool: ProviderPool, limits: LimitsBackend
) -> list[PrincipalRow]:
    """Every configured principal and every active one: the pool's counts
    (in flight, queued on this edge) and the limits backend's windows."""
    loads = pool.principal_loads()
    windows = limits.status()
    refs = sorted(
        {t.principal_ref for t in cfg.openai.principal_tokens}
        | {p.principal_ref for p in cfg.limits.principals}
        | loads.keys()
        | windows.keys()
    )
    rows: list[PrincipalRow] = []
    for ref in refs:
        running, queued = loads.get(ref, (0, 0))
        st = windows.get(ref)
        if st is None:
            st = limits.status_of(ref)
        rows.append(
            {
                "principal_ref": ref,
                "in_flight": running,
                "queued": queued,
                "max_concurrent": st.limits.max_concurrent,
                "share": st.limits.share,
                "requests_per_minute": _window_row(st.requests_per_minute),
                "tokens_per_minute": _window_row(st.tokens_per_minute),
                "tokens_per_day": _window_row(st.tokens_per_day),
            }
        )
    return rows
