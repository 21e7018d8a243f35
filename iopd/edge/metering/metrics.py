"""Usage metering and gateway health in Prometheus.

Why this module looks the way it does:

* Every ``GatewayMetrics`` owns its registry (never prometheus_client's global
  default), so two edges in one process -- or two tests -- never share state.
* Label cardinality must stay low and no caller-controlled string may ever
  become a label value.  Labels with a fixed vocabulary (``endpoint``,
  ``status``, ...) are checked against the sets of :mod:`iopd.vocabulary` and a
  wrong value raises ``ValueError`` -- that is a programming error in the
  caller, caught by tests.  Identity labels (``model_group``,
  ``principal_ref``, ...) come from config ids; once the edge registered them
  with :meth:`GatewayMetrics.allow_ids`, an id that is not registered raises
  ``ValueError`` too.  There is no parameter through which a request id, a
  session id, a token, a prompt or a response could reach ``/metrics``.
* A request is counted by exactly one call, :meth:`GatewayMetrics.record_request`,
  made when the request is finished (ok, failed or cancelled), with the
  :class:`RequestLabels` built by :meth:`RequestLabels.build` (conventions in
  :mod:`iopd.edge.metering.labels`).  Requests, tokens, reasoning and the
  duration histogram all come from that call, so they can never disagree.
* Provider gauges (in-flight, capacity, load ratio, health) are read from a
  status callable at scrape time by a custom collector
  (:mod:`iopd.edge.metering.gauges`): the values are always current and nothing
  has to remember to update a gauge.

``iop_openai_usage_tokens_total`` carries the full label set of
``iop_openai_requests_total`` (``status`` included) plus ``usage_source`` and
``token_type``, so usage of failed or cancelled requests stays visible.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from iopd.edge.metering.gauges import (
    HEALTH_GAUGE,
    GatewayStatus,
    ProviderGaugeRow,
    StatusCollector,
    StatusSource,
)
from iopd.edge.metering.labels import (
    UNMAPPED_PRINCIPAL,
    PrincipalLabels,
    RequestLabels,
    check_id_shape,
    check_member,
    expected_response_mode,
)
from iopd.edge.metering.usage import UsageItem
from iopd.edge.pool.retry_rules import FailureReason
from iopd.tokens import estimate_tokens_from_chars
from iopd.vocabulary import (
    ADMIN_ACTIONS,
    DISPATCH_OUTCOMES,
    FRAME_DIRECTIONS,
    LIMIT_NAMES,
    REFRESH_OUTCOMES,
    STATUSES,
    TOKEN_TYPES,
    UNKNOWN_GROUP,
    USAGE_SOURCES,
    WIRE_ERROR_REASONS,
)

__all__ = [
    "HEALTH_GAUGE",
    "REJECTED_STATUSES",
    "GatewayMetrics",
    "GatewayStatus",
    "PrincipalLabels",
    "ProviderGaugeRow",
    "RequestLabels",
    "expected_response_mode",
]

ESTIMATION_METHOD: Final = "chars_div_4"
#: ``iop_provider_attempt_failures_total{reason}``: why an attempt failed.
ATTEMPT_FAILURE_REASONS: Final = frozenset(r.value for r in FailureReason)
#: ``iop_http_requests_rejected_total{status}``: what the OpenAI listener answers
#: before there is an endpoint (any other status is counted as ``other``).
REJECTED_STATUSES: Final = frozenset({"400", "404", "405", "408", "413", "431", "501", "503"})
#: ``tool_type`` labels of ``iop_openai_dropped_tools_total`` (the Responses
#: built-in tools); any other type a caller sends is counted as ``other``.
DROPPED_TOOL_TYPES: Final = frozenset(
    {
        "web_search",
        "web_search_preview",
        "file_search",
        "computer_use",
        "computer_use_preview",
        "image_generation",
        "code_interpreter",
        "local_shell",
        "shell",
        "apply_patch",
        "mcp",
        "tool_search",
    }
)
# Seconds.  LLM requests run from milliseconds (echo, errors) to minutes.
_REQUEST_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_WAIT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


# ------------------------------------------------------------ the metrics


_Metric = TypeVar("_Metric", Counter, Histogram)

_REQ_LABELS: Final = (
    "edge_id",
    "principal_ref",
    "principal_alias",
    "token_ref",
    "model_group",
    "endpoint",
    "response_mode",
    "status",
)
_REASONING_LABELS: Final = ("edge_id", "principal_ref", "token_ref", "model_group", "endpoint")


class GatewayMetrics:
    """All Prometheus metrics of one edge, in a registry of their own.

    Typical use by the request handlers::

        labels = RequestLabels.build(principal, model_group=group_id,
                                     endpoint="chat_completions", response_mode="normalized")
        metrics.record_request(labels, status="ok", duration=elapsed,
                               usage=run_event_usage(final_usage), reasoning_chars=n)

    and ``body, content_type = metrics.exposition()`` for ``GET /metrics``.
    """

    def __init__(self, edge_id: str, registry: CollectorRegistry | None = None) -> None:
        check_id_shape("edge_id", edge_id)
        self.edge_id = edge_id
        self.registry = registry if registry is not None else CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Counter | Histogram] = {}
        # The label sets record_request has checked since the last allow_ids
        # (bounded like the children: config ids x fixed vocabularies).
        self._checked: set[tuple[str, ...]] = set()
        self._groups: set[str] = set()
        self._principals: set[PrincipalLabels] = set()
        self._strict_groups = False
        self._strict_principals = False
        r = self.registry
        self._requests = Counter(
            "iop_openai_requests",
            "Finished OpenAI-surface requests, each counted once.",
            _REQ_LABELS,
            registry=r,
        )
        self._tokens = Counter(
            "iop_openai_usage_tokens",
            "Tokens as providers reported them, by where the number came from.",
            (*_REQ_LABELS, "usage_source", "token_type"),
            registry=r,
        )
        self._reasoning_observed = Counter(
            "iop_openai_reasoning_observed",
            "Requests in which the edge saw reasoning text.",
            _REASONING_LABELS,
            registry=r,
        )
        self._reasoning_chars = Counter(
            "iop_openai_reasoning_chars",
            "Code points of reasoning text the edge saw.",
            _REASONING_LABELS,
            registry=r,
        )
        self._reasoning_estimated = Counter(
            "iop_openai_reasoning_estimated_tokens",
            "ceil(chars/4) of reasoning text the provider reported no reasoning tokens for.",
            (*_REASONING_LABELS, "estimation_method"),
            registry=r,
        )
        self._request_duration = Histogram(
            "iop_request_duration_seconds",
            "Wall time of finished OpenAI-surface requests, queueing included.",
            ("edge_id", "endpoint", "response_mode"),
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self._dispatch_wait = Histogram(
            "iop_dispatch_wait_seconds",
            "Time from asking the pool for a provider to the outcome.",
            ("edge_id", "model_group", "outcome"),
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self._queue_timeouts = Counter(
            "iop_queue_waiters_timed_out",
            "Queue waiters that reached their queue_timeout.",
            ("edge_id",),
            registry=r,
        )
        self._refresh = Counter(
            "iop_config_refresh",
            "Config refresh requests by outcome.",
            ("edge_id", "outcome"),
            registry=r,
        )
        self._wire_frames = Counter(
            "iop_wire_frames",
            "Wire frames by direction (in = node to edge).",
            ("edge_id", "direction"),
            registry=r,
        )
        self._wire_errors = Counter(
            "iop_wire_protocol_errors",
            "Wire connections closed because of a protocol problem.",
            ("edge_id", "reason"),
            registry=r,
        )
        self._http_rejected = Counter(
            "iop_http_requests_rejected",
            "Requests the OpenAI listener answered before there was an endpoint "
            "(malformed HTTP, size or time limits, unknown routes), by HTTP status.",
            ("edge_id", "status"),
            registry=r,
        )
        # Routing around failures: retries, passive ejection, fallback groups.  Provider and
        # group ids are config ids; ``reason`` is ``FailureReason``'s fixed set.
        self._attempt_failures = Counter(
            "iop_provider_attempt_failures",
            "Failed attempts on a provider (retried or not), by why they failed.",
            ("edge_id", "model_group", "provider", "reason"),
            registry=r,
        )
        self._retries = Counter(
            "iop_request_retries",
            "Extra attempts made on another provider before the first byte.",
            ("edge_id", "model_group"),
            registry=r,
        )
        self._ejections = Counter(
            "iop_provider_ejections",
            "Passive ejections of a provider (consecutive failed attempts, or a failed probe).",
            ("edge_id", "provider"),
            registry=r,
        )
        self._fallbacks = Counter(
            "iop_fallbacks",
            "Requests served by a fallback group instead of the group they named.",
            ("edge_id", "model_group", "fallback_group"),
            registry=r,
        )
        self._limit_rejections = Counter(
            "iop_limit_rejections",
            "Requests refused 429 rate_limit_exceeded, by principal and by the limit over.",
            ("edge_id", "principal_ref", "limit"),
            registry=r,
        )
        self._admin_actions = Counter(
            "iop_admin_actions",
            "Runtime controls applied through the admin API (drain, disable, enable, "
            "override, reset, node_drain).",
            ("edge_id", "action"),
            registry=r,
        )
        self._dropped_tools = Counter(
            "iop_openai_dropped_tools",
            "Responses tools a normalized provider cannot run, dropped from requests "
            "(openai.unsupported_tools: drop), by tool type.",
            ("edge_id", "model_group", "tool_type"),
            registry=r,
        )
        self._status = StatusCollector(edge_id, self._principal_ref_allowed)
        r.register(self._status)

    # -------------------------------------------------- label vocabulary

    def allow_ids(
        self,
        *,
        model_groups: Iterable[str] = (),
        principals: Iterable[PrincipalLabels] = (),
    ) -> None:
        """Register the config ids that may appear as label values.

        Call at start with the catalog's group ids and the configured
        principals, and again after each refresh (ids accumulate; a group
        removed by refresh stays allowed so in-flight requests still record).
        After the first call for a kind, an unregistered value of that kind
        makes :meth:`record_request` / :meth:`observe_dispatch_wait` raise
        ``ValueError``.  :data:`UNKNOWN_GROUP` and the unmapped principal are
        always allowed.
        """
        self._checked.clear()  # an id may be unregistered now: check anew
        for g in model_groups:
            check_id_shape("model_group", g)
            self._groups.add(g)
            self._strict_groups = True
        for p in principals:
            self._principals.add(p)
            self._strict_principals = True

    def _check_group(self, group: str) -> None:
        check_id_shape("model_group", group)
        if self._strict_groups and group != UNKNOWN_GROUP and group not in self._groups:
            raise ValueError("model_group is not a registered catalog id")

    def _principal_ref_allowed(self, ref: str) -> bool:
        """A ``principal_ref`` label value a config registered (or ``unmapped``)."""
        return (
            ref == UNMAPPED_PRINCIPAL.principal_ref
            or not self._strict_principals
            or any(p.principal_ref == ref for p in self._principals)
        )

    def _check_principal(self, p: PrincipalLabels) -> None:
        if self._strict_principals and p != UNMAPPED_PRINCIPAL and p not in self._principals:
            raise ValueError("principal labels are not a registered principal token")

    # -------------------------------------------------- per request

    def record_request(
        self,
        labels: RequestLabels,
        *,
        status: str,
        duration: float,
        usage: Iterable[UsageItem] = (),
        reasoning_chars: int = 0,
        reasoning_reported: bool = False,
    ) -> None:
        """Count one finished request: call exactly once per request, on every path.

        ``usage`` is the list from ``iopd.edge.metering.usage`` (each token type at most
        once; zero counts are skipped).  ``reasoning_chars`` is the reasoning
        text the edge (or the node, for tunnels) saw.  Reasoning counts as
        reported when ``reasoning_reported`` is true or ``usage`` has a
        non-zero ``reasoning`` item.  When ``reasoning_chars > 0``:
        ``observed`` += 1 and ``chars`` += chars always; the ``chars_div_4``
        estimate is added only when reasoning was not reported.  A reported
        reasoning count is only ever in ``token_type="reasoning"``; an estimate
        never is.

        Everything is validated before anything is counted, so a ``ValueError``
        leaves the counters untouched.
        """
        base = (
            self.edge_id,
            labels.principal_ref,
            labels.principal_alias,
            labels.token_ref,
            labels.model_group,
            labels.endpoint,
            labels.response_mode,
            status,
        )
        if base not in self._checked:  # (once per label set: the same verdict every time)
            check_member("status", status, STATUSES)
            self._check_group(labels.model_group)
            self._check_principal(labels.principal)
            self._checked.add(base)
        if duration < 0:
            raise ValueError("duration must be >= 0")
        if reasoning_chars < 0:
            raise ValueError("reasoning_chars must be >= 0")
        items: list[UsageItem] = []
        seen_types: set[str] = set()
        for source, token_type, count in usage:
            check_member("usage_source", source, USAGE_SOURCES)
            check_member("token_type", token_type, TOKEN_TYPES)
            if count < 0:
                raise ValueError("token counts must be >= 0")
            if token_type in seen_types:
                raise ValueError(f"token_type {token_type} given twice (would double count)")
            seen_types.add(token_type)
            if count:
                items.append((source, token_type, count))
        reported = reasoning_reported or any(t == "reasoning" for _, t, _ in items)

        child = self._child
        child(self._requests, base).inc()
        for source, token_type, count in items:
            child(self._tokens, (*base, source, token_type)).inc(count)
        if reasoning_chars:
            r = (
                self.edge_id,
                labels.principal_ref,
                labels.token_ref,
                labels.model_group,
                labels.endpoint,
            )
            child(self._reasoning_observed, r).inc()
            child(self._reasoning_chars, r).inc(reasoning_chars)
            if not reported:
                child(self._reasoning_estimated, (*r, ESTIMATION_METHOD)).inc(
                    estimate_tokens_from_chars(reasoning_chars)
                )
        child(
            self._request_duration, (self.edge_id, labels.endpoint, labels.response_mode)
        ).observe(duration)

    def _child(self, metric: _Metric, key: tuple[str, ...]) -> _Metric:
        """``metric.labels(*key)``, cached: label sets are bounded (config ids x fixed sets)."""
        ck = (id(metric), key)
        found = self._children.get(ck)
        if found is None:
            found = self._children[ck] = metric.labels(*key)
        return cast(_Metric, found)

    # -------------------------------------------------- gateway health

    def set_status_source(self, fn: StatusSource | None) -> None:
        """Install the callable read at every scrape for queue, node and provider gauges.

        It must be cheap and synchronous (it runs inside ``exposition()``); if
        it raises, that scrape simply has no status gauges.
        """
        self._status.source = fn

    def observe_dispatch_wait(self, group: str, seconds: float, outcome: str) -> None:
        """Time spent getting a lease for ``group``; ``outcome`` in :data:`DISPATCH_OUTCOMES`.

        Call once per lease attempt (the pool's ``on_wait_done`` hook).  An
        ``outcome="queue_timeout"`` also counts ``iop_queue_waiters_timed_out_total``.
        """
        if seconds < 0:
            raise ValueError("seconds must be >= 0")
        # On the path of every lease: the labels are checked when their child is
        # first made (ids registered once stay allowed), not at every call.
        key = (self.edge_id, group, outcome)
        found = self._children.get((id(self._dispatch_wait), key))
        if not isinstance(found, Histogram):  # None: not made yet
            check_member("outcome", outcome, DISPATCH_OUTCOMES)
            self._check_group(group)
            found = self._child(self._dispatch_wait, key)
        found.observe(seconds)
        if outcome == "queue_timeout":
            self._queue_timeouts.labels(self.edge_id).inc()

    def count_attempt_failure(self, group: str, provider: str, reason: str) -> None:
        """A failed attempt on ``provider`` (a config id) for ``group``; ``reason``
        in ``FailureReason``'s values."""
        check_member("reason", reason, ATTEMPT_FAILURE_REASONS)
        self._check_group(group)
        self._child(self._attempt_failures, (self.edge_id, group, provider, reason)).inc()

    def count_retry(self, group: str) -> None:
        """One extra attempt of a request of ``group`` (the group it named)."""
        self._check_group(group)
        self._child(self._retries, (self.edge_id, group)).inc()

    def count_ejection(self, provider: str) -> None:
        """``provider`` (a config id) was ejected."""
        self._child(self._ejections, (self.edge_id, provider)).inc()

    def count_fallback(self, group: str, fallback_group: str) -> None:
        """A request for ``group`` was served by ``fallback_group``."""
        self._check_group(group)
        self._check_group(fallback_group)
        self._child(self._fallbacks, (self.edge_id, group, fallback_group)).inc()

    def count_limit_rejection(self, principal_ref: str, limit: str) -> None:
        """One 429 ``rate_limit_exceeded``; ``limit`` in :data:`LIMIT_NAMES`."""
        check_member("limit", limit, LIMIT_NAMES)
        check_id_shape("principal_ref", principal_ref)
        if not self._principal_ref_allowed(principal_ref):
            raise ValueError("principal_ref is not a registered principal")
        self._child(self._limit_rejections, (self.edge_id, principal_ref, limit)).inc()

    def count_refresh(self, outcome: str) -> None:
        """One config refresh; ``outcome`` in :data:`REFRESH_OUTCOMES`."""
        check_member("outcome", outcome, REFRESH_OUTCOMES)
        self._refresh.labels(self.edge_id, outcome).inc()

    def count_admin_action(self, action: str) -> None:
        """One runtime control applied; ``action`` in :data:`ADMIN_ACTIONS`."""
        check_member("action", action, ADMIN_ACTIONS)
        self._child(self._admin_actions, (self.edge_id, action)).inc()

    def count_wire_frames(self, direction: str, n: int = 1) -> None:
        """``n`` wire frames sent (``out``) or received (``in``)."""
        check_member("direction", direction, FRAME_DIRECTIONS)
        if n < 0:
            raise ValueError("n must be >= 0")
        self._child(self._wire_frames, (self.edge_id, direction)).inc(n)

    def count_dropped_tool(self, group: str, tool_type: str) -> None:
        """A tool of ``tool_type`` dropped from a request of ``group`` (a type
        outside :data:`DROPPED_TOOL_TYPES` counts as ``other``)."""
        self._check_group(group)
        label = tool_type if tool_type in DROPPED_TOOL_TYPES else "other"
        self._child(self._dropped_tools, (self.edge_id, group, label)).inc()

    def count_http_rejected(self, status: int) -> None:
        """A request answered ``status`` before routing (see :data:`REJECTED_STATUSES`)."""
        label = str(status)
        if label not in REJECTED_STATUSES:
            label = "other"
        self._child(self._http_rejected, (self.edge_id, label)).inc()

    def count_wire_error(self, reason: str) -> None:
        """A wire connection closed for ``reason`` in :data:`WIRE_ERROR_REASONS`."""
        check_member("reason", reason, WIRE_ERROR_REASONS)
        self._wire_errors.labels(self.edge_id, reason).inc()

    # -------------------------------------------------- exposition

    def exposition(self) -> tuple[bytes, str]:
        """The ``/metrics`` body and its ``Content-Type`` (text format 0.0.4)."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
