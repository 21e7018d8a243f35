"""The real coding-agent CLIs complete a tool-using task through the edge.

Claude Code (``claude -p``), Codex CLI (``codex exec``) and opencode
(``opencode run``) each run headless in a fresh directory, told only the
edge's base URL, a principal token and the model group (see
``tests/support/agent_clis.py``).  The provider behind the edge is a scripted
upstream (``tests/support/agent_upstream.py``) that answers the agent's first
turn with a call of the agent's own write or shell tool, and the turn carrying
the tool's result with a final text.  A case passes when the file is there
with the content asked for, the agent exited 0 with the final text, the edge
metered every turn the upstream answered ``ok`` with its usage, and (on a
provider that speaks the agent's API, so that the request is relayed as sent)
the agent's session header reached the provider.

The same agents also run against the scripted upstream directly, without the
edge: when a case through the edge fails and its direct twin passes, the edge
is at fault, not the harness.

The CLIs are npm packages outside the repository (``.ci/run`` installs them
when npm is there); a case whose CLI is missing is skipped, saying how to
install it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.support import agent_clis
from tests.support.agent_upstream import (
    FINAL_TEXT,
    INPUT_TOKENS,
    OUTPUT_TOKENS,
    AgentOllamaServer,
    AgentOpenAIServer,
    AgentTask,
)
from tests.support.configs import edge_yaml, model, node, principal_token
from tests.support.gateway import metric, running_gateway, wait_until

TOKEN = "sk-agent-e2e-5b1f"
GROUP = "coder"
SERVED = {"ollama": "coder:latest"}
PROMPT = "Create the file hello.txt in the current directory."

Runner = Callable[..., Awaitable[agent_clis.AgentRun]]
RUNNERS: dict[str, Runner] = {
    "claude": agent_clis.run_claude,
    "codex": agent_clis.run_codex,
    "opencode": agent_clis.run_opencode,
}
#: The header carrying each agent's session id (what cache-aware upstreams key on).
SESSION_HEADERS = {
    "claude": "x-claude-code-session-id",
    "codex": "session-id",
    "opencode": "x-session-id",
}
#: The edge endpoint (metric label) each agent calls, and the API it speaks.
ENDPOINTS = {"claude": "messages", "codex": "responses", "opencode": "chat_completions"}
APIS = {"claude": "messages", "codex": "responses", "opencode": "chat"}
#: Where an OpenAI-compatible upstream serves each API.
API_PATHS = {
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}

#: Providers behind the edge: what the upstream serves, the provider type, extra fields.
#: ``chat``: a passthrough provider speaking only Chat Completions (declared so:
#: ``/v1/responses`` is translated to chat for it); ``responses``: one
#: that also speaks Responses; ``messages``: one that speaks Anthropic Messages natively.
PROVIDERS: dict[str, tuple[tuple[str, ...], str, dict[str, Any]]] = {
    "chat": (("chat",), "openai", {"openai_responses": False}),
    "responses": (("chat", "responses"), "openai", {}),
    "messages": (("chat", "messages"), "openai", {"anthropic_messages": True}),
    "ollama": ((), "ollama", {}),
}

@dataclass(frozen=True)
class Case:
    agent: str
    provider: str  # a key of PROVIDERS
    xfail: str = ""
    options: tuple[tuple[str, Any], ...] = ()  # more keyword arguments of the runner

    @property
    def id(self) -> str:
        return "-".join([self.agent, self.provider, *(k for k, _ in self.options)])


CASES = [
    Case("opencode", "chat"),
    Case("opencode", "ollama"),
    Case("codex", "responses"),
    Case("codex", "chat"),
    Case("codex", "ollama"),
    Case("claude", "messages"),
    Case("claude", "messages", options=(("bearer", True),)),
    Case("claude", "chat"),
    Case("claude", "ollama"),
]
DIRECT = {"claude": ("messages",), "codex": ("responses",), "opencode": ("chat",)}


def _params(cases: list[Case]) -> list[Any]:
    marks = lambda c: [pytest.mark.xfail(reason=c.xfail, strict=False)] if c.xfail else []  # noqa: E731
    return [pytest.param(c, id=c.id, marks=marks(c)) for c in cases]


@pytest.fixture
def cli(request: pytest.FixtureRequest) -> str:
    """The case's agent; the test is skipped, saying how to install it, when its CLI
    is missing (a sync fixture: a skip raised inside a trio test loses its reason)."""
    params = request.node.callspec.params
    agent: str = params["case"].agent if "case" in params else params["agent"]
    if agent_clis.installed(agent) is None:
        pytest.skip(
            f"{agent} is not installed under {agent_clis.cli_dir()} "
            f"(npm install --prefix <that dir> {agent_clis.PACKAGES[agent]})"
        )
    return agent


def _task(agent: str, workdir: Path) -> AgentTask:
    return AgentTask(path=str(workdir / "hello.txt"), content=f"{agent} wrote this through iopd\n")


def _assert_done(run: agent_clis.AgentRun, task: AgentTask, turns: list[str]) -> None:
    assert Path(task.path).is_file(), f"no file; turns {turns}\n{run}"
    assert Path(task.path).read_text() == task.content
    assert run.returncode == 0, str(run)
    assert FINAL_TEXT in run.stdout, str(run)
    assert turns.count("tool") == 1 and turns.count("final") == 1, turns


async def _serve(nursery: trio.Nursery, provider: str, task: AgentTask) -> Any:
    if provider == "ollama":
        upstream = AgentOllamaServer(task)
        upstream.models = [SERVED["ollama"]]
    else:
        upstream = AgentOpenAIServer(task, speaks=PROVIDERS[provider][0])
    return await nursery.start(upstream.serve)


def _edge(provider: str, base_url: str) -> str:
    _, ptype, extra = PROVIDERS[provider]
    served = SERVED.get(provider, "served")
    spec = {"id": "up-1", "type": ptype, "base_url": base_url, "models": [served], **extra}
    return edge_yaml(
        edge_id="edge-agents",
        openai={"principal_tokens": [principal_token(TOKEN)]},
        models=[model(GROUP, {"up-1": served})],
        nodes=[node(providers=[spec])],
    )


def _agent_base_url(agent: str, root: str) -> str:
    """Claude Code takes the root (it appends ``/v1/messages``); the others ``…/v1``."""
    return root if agent == "claude" else f"{root}/v1"


@pytest.mark.parametrize("case", _params(CASES))
async def test_agent_writes_the_file_through_the_edge(case: Case, cli: str, tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    task = _task(case.agent, workdir)
    endpoint = ENDPOINTS[case.agent]
    with trio.fail_after(agent_clis.RUN_TIMEOUT + 20):
        async with trio.open_nursery() as nursery:
            upstream = await _serve(nursery, case.provider, task)
            async with running_gateway(_edge(case.provider, upstream.base_url)) as gw:
                root = gw.base_url.removesuffix("/v1")
                run = await RUNNERS[case.agent](
                    base_url=_agent_base_url(case.agent, root),
                    token=TOKEN,
                    model=GROUP,
                    workdir=workdir,
                    home=tmp_path / "home",
                    prompt=PROMPT,
                    **dict(case.options),
                )
                turns = list(upstream.turns)
                posts = [r for r in upstream.requests if r.method == "POST"]
                with trio.move_on_after(5):  # the last turn's accounting may trail the exit
                    await wait_until(lambda: sum(_statuses(gw, endpoint).values()) >= len(turns))
                statuses = _statuses(gw, endpoint)
                usage = {t: _tokens(gw, endpoint, "ok", t) for t in ("input", "output")}
            nursery.cancel_scope.cancel()
    _assert_done(run, task, turns)
    # Every turn the upstream answered is one ``ok`` request with the upstream's usage.
    assert statuses == {"ok": len(turns)}
    assert usage == {"input": INPUT_TOKENS * len(turns), "output": OUTPUT_TOKENS * len(turns)}
    # The agent's API went to the provider as it is where the provider speaks it
    # (its session header with it), else translated to Chat Completions or Ollama's.
    speaks, ptype, _ = PROVIDERS[case.provider]
    native = ptype == "openai" and APIS[case.agent] in speaks
    want = (
        API_PATHS[APIS[case.agent]]
        if native
        else "/api/chat"
        if ptype == "ollama"
        else API_PATHS["chat"]
    )
    assert {r.path.split("?")[0] for r in posts} == {want}
    if native:
        header = SESSION_HEADERS[case.agent]
        assert [r.path for r in posts if not r.header(header)] == [], header
        names = [[k for k, _ in r.headers] for r in posts]
        assert [sorted({k for k in n if n.count(k) > 1}) for n in names] == [[]] * len(posts)


def _statuses(gw: Any, endpoint: str) -> dict[str, float]:
    """``iop_openai_requests_total`` of ``endpoint`` by status (the ones that moved)."""
    found: dict[str, float] = {}
    for family in gw.runtime.metrics.registry.collect():
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "iop_openai_requests_total" and labels.get("endpoint") == endpoint:
                found[labels["status"]] = found.get(labels["status"], 0.0) + sample.value
    return {status: n for status, n in found.items() if n}


def _tokens(gw: Any, endpoint: str, status: str, token_type: str) -> float:
    return metric(
        gw, "iop_openai_usage_tokens_total", endpoint=endpoint, status=status, token_type=token_type
    )


@pytest.mark.parametrize("agent", sorted(DIRECT))
async def test_agent_writes_the_file_against_the_upstream_directly(
    agent: str, cli: str, tmp_path: Path
) -> None:
    """The harness alone: the agent against the scripted upstream, no edge."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    task = _task(agent, workdir)
    with trio.fail_after(agent_clis.RUN_TIMEOUT + 10):
        async with trio.open_nursery() as nursery:
            upstream = AgentOpenAIServer(task, speaks=DIRECT[agent])
            await nursery.start(upstream.serve)
            run = await RUNNERS[agent](
                base_url=_agent_base_url(agent, upstream.base_url),
                token=TOKEN,
                model="served",
                workdir=workdir,
                home=tmp_path / "home",
                prompt=PROMPT,
            )
            nursery.cancel_scope.cancel()
    _assert_done(run, task, upstream.turns)
