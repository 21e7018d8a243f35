"""docs/configuration.md documents every schema key, with its real default and refresh class.

Notation (see the doc's "Key notation"): dotted paths from the top of the
file, ``[]`` for "every item of this list" — ``nodes[].providers[].kill_grace``.
Each key has a table row whose first cell is the key in backticks.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

from iopd.config.refresh_classify import (
    LIVE_EDGE_KEYS,
    LIVE_NODE_KEYS,
    LIVE_OPENAI_KEYS,
    LIVE_PROVIDER_KEYS,
    LIVE_SECTIONS,
    RESTART_LIMITS_KEYS,
)
from iopd.config.schema import EdgeConfig, NodeConfigFile
from tests.support.paths import ROOT

DOC = (ROOT / "docs" / "configuration.md").read_text()
ROW = re.compile(r"^\| `([a-z_][a-z0-9_.\[\]]*)` \|(.*)\|\s*$")


def schema_keys(t: mi.StructType, prefix: str = "") -> list[tuple[str, mi.Field]]:
    """Every field of ``t``, recursively, in the doc's key notation."""
    out: list[tuple[str, mi.Field]] = []
    for f in t.fields:
        key = f"{prefix}{f.encode_name}"
        out.append((key, f))
        inner: mi.Type = f.type
        if isinstance(inner, mi.UnionType):  # e.g. X | None
            members = [m for m in inner.types if not isinstance(m, mi.NoneType)]
            inner = members[0] if len(members) == 1 else inner
        if isinstance(inner, mi.StructType):
            out += schema_keys(inner, key + ".")
        elif isinstance(inner, mi.ListType) and isinstance(inner.item_type, mi.StructType):
            out += schema_keys(inner.item_type, key + "[].")
    return out


def struct(cls: type[msgspec.Struct]) -> mi.StructType:
    t = mi.type_info(cls)
    assert isinstance(t, mi.StructType)
    return t


EDGE_KEYS = schema_keys(struct(EdgeConfig))
NODE_KEYS = schema_keys(struct(NodeConfigFile))


def rows() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in DOC.splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in out, f"{m.group(1)} documented twice"
            out[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return out


ROWS = rows()


def test_schema_walk_sees_nested_keys() -> None:
    keys = {k for k, _ in EDGE_KEYS} | {k for k, _ in NODE_KEYS}
    for expected in (
        "openai.provider_auth.target_header",
        "nodes[].providers[].kill_grace",
        "openai.principal_tokens[].token_hash_sha256",
        "models[].generation.limits",
        "node.tls.ca",
    ):
        assert expected in keys


@pytest.mark.parametrize("key", [k for k, _ in EDGE_KEYS + NODE_KEYS])
def test_every_schema_key_is_documented(key: str) -> None:
    assert key in ROWS, f"docs/configuration.md has no table row for `{key}`"


def test_every_documented_key_exists() -> None:
    known = {k for k, _ in EDGE_KEYS + NODE_KEYS}
    stale = sorted(set(ROWS) - known)
    assert stale == [], f"documented keys not in the schema: {stale}"


def render_default(f: mi.Field) -> str | None:
    """The default as the doc writes it, or None when the doc describes it in words."""
    if f.required:
        return "*required*"
    if f.default_factory is not msgspec.NODEFAULT:
        value: Any = f.default_factory()
        if isinstance(value, list) and not value:
            return "`[]`"
        if isinstance(value, dict) and not value:
            return "`{}`"
        return None  # sections: "all defaults" / "see below"
    value = f.default
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, int):
        return f"`{value}`"
    if isinstance(value, str):
        if not value:
            return '`""`'
        return f"`{value}`" if len(value) < 40 else None
    return None


@pytest.mark.parametrize(("key", "field"), EDGE_KEYS + NODE_KEYS, ids=lambda x: str(x)[:60])
def test_documented_default_matches_schema(key: str, field: mi.Field) -> None:
    expected = render_default(field)
    if expected is None or key not in ROWS:
        return
    default_cell = ROWS[key][1]
    assert default_cell == expected, f"{key}: doc says {default_cell}, schema {expected}"


def expected_refresh(key: str) -> str:
    if key == "models" or key.startswith("models[]"):
        return "live"
    if key.startswith("limits.") and key.split(".", 1)[1] in RESTART_LIMITS_KEYS:
        return "restart"
    if key.split(".", 1)[0].split("[", 1)[0] in LIVE_SECTIONS:
        return "live"
    if key.startswith("edge.") and key.split(".", 1)[1] in LIVE_EDGE_KEYS:
        return "live"
    if key.startswith("openai.") and key.split(".", 1)[1].split("[", 1)[0] in LIVE_OPENAI_KEYS:
        return "live"
    if key.startswith("nodes[].providers[]."):
        return "live" if key.rsplit(".", 1)[1] in LIVE_PROVIDER_KEYS else "restart"
    if key == "nodes" or (key.startswith("nodes[].") and key.split(".", 1)[1] in LIVE_NODE_KEYS):
        return "live"
    return "restart"


@pytest.mark.parametrize("key", [k for k, _ in EDGE_KEYS])
def test_edge_keys_state_their_refresh_class(key: str) -> None:
    if key not in ROWS:
        pytest.fail(f"{key} undocumented")
    assert ROWS[key][2] == expected_refresh(key), key


def test_env_rules_are_documented() -> None:
    for text in ("${NAME}", "${NAME:-default}", "${NAME:-}", "not set"):
        assert text in DOC
