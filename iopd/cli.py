"""The ``iopd`` command line.

Sub-commands import their modules lazily so ``iopd token`` or
``iopd config check`` start fast and never pull in the daemons.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import secrets
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from iopd import __version__

if TYPE_CHECKING:
    from iopd.admin_client import AdminTarget

DEFAULT_ADMIN = "http://127.0.0.1:7071"
ADMIN_URL_ENV = "IOP_ADMIN_URL"


def _port(text: str) -> int:
    """An argparse type: a TCP port number, 0 (any free port) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535 (got {port})")
    return port


def _print_help(parser: argparse.ArgumentParser, _args: argparse.Namespace) -> int:
    """A command without its sub-command (bare ``iopd``): the commands, on stdout."""
    parser.print_help()
    return 0


def _cmd_token(args: argparse.Namespace) -> int:
    """A new token (or the one in ``--token-env``), its SHA-256 and a node verifier.

    The verifier has a fresh salt at every run: run it once per edge with the
    same token so that each edge holds its own.
    """
    import os

    from wire.scram import Verifier

    if args.token_env:
        token = os.environ.get(args.token_env, "")
        if not token:
            print(f"iopd token: ${args.token_env} is not set or empty", file=sys.stderr)
            return 2
    else:
        token = "iop_" + secrets.token_urlsafe(32)
        print(f"token:             {token}")
    digest = hashlib.sha256(token.encode()).hexdigest()
    print(f"token_hash_sha256: {digest}")
    print(f"token_verifier:    {Verifier.create(token).encode()}")
    return 0


def _cmd_config_check(args: argparse.Namespace) -> int:
    from iopd.config.check import check_main

    return check_main(args.path)


def _cmd_edge(args: argparse.Namespace) -> int:
    from iopd.edge.daemon import edge_main

    return edge_main(args.config, log_level=args.log_level)


def _cmd_node(args: argparse.Namespace) -> int:
    from iopd.node.run import node_main

    if args.config is None:
        print("iopd node: --config PATH is required (or: iopd node drain ID)", file=sys.stderr)
        return 2

    return node_main(args.config, log_level=args.log_level)


def _cmd_demo(args: argparse.Namespace) -> int:
    from iopd.demo import demo_main

    return demo_main(port=args.port, admin_port=args.admin_port)


def _admin_target(args: argparse.Namespace, command: str) -> AdminTarget | None:
    """Where the admin API is (``--admin`` > ``$IOP_ADMIN_URL`` > ``--config`` > the
    default), or None after printing why it cannot be told."""
    from iopd.admin_client import AdminError, find_admin

    try:
        return find_admin(args.admin, args.config)
    except AdminError as exc:
        print(f"iopd {command}: {exc}", file=sys.stderr)
        return None


def _cmd_status(args: argparse.Namespace) -> int:
    from iopd.admin_client import status_main

    target = _admin_target(args, "status")
    if target is None:
        return 1
    return status_main(target, as_json=args.json, principals=args.principals)


def _cmd_refresh(args: argparse.Namespace) -> int:
    from iopd.admin_client import refresh_main

    target = _admin_target(args, "refresh")
    if target is None:
        return 1
    return refresh_main(target, dry_run=args.dry_run)


def _cmd_restart(args: argparse.Namespace) -> int:
    from iopd.admin_client import restart_main

    target = _admin_target(args, "restart")
    if target is None:
        return 1
    return restart_main(target)


def _override(text: str) -> int | None:
    """An argparse type: an override value, an integer >= 0, or ``none`` to clear it."""
    if text.strip().lower() in ("none", "null"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer or 'none': {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {value})")
    return value


def _cmd_provider(args: argparse.Namespace) -> int:
    from iopd.admin_client import provider_main, provider_set_main

    if args.action == "set":
        overrides = {k: getattr(args, k) for k in ("capacity", "priority") if k in args}
        if not overrides:
            print("iopd provider set: give --capacity and/or --priority", file=sys.stderr)
            return 1
    target = _admin_target(args, f"provider {args.action}")
    if target is None:
        return 1
    if args.action != "set":
        return provider_main(target, args.action, args.id, as_json=args.json)
    return provider_set_main(target, args.id, overrides, as_json=args.json)


def _cmd_node_drain(args: argparse.Namespace) -> int:
    from iopd.admin_client import node_drain_main

    target = _admin_target(args, "node drain")
    if target is None:
        return 1
    return node_drain_main(target, args.id, as_json=args.json)


def _add_control_parsers(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    node_parser: argparse.ArgumentParser,
    admin_token_note: str,
) -> None:
    """``iopd provider drain|disable|enable|set|reset ID`` and ``iopd node drain ID``."""
    lost = (
        "Runtime controls live in the edge's memory: they survive `iopd refresh` and are "
        "lost when the edge restarts. "
    )
    p = sub.add_parser(
        "provider",
        help="runtime controls of a provider (drain, disable, enable, set, reset)",
        description="Change a provider of a running edge without editing the config. "
        + lost
        + admin_token_note,
    )
    psub = p.add_subparsers(dest="action", metavar="ACTION", required=False)
    p.set_defaults(func=functools.partial(_print_help, p))
    helps = {
        "drain": "take no new requests; 'drained' once the last one in flight is done",
        "disable": "take no new requests at once (requests in flight finish)",
        "enable": "take requests again (state active; overrides are kept)",
        "set": "override capacity and/or priority ('none' clears an override)",
        "reset": "state active and every override cleared: the config's values again",
    }
    for action, text in helps.items():
        a = psub.add_parser(action, help=text, description=text)
        a.add_argument("id", metavar="ID", help="provider id (as `iopd status` lists it)")
        if action == "set":
            for key in ("capacity", "priority"):
                a.add_argument(
                    f"--{key}",
                    type=_override,
                    default=argparse.SUPPRESS,
                    metavar="N|none",
                    help=f"{key} in force instead of the configured one; 'none' clears it",
                )
        _add_admin_options(a)
        a.set_defaults(func=_cmd_provider)

    # ``iopd node`` runs the node daemon; ``iopd node drain ID`` is its one sub-command.
    nsub = node_parser.add_subparsers(dest="action", metavar="ACTION", required=False)
    text = (
        "every provider of the node drains on a running edge (see `iopd provider drain`). "
        + lost
        + admin_token_note
    )
    a = nsub.add_parser("drain", help=text, description=text)
    a.add_argument("id", metavar="ID", help="node id (as `iopd status` lists it)")
    _add_admin_options(a)
    a.set_defaults(func=_cmd_node_drain)


def _add_admin_options(
    p: argparse.ArgumentParser, *, json_help: str | None = None, with_json: bool = True
) -> None:
    """``--admin``, ``--config`` (where the admin API is) and ``--json``."""
    p.add_argument(
        "--admin",
        default=None,
        metavar="URL",
        help=f"admin API URL (first of: this, ${ADMIN_URL_ENV}, --config's edge.admin_listen, "
        f"{DEFAULT_ADMIN})",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="EDGE_CONFIG",
        help="the edge's config file: its edge.admin_listen names the admin API "
        "(default /etc/iopd/edge.yaml when it can be read)",
    )
    if with_json:
        p.add_argument(
            "--json", action="store_true", help=json_help or "print the admin API's JSON answer"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iopd",
        description="iopd: a self-hosted OpenAI-compatible LLM gateway (edge + node daemons).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "first steps:\n"
            "  iopd demo            a whole gateway on loopback (model 'echo')\n"
            "  iopd status          what the running edge serves\n"
            "on a running edge (found by --config EDGE_CONFIG, --admin URL or $IOP_ADMIN_URL):\n"
            "  iopd refresh [--dry-run]\n"
            "  iopd restart         a new edge process takes over the sockets; nothing refused\n"
            "  iopd provider drain|disable|enable|set|reset ID\n"
            "  iopd node drain ID\n"
            "`iopd COMMAND -h` shows a command's options."
        ),
    )
    parser.add_argument("--version", action="version", version=f"iopd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=False)
    parser.set_defaults(func=functools.partial(_print_help, parser))

    p = sub.add_parser(
        "edge",
        help="run the edge daemon (OpenAI API, wire listener, admin API)",
        description=(
            "Run the edge: the OpenAI API on openai.listen, the node wire on edge.node_listen "
            "and the loopback admin API (/status, /refresh, /metrics) on edge.admin_listen. "
            "SIGHUP re-reads and applies the config file (like `iopd refresh`); SIGTERM or "
            "SIGINT drains: stop accepting, let requests finish within edge.drain_timeout, "
            "end the rest with an error, exit 0. A second signal exits at once. "
            "Logs go to stdout, one line per request."
        ),
    )
    p.add_argument("--config", required=True, metavar="PATH", help="edge config YAML")
    p.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default=None,
        help="override edge.log_level from the config",
    )
    p.set_defaults(func=_cmd_edge)

    p = sub.add_parser(
        "node",
        help="run the node daemon (dials the edge, runs providers)",
        description=(
            "Run a node: dial node.edge (or every one of node.edges), prove node.id with "
            "node.token (SCRAM: the token never crosses the wire), receive the provider "
            "set from the edge, run requests and report provider health; reconnect with "
            "backoff after a loss. SIGTERM or SIGINT drains within node.drain_timeout, then "
            "exits 0; a second signal exits at once. (`iopd node drain ID` drains a node's "
            "providers on a running edge instead.)"
        ),
    )
    # Not required by argparse: ``iopd node drain ID`` has no config (_cmd_node checks it).
    p.add_argument("--config", metavar="PATH", help="node config YAML (required)")
    p.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default=None,
        help="override node.log_level from the config",
    )
    p.set_defaults(func=_cmd_node)
    node_parser = p

    p = sub.add_parser(
        "demo",
        help="edge + one node + the built-in echo provider in one process",
        description=(
            "A local demo over the real wire on loopback: model 'echo' answers with the last "
            "user message, word by word. Prints the OpenAI base URL, the admin API URL and a "
            "curl example. Ctrl-C stops it."
        ),
    )
    p.add_argument(
        "--port", type=_port, default=8080, help="OpenAI listener port (default 8080; 0 = any free)"
    )
    p.add_argument(
        "--admin-port",
        type=_port,
        default=7071,
        help="admin API port, /status and /metrics (default 7071; 0 = any free)",
    )
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_command", metavar="SUBCOMMAND", required=False)
    p.set_defaults(func=functools.partial(_print_help, p))
    c = csub.add_parser(
        "check", help="validate an edge or node config; exit 1 listing every problem"
    )
    c.add_argument("path", metavar="PATH", help="config YAML (edge or node, detected)")
    c.set_defaults(func=_cmd_config_check)

    admin_token_note = (
        "The admin API is the first of --admin URL, $IOP_ADMIN_URL, edge.admin_listen of the "
        "edge config given with --config (or /etc/iopd/edge.yaml when it can be read) and "
        f"{DEFAULT_ADMIN}. When the environment variable IOP_ADMIN_TOKEN is set, its value is "
        "sent as the admin API's bearer token (needed when the edge sets "
        "edge.admin_token_hash_sha256); it is never printed."
    )
    p = sub.add_parser(
        "status",
        help="show the provider catalog of a running edge",
        description="Show the provider catalog of a running edge. " + admin_token_note,
    )
    _add_admin_options(p, json_help="print the raw /status JSON")
    p.add_argument(
        "--principals",
        action="store_true",
        help="show per principal: requests in flight and queued, and what is left of each limit",
    )
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser(
        "refresh",
        help="dry-run or apply the running edge's config file",
        description="Dry-run or apply the running edge's config file. " + admin_token_note,
    )
    _add_admin_options(p, json_help=None, with_json=False)
    p.add_argument(
        "--dry-run", action="store_true", help="only classify and report; change nothing"
    )
    p.set_defaults(func=_cmd_refresh)

    p = sub.add_parser(
        "restart",
        help="restart the running edge with nothing refused (a new process takes its sockets)",
        description=(
            "Restart the running edge without refusing a request: a new `iopd edge` process "
            "(new code, the config file read again) takes over the listening sockets and the "
            "nodes, then the old one drains and exits.  If the new process fails, the old one "
            "goes on serving.  The same as SIGUSR2.  " + admin_token_note
        ),
    )
    _add_admin_options(p, json_help=None, with_json=False)
    p.set_defaults(func=_cmd_restart)

    _add_control_parsers(sub, node_parser, admin_token_note)

    p = sub.add_parser(
        "token",
        help="print a new random token, its SHA-256 and its node verifier for the config",
        description=(
            "Print a new random token, its SHA-256 (token_hash_sha256: principals, the admin "
            "API, the legacy node form) and a SCRAM-SHA-256 verifier (nodes[].token_verifier, "
            "fresh salt each run: one per edge)."
        ),
    )
    p.add_argument(
        "--token-env",
        metavar="NAME",
        help="use the token in environment variable NAME instead of a new one (not printed)",
    )
    p.set_defaults(func=_cmd_token)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one sub-command; its exit status.

    A start-up failure of a daemon is one line on stderr, ``iopd <command>:
    <what> <address or path>: <reason>``, and exit status 1 (never a traceback).
    """
    from iopd.startup import StartupError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except StartupError as exc:
        print(f"iopd {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
