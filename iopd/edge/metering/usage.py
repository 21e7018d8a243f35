"""Turn provider-reported usage into metric items, without I/O.

Why a module of its own: the merge of a passthrough response's two usage
sources is where double counting would creep in.  The node extracts usage from
the provider's body (``body_usage``) and may also learn usage otherwise
(``usage``, e.g. from response headers).  The rule, per token type:

* ``input`` and ``output``: the body's number wins (source ``provider_body``);
  the frame's is used only when the body lacks it (source ``tunnel_frame``).
* ``reasoning`` and ``cached_input``: the body's number if present, else the
  frame's (the frame supplements).

Each token type appears at most once, tagged with the source it came from.
Numbers are passed through unchanged: ``output`` includes reasoning tokens
where the provider counts them so, and nothing is subtracted.  ``None`` means
"not reported"; a negative number is treated as not reported (a broken
provider must not break metering); zero counts are omitted.
"""

from __future__ import annotations

from wire.messages import ProviderTunnelFrame, Usage

__all__ = ["UsageItem", "run_event_usage", "tunnel_frame_usage", "tunnel_usage"]

UsageItem = tuple[str, str, int]
"""(usage_source, token_type, count) -- what ``GatewayMetrics.record_request`` takes."""

_FIELDS: tuple[tuple[str, str], ...] = (
    ("input", "input_tokens"),
    ("output", "output_tokens"),
    ("reasoning", "reasoning_tokens"),
    ("cached_input", "cached_input_tokens"),
)


def _reported(usage: Usage | None, attr: str) -> int | None:
    """The count of ``attr`` when reported as a usable number, else None."""
    if usage is None:
        return None
    value = getattr(usage, attr)
    if value is None or isinstance(value, bool) or value < 0:
        return None
    return int(value)


def run_event_usage(usage: Usage | None) -> list[UsageItem]:
    """Usage items of a normalized run (source ``run_event``), in token-type order."""
    items: list[UsageItem] = []
    for token_type, attr in _FIELDS:
        n = _reported(usage, attr)
        if n:
            items.append(("run_event", token_type, n))
    return items


def tunnel_usage(body: Usage | None, frame: Usage | None) -> list[UsageItem]:
    """Merge a tunnel's body usage and frame usage; each token type counted once.

    For every token type the body's number is taken when present (source
    ``provider_body``), else the frame's (source ``tunnel_frame``).  The same
    rule serves input/output ("body wins") and reasoning/cached_input ("the
    frame supplements").
    """
    items: list[UsageItem] = []
    for token_type, attr in _FIELDS:
        from_body = _reported(body, attr)
        if from_body is not None:
            if from_body:
                items.append(("provider_body", token_type, from_body))
            continue
        from_frame = _reported(frame, attr)
        if from_frame:
            items.append(("tunnel_frame", token_type, from_frame))
    return items


def tunnel_frame_usage(frame: ProviderTunnelFrame | None) -> list[UsageItem]:
    """:func:`tunnel_usage` of a ``kind="usage"`` tunnel frame (``[]`` for None)."""
    if frame is None:
        return []
    return tunnel_usage(frame.body_usage, frame.usage)
