"""Per-principal limits as the rest of the edge sees them (issue #17).

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
from iopd.edge.principal_limits import PrincipalLimiter, WindowStatus

__all__ = [
    "PrincipalRow",
    "WindowRow",
    "principal_policies",
    "principal_rows",
    "rates_in_force",
]


def rates_in_force(section: LimitsSection) -> bool:
    """True when ``limits`` sets a rate or a budget for anyone."""
    entries: list[LimitDefaults | PrincipalLimit] = [section.default, *section.principals]
    return any(
        e.requests_per_minute or e.tokens_per_minute or e.tokens_per_day for e in entries
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
    holds and keeps one more request waiting in its queue.
    """
    d = section.default
    default = PrincipalPolicy(share=d.share, max_concurrent=d.max_concurrent)
    principals = {
        p.principal_ref: PrincipalPolicy(
            share=d.share if p.share is None else p.share,
            max_concurrent=d.max_concurrent if p.max_concurrent is None else p.max_concurrent,
        )
        for p in section.principals
    }
    return default, principals


class WindowRow(TypedDict):
    """One limit window of a principal in ``GET /status``."""

    limit: int  # 0 = unlimited
    used: int
    remaining: int | None  # None when unlimited
    reset_s: float  # until the window is empty again


class PrincipalRow(TypedDict):
    """One principal of ``GET /status`` (issue #17)."""

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
    cfg: EdgeConfig, pool: ProviderPool, limiter: PrincipalLimiter, now: float
) -> list[PrincipalRow]:
    """Every configured principal and every active one: the pool's counts
    (in flight, queued: the one owner of concurrency) and the limiter's windows."""
    loads = pool.principal_loads()
    windows = limiter.status(now)
    refs = sorted(
        {t.principal_ref for t in cfg.openai.principal_tokens}
        | {p.principal_ref for p in cfg.limits.principals}
        | loads.keys()
        | windows.keys()
    )
    policy = pool.snapshot.principal
    rows: list[PrincipalRow] = []
    for ref in refs:
        running, queued = loads.get(ref, (0, 0))
        st = windows.get(ref)
        if st is None:
            st = limiter.status_of(ref, now)
        rows.append(
            {
                "principal_ref": ref,
                "in_flight": running,
                "queued": queued,
                "max_concurrent": policy(ref).max_concurrent,
                "share": policy(ref).share,
                "requests_per_minute": _window_row(st.requests_per_minute),
                "tokens_per_minute": _window_row(st.tokens_per_minute),
                "tokens_per_day": _window_row(st.tokens_per_day),
            }
        )
    return rows
