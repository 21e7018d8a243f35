"""Load edge and node configs from YAML: ``${NAME}`` substitution, every error at its path.

Why this is more than ``msgspec.convert(yaml.safe_load(text), EdgeConfig)``:
msgspec stops at the first problem, and an operator fixing a config wants the
whole list at once.  So the YAML data is walked against the Struct
definitions (``msgspec.inspect``) first; each unknown key, missing key, wrong
type or bad enum value becomes one ``ConfigProblem`` (YAML path, reason).  A
bad value is replaced by its default (or a typed placeholder) so the semantic
rules of ``rules/`` can still run over the rest; semantic problems at or
under a path that already failed the walk are dropped as noise.  Only a
config with no problem at all is turned into Structs.  The problems become
the ``YAML.PATH: reason`` lines of ``ConfigError`` in one place,
``_config_error``.

Environment substitution happens during the same walk, only in string
positions the schema knows (unknown keys are never expanded), so a recursive
YAML alias or a huge unknown subtree cannot make the walk run away.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

import msgspec
import msgspec.inspect as mi
import yaml

from iopd.config.problems import ConfigProblem, join_key
from iopd.config.rules import validate_edge_config, validate_node_config
from iopd.config.schema import EdgeConfig, NodeConfigFile

__all__ = [
    "ConfigError",
    "ConfigUnreadable",
    "load_any_config",
    "load_edge_config",
    "load_node_config",
    "parse_edge_config",
    "parse_node_config",
]

#: The path used for problems of the document as a whole (syntax, top level).
DOCUMENT_PATH = "(document)"
#: The path used when the file itself cannot be read.
FILE_PATH = "(file)"
#: At most this many errors are reported; the rest are summarised.
MAX_ERRORS = 200

_REF = re.compile(r"\$\{([^}]*)\}")
_REF_BODY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?$", re.DOTALL)
_TYPE_DEPENDENT = ("base_url", "command")

T = TypeVar("T", EdgeConfig, NodeConfigFile)


class ConfigError(Exception):
    """A config could not be loaded; ``errors`` lists every problem as ``YAML.PATH: reason``."""

    def __init__(self, errors: list[str], *, source: str = "<config>") -> None:
        self.errors = list(errors)
        self.source = source
        n = len(self.errors)
        lines = "\n".join(f"  {e}" for e in self.errors)
        super().__init__(f"{source}: {n} config error{'s' if n != 1 else ''}\n{lines}")


class ConfigUnreadable(ConfigError):
    """The config file itself could not be read: ``path`` and the ``reason`` (one problem)."""

    def __init__(self, path: str, reason: str, line: str) -> None:
        super().__init__([line], source=path)
        self.path = path
        self.reason = reason


# ------------------------------------------------------------------ messages


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "mapping"
    return type(value).__name__


def _describe(t: mi.Type) -> str:
    """A short human name of a schema type, for 'expected ...' messages."""
    if isinstance(t, mi.StrType):
        return "a string"
    if isinstance(t, mi.BoolType):
        return "a boolean (true/false)"
    if isinstance(t, mi.IntType):
        return "an integer"
    if isinstance(t, mi.FloatType):
        return "a number"
    if isinstance(t, mi.NoneType):
        return "null"
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(repr(v) for v in t.values)
    if isinstance(t, mi.ListType):
        return "a list"
    if isinstance(t, mi.DictType | mi.StructType):
        return "a mapping"
    if isinstance(t, mi.UnionType):
        return " or ".join(_describe(x) for x in t.types)
    return "a value"


# ------------------------------------------------------------------ walk


class _Walk:
    """State of one schema walk: environment, collected problems, failed paths."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.problems: list[ConfigProblem] = []
        self.failed: list[str] = []

    def error(self, path: str, reason: str) -> None:
        self.problems.append(ConfigProblem(path or DOCUMENT_PATH, reason))
        self.failed.append(path)

    # -- ${NAME} substitution

    def substitute(self, text: str, path: str) -> tuple[str | None, bool]:
        """Expand ``${NAME}``/``${NAME:-default}``; returns (result or None on error, had_ref)."""
        if "${" not in text:
            return text, False
        ok = True

        def repl(m: re.Match[str]) -> str:
            nonlocal ok
            body = _REF_BODY.match(m.group(1))
            if body is None:
                ok = False
                self.error(
                    path,
                    "malformed environment reference (use ${NAME} or ${NAME:-default})",
                )
                return ""
            name, default = body.group(1), body.group(2)
            if name in self.env:
                return self.env[name]
            if default is not None:
                return default
            ok = False
            self.error(path, f"environment variable {name} is not set and has no default")
            return ""

        result = _REF.sub(repl, text)
        if ok and "${" in _REF.sub("", text):
            self.error(path, "unterminated environment reference '${' (missing '}')")
            ok = False
        return (result if ok else None), True

    # -- type checks

    def check(self, value: object, t: mi.Type, path: str) -> tuple[bool, object]:
        """Check ``value`` against ``t``; returns (ok, repaired value).

        A string is expanded here, once: its result is never expanded again.
        """
        if isinstance(value, str) and "${" in value:
            expanded, had_ref = self.substitute(value, path)
            if expanded is None:
                return False, _placeholder(t)
            if _wants_scalar_from_str(t):
                # ``capacity: ${CAP:-4}``: the text becomes a YAML scalar.
                try:
                    value = yaml.safe_load(expanded) if expanded.strip() else None
                except (yaml.YAMLError, RecursionError, ValueError):
                    value = expanded
            elif had_ref and expanded == "" and _allows_none(t):
                return True, None  # ${NAME:-} means "not set"
            else:
                value = expanded
        return self._check(value, t, path)

    def _check(self, value: object, t: mi.Type, path: str) -> tuple[bool, object]:
        if isinstance(t, mi.AnyType):
            return True, value
        if isinstance(t, mi.StructType):
            return self.check_struct(value, t, path)
        if isinstance(t, mi.UnionType):
            return self._check_union(value, t, path)
        if isinstance(t, mi.StrType):
            if not isinstance(value, str):
                return self._wrong(value, t, path)
            return True, value
        if isinstance(t, mi.LiteralType):
            if isinstance(value, str | int) and not isinstance(value, bool) and value in t.values:
                return True, value
            shown = repr(value)[:60] if isinstance(value, str | int | float) else _type_name(value)
            self.error(path, f"must be {_describe(t)} (got {shown})")
            return False, t.values[0]
        if isinstance(t, mi.BoolType):
            if isinstance(value, bool):
                return True, value
            return self._wrong(value, t, path)
        if isinstance(t, mi.IntType):
            if isinstance(value, int) and not isinstance(value, bool):
                return True, value
            return self._wrong(value, t, path)
        if isinstance(t, mi.FloatType):
            if isinstance(value, int | float) and not isinstance(value, bool):
                return True, value
            return self._wrong(value, t, path)
        if isinstance(t, mi.NoneType):
            if value is None:
                return True, None
            return self._wrong(value, t, path)
        if isinstance(t, mi.ListType):
            if not isinstance(value, list):
                return self._wrong(value, t, path)
            ok, out = True, []
            for i, item in enumerate(value):
                item_ok, fixed = self.check(item, t.item_type, f"{path}[{i}]")
                ok = ok and item_ok
                out.append(fixed)
            return ok, out
        if isinstance(t, mi.DictType):
            if not isinstance(value, dict):
                return self._wrong(value, t, path)
            ok, out_d = True, {}
            for k, v in value.items():
                if not isinstance(k, str):
                    ok = False
                    self.error(join_key(path, k), f"key must be a string, got {_type_name(k)}")
                    continue
                item_ok, fixed = self.check(v, t.value_type, join_key(path, k))
                ok = ok and item_ok
                out_d[k] = fixed
            return ok, out_d
        self.error(path, "unsupported schema type")  # pragma: no cover - schema bug
        return False, None  # pragma: no cover

    def _check_union(self, value: object, t: mi.UnionType, path: str) -> tuple[bool, object]:
        if value is None:
            if _allows_none(t):
                return True, None
            return self._wrong(value, t, path)
        for member in t.types:
            if isinstance(member, mi.NoneType):
                continue
            if _fits(value, member):
                sub = _Walk(self.env)
                ok, fixed = sub._check(value, member, path)
                if ok:
                    return True, fixed
        return self._wrong(value, t, path)

    def _wrong(self, value: object, t: mi.Type, path: str) -> tuple[bool, object]:
        self.error(path, f"expected {_describe(t)}, got {_type_name(value)}")
        return False, _placeholder(t)

    def check_struct(self, value: object, t: mi.StructType, path: str) -> tuple[bool, object]:
        if not isinstance(value, dict):
            self.error(path, f"expected a mapping, got {_type_name(value)}")
            return False, _placeholder(t)
        fields = {f.encode_name: f for f in t.fields}
        ok = True
        out: dict[str, object] = {}
        # Keys in document order, so errors read top to bottom like the file.
        for key, raw in value.items():
            if not isinstance(key, str) or key not in fields:
                ok = False
                known = ", ".join(sorted(fields))
                self.error(join_key(path, key), f"unknown key (known keys here: {known})")
                continue
            if not self._check_field(fields[key], raw, join_key(path, key), out):
                ok = False
        for name, f in fields.items():
            if f.required and name not in value:
                ok = False
                self.error(join_key(path, name), "required key is missing")
                out[name] = _placeholder(f.type)
        return ok, out

    def _check_field(self, f: mi.Field, raw: object, fpath: str, out: dict[str, object]) -> bool:
        """Check one present struct field; store its (repaired) value in ``out``."""
        name = f.encode_name
        if isinstance(raw, str) and "${" in raw:
            # An optional key whose reference expands to "" is "not set".
            probe = _Walk(self.env)
            expanded, had_ref = probe.substitute(raw, fpath)
            if expanded == "" and had_ref and not probe.problems:
                if f.required:
                    self.error(fpath, "required key is empty after ${...} substitution")
                    out[name] = _placeholder(f.type)
                    return False
                return True
        failed_before = len(self.failed)
        field_ok, fixed = self.check(raw, f.type, fpath)
        if field_ok:
            out[name] = fixed
            return True
        # Keep a container whose problems are all inside it (so the rest of
        # it is still validated); drop a bad value itself (its default applies).
        value_itself_bad = fpath in self.failed[failed_before:]
        if f.required or not value_itself_bad:
            out[name] = fixed
        return False


def _wants_scalar_from_str(t: mi.Type) -> bool:
    """True when a ``${...}`` string in this position must become a number/bool."""
    if isinstance(t, mi.IntType | mi.FloatType | mi.BoolType):
        return True
    if isinstance(t, mi.UnionType):
        members = [x for x in t.types if not isinstance(x, mi.NoneType)]
        return bool(members) and all(
            isinstance(x, mi.IntType | mi.FloatType | mi.BoolType) for x in members
        )
    return False


def _allows_none(t: mi.Type) -> bool:
    return isinstance(t, mi.NoneType) or (
        isinstance(t, mi.UnionType) and any(isinstance(x, mi.NoneType) for x in t.types)
    )


def _fits(value: object, t: mi.Type) -> bool:
    """Cheap pre-check which union member a value is meant for."""
    if isinstance(t, mi.StrType | mi.LiteralType):
        return isinstance(value, str)
    if isinstance(t, mi.BoolType):
        return isinstance(value, bool)
    if isinstance(t, mi.IntType):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(t, mi.FloatType):
        return isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(t, mi.ListType):
        return isinstance(value, list)
    if isinstance(t, mi.DictType | mi.StructType):
        return isinstance(value, dict)
    return True


def _placeholder(t: mi.Type) -> object:
    """A value of type ``t`` standing in for a bad one, so validation can go on."""
    if isinstance(t, mi.StrType):
        return ""
    if isinstance(t, mi.BoolType):
        return False
    if isinstance(t, mi.IntType):
        return 0
    if isinstance(t, mi.FloatType):
        return 0.0
    if isinstance(t, mi.LiteralType):
        return t.values[0]
    if isinstance(t, mi.ListType):
        return []
    if isinstance(t, mi.DictType):
        return {}
    if isinstance(t, mi.StructType):
        return {f.encode_name: _placeholder(f.type) for f in t.fields if f.required}
    if isinstance(t, mi.UnionType):
        if any(isinstance(x, mi.NoneType) for x in t.types):
            return None
        return _placeholder(t.types[0])
    return None


def _under(path: str, failed: str) -> bool:
    if not failed:
        return True
    return path == failed or path.startswith(failed + ".") or path.startswith(failed + "[")


# ------------------------------------------------------------------ public


def _read_yaml(text: str) -> tuple[object, list[ConfigProblem]]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        reason = f"YAML syntax error{where}: {_one_line(str(problem))}"
        return None, [ConfigProblem(DOCUMENT_PATH, reason)]
    except (RecursionError, ValueError, TypeError) as exc:  # pathological input
        reason = f"cannot parse YAML: {_one_line(type(exc).__name__)}"
        return None, [ConfigProblem(DOCUMENT_PATH, reason)]
    return data, []


def _config_error(problems: list[ConfigProblem], source: str) -> ConfigError:
    """The one place problems become the ``YAML.PATH: reason`` lines of a ``ConfigError``."""
    shown = problems[:MAX_ERRORS]
    if len(problems) > MAX_ERRORS:
        extra = len(problems) - MAX_ERRORS
        shown.append(ConfigProblem(DOCUMENT_PATH, f"... and {extra} more errors"))
    return ConfigError([_one_line(p.line()) for p in shown], source=source)


def _not_seen_by_walk(semantic: list[ConfigProblem], walk_failed: list[str]) -> list[ConfigProblem]:
    """The semantic problems not at or under a path the schema walk already rejected."""
    failed = list(walk_failed)
    for f in walk_failed:
        # A provider whose ``type`` was bad is checked as a placeholder type:
        # its type-specific rules would only add noise.
        if f.endswith(".type"):
            failed += [f[: -len("type")] + dep for dep in _TYPE_DEPENDENT]
    return [p for p in semantic if not any(_under(p.path, f) for f in failed)]


@functools.cache
def _schema(cls: type[msgspec.Struct]) -> mi.StructType:
    t = mi.type_info(cls)
    assert isinstance(t, mi.StructType)
    return t


def _build(data: object, cls: type[T], env: Mapping[str, str] | None, source: str) -> T:
    top = "edge" if cls is EdgeConfig else "node"
    if data is None:
        reason = f"the config is empty (expected a mapping with key '{top}')"
        raise _config_error([ConfigProblem(DOCUMENT_PATH, reason)], source)
    if not isinstance(data, dict):
        reason = f"expected a mapping with key '{top}' at the top level, got {_type_name(data)}"
        raise _config_error([ConfigProblem(DOCUMENT_PATH, reason)], source)
    walk = _Walk(os.environ if env is None else env)
    t = _schema(cls)
    ok, repaired = walk.check_struct(data, t, "")
    problems = list(walk.problems)
    try:
        cfg = msgspec.convert(repaired, cls)
    except (msgspec.ValidationError, ValueError, TypeError) as exc:
        # The walk mirrors msgspec's rules; this is a safety net, not a path.
        if ok:
            problems.append(ConfigProblem(DOCUMENT_PATH, _one_line(str(exc))))
        raise _config_error(problems, source) from None
    semantic = (
        validate_edge_config(cfg) if isinstance(cfg, EdgeConfig) else validate_node_config(cfg)
    )
    problems += _not_seen_by_walk(semantic, walk.failed)
    if problems:
        raise _config_error(problems, source)
    return cfg


def parse_edge_config(
    text: str, *, env: Mapping[str, str] | None = None, source: str = "<config>"
) -> EdgeConfig:
    """Parse and validate an edge config from YAML text.

    ``env`` is the environment for ``${NAME}`` substitution (default: ``os.environ``).
    Raises ``ConfigError`` listing every problem.
    """
    data, problems = _read_yaml(text)
    if problems:
        raise _config_error(problems, source)
    return _build(data, EdgeConfig, env, source)


def parse_node_config(
    text: str, *, env: Mapping[str, str] | None = None, source: str = "<config>"
) -> NodeConfigFile:
    """Parse and validate a node config from YAML text (see ``parse_edge_config``)."""
    data, problems = _read_yaml(text)
    if problems:
        raise _config_error(problems, source)
    return _build(data, NodeConfigFile, env, source)


def _read_text(path: str | os.PathLike[str]) -> str:
    source = os.fspath(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        line = f"{FILE_PATH}: cannot read {source}: {reason}"
        raise ConfigUnreadable(source, reason, line) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        reason = f"not UTF-8 text (byte offset {exc.start})"
        raise ConfigUnreadable(source, reason, f"{FILE_PATH}: {source} is {reason}") from None


def load_edge_config(
    path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None
) -> EdgeConfig:
    """Read, parse and validate the edge config file at ``path``."""
    return parse_edge_config(_read_text(path), env=env, source=os.fspath(path))


def load_node_config(
    path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None
) -> NodeConfigFile:
    """Read, parse and validate the node config file at ``path``."""
    return parse_node_config(_read_text(path), env=env, source=os.fspath(path))


def parse_any_config(
    text: str, *, env: Mapping[str, str] | None = None, source: str = "<config>"
) -> EdgeConfig | NodeConfigFile:
    """Parse an edge or node config, told apart by the top-level ``edge:``/``node:`` key."""
    data, problems = _read_yaml(text)
    if problems:
        raise _config_error(problems, source)
    if isinstance(data, dict) and "edge" not in data and "node" in data:
        return _build(data, NodeConfigFile, env, source)
    if isinstance(data, dict) and "edge" not in data:
        reason = "expected a top-level key 'edge' (edge config) or 'node' (node config)"
        raise _config_error([ConfigProblem(DOCUMENT_PATH, reason)], source)
    return _build(data, EdgeConfig, env, source)


def load_any_config(
    path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None
) -> EdgeConfig | NodeConfigFile:
    """Read an edge or node config file, detected by its top-level ``edge:``/``node:`` key."""
    return parse_any_config(_read_text(path), env=env, source=os.fspath(path))
