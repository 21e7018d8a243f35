"""OpenAI's ``x-ratelimit-*`` headers: how a window is written.

Three headers per window (``-requests``, ``-tokens``): ``limit`` and
``remaining`` as integers, ``reset`` (until the window is empty again) as a
duration the way OpenAI writes it (``20ms``, ``1.5s``, ``6m0s``).
"""

from __future__ import annotations

import math

__all__ = ["format_reset", "ratelimit_trio"]


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` headers write it: ``20ms``, ``1.5s``, ``6m0s``."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def ratelimit_trio(
    kind: str, limit: int, remaining: int | None, reset_s: float
) -> list[tuple[str, str]]:
    """``x-ratelimit-limit|remaining|reset-<kind>`` of one window."""
    return [
        (f"x-ratelimit-limit-{kind}", str(limit)),
        (f"x-ratelimit-remaining-{kind}", str(remaining if remaining is not None else 0)),
        (f"x-ratelimit-reset-{kind}", format_reset(reset_s)),
    ]
