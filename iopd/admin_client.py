"""``iopd status`` and ``iopd refresh``: small clients of the edge's admin API.

Plain ``http.client`` (stdlib, blocking) — a CLI talking to loopback needs no
event loop.
"""

from __future__ import annotations

import http.client
import json
import sys
from typing import Any
from urllib.parse import urlsplit


class AdminError(Exception):
    """The admin API could not be reached or answered badly."""


def _call(admin: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    url = urlsplit(admin if "://" in admin else f"http://{admin}")
    if url.scheme != "http" or not url.hostname:
        raise AdminError(f"admin URL must look like http://127.0.0.1:7071, got {admin!r}")
    conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=30)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"content-type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
    except OSError as exc:
        raise AdminError(f"cannot reach the admin API at {admin}: {exc}") from None
    finally:
        conn.close()
    try:
        doc = json.loads(raw)
    except ValueError:
        raise AdminError(f"admin API answered {resp.status} with a non-JSON body") from None
    if resp.status != 200:
        msg = doc.get("error", {}).get("message") if isinstance(doc, dict) else None
        raise AdminError(f"admin API answered {resp.status}: {msg or raw[:200]!r}")
    return doc


def format_status(doc: dict[str, Any]) -> str:
    """The provider catalog as a fixed-width table (plus nodes and queue)."""
    lines = [f"edge {doc.get('edge_id', '?')}"]
    lines.append("")
    lines.append(f"{'NODE':<14} {'ALIAS':<14} {'CONNECTED':<10} PROVIDERS")
    for n in doc.get("nodes", []):
        lines.append(
            f"{n['id']:<14} {n.get('alias') or '-':<14} {'yes' if n['connected'] else 'no':<10} "
            f"{','.join(n.get('providers', [])) or '-'}"
        )
    lines.append("")
    header = (
        f"{'NODE':<14} {'PROVIDER':<16} {'TYPE':<7} {'CATEGORY':<16} {'ENABLED':<8} "
        f"{'HEALTH':<10} {'IN_FLIGHT':>9} {'LOAD':>6} {'QUEUED':>6} {'LONG':>7}  MODELS / LAST ERROR"
    )
    lines.append(header)
    for p in doc.get("providers", []):
        long = f"{p['long_in_flight']}/{p['long_context_capacity']}"
        models = ",".join(p.get("models", []))
        err = p.get("last_error") or ""
        lines.append(
            f"{p['node_id']:<14} {p['id']:<16} {p['type']:<7} {p['category']:<16} "
            f"{'yes' if p['enabled'] else 'no':<8} {p['health']:<10} "
            f"{str(p['in_flight']) + '/' + str(p['capacity']):>9} {p['load_ratio']:>6.2f} "
            f"{p['queued']:>6} {long:>7}  {models}" + (f"  ! {err}" if err else "")
        )
    q = doc.get("queue", {})
    lines.append("")
    lines.append(f"queue depth {q.get('depth', 0)} / max {q.get('max_queue', 0)}")
    return "\n".join(lines)


def format_report(doc: dict[str, Any]) -> str:
    lines = [f"mode: {doc['mode']}   applied: {'yes' if doc['applied'] else 'no'}"]
    for key in ("changed_nodes", "changed_providers", "changed_models", "restart_required", "errors"):
        items = doc.get(key, [])
        lines.append(f"{key}: {', '.join(items) if items else '-'}")
    return "\n".join(lines)


def status_main(admin: str, *, as_json: bool = False) -> int:
    try:
        doc = _call(admin, "GET", "/status")
    except AdminError as exc:
        print(f"iopd status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2) if as_json else format_status(doc))
    return 0


def refresh_main(admin: str, *, dry_run: bool = False) -> int:
    mode = "dry_run" if dry_run else "apply"
    try:
        doc = _call(admin, "POST", "/refresh", {"mode": mode})
    except AdminError as exc:
        print(f"iopd refresh: {exc}", file=sys.stderr)
        return 1
    print(format_report(doc))
    refused = bool(doc.get("errors") or doc.get("restart_required"))
    if dry_run:
        return 1 if refused else 0
    return 0 if doc.get("applied") else 1
