"""``/v1/responses`` tools on the normalized path: what a chat-only provider can run.

Pure.  A Responses body's ``tools`` are planned once, when the body is
parsed (:func:`plan_tools`), into a :class:`ToolPlan`:

- ``function`` tools: validated like chat's and reshaped to chat's
  ``{"type": "function", "function": {...}}``;
- ``namespace`` tools (a group of tools under one name, as coding agents
  send their MCP servers' tools): flattened to the function and custom tools
  they hold, each under its own name (under ``<namespace>__<name>`` when that
  name is already taken); a call comes back as a ``function_call`` carrying
  its ``namespace`` and original name;
- ``custom`` tools (freeform input, such as a coding agent's ``apply_patch``):
  a function taking one string argument, ``input`` (its grammar, if any,
  described to the model); a call comes back as a ``custom_tool_call`` item
  with that ``input``, so the agent runs it as it would on OpenAI;
- every other type (``web_search``, ``file_search``, ``computer_use_preview``,
  ``image_generation``, ``code_interpreter``, ``local_shell``, ``mcp``...)
  is a tool the provider cannot run: it is listed in ``unsupported``, and the
  ``openai.unsupported_tools`` policy decides (``drop``: the request runs
  without it and the response names it in ``X-Iopd-Dropped-Tools``;
  ``reject``: a 400 naming the tool).

:func:`tool_choice_plan` reads Responses' ``tool_choice`` the same way.
Everything is linear in the (size-bounded) body.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from iopd.edge.openai.incoming.jsonschema import JSONObject, JSONValue
from iopd.edge.openai.incoming.request_fields import TOOL_NAME
from iopd.errors import InvalidRequest

__all__ = [
    "DROPPED_TOOLS_HEADER",
    "CUSTOM_INPUT",
    "ToolOrigin",
    "ToolPlan",
    "dropped_header",
    "plan_tools",
    "tool_choice_plan",
    "unsupported_refusal",
]

#: Response header naming the tool types dropped from a normalized request.
DROPPED_TOOLS_HEADER = "X-Iopd-Dropped-Tools"
#: The one string argument a custom tool takes as a function.
CUSTOM_INPUT = "input"
#: Longest grammar or description shown to the model for a custom tool.
MAX_CUSTOM_TEXT_CHARS = 8192
_TYPE_CHARS = 40
#: A tool type as the edge names it (in a header, a message, a metric label):
#: anything else a caller sends is named ``unknown``.
_TYPE_LABEL = re.compile(r"[A-Za-z0-9_.-]{1,40}")
#: Most tool types ``X-Iopd-Dropped-Tools`` names (then ``+N more``).
MAX_NAMED_DROPPED = 8


def _type_label(kind: JSONValue) -> str:
    return kind if isinstance(kind, str) and _TYPE_LABEL.fullmatch(kind) else "unknown"


@dataclass(frozen=True, slots=True)
class ToolOrigin:
    """What a flattened function tool was in the caller's request."""

    kind: str  # "function" or "custom"
    name: str  # the caller's name of the tool
    namespace: str | None = None


@dataclass(slots=True)
class ToolPlan:
    """A Responses body's tools as a chat-only provider takes them."""

    #: The function tools in chat's shape (None: the body sent no ``tools``).
    function_tools: list[JSONObject] | None = None
    #: ``(tools index, type)`` of each tool no normalized provider can run.
    unsupported: list[tuple[int, str]] = field(default_factory=list)
    #: Flattened name -> what it was, for the tools that are not plain
    #: top-level functions (custom tools, namespaced tools).
    origins: dict[str, ToolOrigin] = field(default_factory=dict)
    #: ``(namespace, name)`` of a namespaced tool -> its flattened name.
    flat_names: dict[tuple[str, str], str] = field(default_factory=dict)
    #: The first malformed custom or namespace tool's 400 (see :func:`plan_tools`).
    problem: InvalidRequest | None = None

    @property
    def dropped_types(self) -> list[str]:
        """The unsupported tool types, each once, in request order."""
        return list(dict.fromkeys(kind for _, kind in self.unsupported))

    def origin(self, name: str) -> ToolOrigin | None:
        """What the called (flattened) name was, or None for a plain function."""
        return self.origins.get(name)

    def flat_name(self, name: str, namespace: str | None) -> str:
        """The flattened name of an earlier call's tool (``function_call`` input items)."""
        if namespace is None:
            return name
        return self.flat_names.get((namespace, name), name)


def _name(tool: JSONObject, here: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise InvalidRequest(
            f"'{here}.name' must be 1-64 characters of a-z, A-Z, 0-9, _ or -",
            param=f"{here}.name",
        )
    return name


def _opt_str(tool: JSONObject, key: str, here: str) -> str | None:
    value = tool.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"'{here}.{key}' must be a string", param=f"{here}.{key}")
    return value


def _function(tool: JSONObject, here: str, name: str) -> JSONObject:
    """A Responses function tool in chat's shape (``name`` possibly renamed)."""
    function: JSONObject = {"name": name}
    description = _opt_str(tool, "description", here)
    if description is not None:
        function["description"] = description
    parameters = tool.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise InvalidRequest(
                f"'{here}.parameters' must be an object", param=f"{here}.parameters"
            )
        function["parameters"] = parameters
    strict = tool.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(f"'{here}.strict' must be a boolean", param=f"{here}.strict")
    if strict:
        function["strict"] = True
    return {"type": "function", "function": function}


def _custom(tool: JSONObject, here: str, name: str) -> JSONObject:
    """A custom (freeform) tool as a function of one string, ``input``."""
    description = (_opt_str(tool, "description", here) or "")[:MAX_CUSTOM_TEXT_CHARS]
    hint = "The tool's whole input, as free text (not JSON)."
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        syntax = fmt.get("syntax")
        definition = fmt.get("definition")
        if isinstance(definition, str) and definition:
            kind = syntax if isinstance(syntax, str) else "grammar"
            hint += (
                f" It must follow this {str(kind)[:_TYPE_CHARS]} grammar:\n"
                + definition[:MAX_CUSTOM_TEXT_CHARS]
            )
    function: JSONObject = {
        "name": name,
        "parameters": {
            "type": "object",
            "properties": {CUSTOM_INPUT: {"type": "string", "description": hint}},
            "required": [CUSTOM_INPUT],
        },
    }
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


def plan_tools(tools: list[JSONObject] | None) -> ToolPlan:
    """Plan a Responses body's ``tools`` (already an array of objects).

    Raises :class:`~iopd.errors.InvalidRequest` for a malformed function
    tool (on every path, as before there were plans).  A malformed custom or
    namespace tool is the normalized path's concern only (a passthrough
    provider judges its own): it is left out and kept as ``problem``, the
    400 :func:`unsupported_refusal` gives.  An unsupported type is not an
    error here (the policy decides).
    """
    plan = ToolPlan()
    if tools is None:
        return plan
    out: list[JSONObject] = []
    taken: set[str] = set()
    nested: list[tuple[int, str, JSONObject, str]] = []  # (index, namespace, tool, here)
    for i, tool in enumerate(tools):
        here = f"tools[{i}]"
        kind = tool.get("type")
        if kind == "function":
            name = _name(tool, here)
            taken.add(name)
            out.append(_function(tool, here, name))
        elif kind == "custom":
            try:
                name = _name(tool, here)
                out.append(_custom(tool, here, name))
            except InvalidRequest as exc:
                plan.problem = plan.problem or exc
                continue
            taken.add(name)
            plan.origins[name] = ToolOrigin("custom", name)
        elif kind == "namespace":
            try:
                nested += _namespace_tools(i, tool, here)
            except InvalidRequest as exc:
                plan.problem = plan.problem or exc
        else:
            plan.unsupported.append((i, _type_label(kind)))
    # Namespaced tools after the top-level ones: a top-level name keeps its name.
    for index, namespace, sub, where in nested:
        kind = sub.get("type")
        if kind not in ("function", "custom"):
            plan.unsupported.append((index, _type_label(kind)))
            continue
        try:
            name = _name(sub, where)
            flat = name if name not in taken else f"{namespace}__{name}"[:64]
            if flat in taken:
                raise InvalidRequest(
                    f"'{where}.name' {name!r} is given twice in namespace {namespace!r}",
                    param=f"{where}.name",
                )
            made = _function(sub, where, flat) if kind == "function" else _custom(sub, where, flat)
        except InvalidRequest as exc:
            plan.problem = plan.problem or exc
            continue
        taken.add(flat)
        plan.flat_names[(namespace, name)] = flat
        plan.origins[flat] = ToolOrigin(str(kind), name, namespace)
        out.append(made)
    plan.function_tools = out
    return plan


def _namespace_tools(i: int, tool: JSONObject, here: str) -> list[tuple[int, str, JSONObject, str]]:
    """A namespace tool's tools: ``(tools index, namespace, tool, param)`` each."""
    namespace = _name(tool, here)
    inner = tool.get("tools")
    if not isinstance(inner, list):
        raise InvalidRequest(f"'{here}.tools' must be an array", param=f"{here}.tools")
    nested = []
    for j, sub in enumerate(inner):
        where = f"{here}.tools[{j}]"
        if not isinstance(sub, dict):
            raise InvalidRequest(f"'{where}' must be an object", param=where)
        nested.append((i, namespace, sub, where))
    return nested


def dropped_header(kinds: tuple[str, ...] | list[str]) -> tuple[str, str]:
    """``X-Iopd-Dropped-Tools``: the dropped types, at most ``MAX_NAMED_DROPPED``."""
    shown = ", ".join(kinds[:MAX_NAMED_DROPPED])
    if len(kinds) > MAX_NAMED_DROPPED:
        shown += f", +{len(kinds) - MAX_NAMED_DROPPED} more"
    return DROPPED_TOOLS_HEADER, shown


def unsupported_refusal(plan: ToolPlan) -> InvalidRequest | None:
    """The 400 for a request whose tools a normalized provider cannot run, or None."""
    if plan.problem is not None:
        return plan.problem
    if not plan.unsupported:
        return None
    index, kind = plan.unsupported[0]
    return InvalidRequest(
        f"the tool type '{kind}' is not supported on this model's providers (only "
        "function, custom and namespace tools are); use a model with an "
        "OpenAI-compatible provider for it, or ask the operator for "
        "openai.unsupported_tools: drop",
        param=f"tools[{index}].type",
    )


def tool_choice_plan(choice: JSONValue, plan: ToolPlan) -> tuple[str | None, str | None]:
    """Responses' ``tool_choice`` as ``(mode, function name)``.

    ``mode``: ``none``, ``auto`` or ``required`` (None: not sent); a forced
    tool (``{"type": "function" | "custom", "name"}``) gives ``required`` and
    its flattened name.  Anything else is a 400 naming ``tool_choice``.
    """
    if choice is None:
        return None, None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequest(
                "'tool_choice' must be 'none', 'auto', 'required' or a tool object",
                param="tool_choice",
            )
        return choice, None
    if not isinstance(choice, dict):
        raise InvalidRequest("'tool_choice' must be a string or an object", param="tool_choice")
    kind = choice.get("type")
    if kind in ("function", "custom"):
        name = choice.get("name")
        if not isinstance(name, str):
            raise InvalidRequest("'tool_choice.name' must be a string", param="tool_choice.name")
        namespace = choice.get("namespace")
        return "required", plan.flat_name(name, namespace if isinstance(namespace, str) else None)
    if kind == "allowed_tools":
        mode = choice.get("mode")
        return ("required" if mode == "required" else "auto"), None
    # A built-in tool forced (``{"type": "web_search"}``...): it is not run here.
    return "auto", None
