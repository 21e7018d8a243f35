"""The shapes of the node's consent keys: ``node.allowed_commands`` and
``node.allowed_provider_origins`` (what ``iopd.node.consent`` enforces).

Checked at load so the node never starts with an entry it could not apply:
an argv prefix needs a program, named on ``PATH`` or by an absolute path (a
relative one would resolve against the request's workspace, which the edge
chooses); an origin is ``http(s)://host[:port]`` and nothing more.
"""

from __future__ import annotations

from iopd.config.addresses import provider_origin_problem
from iopd.config.problems import ConfigProblem
from iopd.config.schema import NodeSection

__all__ = ["argv_prefix_problem", "consent_problems"]


def argv_prefix_problem(prefix: list[str]) -> str | None:
    """Why ``prefix`` is no ``node.allowed_commands`` entry (None: it is one)."""
    if not prefix:
        return "must be a non-empty argv prefix, e.g. [ollama, run]"
    program = prefix[0]
    if not program.strip():
        return "the program (the first element) must not be empty"
    if "/" in program and not program.startswith("/"):
        return f"the program {program[:80]!r} must be a name on PATH or an absolute path"
    return None


def consent_problems(node: NodeSection) -> list[ConfigProblem]:
    """Every problem of the node's consent keys, in file order."""
    problems = [
        ConfigProblem(f"node.allowed_commands[{i}]", why)
        for i, prefix in enumerate(node.allowed_commands)
        if (why := argv_prefix_problem(prefix)) is not None
    ]
    problems += [
        ConfigProblem(f"node.allowed_provider_origins[{i}]", why)
        for i, origin in enumerate(node.allowed_provider_origins)
        if (why := provider_origin_problem(origin)) is not None
    ]
    return problems
