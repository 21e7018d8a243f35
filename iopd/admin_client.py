"""``iopd status``, ``iopd refresh``, ``iopd provider …`` and ``iopd node drain``:
small clients of the edge's admin API.

Plain ``http.client`` (stdlib, blocking) — a CLI talking to loopback needs no
event loop.  When ``IOP_ADMIN_TOKEN`` is set, its value is sent as the bearer
token (an edge with ``edge.admin_token_hash_sha256`` asks for it).

Where the admin API is (``find_admin``), first match wins: ``--admin URL``,
then ``$IOP_ADMIN_URL``, then ``edge.admin_listen`` of the edge config given
with ``--config`` (or of ``/etc/iopd/edge.yaml``, the shipped units' file, when
it can be read), then ``http://127.0.0.1:7071``.  The config is read as plain
YAML for that one key: the rest of it (and its ``${NAME}`` references, which
the operator's shell may not have) is not validated here.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias
from urllib.parse import quote, urlsplit

import yaml

from iopd.json_types import JSONValue

#: An admin API answer, read by key as the formatters expect it: an answer of
#: another shape raises one of ``_ANSWER_ERRORS`` on the way, reported as "did
#: not answer like the admin API" (so no reader narrows each value first).
AdminDoc: TypeAlias = dict[str, Any]  # Any: read by key, a wrong shape is caught


class AdminError(Exception):
    """The admin API could not be reached or answered badly."""


#: The environment variable holding the admin API's bearer token.
TOKEN_ENV = "IOP_ADMIN_TOKEN"
#: The environment variable naming the admin API (``http://127.0.0.1:7071`` or ``host:port``).
URL_ENV = "IOP_ADMIN_URL"
#: Where nothing else names the admin API: a default edge's (and ``iopd demo``'s).
DEFAULT_ADMIN = "http://127.0.0.1:7071"
#: The edge config the shipped systemd unit runs; read when no ``--config`` is given.
SYSTEM_CONFIG = "/etc/iopd/edge.yaml"
#: What the operator can do when the admin API is not where it was looked for.
WHERE_HINT = f"--config EDGE_CONFIG, --admin URL or {URL_ENV}"


@dataclass(frozen=True)
class AdminTarget:
    """The admin API's URL and what named it (for the messages)."""

    url: str
    source: str  # "--admin", "$IOP_ADMIN_URL", "edge.admin_listen in PATH", "the default"
    #: What to try when nothing answers there.
    hint: str


def _admin_listen(path: str) -> str:
    """``edge.admin_listen`` of the edge config at ``path``, as a URL; ``AdminError`` if none."""
    from iopd.config.addresses import parse_host_port

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise AdminError(f"cannot read config {path}: {why[:1].lower()}{why[1:]}") from None
    try:
        doc = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError, ValueError, TypeError):
        raise AdminError(
            f"config {path} is not valid YAML (`iopd config check {path}` says where)"
        ) from None
    edge = doc.get("edge") if isinstance(doc, dict) else None
    if isinstance(doc, dict) and edge is None and "node" in doc:
        raise AdminError(
            f"{path} is a node config: give the edge's config (its edge.admin_listen "
            "names the admin API)"
        )
    listen = edge.get("admin_listen") if isinstance(edge, dict) else None
    if not isinstance(listen, str) or not listen:
        raise AdminError(f"{path} has no edge.admin_listen: give the edge's config or --admin URL")
    if "${" in listen:
        raise AdminError(
            f"edge.admin_listen in {path} is an environment reference ({listen}): "
            f"give --admin URL or set {URL_ENV}"
        )
    try:
        host, port = parse_host_port(listen)
    except ValueError as exc:
        raise AdminError(f"edge.admin_listen in {path}: {exc}") from None
    if port == 0:
        raise AdminError(
            f"edge.admin_listen in {path} is port 0 (any free port): give --admin URL or set "
            f"{URL_ENV} to the port the edge logged (event=edge_started admin=...)"
        )
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def find_admin(
    flag: str | None,
    config: str | None,
    env: Mapping[str, str] | None = None,
    *,
    system_config: str = SYSTEM_CONFIG,
) -> AdminTarget:
    """Where the admin API is: ``--admin``, ``$IOP_ADMIN_URL``, the config's
    ``edge.admin_listen``, the default (see the module docstring)."""
    environ = os.environ if env is None else env
    if flag:
        return AdminTarget(
            flag,
            "--admin",
            "is the edge running, and is that its edge.admin_listen? "
            "(--config EDGE_CONFIG reads it from the edge's config)",
        )
    from_env = environ.get(URL_ENV, "").strip()
    if from_env:
        return AdminTarget(
            from_env,
            f"${URL_ENV}",
            f"is the edge running, and is that its edge.admin_listen? (--admin URL wins over "
            f"${URL_ENV}; unset it to use --config EDGE_CONFIG)",
        )
    if config is None and os.access(system_config, os.R_OK):
        config = system_config
    if config is not None:
        return AdminTarget(
            _admin_listen(config),
            f"edge.admin_listen in {config}",
            "is the edge running with that config? (`systemctl status iopd-edge`, or its log)",
        )
    if os.path.exists(system_config):  # there, but this user may not read it
        return AdminTarget(
            DEFAULT_ADMIN,
            "the default",
            f"is the edge running? {system_config} names its admin API but cannot be read by "
            f"this user: run as a member of its group (or with sudo), or give {WHERE_HINT}",
        )
    return AdminTarget(
        DEFAULT_ADMIN,
        "the default",
        f"is the edge running? If its edge.admin_listen is another address, give {WHERE_HINT}",
    )


#: What to do about an answer that is not the admin API's fault.
_HINTS = {
    401: (
        f"the edge wants the admin token (edge.admin_token_hash_sha256): set {TOKEN_ENV} "
        "to the token whose SHA-256 is configured there"
    ),
    421: (
        "the edge refused the Host of this request: the admin API answers only "
        "localhost, 127.0.0.1 or [::1]; use --admin http://127.0.0.1:PORT"
    ),
}


def _target(admin: AdminTarget | str) -> AdminTarget:
    """``admin`` as a target: a bare URL is one the caller named (as ``--admin``)."""
    return admin if isinstance(admin, AdminTarget) else find_admin(admin, None)


def _url(admin: AdminTarget | str) -> str:
    return admin.url if isinstance(admin, AdminTarget) else admin


def _call(
    admin: AdminTarget | str,
    method: str,
    path: str,
    body: Mapping[str, object] | None = None,
    *,
    timeout: float = 30,
) -> JSONValue:
    target = _target(admin)
    where = target.url
    bad_url = AdminError(
        f"admin URL must look like http://127.0.0.1:7071, got {where!r} (from {target.source})"
    )
    try:
        url = urlsplit(where if "://" in where else f"http://{where}")
        port = url.port or 80
    except ValueError:  # a port that is not a number or out of range
        raise bad_url from None
    if url.scheme != "http" or not url.hostname:
        raise bad_url
    conn = http.client.HTTPConnection(url.hostname, port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"content-type": "application/json"} if data is not None else {}
        token = os.environ.get(TOKEN_ENV, "").strip()
        if token:
            headers["authorization"] = f"Bearer {token}"
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        why = why[:1].lower() + why[1:]
        raise AdminError(
            f"cannot reach the admin API at {where} ({target.source}): {why}; {target.hint}"
        ) from None
    except http.client.HTTPException as exc:  # something answered, but not HTTP
        raise AdminError(
            f"{where} did not answer like the admin API: {type(exc).__name__}"
        ) from None
    finally:
        conn.close()
    if resp.status in _HINTS:
        detail = " (a wrong token)" if resp.status == 401 and os.environ.get(TOKEN_ENV) else ""
        raise AdminError(f"admin API answered {resp.status}{detail}: {_HINTS[resp.status]}")
    try:
        doc: JSONValue = json.loads(raw)
    except ValueError:
        raise AdminError(f"admin API answered {resp.status} with a non-JSON body") from None
    if resp.status != 200:
        error = doc.get("error") if isinstance(doc, dict) else None
        msg = error.get("message") if isinstance(error, dict) else None
        raise AdminError(f"admin API answered {resp.status}: {msg or raw[:200]!r}")
    return doc


#: Longest last error shown in the table (the JSON has it whole).
LAST_ERROR_WIDTH = 120


def _health_cell(p: AdminDoc) -> str:
    """``ejected`` carries when it ends (``ejected_until``, local time); an older
    edge's rows have no such key."""
    until = p.get("ejected_until")
    if p["health"] == "ejected" and isinstance(until, int | float):
        return "ejected until " + time.strftime("%H:%M:%S", time.localtime(until))
    return str(p["health"])


def _override_cell(override: object) -> str:
    """``cap=5 prio=2`` for the runtime overrides set, ``-`` for none (or an older edge)."""
    if not isinstance(override, dict):
        return "-"
    names = {"capacity": "cap", "priority": "prio"}
    cells = [f"{names[k]}={override[k]}" for k in names if override.get(k) is not None]
    return " ".join(cells) or "-"


def _index_cells(routing: object, provider_id: str) -> list[str]:
    """A provider's prefix index size (blocks) and hit rate from ``/status`` ``routing``;
    ``-`` for an older edge (no such key), the rate ``-`` until a lookup counted it."""
    rows = routing.get("providers") if isinstance(routing, dict) else None
    row = rows.get(provider_id) if isinstance(rows, dict) else None
    if not isinstance(row, dict):
        return ["-", "-"]
    rate = f"{row['hit_rate']:.2f}" if row.get("lookups") else "-"
    return [str(row["index_blocks"]), rate]


def _one_line(text: str, limit: int = LAST_ERROR_WIDTH) -> str:
    """``text`` with all whitespace runs as one space, cut to ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _table(
    rows: list[list[str]], mins: list[int], right: frozenset[int], last_sep: str = "  "
) -> list[str]:
    """Rows of ``len(mins) + 1`` cells: columns padded to the widest cell (at least
    ``mins``, right-aligned where in ``right``); the last cell is not padded."""
    widths = [max([mins[i], *(len(r[i]) for r in rows)]) for i in range(len(mins))]
    out = []
    for r in rows:
        cells = [
            r[i].rjust(widths[i]) if i in right else r[i].ljust(widths[i]) for i in range(len(mins))
        ]
        out.append(" ".join(cells) + last_sep + r[-1])
    return [line.rstrip() for line in out]


def format_status(doc: AdminDoc) -> str:
    """The provider catalog as a table (plus nodes, model groups and queue).

    Each provider has its prefix index size and hit rate (``routing``), each
    model group its routing policy; an older edge's document lacks them (``-``).

    Columns widen to the longest id so rows stay aligned; a last error is
    flattened to one line and shortened (``--json`` has it whole).
    """
    lines = [f"edge {doc.get('edge_id', '?')}", ""]
    node_rows = [["NODE", "ALIAS", "CONNECTED", "PROVIDERS"]]
    for n in doc.get("nodes", []):
        node_rows.append(
            [
                n["id"],
                n.get("alias") or "-",
                "yes" if n["connected"] else "no",
                ",".join(n.get("providers", [])) or "-",
            ]
        )
    lines += _table(node_rows, [14, 14, 10], frozenset(), last_sep=" ")
    lines.append("")
    provider_rows = [
        [
            "NODE",
            "PROVIDER",
            "TYPE",
            "CATEGORY",
            "ENABLED",
            "STATE",
            "HEALTH",
            "IN_FLIGHT",
            "LOAD",
            "QUEUED",
            "LONG",
            "OVERRIDE",
            "INDEX",
            "HIT_RATE",
            "MODELS / LAST ERROR",
        ]
    ]
    for p in doc.get("providers", []):
        models = ",".join(p.get("models", [])) or "-"
        err = _one_line(p.get("last_error") or "")
        provider_rows.append(
            [
                p["node_id"],
                p["id"],
                p["type"],
                p["category"],
                "yes" if p["enabled"] else "no",
                p.get("state", "-"),
                _health_cell(p),
                f"{p['in_flight']}/{p['capacity']}",
                f"{p['load_ratio']:.2f}",
                str(p["queued"]),
                f"{p['long_in_flight']}/{p['long_context_capacity']}",
                _override_cell(p.get("override")),
                *_index_cells(doc.get("routing"), p["id"]),
                models + (f"  ! {err}" if err else ""),
            ]
        )
    lines += _table(
        provider_rows,
        [14, 16, 7, 16, 8, 8, 10, 9, 6, 6, 7, 8, 6, 8],
        frozenset({7, 8, 9, 10, 12, 13}),
    )
    groups = doc.get("models")
    if groups is not None:  # an older edge's /status has no model groups
        lines.append("")
        model_rows = [["MODEL", "SOURCE", "ROUTING", "PROVIDERS (provider=served model)"]]
        for m in groups:
            served = " ".join(f"{p['provider']}={p['served']}" for p in m.get("providers", []))
            model_rows.append([m["id"], m.get("source", "-"), m.get("routing", "-"), served or "-"])
        lines += _table(model_rows, [14, 8, 10], frozenset())
    q = doc.get("queue", {})
    lines.append("")
    lines.append(f"queue depth {q.get('depth', 0)} / max {q.get('max_queue', 0)}")
    return "\n".join(lines)


def _window(w: AdminDoc) -> str:
    """One limit window as ``used/limit (reset)``; ``-`` when unlimited (usage still counts)."""
    if not w.get("limit"):
        return f"{w.get('used', 0)}/-"
    return f"{w['used']}/{w['limit']} ({w.get('reset_s', 0):g}s)"


def format_principals(doc: AdminDoc) -> str:
    """Per principal: requests in flight and queued, and each window's use.

    ``REMAINING`` columns are what is left of each limit; windows read
    ``used/limit (seconds until empty)``.
    """
    rows = [
        [
            "PRINCIPAL",
            "IN_FLIGHT",
            "QUEUED",
            "SHARE",
            "REQ/MIN LEFT",
            "TOK/MIN LEFT",
            "TOK/DAY LEFT",
            "REQ/MIN  TOK/MIN  TOK/DAY (used/limit)",
        ]
    ]
    for p in doc.get("principals", []):
        windows = [p["requests_per_minute"], p["tokens_per_minute"], p["tokens_per_day"]]
        cap = p.get("max_concurrent", 0)
        rows.append(
            [
                p["principal_ref"],
                f"{p['in_flight']}/{cap}" if cap else str(p["in_flight"]),
                str(p["queued"]),
                str(p.get("share", 1)),
                *("-" if w.get("remaining") is None else str(w["remaining"]) for w in windows),
                "  ".join(_window(w) for w in windows),
            ]
        )
    if len(rows) == 1:
        return "no principal is configured or active"
    return "\n".join(_table(rows, [14, 9, 6, 5, 12, 12, 12], frozenset({1, 2, 3, 4, 5, 6})))


def format_report(doc: AdminDoc) -> str:
    """A refresh report: one line per list of ids or paths, one line per error.

    Errors get a line each because their reasons may contain commas.
    """
    lines = [f"mode: {doc['mode']}   applied: {'yes' if doc['applied'] else 'no'}"]
    for key in ("changed_nodes", "changed_providers", "changed_models", "restart_required"):
        items = doc.get(key, [])
        lines.append(f"{key}: {', '.join(items) if items else '-'}")
    errors = doc.get("errors", [])
    if not errors:
        lines.append("errors: -")
    elif len(errors) == 1:
        lines.append(f"errors: {errors[0]}")
    else:
        lines.append(f"errors: {len(errors)}")
        lines += [f"  {e}" for e in errors]
    return "\n".join(lines)


STATUS_KEYS = frozenset({"edge_id", "nodes", "providers", "queue"})
REPORT_KEYS = frozenset({"mode", "applied", "restart_required", "errors"})


def _expect(doc: JSONValue, keys: frozenset[str], admin: AdminTarget | str) -> AdminDoc:
    """``doc`` if it is an object with ``keys``; else the admin URL points elsewhere."""
    if not isinstance(doc, dict) or not keys <= doc.keys():
        raise AdminError(f"{_url(admin)} did not answer like the admin API")
    return doc


#: What reading an answer raises when the admin API could not say: its own error,
#: or (from ``_expect`` and the formatters) an answer not shaped like the admin API's.
_ANSWER_ERRORS = (AdminError, KeyError, TypeError, ValueError, AttributeError)


def _failed(command: str, admin: AdminTarget | str, exc: Exception) -> int:
    """Print on stderr why ``iopd COMMAND`` has no answer; its exit status (1)."""
    why = (
        str(exc)
        if isinstance(exc, AdminError)
        else f"{_url(admin)} did not answer like the admin API"
    )
    print(f"iopd {command}: {why}", file=sys.stderr)
    return 1


def status_main(
    admin: AdminTarget | str, *, as_json: bool = False, principals: bool = False
) -> int:
    """``iopd status``: print the catalog (``principals``: the per-principal
    limits instead); exit 1 when the admin API cannot say."""
    try:
        doc = _expect(_call(admin, "GET", "/status"), STATUS_KEYS, admin)
        if principals:
            if "principals" not in doc:
                raise AdminError(f"{_url(admin)} is an edge without per-principal limits (older)")
            shown: JSONValue = doc["principals"]
            text = json.dumps(shown, indent=2) if as_json else format_principals(doc)
        else:
            text = json.dumps(doc, indent=2) if as_json else format_status(doc)
    except _ANSWER_ERRORS as exc:
        return _failed("status", admin, exc)
    print(text)
    return 0


def refresh_main(admin: AdminTarget | str, *, dry_run: bool = False) -> int:
    """``iopd refresh``: print the report; exit 0 only when it is clean.

    Exit 1 when the apply is (or, dry run, would be) refused, and also when it
    was applied but the report has ``errors`` (a changed node rejected or did
    not acknowledge its config push): any error line means exit 1.
    """
    mode = "dry_run" if dry_run else "apply"
    try:
        doc = _expect(_call(admin, "POST", "/refresh", {"mode": mode}), REPORT_KEYS, admin)
        text = format_report(doc)
    except _ANSWER_ERRORS as exc:
        return _failed("refresh", admin, exc)
    print(text)
    refused = bool(doc.get("errors") or doc.get("restart_required"))
    if dry_run:
        return 1 if refused else 0
    return 0 if doc.get("applied") and not doc.get("errors") else 1


#: How long ``iopd restart`` waits for the new process (it is given 60 s to be ready).
RESTART_TIMEOUT = 90.0


def restart_main(admin: AdminTarget | str) -> int:
    """``iopd restart``: the edge hands its sockets to a new process and drains.

    Exit 0 once the new process took over (its pid printed); 1 when it did
    not, with the reason (the old edge goes on serving).
    """
    try:
        doc = _call(admin, "POST", "/restart", timeout=RESTART_TIMEOUT)
        if not isinstance(doc, dict) or doc.get("outcome") != "handed_over":
            raise AdminError(f"{_url(admin)} did not answer like the admin API")
    except _ANSWER_ERRORS as exc:
        return _failed("restart", admin, exc)
    print(
        f"restarted: the new edge process (pid {doc.get('successor_pid')}) serves; "
        "the old one drains its open connections and exits"
    )
    return 0


#: ``iopd provider ACTION``: the admin route (after ``/providers/{id}/``) and its body.
PROVIDER_ACTIONS: dict[str, tuple[str, dict[str, str]]] = {
    "drain": ("state", {"state": "draining"}),
    "disable": ("state", {"state": "disabled"}),
    "enable": ("state", {"state": "active"}),
    "reset": ("reset", {}),
}
CONTROL_KEYS = frozenset({"id", "node_id", "state", "capacity", "priority", "override"})
NODE_KEYS = frozenset({"id", "providers"})


def format_control(view: AdminDoc) -> str:
    """One provider after a control: state, in flight, effective values, overrides."""
    override = view["override"]

    def value(key: str) -> str:
        raw = override.get(key)
        return f"{view[key]} (override)" if raw is not None else f"{view[key]}"

    return (
        f"{view['id']} on {view['node_id']}: {view['state']}, "
        f"in flight {view.get('in_flight', 0)}, capacity {value('capacity')}, "
        f"priority {value('priority')}"
    )


def _control(
    admin: AdminTarget | str, command: str, path: str, body: Mapping[str, object], as_json: bool
) -> int:
    """POST one runtime control; print the provider(s) it left; exit 1 on any error."""
    try:
        doc = _call(admin, "POST", path, body)
        if command == "node drain":
            node = _expect(doc, NODE_KEYS, admin)
            views = [_expect(v, CONTROL_KEYS, admin) for v in node["providers"]]
            empty = f"node {node['id']} has no providers"
        else:
            views = [_expect(doc, CONTROL_KEYS, admin)]
            empty = ""
        text = json.dumps(doc, indent=2) if as_json else "\n".join(map(format_control, views))
    except _ANSWER_ERRORS as exc:
        return _failed(command, admin, exc)
    print(text or empty)
    return 0


def provider_main(
    admin: AdminTarget | str, action: str, provider_id: str, *, as_json: bool = False
) -> int:
    """``iopd provider drain|disable|enable|reset ID``."""
    route, body = PROVIDER_ACTIONS[action]
    path = f"/providers/{quote(provider_id, safe='')}/{route}"
    return _control(admin, "provider " + action, path, body, as_json)


def provider_set_main(
    admin: AdminTarget | str,
    provider_id: str,
    overrides: dict[str, int | None],
    *,
    as_json: bool = False,
) -> int:
    """``iopd provider set ID [--capacity N|none] [--priority N|none]``: only the
    options given change (``none`` clears that override)."""
    path = f"/providers/{quote(provider_id, safe='')}/override"
    return _control(admin, "provider set", path, overrides, as_json)


def node_drain_main(admin: AdminTarget | str, node_id: str, *, as_json: bool = False) -> int:
    """``iopd node drain ID``: every provider of the node drains."""
    path = f"/nodes/{quote(node_id, safe='')}/drain"
    return _control(admin, "node drain", path, {}, as_json)
