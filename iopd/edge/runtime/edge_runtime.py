"""The edge's runtime state and its copy-on-write refresh.

Why one object: a request reads ``runtime.snapshot`` once at its start and
keeps that immutable ``Snapshot`` (config, catalog, authenticator) until it
ends, so a refresh never changes the rules under a request in flight.  A
refresh builds a complete new ``Snapshot`` off to the side and swaps it in
with one assignment, then tells the pool (which re-examines its waiters) and
pushes a new ``NodeConfig`` to every changed node; a node the refresh removed
has its session retired (its streams finish, then it ends).  A push the node rejects
or never acknowledges does not undo the apply (the edge's side is already
swapped), but it is reported in the refresh report's ``errors``.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import msgspec
import trio

from iopd.config.catalog import Catalog, build_catalog, node_config_for
from iopd.config.load import ConfigError, load_edge_config
from iopd.config.refresh_classify import RefreshDiff, classify
from iopd.config.schema import EdgeConfig, NodeEntry
from iopd.edge.metering.activity import ActivityRecorder
from iopd.edge.metering.metrics import (
    GatewayMetrics,
    GatewayStatus,
    PrincipalLabels,
    ProviderGaugeRow,
)
from iopd.edge.nodes.hub import HubSettings, NodeHub
from iopd.edge.nodes.node_state import NodeConfigStates, apply_node_controls, send_controls
from iopd.edge.nodes.node_text import (
    MODEL_TEXT_BUDGET,
    bounded,
    bounded_models,
    last_error_limit,
    safe_node_reason,
)
from iopd.edge.pool.pool import ProviderPool
from iopd.edge.pool.retry_budget import RetryBudget
from iopd.edge.principals.authenticator import Authenticator
from iopd.edge.principals.backend import LimitsBackend
from iopd.edge.principals.limiter import PrincipalLimiter
from iopd.edge.principals.shared_limits import limits_backend_for
from iopd.edge.principals.status import (
    principal_rows,
    principals_in_flight,
    rates_in_force,
)
from iopd.edge.runtime.health_state import DISCONNECTED, ProviderHealthState
from iopd.edge.runtime.pool_config import pool_snapshot, retry_budget_policy
from iopd.edge.runtime.routing_status import routing_row, routing_view
from iopd.edge.runtime.runtime_controls import RuntimeControls
from iopd.edge.runtime.status_document import (
    ModelProviderRow,
    ModelRow,
    NodeRow,
    ProviderRow,
    RefreshReport,
    StatusDocument,
)
from iopd.redact import Scrubber, url_secrets
from iopd.vocabulary import FrameDirection, ShownHealth, WireErrorReason, load_ratio
from wire.messages import (
    Busy,
    ControlState,
    LoadReport,
    NodeConfig,
    NodeConfigState,
    ProviderHealth,
    ProviderStatus,
    Waiting,
)

log = logging.getLogger("iopd.edge")

NODE_PUSH_TIMEOUT = 10.0


@dataclass(frozen=True)
class Snapshot:
    """Everything a request needs from the config, frozen for its lifetime."""

    config: EdgeConfig
    catalog: Catalog
    auth: Authenticator
    version: int
    nodes: Mapping[str, NodeEntry]
    #: Scrubs every secret of ``config`` (provider keys, the legacy bearer) from text.
    secrets: Scrubber
    #: ``openai.cors_allow_origins`` as a set (empty: CORS is off).
    cors_origins: frozenset[str] = frozenset()
    #: A rate or budget of ``limits`` is in force for some principal: only then
    #: does a request go through the limiter (``max_concurrent`` and ``share``
    #: are the pool's, from its snapshot).
    rates_limited: bool = False


def config_secrets(cfg: EdgeConfig) -> list[str]:
    """The secrets an edge config holds in clear: provider API keys, the legacy bearer,
    the password of ``limits.redis_url``."""
    keys = [p.api_key for n in cfg.nodes for p in n.providers if p.api_key]
    keys += [cfg.openai.bearer_token] if cfg.openai.bearer_token else []
    return keys + url_secrets(cfg.limits.redis_url)


def _make_snapshot(cfg: EdgeConfig, version: int, embedded: Mapping[str, str]) -> Snapshot:
    """``embedded``: the in-memory token of each embedded node, whose hash its entry gets."""
    return Snapshot(
        config=cfg,
        catalog=build_catalog(cfg),
        auth=Authenticator(cfg.openai),
        version=version,
        nodes={n.id: _with_embedded_token(n, embedded) for n in cfg.nodes},
        secrets=Scrubber(config_secrets(cfg)),
        cors_origins=frozenset(cfg.openai.cors_allow_origins),
        rates_limited=rates_in_force(cfg.limits),
    )


def _with_embedded_token(node: NodeEntry, embedded: Mapping[str, str]) -> NodeEntry:
    """An embedded node's entry as the hub checks it: with the hash of its minted token."""
    token = embedded.get(node.id) if node.embedded else None
    if token is None:
        return node
    digest = hashlib.sha256(token.encode()).hexdigest()
    return msgspec.structs.replace(node, token_hash_sha256=digest)


def mint_embedded_tokens(cfg: EdgeConfig) -> dict[str, str]:
    """A fresh random token per embedded node: it lives in this process only."""
    return {n.id: secrets.token_urlsafe(32) for n in cfg.nodes if n.embedded}


@dataclass
class EdgeRuntime:
    """Owns the snapshot, the pool, the node hub and the metrics of one edge."""

    config_path: str | None
    snapshot: Snapshot
    pool: ProviderPool
    metrics: GatewayMetrics
    hub: NodeHub = field(init=False)
    #: The operator's runtime controls (drain, disable, overrides).
    controls: RuntimeControls = field(init=False)
    health: dict[str, ProviderHealthState] = field(default_factory=dict)
    _refresh_lock: trio.Lock = field(default_factory=trio.Lock)
    started_at: float = field(default_factory=time.time)
    #: node id -> the token of each embedded node (``iopd.edge.embedded``).  Fixed
    #: at start: making a node embedded, or adding one, needs a restart.
    embedded_tokens: Mapping[str, str] = field(default_factory=dict, repr=False)
    #: Retries per model group over the last minute, shared by
    #: every request; its policy follows the snapshot on refresh.
    retry_budget: RetryBudget = field(default_factory=RetryBudget)
    #: Per-principal limits (``limits``) in memory (kept across a refresh, lost by a restart).
    limiter: PrincipalLimiter = field(default_factory=PrincipalLimiter)
    limits: LimitsBackend = field(init=False)  # the request path's: ``limiter`` or the store
    #: The limiter's clock: wall-clock seconds, because the day budget follows
    #: the calendar day in UTC (tests drive it directly).
    limits_clock: Callable[[], float] = time.time
    activity: ActivityRecorder = field(init=False)  # recent usage and errors (web console)
    #: Each node's config revision in force, as it last told.
    node_states: NodeConfigStates = field(default_factory=NodeConfigStates)
    stopping: trio.Event = field(default_factory=trio.Event)  # set at drain: /events end

    @classmethod
    def create(cls, cfg: EdgeConfig, config_path: str | None = None) -> EdgeRuntime:
        embedded = mint_embedded_tokens(cfg)
        snap = _make_snapshot(cfg, version=1, embedded=embedded)
        metrics = GatewayMetrics(cfg.edge.id)
        pool = ProviderPool(
            pool_snapshot(cfg, snap.catalog), on_wait_done=metrics.observe_dispatch_wait
        )
        rt = cls(
            config_path=config_path,
            snapshot=snap,
            pool=pool,
            metrics=metrics,
            embedded_tokens=embedded,
            limiter=PrincipalLimiter(cfg.limits, now=time.time()),
        )
        rt.activity = ActivityRecorder(scrub=rt.scrub)
        rt.limits = limits_backend_for(cfg, rt.limiter, lambda: rt.limits_clock(), metrics)
        rt._allow_metric_ids(cfg)
        rt.retry_budget.set_policy(retry_budget_policy(cfg))
        rt.hub = NodeHub(HubSettings.from_config(cfg.edge), owner=rt)
        pool.on_waiting = rt._tell_node_waiting
        rt.controls = RuntimeControls(
            pool,
            metrics,
            known_nodes=lambda: rt.snapshot.nodes,
            send=lambda node_id, msg: send_controls(rt.hub, node_id, msg),
        )
        metrics.set_status_source(rt._gateway_status)
        return rt

    def _allow_metric_ids(self, cfg: EdgeConfig) -> None:
        """Only config ids may become metric label values (never caller strings)."""
        self.metrics.allow_ids(
            model_groups=[g.id for g in self.snapshot.catalog.listed()],
            principals=[
                PrincipalLabels.from_config(t.principal_ref, t.alias, t.token_ref)
                for t in cfg.openai.principal_tokens
            ],
        )

    # ------------------------------------------------------------ node events
    # ``iopd.edge.nodes.hub.HubOwner``: what the node hub asks and tells the runtime.
    # (The hub logs event=node_connected / node_disconnected, with peer and reason.)

    def known_nodes(self) -> Mapping[str, NodeEntry]:
        return self.snapshot.nodes

    def node_config(self, node_id: str) -> NodeConfig:
        return node_config_for(self.snapshot.config, node_id, self.snapshot.version)

    def node_connected(self, node_id: str) -> None:
        self.pool.set_node_connected(node_id, True)

    def node_disconnected(self, node_id: str) -> None:
        # Synchronous, before the node's streams fail (the hub's order): the
        # leases they free re-examine the queue without this node.
        self.pool.set_node_connected(node_id, False)
        self.node_states.forget(node_id)

    def node_config_state(self, node_id: str, msg: NodeConfigState) -> None:
        self.node_states.update(node_id, msg, self.snapshot.config)

    def config_mismatch(self, node_id: str) -> bool:
        """``node_id`` runs another config than this edge's (``/status``)."""
        return self.node_states.mismatch(node_id, self.snapshot.config)

    def node_controls(self, node_id: str, msg: ControlState) -> None:
        apply_node_controls(self.pool, self.snapshot.catalog, node_id, msg)

    def provider_load(self, node_id: str, msg: LoadReport) -> None:
        # The last report per provider is what counts: a repeated id costs no
        # second look at its queue.
        latest = {load.provider_id: load for load in msg.providers}
        for load in latest.values():
            self.pool.set_remote_load(
                node_id, load.provider_id, load.in_flight, load.long_in_flight, load.offered
            )

    def provider_busy(self, node_id: str, msg: Busy) -> None:
        load = msg.load
        self.pool.provider_busy(
            node_id, load.provider_id, load.in_flight, load.long_in_flight, load.offered
        )

    def _tell_node_waiting(self, node_id: str, provider_id: str, waiting: bool) -> None:
        """The pool's ``on_waiting``: tell the node (told again when it reconnects)."""
        session = self.hub.session(node_id)
        if session is not None:
            session.post(Waiting(provider_id=provider_id, waiting=waiting))

    def wire_frames(self, direction: FrameDirection, n: int) -> None:
        self.metrics.count_wire_frames(direction, n)

    def wire_error(self, reason: WireErrorReason, detail: str) -> None:
        self.metrics.count_wire_error(reason)  # the hub logged the detail

    def scrub(self, text: str) -> str:
        return self.snapshot.secrets.scrub(text)

    def provider_status(self, node_id: str, msg: ProviderStatus) -> int:
        """Apply the health ``node_id`` reported of its own providers; return how
        many entries named another id (ignored: the hub logs them once per session).

        Bounded by the node's configured providers, whatever the message holds:
        an entry per id is kept (the last), each ``last_error`` cut to
        ``last_error_limit`` before it is scrubbed (``STATUS_TEXT_BUDGET``
        characters per message in all), the served models' details only for
        the provider's served names (``bounded_models``), and a health change is logged at most
        ``HEALTH_LOG_BURST`` times per provider per ``HEALTH_LOG_WINDOW``.
        """
        providers = self.snapshot.catalog.providers
        latest: dict[str, ProviderHealth] = {}
        ignored = 0
        for p in msg.providers:
            ref = providers.get(p.provider_id)
            if ref is None or ref.node_id != node_id:
                ignored += 1
            else:
                latest[p.provider_id] = p
        limit, budget = last_error_limit(len(latest)), MODEL_TEXT_BUDGET
        for provider_id, p in latest.items():
            budget = self._apply_health(node_id, provider_id, p, limit, budget)
        return ignored

    def _apply_health(
        self, node_id: str, provider_id: str, p: ProviderHealth, limit: int, budget: int
    ) -> int:
        """Apply one entry; return the served-model ``budget`` it left."""
        state = self.health.setdefault(provider_id, ProviderHealthState())
        # A probe's last error may quote the provider's answer: never a key in /status.
        last_error = bounded(p.last_error, limit, self.snapshot.secrets.scrub)
        if state.health != p.health and state.may_log_change(trio.current_time()):
            log.info(
                "event=provider_health node=%s provider=%s health=%s last_error=%r unlogged=%d",
                node_id,
                provider_id,
                p.health,
                last_error[:200],
                state.unlogged,
            )
            state.unlogged = 0
        state.health = p.health
        state.last_error = last_error
        served = self.snapshot.catalog.providers[provider_id].config.models
        state.models, budget = bounded_models(p.models, served, self.scrub, budget)
        self.pool.set_provider_health(provider_id, p.health)
        return budget

    # ---------------------------------------------------------------- status

    def _connected_count(self) -> int:
        return sum(1 for n in self.snapshot.nodes if self.hub.connected_since(n) is not None)

    def _gateway_status(self) -> GatewayStatus:
        return GatewayStatus(
            queue_depth=self.pool.queue_depth,
            max_queue=self.pool.max_queue,
            queued_bytes=self.pool.queued_bytes,
            connected_nodes=self._connected_count(),
            providers=self._gauge_rows(),
            principals_in_flight=principals_in_flight(self.snapshot.config, self.pool),
            routing=routing_view(self.pool),
        )

    def _shown_health(self, node_id: str, provider_id: str) -> ProviderHealthState:
        """``disconnected`` while the node is away, ``ejected`` while passive
        ejection holds, else the last probe the node reported.

        The probe result is kept (not reset) on a disconnect: the node reports
        its current status right after its next handshake, which replaces it.
        """
        if self.hub.connected_since(node_id) is None:
            return ProviderHealthState(health=DISCONNECTED)
        probe = self.health.get(provider_id, ProviderHealthState())
        if self.pool.scheduler.outliers.is_ejected(provider_id):
            return ProviderHealthState(health="ejected", last_error=probe.last_error)
        return probe

    def _ejected_until(self, provider_id: str, shown: ShownHealth) -> float | None:
        """The end of a provider's ejection in Unix time (None unless ``ejected`` is shown)."""
        if shown != "ejected":
            return None
        ejection = self.pool.ejection(provider_id)
        if ejection is None:
            return None
        return round(time.time() + max(0.0, ejection.until - trio.current_time()), 3)

    def _gauge_rows(self) -> list[ProviderGaugeRow]:
        loads = self.pool.provider_loads()
        rows = []
        for pid, ref in self.snapshot.catalog.providers.items():
            load = loads.get(pid)
            rows.append(
                ProviderGaugeRow(
                    node_id=ref.node_id,
                    provider_id=pid,
                    # This edge's share: Prometheus sums the edges (``/status``
                    # shows the node's total across them).
                    in_flight=load.own_in_flight if load else 0,
                    capacity=load.capacity if load else ref.config.capacity,
                    long_in_flight=load.own_long_in_flight if load else 0,
                    long_capacity=ref.config.long_context_capacity,
                    health=self._shown_health(ref.node_id, pid).health,
                    enabled=ref.config.enabled,
                )
            )
        return rows

    def status(self) -> StatusDocument:
        """The admin ``GET /status`` document."""
        snap = self.snapshot
        loads = self.pool.provider_loads()
        nodes: list[NodeRow] = []
        for node in snap.config.nodes:
            since = self.hub.connected_since(node.id)
            nodes.append(
                {
                    "id": node.id,
                    "alias": node.alias,
                    "connected": since is not None,
                    "connected_since": since,
                    "providers": [p.id for p in node.providers],
                    "config_revision": self.node_states.revision(node.id),
                    "config_mismatch": self.config_mismatch(node.id),
                }
            )
        providers: list[ProviderRow] = []
        for node in snap.config.nodes:
            for p in node.providers:
                load = loads.get(p.id)
                hs = self._shown_health(node.id, p.id)
                in_flight = load.in_flight if load else 0
                control = self.controls.view(p.id)
                providers.append(
                    {
                        "node_id": node.id,
                        "id": p.id,
                        "type": p.type,
                        "category": p.category,
                        "models": list(p.models),
                        "enabled": p.enabled,
                        "state": control["state"],
                        "health": hs.health,
                        "capacity": control["capacity"],
                        "priority": control["priority"],
                        "override": control["override"],
                        "in_flight": in_flight,
                        "queued": load.queued if load else 0,
                        "load_ratio": load_ratio(in_flight, control["capacity"]),
                        "long_context_capacity": p.long_context_capacity,
                        "long_in_flight": load.long_in_flight if load else 0,
                        "lifecycle_capabilities": list(p.lifecycle_capabilities),
                        "last_error": hs.last_error,
                        "ejected_until": self._ejected_until(p.id, hs.health),
                    }
                )
        return {
            "edge_id": snap.config.edge.id,
            "config_version": snap.version,
            "config_revision": snap.config.edge.config_revision,
            "nodes": nodes,
            "providers": providers,
            "models": self._model_rows(),
            "queue": {
                "depth": self.pool.queue_depth,
                "max_queue": self.pool.max_queue,
                "queued_bytes": self.pool.queued_bytes,
                "max_queued_bytes": self.pool.max_queued_bytes,
            },
            "principals": principal_rows(snap.config, self.pool, self.limits),
            "limits_backend": self.limits.backend_row(),
            "routing": routing_row(self.pool),
        }

    def _model_rows(self) -> list[ModelRow]:
        """The model groups as ``/v1/models`` lists them, each with its providers."""
        catalog = self.snapshot.catalog
        rows: list[ModelRow] = []
        for group in catalog.listed():
            providers: list[ModelProviderRow] = []
            for pid, served in group.providers:
                ref = catalog.providers.get(pid)
                ptype = ref.config.type if ref is not None else "-"
                providers.append({"provider": pid, "served": served, "type": ptype})
            rows.append(
                {
                    "id": group.id,
                    "source": group.source,
                    "routing": group.routing,
                    "providers": providers,
                }
            )
        return rows

    # --------------------------------------------------------------- refresh

    async def refresh(self, mode: str) -> RefreshReport:
        """Dry-run or apply the config file the edge was started with."""
        report: RefreshReport = {
            "mode": mode,
            "applied": False,
            "changed_nodes": [],
            "changed_providers": [],
            "changed_models": [],
            "restart_required": [],
            "errors": [],
        }
        if mode not in ("dry_run", "apply"):
            report["errors"] = [f"mode: must be 'dry_run' or 'apply', not {mode!r}"]
            self.metrics.count_refresh("failed")
            return report
        if self.config_path is None:
            report["errors"] = ["config: this edge was started without a config file"]
            self.metrics.count_refresh("failed")
            return report
        async with self._refresh_lock:
            try:
                new_cfg = await trio.to_thread.run_sync(load_edge_config, self.config_path)
            except ConfigError as exc:
                report["errors"] = list(exc.errors)
                self.metrics.count_refresh("failed")
                log.warning("event=refresh mode=%s outcome=failed errors=%d", mode, len(exc.errors))
                return report
            diff = classify(self.snapshot.config, new_cfg)
            report["changed_nodes"] = list(diff.changed_nodes)
            report["changed_providers"] = list(diff.changed_providers)
            report["changed_models"] = list(diff.changed_models)
            report["restart_required"] = list(diff.restart_required)
            if mode == "dry_run":
                self.metrics.count_refresh("dry_run")
                return report
            if diff.restart_required:
                self.metrics.count_refresh("refused")
                log.warning(
                    "event=refresh mode=apply outcome=refused restart_required=%s",
                    ",".join(diff.restart_required),
                )
                return report
            self._swap(new_cfg, changed=not diff.is_empty)
            self._node_changes(diff)
            report["applied"] = True
            self.metrics.count_refresh("applied")
            log.info(
                "event=refresh mode=apply outcome=applied version=%d nodes=%s providers=%s models=%s",
                self.snapshot.version,
                ",".join(diff.changed_nodes),
                ",".join(diff.changed_providers),
                ",".join(diff.changed_models),
            )
            report["errors"] = await self._push_configs(diff.changed_nodes)
            return report

    def _swap(self, cfg: EdgeConfig, *, changed: bool) -> None:
        """Install ``cfg`` as the new snapshot and re-examine the pool's waiters.

        Synchronous on purpose: no checkpoint, so no request and no caller's
        cancel can see half of it.  The version (``/status`` ``config_version``,
        the ``NodeConfig`` version) moves only when something changed, so a
        no-change apply is invisible.
        """
        version = self.snapshot.version + (1 if changed else 0)
        new = _make_snapshot(cfg, version=version, embedded=self.embedded_tokens)
        self.snapshot = new  # the one atomic swap
        for gone in self.health.keys() - new.catalog.providers.keys():
            del self.health[gone]
        self._allow_metric_ids(cfg)
        self.limits.apply_config(cfg.limits)  # counters are kept

        self.pool.apply_snapshot(pool_snapshot(cfg, new.catalog))
        self.retry_budget.set_policy(retry_budget_policy(cfg))
        self.retry_budget.retain(g.id for g in new.catalog.listed())

    def _node_changes(self, diff: RefreshDiff) -> None:
        """After the swap: a removed node's session is retired (out of routing
        now, ended once its streams are done); a changed verifier is checked at
        the node's next handshake, the session in force goes on."""
        for node_id in diff.removed_nodes:
            self.hub.retire(node_id, "removed from the config by a refresh")
        for node_id in diff.verifier_changed:
            log.info("event=node_verifier_changed node=%s applies=next_handshake", node_id)

    async def _push_configs(self, changed_nodes: list[str]) -> list[str]:
        """Push the current snapshot's ``NodeConfig`` to every changed, connected node.

        Returns the report's ``errors`` entries (``nodes.<id>: config push
        rejected|failed: <reason>``), in ``changed_nodes`` order.  A changed
        node that is not connected is no error: it gets the new config at its
        next handshake.

        Concurrent, so a node that does not answer holds up no other node's
        push; shielded, so an admin caller hanging up after the swap cannot
        leave some changed nodes on the old config.  Each push is bounded by
        ``NODE_PUSH_TIMEOUT``, which therefore bounds the whole step.
        """
        snap = self.snapshot
        problems: dict[str, str] = {}
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for node_id in changed_nodes:
                    if node_id not in snap.nodes or self.hub.session(node_id) is None:
                        continue  # removed, or it gets the new config at its next handshake
                    msg = node_config_for(snap.config, node_id, snap.version)
                    nursery.start_soon(self._push_config, node_id, msg, problems)
        return [problems[n] for n in changed_nodes if n in problems]

    async def _push_config(self, node_id: str, msg: NodeConfig, problems: dict[str, str]) -> None:
        """Push one node's config; a failure or rejection goes into ``problems[node_id]``."""
        try:
            ack = await self.hub.push_config(node_id, msg, timeout=NODE_PUSH_TIMEOUT)
        except Exception as exc:  # lost mid-push (it reconnects and gets it then) or silent
            outcome, reason = "failed", str(exc)
        else:
            if ack.ok:
                return
            outcome, reason = "rejected", ack.error
        # Never a secret in the report or the log, even should the node echo one.
        reason = safe_node_reason(
            reason, msg, known_secrets=[self.snapshot.config.openai.bearer_token or ""]
        )
        log.warning("event=node_config_push node=%s outcome=%s reason=%r", node_id, outcome, reason)
        problems[node_id] = f"nodes.{node_id}: config push {outcome}: {reason}"
