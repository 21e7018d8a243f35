"""The edge daemon: one nursery owning the wire listener, the OpenAI and admin
listeners, signal handling and the drain.

The OpenAI listener is ``iopd.http.server``; the admin listener is a quart-trio
app on hypercorn's trio worker (``iopd.edge.admin``), in the same nursery and
trio run.

Drain (SIGTERM/SIGINT or ``EdgeHandle.drain()``): stop accepting on the OpenAI
listener, let in-flight requests finish within ``edge.drain_timeout``, then
end the rest with a terminal error (their leaving the node stream sends
``Cancel`` to the node), close node sessions and return.  A second signal
stops at once.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from iopd import __version__, errors, sdnotify
from iopd.config.load import ConfigError, ConfigUnreadable, load_edge_config
from iopd.config.schema import EdgeConfig
from iopd.edge.admin import AdminLimits, AdminServer, create_admin_app, is_loopback_peer
from iopd.edge.embedded import EmbeddedNodes, embedded_node_ids, serve_embedded_nodes
from iopd.edge.handover import (
    NODE_WAIT,
    HandoverFailed,
    HandoverOutcome,
    Successor,
    hand_over,
    successor_argv,
)
from iopd.edge.openai.app import OpenAIApp
from iopd.edge.openai.outgoing.error_envelope import gateway_error, render_error
from iopd.edge.runtime.edge_runtime import EdgeRuntime
from iopd.edge.runtime.status_document import RefreshReport
from iopd.http.errors import Refusal
from iopd.http.server import HttpLimits, HttpServer
from iopd.logs import LOG_SECRETS, setup_logging
from iopd.startup import StartupError, listen_failed, run_daemon
from iopd.transport.listen import serve_wire
from iopd.transport.sockets import Inherited, open_listeners
from iopd.transport.tls import server_ssl_context

log = logging.getLogger("iopd.edge")

#: After the drain deadline, how long cut requests get to write their error.
CUT_GRACE = 2.0


def split_hostport(addr: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` → (host, port); validated by the config loader."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def _fmt(addr: tuple[str, int]) -> str:
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class EdgeHandle:
    """What ``run_edge`` reports when it is serving: the runtime and bound addresses."""

    runtime: EdgeRuntime
    wire: tuple[str, int]
    admin: tuple[str, int]
    openai: tuple[str, int] | None
    #: The OpenAI listener's server (``open_connections``, ``in_flight``), for tests.
    openai_server: HttpServer | None = None
    _drain: trio.Event = field(default_factory=trio.Event)
    _stop_now: trio.Event = field(default_factory=trio.Event)
    #: The listening sockets by name, what a successor is handed.
    listeners: dict[str, list[trio.SocketListener]] = field(default_factory=dict)
    #: The successor's command line (``iopd edge`` only; None: no hand-over here).
    successor_argv: list[str] | None = None
    #: Set: the wire listener accepts no more (its successor does).
    _wire_stop: trio.Event = field(default_factory=trio.Event)
    _nursery: trio.Nursery | None = None
    _upgrading: bool = False
    #: The drain under way is a hand-over: idle connections are left to close.
    _handed_over: bool = False

    @property
    def base_url(self) -> str:
        assert self.openai is not None
        return f"http://{_fmt(self.openai)}/v1"

    def hand_over(self) -> HandoverOutcome:
        """Hand the sockets to a new ``iopd edge`` (like ``SIGUSR2``; see ``handover``).

        Runs in the edge's own nursery (a caller that goes away cancels
        nothing); the outcome is set when the successor took over or failed.
        """
        outcome = HandoverOutcome()
        assert self._nursery is not None
        self._nursery.start_soon(_upgrade, self, self.runtime, outcome)
        return outcome

    def drain(self) -> None:
        """Begin a graceful drain (like SIGTERM); a second call stops at once."""
        if self._drain.is_set():
            self._stop_now.set()
        self._drain.set()


def _count_refusal(app: OpenAIApp, status: int, exc: Refusal, context: object) -> None:
    """The OpenAI listener's ``on_reject``: the HTTP layer's refusal, in the app's terms."""
    app.layer_refused(status, gateway_error(exc), context)


async def run_edge(
    cfg: EdgeConfig,
    config_path: str | None = None,
    *,
    handle_signals: bool = False,
    successor_argv: list[str] | None = None,
    task_status: trio.TaskStatus[EdgeHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run an edge until drained; reports an ``EdgeHandle`` once every listener is bound.

    Listening sockets handed to this process (``iopd.transport.sockets``) are
    used instead of binding; started by a predecessor (``iopd.edge.handover``)
    it reports its progress to it.  ``successor_argv``: how to start the
    process this one hands over to on ``SIGUSR2``.
    """
    inherited = Inherited.from_environ()
    predecessor = Successor.from_environ()
    rt = EdgeRuntime.create(cfg, config_path)
    oa = cfg.openai
    app = OpenAIApp(rt)
    openai_srv = HttpServer(
        app,
        limits=HttpLimits(
            max_body_bytes=oa.max_body_bytes,
            max_header_bytes=oa.max_header_bytes,
            header_timeout=oa.header_timeout,
            body_timeout=oa.body_timeout,
            idle_timeout=oa.idle_timeout,
            max_connections=oa.max_connections,
            max_inflight_body_bytes=oa.max_inflight_body_bytes,
            send_timeout=oa.send_timeout,
        ),
        render_error=render_error,
        on_reject=functools.partial(_count_refusal, app),
        head_check=app.check_head,
    )
    handles: list[EdgeHandle] = []  # the one this run reports, once it serves
    restart = (lambda: handles[0].hand_over()) if successor_argv is not None else None
    admin_srv = AdminServer(
        create_admin_app(rt, restart=restart),
        limits=AdminLimits(keep_alive_timeout=oa.idle_timeout),
        allow_peer=is_loopback_peer,
    )
    ssl_ctx = server_ssl_context(cfg.edge.tls)
    async with trio.open_nursery() as nursery:
        await nursery.start(_scrub_secrets_from_logs, rt)
        await nursery.start(rt.pool.run_outlier_timer)  # ejections that run out wake waiters
        await nursery.start(rt.limits.run)  # the shared limits store's client, renewals, probes
        listeners: dict[str, list[trio.SocketListener]] = {}
        wire_stop = trio.Event()
        gate = rt.hub.listener_gate()  # unauthenticated connections, capped
        wire_addr = await _listen(
            nursery,
            "edge.node_listen",
            cfg.edge.node_listen,
            functools.partial(
                serve_wire,
                functools.partial(rt.hub.handle_connection, gate=gate),
                ssl_context=ssl_ctx,
                gate=gate,
                stop_accepting=wire_stop,
            ),
            name="wire",
            inherited=inherited,
            listeners=listeners,
        )
        admin_addr = await _listen(
            nursery,
            "edge.admin_listen",
            cfg.edge.admin_listen,
            admin_srv.serve,
            name="admin",
            inherited=inherited,
            listeners=listeners,
        )
        if predecessor is not None:  # it stops taking nodes, which dial here now
            predecessor.tell("wire")
            await _wait_for_nodes(rt, cfg, NODE_WAIT)
        openai_addr = None
        if oa.enabled:
            openai_addr = await _listen(
                nursery,
                "openai.listen",
                oa.listen,
                openai_srv.serve,
                name="openai",
                inherited=inherited,
                listeners=listeners,
            )
        inherited.close_rest()
        embedded: EmbeddedNodes | None = None
        if embedded_node_ids(cfg):  # nodes[].embedded: run them here, over loopback
            embedded = await nursery.start(serve_embedded_nodes, rt, cfg)
        handle = EdgeHandle(
            runtime=rt,
            wire=(wire_addr[0], wire_addr[1]),
            admin=admin_addr,
            openai=openai_addr,
            openai_server=openai_srv if oa.enabled else None,
            listeners=listeners,
            successor_argv=successor_argv,
            _wire_stop=wire_stop,
            _nursery=nursery,
        )
        handles.append(handle)
        if handle_signals:  # before edge_started: a SIGHUP sent on that line is handled
            await nursery.start(_signals, handle, rt)
        log.info(
            "event=edge_started edge=%s version=%s wire=%s admin=%s openai=%s tls=%s",
            cfg.edge.id,
            __version__,
            _fmt(handle.wire),
            _fmt(admin_addr),
            _fmt(openai_addr) if openai_addr else "disabled",
            "on" if ssl_ctx is not None else "off",
        )
        sdnotify.notify(*sdnotify.ready(f"serving edge {cfg.edge.id}"))
        task_status.started(handle)
        if predecessor is not None:  # it stops accepting and drains now
            predecessor.tell("ready")
            predecessor.close()

        await handle._drain.wait()
        if not handle._handed_over:  # (after a hand-over the successor is the service)
            sdnotify.notify(*sdnotify.stopping())
        with trio.CancelScope() as hard:
            nursery.start_soon(_stop_at_second_signal, handle, hard)
            await _drain(
                rt,
                app,
                openai_srv,
                admin_srv,
                cfg.edge.drain_timeout,
                handed_over=handle._handed_over,
            )
        if embedded is not None:
            embedded.stop()
        await rt.hub.aclose("edge shutting down")
        nursery.cancel_scope.cancel()
    log.info("event=edge_stopped edge=%s", cfg.edge.id)


class ListenFailed(StartupError):
    """A listener could not bind: the config ``key`` naming ``address``, the system's reason.

    The line names the key and what to do; ``iopd demo`` rebuilds it with its own flags.
    """

    def __init__(self, key: str, address: str, exc: OSError) -> None:
        self.key = key
        self.address = address
        self.in_use = exc.errno == errno.EADDRINUSE
        self.os_reason = listen_failed(address, exc).reason
        if self.in_use:
            hint = f"another process holds that port: stop it, or set {key} to a free port"
        else:
            hint = f"check {key} (an address of this machine, host:port)"
        super().__init__("cannot listen on", f"{address} ({key})", f"{self.os_reason}: {hint}")


async def _listen(
    nursery: trio.Nursery,
    key: str,
    address: str,
    serve: Callable[..., Awaitable[object]],
    *,
    name: str,
    inherited: Inherited,
    listeners: dict[str, list[trio.SocketListener]],
) -> tuple[str, int]:
    """Start ``serve(host, port)`` on ``address`` (the config's ``key``, or the sockets
    inherited as ``name``); what it bound, or a one-line ``StartupError`` naming the key."""
    host, port = split_hostport(address)
    try:
        bound_listeners = await open_listeners(name, host, port, inherited)
        listeners[name] = bound_listeners
        bound: tuple[str, int] = await nursery.start(
            functools.partial(serve, listeners=bound_listeners), host, port
        )
    except OSError as exc:  # in use, not an address of this machine, unresolvable
        raise ListenFailed(key, address, exc) from None
    return bound


async def _wait_for_nodes(rt: EdgeRuntime, cfg: EdgeConfig, timeout: float) -> None:
    """A successor: wait (at most ``timeout``) until every remote node is connected,
    so that no request it accepts waits for one."""
    remote = [n.id for n in cfg.nodes if not n.embedded]
    with trio.move_on_after(timeout):
        # A one-off wait at a hand-over: a look every 50 ms costs nothing.
        while not all(rt.hub.session(node_id) is not None for node_id in remote):  # noqa: ASYNC110
            await trio.sleep(0.05)
    missing = [node_id for node_id in remote if rt.hub.session(node_id) is None]
    log.info(
        "event=handover_nodes connected=%d missing=%s",
        len(remote) - len(missing),
        ",".join(missing) or "-",
    )


async def _scrub_secrets_from_logs(rt: EdgeRuntime, *, task_status: trio.TaskStatus[None]) -> None:
    """For as long as the edge runs, no piece of its config's secrets reaches a log line."""
    owner = f"edge:{id(rt)}"
    LOG_SECRETS.add(owner, lambda: rt.snapshot.secrets)
    try:
        task_status.started()
        await trio.sleep_forever()
    finally:
        LOG_SECRETS.forget(owner)


async def _stop_at_second_signal(handle: EdgeHandle, hard: trio.CancelScope) -> None:
    await handle._stop_now.wait()
    log.warning("event=edge_stop_now reason=second_signal")
    hard.cancel()


async def _drain(
    rt: EdgeRuntime,
    app: OpenAIApp,
    openai_srv: HttpServer,
    admin_srv: AdminServer,
    timeout: float,
    *,
    handed_over: bool = False,
) -> None:
    rt.stopping.set()  # the console's event streams end
    in_flight = openai_srv.in_flight
    log.info(
        "event=drain_started in_flight=%d deadline_s=%s handover=%s",
        in_flight,
        timeout,
        "yes" if handed_over else "no",
    )
    if not handed_over:  # (a successor answers /healthz on the same port now)
        app.begin_drain()  # /healthz answers 503 from now on: load balancers stop sending
    # After a hand-over an idle keep-alive connection is answered once more
    # (with ``Connection: close``) rather than closed under a client that
    # may be sending on it; the drain waits for the connections to close.
    openai_srv.shutdown(close_idle=not handed_over)
    with trio.move_on_after(timeout):
        await openai_srv.wait_idle()
        if handed_over:
            await openai_srv.wait_closed()
    if openai_srv.in_flight:
        log.warning("event=drain_deadline cut=%d", openai_srv.in_flight)
        app.cut_all()
        rt.pool.fail_all_waiters(lambda: errors.ShuttingDown("the edge is shutting down"))
        with trio.move_on_after(CUT_GRACE):
            await openai_srv.wait_idle()
    admin_srv.shutdown()  # last: operators watch the drain on it
    with trio.move_on_after(admin_srv.limits.graceful_timeout + CUT_GRACE):
        await admin_srv.stopped.wait()
    log.info("event=drain_done")


async def _signals(
    handle: EdgeHandle, rt: EdgeRuntime, *, task_status: trio.TaskStatus[None]
) -> None:
    # A refresh runs in its own task: it may wait NODE_PUSH_TIMEOUT for a silent
    # node's ack, and a SIGTERM (or the second one) must not wait behind it.
    with trio.open_signal_receiver(
        signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGUSR2
    ) as signals:
        async with trio.open_nursery() as refreshes:
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGUSR2:
                    log.info("event=sigusr2 action=hand_over")
                    handle.hand_over()
                elif signum == signal.SIGHUP:
                    log.info("event=sighup action=refresh")
                    refreshes.start_soon(_refresh_on_sighup, rt)
                else:
                    log.info("event=signal signal=%s action=drain", signal.Signals(signum).name)
                    handle.drain()


async def _upgrade(handle: EdgeHandle, rt: EdgeRuntime, outcome: HandoverOutcome) -> None:
    """``SIGUSR2``: hand the sockets to a new ``iopd edge`` (``iopd.edge.handover``)."""
    if handle.successor_argv is None or handle._upgrading or handle._drain.is_set():
        why = "the edge is draining" if handle._drain.is_set() else "a hand-over is under way"
        if handle.successor_argv is None:
            why = "this edge was not started by 'iopd edge' (embedded in another program)"
        log.warning("event=handover_refused reason=%r", why)
        outcome.finish(error=why)
        return
    handle._upgrading = True
    keep = frozenset(embedded_node_ids(rt.snapshot.config))
    # The wire sockets must outlive the accept loop stopped at ``wire``: if the
    # successor fails after it, this process listens on them again.
    wire_dups = [os.dup(listener.socket.fileno()) for listener in handle.listeners.get("wire", [])]

    def on_wire() -> None:
        handle._wire_stop.set()
        told = rt.hub.go_away("edge process handing over to its successor", keep=keep)
        log.info("event=handover_wire nodes_told=%d", told)

    try:
        pid = await hand_over(handle.successor_argv, handle.listeners, on_wire=on_wire)
    except HandoverFailed as exc:
        log.error(
            "event=handover_failed reason=%r action=%r", str(exc), "this edge goes on serving"
        )
        handle._upgrading = False
        if handle._wire_stop.is_set():
            await _listen_again(handle, rt, wire_dups)
        else:
            for fd in wire_dups:
                os.close(fd)
        return
    for fd in wire_dups:
        os.close(fd)
    log.info("event=handover_done successor_pid=%d", pid)
    sdnotify.notify(f"MAINPID={pid}")  # systemd follows the successor from now on
    handle._handed_over = True
    outcome.finish(pid=pid)
    handle.drain()


async def _listen_again(handle: EdgeHandle, rt: EdgeRuntime, fds: list[int]) -> None:
    """After a failed hand-over: accept node connections on the kept wire sockets again
    (taken back the way a successor takes inherited ones)."""
    assert handle._nursery is not None
    cfg = rt.snapshot.config
    host, port = split_hostport(cfg.edge.node_listen)
    listeners = await open_listeners("wire", host, port, Inherited({"wire": fds}))
    handle._wire_stop = trio.Event()
    handle.listeners["wire"] = listeners
    gate = rt.hub.listener_gate()
    await handle._nursery.start(
        functools.partial(
            serve_wire,
            functools.partial(rt.hub.handle_connection, gate=gate),
            ssl_context=server_ssl_context(cfg.edge.tls),
            gate=gate,
            listeners=listeners,
            stop_accepting=handle._wire_stop,
        ),
        host,
        port,
    )
    log.info("event=wire_listening_again count=%d", len(listeners))


async def _refresh_on_sighup(rt: EdgeRuntime) -> None:
    sdnotify.notify(*sdnotify.reloading())
    status = "serving"
    try:
        status = sighup_outcome(await rt.refresh("apply"), rt.config_path)
    finally:
        sdnotify.notify(*sdnotify.ready(status))


def sighup_outcome(report: RefreshReport, config_path: str | None) -> str:
    """Log why a SIGHUP (``systemctl reload``) refresh did not apply, one line per
    reason with what to do; the unit's status text (``systemctl status``)."""
    if report["applied"] and not report["errors"]:
        return "serving"
    check = f"`iopd config check {config_path}`" if config_path else "`iopd config check`"
    if report["applied"]:  # applied, but a changed node did not take its new config
        for problem in report["errors"]:
            log.warning(
                "event=sighup_refresh outcome=incomplete problem=%r hint=%r",
                problem,
                "the node keeps its previous config: see its log, then reload again",
            )
        return f"serving; the last reload left {len(report['errors'])} node(s) behind (see log)"
    if report["restart_required"]:
        keys = ",".join(report["restart_required"])
        log.error(
            "event=sighup_refresh outcome=refused restart_required=%s hint=%r",
            keys,
            "nothing was applied: these keys change only at a restart; revert them and "
            "reload to apply the rest, or restart the edge",
        )
        return f"serving the previous config; the last reload needs a restart for {keys}"
    for problem in report["errors"]:
        log.error(
            "event=sighup_refresh outcome=failed problem=%r hint=%r",
            problem,
            f"nothing was applied: fix the config and reload again ({check} lists every problem)",
        )
    first = report["errors"][0] if report["errors"] else "unknown"
    return f"serving the previous config; the last reload failed: {first}"


def edge_main(config_path: str, *, log_level: str | None = None) -> int:
    """``iopd edge --config PATH``; a start-up failure raises ``StartupError`` (one line)."""
    try:
        cfg = load_edge_config(config_path)
    except ConfigUnreadable as exc:
        raise StartupError("cannot read config", exc.path, exc.reason) from None
    except ConfigError as exc:
        for line in exc.errors:
            print(line, file=sys.stderr)
        return 1
    setup_logging(cfg.edge.log_format, log_level or cfg.edge.log_level)
    try:
        argv = successor_argv(config_path, log_level)
        run_daemon(lambda: run_edge(cfg, config_path, handle_signals=True, successor_argv=argv))
    except StartupError as exc:  # a port in use, unreadable certificates
        log.error("event=edge_failed reason=%r", str(exc))
        raise
    return 0
