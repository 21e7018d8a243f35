"""The real coding-agent CLIs, run headless against a base URL, a token and a model.

The CLIs are npm packages installed outside the repository (``.ci/run`` does
it when npm is there) into ``$IOPD_AGENT_CLIS`` (default
``~/.cache/iopd-agents``)::

    npm install --prefix ~/.cache/iopd-agents \
        @anthropic-ai/claude-code @openai/codex opencode-ai

``installed(name)`` finds one (None when absent, and the tests skip).  Each
``run_*`` gives its agent exactly three things about the endpoint -- the base
URL, the token and the model -- in the agent's own way, plus what keeps a test
run private and offline: a fresh home, no call home, and every proxy variable
pointing at a closed loopback port with only loopback exempt, so anything the
agent tries to reach beyond loopback fails instead of leaving the machine.  The
permission to write files (a local choice of whoever runs the agent, nothing to
do with the endpoint) is given by each agent's own headless flag.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import trio

from tests.support.mock_providers import closed_port_url

__all__ = ["AgentRun", "installed", "cli_dir", "run_claude", "run_codex", "run_opencode"]

#: The npm package of each CLI, by executable name.
PACKAGES = {
    "claude": "@anthropic-ai/claude-code",
    "codex": "@openai/codex",
    "opencode": "opencode-ai",
}

#: How long one agent run may take (each takes seconds against a scripted upstream;
#: within pytest-timeout's 120 s with the edge's start and stop).
RUN_TIMEOUT = 75.0


def cli_dir() -> Path:
    return Path(os.environ.get("IOPD_AGENT_CLIS") or Path.home() / ".cache" / "iopd-agents")


@functools.cache
def installed(name: str) -> Path | None:
    """The executable of CLI ``name`` when it is installed and answers ``--version``
    (a half-done install, such as a placeholder binary, counts as absent), else None."""
    path = cli_dir() / "node_modules" / ".bin" / name
    if not (path.exists() and os.access(path, os.X_OK)):
        return None
    try:
        with tempfile.TemporaryDirectory() as home:
            done = subprocess.run(
                [str(path), "--version"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=30,
                check=False,
                env=_private_env(Path(home)),
            )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if done.returncode == 0 else None


def version(name: str) -> str:
    """The installed package's version (from its package.json)."""
    manifest = cli_dir() / "node_modules" / PACKAGES[name] / "package.json"
    return str(json.loads(manifest.read_text())["version"])


@dataclass
class AgentRun:
    returncode: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def _private_env(home: Path) -> dict[str, str]:
    """A fresh home, loopback only: proxies at a closed port, loopback exempt."""
    dead = closed_port_url()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "TERM": "dumb",
        "NO_COLOR": "1",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env[var] = dead
    home.mkdir(parents=True, exist_ok=True)
    return env


def _kill_group(process: trio.Process) -> None:
    """Kill ``process`` and everything it started (its own session: a CLI's wrapper
    and the native binary it runs, the shells its tools start)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


async def _deliver_cancel(process: trio.Process) -> None:
    _kill_group(process)


async def _run(argv: list[str], *, cwd: Path, env: dict[str, str]) -> AgentRun:
    """Run ``argv`` to its end; one that overruns ``RUN_TIMEOUT`` is killed and
    reported with what it wrote so far (exit code -1).  Nothing it started outlives it."""
    out, err = Path(env["HOME"]) / "agent.stdout", Path(env["HOME"]) / "agent.stderr"
    returncode = -1
    with out.open("wb") as stdout, err.open("wb") as stderr:
        start = functools.partial(
            trio.run_process,
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            check=False,
            start_new_session=True,
            deliver_cancel=_deliver_cancel,
        )
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(start)
            with trio.move_on_after(RUN_TIMEOUT):
                returncode = await process.wait()
            nursery.cancel_scope.cancel()
        _kill_group(process)
    killed = "" if returncode != -1 else f"\n(killed after {RUN_TIMEOUT} s)"
    return AgentRun(
        returncode, out.read_text(errors="replace"), err.read_text(errors="replace") + killed
    )


async def run_claude(
    *,
    base_url: str,
    token: str,
    model: str,
    workdir: Path,
    home: Path,
    prompt: str,
    bearer: bool = False,
) -> AgentRun:
    """``claude -p``: ``ANTHROPIC_BASE_URL`` (the root, without ``/v1``),
    ``ANTHROPIC_API_KEY`` (sent as ``x-api-key``; ``bearer``: ``ANTHROPIC_AUTH_TOKEN``,
    sent as ``Authorization: Bearer``) and ``ANTHROPIC_MODEL``."""
    exe = installed("claude")
    assert exe is not None
    env = _private_env(home)
    env["ANTHROPIC_AUTH_TOKEN" if bearer else "ANTHROPIC_API_KEY"] = token
    env.update(
        ANTHROPIC_BASE_URL=base_url,
        ANTHROPIC_MODEL=model,
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_ERROR_REPORTING="1",
    )
    argv = [str(exe), "-p", prompt, "--permission-mode", "acceptEdits"]
    return await _run(argv, cwd=workdir, env=env)


async def run_codex(
    *, base_url: str, token: str, model: str, workdir: Path, home: Path, prompt: str
) -> AgentRun:
    """``codex exec``: a model provider in ``$CODEX_HOME/config.toml`` with the
    base URL (``…/v1``), the variable holding the token, and the model."""
    exe = installed("codex")
    assert exe is not None
    env = _private_env(home)
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{model}"\n'
        'model_provider = "iopd"\n'
        "[model_providers.iopd]\n"
        'name = "iopd"\n'
        f'base_url = "{base_url}"\n'
        'env_key = "IOPD_TOKEN"\n'
    )
    env.update(CODEX_HOME=str(codex_home), IOPD_TOKEN=token)
    argv = [
        str(exe),
        "exec",
        "--skip-git-repo-check",
        "--ephemeral",
        "--dangerously-bypass-approvals-and-sandbox",
        prompt,
    ]
    return await _run(argv, cwd=workdir, env=env)


async def run_opencode(
    *, base_url: str, token: str, model: str, workdir: Path, home: Path, prompt: str
) -> AgentRun:
    """``opencode run``: a provider of the bundled ``@ai-sdk/openai-compatible``
    package with ``baseURL`` (``…/v1``), ``apiKey`` and the model."""
    exe = installed("opencode")
    assert exe is not None
    env = _private_env(home)
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "iopd": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "iopd",
                "options": {"baseURL": base_url, "apiKey": token},
                "models": {model: {"name": model}},
            }
        },
        "model": f"iopd/{model}",
    }
    config_path = home / "opencode.json"
    config_path.write_text(json.dumps(config))
    env.update(
        OPENCODE_CONFIG=str(config_path),
        OPENCODE_DISABLE_MODELS_FETCH="1",
        OPENCODE_DISABLE_AUTOUPDATE="1",
        OPENCODE_DISABLE_LSP_DOWNLOAD="1",
    )
    return await _run([str(exe), "run", prompt], cwd=workdir, env=env)
