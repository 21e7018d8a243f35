"""The sizes the edge keeps of the free text a node sends, and the one cut.

Why: an authenticated node is still a peer the edge does not control.  A
string it sends is bounded only by the frame cap (16 MiB by default), and
the edge keeps some of them (a provider's ``last_error`` in ``/status`` and
the console), relays others to callers (a run's or tunnel's error message)
and logs a few.  Each is cut here, at the one place it enters the edge,
before anything scans it (the secret scrubber is linear, but linear in 16
MiB is a stall of the loop).  A long string is cut, never a reason to
refuse the message.

A provider's served-model details (``ProviderHealth.models``, shown by
``/api/tags``) are kept only for the names the provider serves in the
edge's config, each string cut to ``MAX_MODEL_TEXT_CHARS`` and scrubbed,
``MODEL_TEXT_BUDGET`` characters per message in all (``bounded_models``).

The cuts of the hub's own reads live here too: `needs_bounding` and
`scrubbed_message` for a run's or tunnel's error text, `safe_node_reason`
for a node's config rejection.

Cutting first and scrubbing the result is as safe as scrubbing first: the
scrubber masks every run of ``MIN_RUN`` characters of a secret wherever it
is, so a secret the cut splits is masked in the part that is kept.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

import msgspec

from iopd.redact import Scrubber
from wire.messages import (
    MAX_MODEL_FAMILIES,
    MAX_MODEL_TEXT_CHARS,
    ModelDetails,
    ModelInfo,
    NodeConfig,
    ProviderTunnelFrame,
    RunEvent,
)

__all__ = [
    "CUT_MARK",
    "MAX_ERROR_CODE_CHARS",
    "MAX_FINISH_REASON_CHARS",
    "MAX_LAST_ERROR_CHARS",
    "MAX_NODE_MESSAGE_CHARS",
    "MODEL_TEXT_BUDGET",
    "STATUS_TEXT_BUDGET",
    "bounded",
    "bounded_models",
    "cut",
    "last_error_limit",
    "needs_bounding",
    "safe_node_reason",
    "scrubbed_message",
]

#: A provider's last probe error as ``/status``, the console and the log keep it.
MAX_LAST_ERROR_CHARS = 512
#: The ``last_error`` characters one ``ProviderStatus`` may make the edge keep
#: (and scrub) in all: a message naming more than 16 providers keeps less of
#: each (``last_error_limit``).  The scrubber's worst case (a text made of
#: pieces of secrets) is about a microsecond a character.
STATUS_TEXT_BUDGET = 8192
#: The served-model characters one ``ProviderStatus`` may make the edge keep
#: (and scrub) in all; the models past it are not kept.
MODEL_TEXT_BUDGET = 65536
#: A run's or tunnel's error message, as a caller and the console see it.
MAX_NODE_MESSAGE_CHARS = 2048
#: A run's or tunnel's error code (a short word; compared, never shown).
MAX_ERROR_CODE_CHARS = 64
#: A run's ``finish_reason`` (a short word the caller gets in the response).
MAX_FINISH_REASON_CHARS = 64
#: What ends a string that was cut.
CUT_MARK = "..."


def last_error_limit(providers: int) -> int:
    """The ``last_error`` size kept of each of ``providers`` reported in one message."""
    return min(MAX_LAST_ERROR_CHARS, STATUS_TEXT_BUDGET // max(1, providers))


def cut(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its first
    characters and ``CUT_MARK``, ``limit`` characters in all (the same object
    when nothing was cut)."""
    if len(text) <= limit:
        return text
    return text[: max(0, limit - len(CUT_MARK))] + CUT_MARK


def bounded(text: str, limit: int, scrub: Callable[[str], str]) -> str:
    """``text`` cut to ``limit``, then scrubbed of the edge's secrets."""
    return scrub(cut(text, limit))


def bounded_models(
    models: Sequence[ModelInfo],
    served: Iterable[str],
    scrub: Callable[[str], str],
    budget: int = MODEL_TEXT_BUDGET,
) -> tuple[dict[str, ModelInfo], int]:
    """``models`` by name, only those named in ``served`` (the first entry of
    each), every string cut to ``MAX_MODEL_TEXT_CHARS`` and scrubbed, at most
    ``MAX_MODEL_FAMILIES`` families; a model whose strings do not fit in
    ``budget`` characters ends the list.  Returns them and the budget left."""
    if not models:
        return {}, budget
    wanted = set(served)
    kept: dict[str, ModelInfo] = {}

    def text(value: str) -> str:
        return bounded(value, MAX_MODEL_TEXT_CHARS, scrub) if value else value

    for m in models:
        if m.name not in wanted or m.name in kept:
            continue
        d = m.details
        families = d.families[:MAX_MODEL_FAMILIES]
        strings = (m.digest, m.modified_at, d.format, d.family, d.parameter_size)
        cost = sum(min(len(t), MAX_MODEL_TEXT_CHARS) for t in (*strings, *families))
        cost += min(len(d.quantization_level), MAX_MODEL_TEXT_CHARS)
        cost += min(len(d.parent_model), MAX_MODEL_TEXT_CHARS)
        if cost > budget:
            break
        budget -= cost
        kept[m.name] = ModelInfo(
            name=m.name,
            size=m.size,
            digest=text(m.digest),
            modified_at=text(m.modified_at),
            details=ModelDetails(
                format=text(d.format),
                family=text(d.family),
                families=[text(f) for f in families],
                parameter_size=text(d.parameter_size),
                quantization_level=text(d.quantization_level),
                parent_model=text(d.parent_model),
            ),
        )
    return kept, budget


_URL_USERINFO = re.compile(r"(://)[^/@\s]+@")


def safe_node_reason(
    reason: str, pushed: NodeConfig, *, known_secrets: Iterable[str] = (), limit: int = 200
) -> str:
    """A node-supplied reason (e.g. a ``NodeConfigAck.error``) fit for a log line or a
    report: without the secrets the edge knows (any 8+ character piece of ``pushed``'s
    API keys or ``known_secrets``, credentials in URLs) should the node have echoed
    one, on one line, at most
    ``limit`` characters."""
    scrubber = Scrubber([*(p.api_key for p in pushed.providers), *known_secrets])
    # Cut before the scans: the reason is the node's, as long as a frame.
    reason = scrubber.scrub(cut(reason, 4 * limit), "<redacted>")
    flat = " ".join(_URL_USERINFO.sub(r"\1<redacted>@", reason).split()) or "no reason given"
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def needs_bounding(msg: RunEvent | ProviderTunnelFrame) -> bool:
    """``msg`` carries text ``scrubbed_message`` must look at (a text or body frame
    does not: three attribute checks on the hot path)."""
    if msg.message or len(msg.code) > MAX_ERROR_CODE_CHARS:
        return True
    finish = getattr(msg, "finish_reason", None)
    return finish is not None and len(finish) > MAX_FINISH_REASON_CHARS


def scrubbed_message(
    msg: RunEvent | ProviderTunnelFrame, scrub: Callable[[str], str]
) -> RunEvent | ProviderTunnelFrame:
    """``msg`` with its error text cut to ``MAX_NODE_MESSAGE_CHARS`` and scrubbed
    (a provider may have echoed a key), its error code cut to ``MAX_ERROR_CODE_CHARS``
    and a run's ``finish_reason`` to ``MAX_FINISH_REASON_CHARS``.

    The node scrubs what it knows; this is the edge's own pass with every key
    of its config, at the one place node text enters the edge.  A
    ``NodeConfigAck`` carries ``error`` instead, cut where it is read
    (``safe_node_reason``).
    """
    message, code = msg.message, msg.code
    clean = bounded(message, MAX_NODE_MESSAGE_CHARS, scrub) if message else message
    short = cut(code, MAX_ERROR_CODE_CHARS)
    if isinstance(msg, RunEvent) and msg.finish_reason is not None:
        finish = cut(msg.finish_reason, MAX_FINISH_REASON_CHARS)
        if finish is not msg.finish_reason:
            return msgspec.structs.replace(msg, message=clean, code=short, finish_reason=finish)
    if clean is message and short is code:
        return msg
    return msgspec.structs.replace(msg, message=clean, code=short)
