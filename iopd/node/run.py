"""The node daemon: executor + health probes + the wire link, and the drain on SIGTERM.

``run_node`` owns one nursery with three things in it: the ``EdgeSessions``
(one ``NodeLink`` per edge: dials it, spawns ``serve_stream`` per request),
the ``HealthMonitor`` (reports to every connected edge) and — with ``handle_signals`` — a signal watcher.

Drain (SIGTERM/SIGINT, or ``NodeHandle.request_drain()``): the executor
stops taking new streams (they get a terminal error at once), in-flight runs
get up to ``node.drain_timeout`` seconds, then the rest are cancelled — each
still sends its terminal ``cancelled`` error — and the daemon exits 0.  A
second signal exits at once.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from iopd import __version__
from iopd.config.schema import NodeConfigFile, node_edge_addresses
from iopd.logs import LOG_SECRETS
from iopd.node.consent import Consent
from iopd.node.edges.link import NodeLink
from iopd.node.edges.sessions import EdgeSessions
from iopd.node.executor import CANCEL_TERMINAL_TIMEOUT, NodeExecutor

log = logging.getLogger(__name__)


@dataclass
class NodeHandle:
    """What ``run_node`` reports when started: the parts, for tests and the demo."""

    executor: NodeExecutor
    sessions: EdgeSessions
    _drain: trio.Event = field(default_factory=trio.Event)

    @property
    def link(self) -> NodeLink:
        """The session with the first (or only) edge."""
        return self.sessions.links[0]

    def request_drain(self) -> None:
        """Start the graceful drain, as SIGTERM would."""
        self._drain.set()


async def _drain(handle: NodeHandle, drain_timeout: float) -> None:
    executor = handle.executor
    executor.begin_drain()
    log.info(
        "event=node_drain_start active_streams=%d timeout_s=%g",
        executor.active_streams,
        drain_timeout,
    )
    with trio.move_on_after(drain_timeout):
        await executor.wait_idle()
    if executor.active_streams:
        log.info("event=node_drain_cancel active_streams=%d", executor.active_streams)
        executor.cancel_all("node shutting down")
        with trio.move_on_after(CANCEL_TERMINAL_TIMEOUT + 1.0):
            await executor.wait_idle()
    log.info("event=node_drain_done")


async def _watch_signals(
    handle: NodeHandle,
    stop: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        seen = 0
        async for signum in signals:
            seen += 1
            name = signal.Signals(signum).name
            if seen == 1:
                log.info("event=node_signal signal=%s action=drain", name)
                handle.request_drain()
            else:
                log.warning("event=node_signal signal=%s action=exit_now", name)
                stop.cancel()
                return


async def run_node(
    cfg: NodeConfigFile,
    *,
    handle_signals: bool = False,
    consent: Callable[[], Consent] | None = None,
    task_status: trio.TaskStatus[NodeHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the node until cancelled or drained; reports a ``NodeHandle`` when started.

    ``consent``: what a pushed provider may run or reach; by default what
    ``cfg.node`` allows (the embedded node passes its edge's config instead).
    """
    from iopd import sdnotify

    executor = NodeExecutor(
        secrets=[cfg.node.token],
        consent=consent if consent is not None else Consent.of_node(cfg.node),
    )
    log_owner = f"node:{id(executor)}"
    LOG_SECRETS.add(log_owner, lambda: executor.secrets)
    sessions = EdgeSessions(cfg.node, executor, software_version=__version__)
    handle = NodeHandle(executor, sessions)
    try:
        with trio.CancelScope() as stop:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(executor.health.run, sessions)
                await nursery.start(sessions.run)
                if handle_signals:
                    await nursery.start(_watch_signals, handle, stop)
                log.info(
                    "event=node_start node=%s edges=%s version=%s",
                    cfg.node.id,
                    ",".join(node_edge_addresses(cfg.node)),
                    __version__,
                )
                task_status.started(handle)
                if handle_signals:
                    sdnotify.notify(*sdnotify.ready(f"node {cfg.node.id} running"))
                await handle._drain.wait()
                if handle_signals:
                    sdnotify.notify(*sdnotify.stopping())
                await _drain(handle, cfg.node.drain_timeout)
                await sessions.shutdown()
                nursery.cancel_scope.cancel()
    finally:
        LOG_SECRETS.forget(log_owner)
        registry = executor.registry
        if registry is not None:
            await registry.aclose()  # shielded inside
    log.info("event=node_stop node=%s", cfg.node.id)


def node_main(config_path: str, *, log_level: str | None) -> int:
    """``iopd node --config PATH``: load the config, run until drained; the exit status.

    A start-up failure (unreadable config or certificates) raises ``StartupError``.
    """
    from iopd.config.load import ConfigError, ConfigUnreadable, load_node_config
    from iopd.logs import setup_logging
    from iopd.startup import StartupError, run_daemon

    try:
        cfg = load_node_config(config_path)
    except ConfigUnreadable as exc:
        raise StartupError("cannot read config", exc.path, exc.reason) from None
    except ConfigError as exc:
        for line in exc.errors:
            print(line, file=sys.stderr)
        return 1
    setup_logging(cfg.node.log_format, log_level or cfg.node.log_level)
    try:
        run_daemon(lambda: run_node(cfg, handle_signals=True))
    except StartupError as exc:
        log.error("event=node_failed reason=%r", str(exc))
        raise
    except KeyboardInterrupt:  # pragma: no cover - a signal before the handler was installed
        return 130
    return 0
