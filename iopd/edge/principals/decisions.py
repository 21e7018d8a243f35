"""What per-principal limits decide, whichever backend keeps the counters.

The limits in force (:class:`Limits`, from ``limits:``), what an admission
attempt answers (:class:`Rejection`, :class:`NeverFits`), what a window
looks like (:class:`WindowStatus`, :class:`PrincipalStatus`) and the two
rules every backend applies the same way: how much a reservation holds
(:func:`reserved_tokens`) and how windows become OpenAI's ``x-ratelimit-*``
headers (:func:`headers_of`).  The in-memory limiter
(``iopd.edge.principals.limiter``) and the shared store
(``iopd.edge.limits_redis``) both build on these, so the two cannot drift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from iopd.config.schema import LimitsSection
from iopd.edge.principals.ratelimit_headers import format_reset, ratelimit_trio
from iopd.edge.principals.reservation import Reservation
from iopd.vocabulary import LimitName

__all__ = [
    "Limits",
    "NeverFits",
    "PrincipalStatus",
    "Rejection",
    "Settlement",
    "WindowStatus",
    "headers_of",
    "limits_from_config",
    "cut_to_room",
    "settled_tokens",
    "reserved_tokens",
    "window_status",
]

@dataclass(frozen=True)
class Limits:
    """One principal's limits in force (0 = unlimited)."""

    max_concurrent: int = 0
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    tokens_per_day: int = 0
    share: int = 1

    @property
    def rate_limited(self) -> bool:
        """True when a rate or budget is in force (the response then carries headers)."""
        return bool(self.requests_per_minute or self.tokens_per_minute or self.tokens_per_day)

    @property
    def token_cap(self) -> int:
        """The smallest token limit in force, 0 when neither is."""
        caps = [v for v in (self.tokens_per_minute, self.tokens_per_day) if v > 0]
        return min(caps) if caps else 0


def limits_from_config(section: LimitsSection) -> tuple[Limits, dict[str, Limits]]:
    """``limits.default`` and each principal's limits, a left-out key taking the default's."""
    d = section.default
    default = Limits(
        d.max_concurrent, d.requests_per_minute, d.tokens_per_minute, d.tokens_per_day, d.share
    )
    principals: dict[str, Limits] = {}
    for p in section.principals:
        principals[p.principal_ref] = Limits(
            *(
                default_value if value is None else value
                for value, default_value in (
                    (p.max_concurrent, default.max_concurrent),
                    (p.requests_per_minute, default.requests_per_minute),
                    (p.tokens_per_minute, default.tokens_per_minute),
                    (p.tokens_per_day, default.tokens_per_day),
                    (p.share, default.share),
                )
            )
        )
    return default, principals


@dataclass(frozen=True)
class Rejection:
    """Over a rate or budget: answer 429 ``rate_limit_exceeded`` with ``Retry-After``."""

    principal_ref: str
    limit: LimitName  # the one that keeps the request out longest
    limit_value: int
    used: int  # in that limit's window, before this request
    requested: int  # 1 for requests, the reservation for tokens
    retry_after_s: float  # when it would fit if nothing else changed; >= 0

    @property
    def type(self) -> Literal["requests", "tokens"]:
        """The OpenAI error ``type``."""
        return "requests" if self.limit == "requests_per_minute" else "tokens"

    @property
    def retry_after_header(self) -> str:
        """The ``Retry-After`` value: whole seconds, rounded up, at least 1."""
        return str(max(1, math.ceil(self.retry_after_s)))

    @property
    def message(self) -> str:
        what = self.limit.replace("_", " ")
        return (
            f"Rate limit reached for {what} of principal {self.principal_ref!r}: "
            f"limit {self.limit_value}, used {self.used}, requested {self.requested}. "
            f"Please try again in {format_reset(self.retry_after_s)}."
        )


@dataclass(frozen=True)
class NeverFits:
    """The reservation alone exceeds a token limit: 400, no ``Retry-After`` (waiting cannot help)."""

    principal_ref: str
    limit: LimitName
    limit_value: int
    requested: int
    param: str | None

    @property
    def message(self) -> str:
        what = self.limit.replace("_", " ")
        hint = f" (lower {self.param})" if self.param else ""
        return (
            f"This request needs {self.requested} tokens, more than the {what} limit "
            f"({self.limit_value}) of principal {self.principal_ref!r}{hint}."
        )


@dataclass(frozen=True)
class Settlement:
    """What settling an admission did."""

    returned_tokens: int  # reservation given back (used < reserved)
    debt_tokens: int  # usage beyond the reservation, charged at settlement
    freed_slot: bool  # a concurrency slot was given back (the pool re-examines)


@dataclass(frozen=True)
class WindowStatus:
    limit: int  # 0 = unlimited
    used: int
    remaining: int | None  # None when unlimited
    reset_s: float  # until the window is back to its initial (empty) state


@dataclass(frozen=True)
class PrincipalStatus:
    principal_ref: str
    limits: Limits
    in_flight: int  # started, not finished
    admitted: int  # admitted, not yet settled (in flight or waiting)
    requests_per_minute: WindowStatus
    tokens_per_minute: WindowStatus
    tokens_per_day: WindowStatus


def reserved_tokens(principal_ref: str, limits: Limits, reservation: Reservation) -> int | NeverFits:
    """The tokens a reservation holds under these limits, or why it can never fit.

    Every backend admits this amount (the default output part cut down to the
    smallest token limit; see :class:`Reservation`).
    """
    tokens = reservation.tokens
    cap = limits.token_cap
    if cap and tokens > cap:
        tokens = max(reservation.required, cap)
    token_limits: tuple[tuple[LimitName, int], ...] = (
        ("tokens_per_minute", limits.tokens_per_minute),
        ("tokens_per_day", limits.tokens_per_day),
    )
    for name, value in token_limits:
        if value and tokens > value:
            param = (
                reservation.input_param
                if reservation.input_tokens > value or reservation.output_param is None
                else reservation.output_param
            )
            return NeverFits(principal_ref, name, value, tokens, param)
    return tokens


def cut_to_room(limits: Limits, reservation: Reservation, tokens: int, minute: int, day: int) -> int:
    """What a request that set no maximum output holds, given the windows' use now.

    Its reservation (already cut to the smallest token limit) is cut again to
    the room the token windows have left (``minute`` and ``day`` tokens in
    use), down to its input estimate, so such a request is admitted with what
    is left rather than refused as too large; only when even its input does
    not fit does it wait (429).  A request with an explicit maximum keeps its
    whole reservation.  The shared store's admission script applies the same rule.
    """
    if reservation.explicit_output:
        return tokens
    room = tokens
    if limits.tokens_per_minute:
        room = min(room, limits.tokens_per_minute - minute)
    if limits.tokens_per_day:
        room = min(room, limits.tokens_per_day - day)
    return max(reservation.required, room)


def settled_tokens(reserved: int, used: int | None, estimated: int = 0) -> int:
    """What an admission settles: the metered usage; with none, the larger of
    its reservation and ``estimated`` (its input estimate plus the output it
    relayed, by the one estimate of ``iopd.tokens``), so a stream that
    reported no usage, or whose caller left before it came, never counts
    less than it produced.  Every backend settles this amount."""
    if used is not None:
        return max(0, used)
    return max(reserved, estimated)


def headers_of(st: PrincipalStatus) -> list[tuple[str, str]]:
    """OpenAI's ``x-ratelimit-*`` headers of a principal's windows (see ``headers``)."""
    limits = st.limits
    shown: list[tuple[str, WindowStatus]] = []
    if limits.requests_per_minute:
        shown.append(("requests", st.requests_per_minute))
    if limits.tokens_per_minute or limits.tokens_per_day:
        day_only = not limits.tokens_per_minute
        shown.append(("tokens", st.tokens_per_day if day_only else st.tokens_per_minute))
    out: list[tuple[str, str]] = []
    for kind, w in shown:
        out += ratelimit_trio(kind, w.limit, w.remaining, w.reset_s)
    return out


def window_status(limit: int, used: int, reset_s: float) -> WindowStatus:
    """A window as ``/status`` and the headers show it (``remaining`` None when unlimited)."""
    return WindowStatus(limit, used, max(0, limit - used) if limit else None, reset_s)
