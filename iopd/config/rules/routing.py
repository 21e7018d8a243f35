"""``provider_pool.routing``: the prefix index's bounds and the choice's thresholds.

Each bound keeps what a caller controls bounded: ``max_prompt_bytes`` and
``block_bytes`` fix the most blocks one request hashes and looks up,
``index_blocks`` and ``max_sessions`` the index's memory.
"""

from __future__ import annotations

import math

from iopd.config.problems import ConfigProblem
from iopd.config.schema import PoolRouting

__all__ = ["MAX_PROMPT_BLOCKS", "check_routing"]

#: The most blocks one request may hash (``max_prompt_bytes / block_bytes``).
MAX_PROMPT_BLOCKS = 16384
_INT_RANGES = {
    "block_bytes": (64, 65536),
    "max_prompt_bytes": (0, 16 * 1024 * 1024),
    "index_blocks": (0, 10_000_000),
    "max_sessions": (0, 10_000_000),
    "wait_min_tokens": (0, 10_000_000),
}


def check_routing(r: PoolRouting) -> list[ConfigProblem]:
    """The problems of ``provider_pool.routing``, each naming its key."""
    out: list[ConfigProblem] = []
    path = "provider_pool.routing."
    for name, (low, high) in _INT_RANGES.items():
        value = getattr(r, name)
        if not low <= value <= high:
            out.append(ConfigProblem(path + name, f"must be in {low}..{high} (got {value})"))
    low, high = _INT_RANGES["block_bytes"]
    if low <= r.block_bytes <= high and r.max_prompt_bytes // r.block_bytes > MAX_PROMPT_BLOCKS:
        out.append(
            ConfigProblem(
                path + "max_prompt_bytes",
                f"at most {MAX_PROMPT_BLOCKS} blocks of block_bytes per request "
                f"(got {r.max_prompt_bytes // r.block_bytes})",
            )
        )
    if not (math.isfinite(r.min_match) and 0 < r.min_match <= 1):
        out.append(ConfigProblem(path + "min_match", f"must be > 0 and <= 1 (got {r.min_match})"))
    for name in ("max_load_gap", "max_load_gap_ratio"):
        value = getattr(r, name)
        if not (math.isfinite(value) and value >= 0):
            out.append(ConfigProblem(path + name, f"must be a finite number >= 0 (got {value})"))
    rate = r.prefill_tokens_per_second
    if not (math.isfinite(rate) and rate > 0):
        out.append(
            ConfigProblem(
                path + "prefill_tokens_per_second", f"must be a finite number > 0 (got {rate})"
            )
        )
    return out
