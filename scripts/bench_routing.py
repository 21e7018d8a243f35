#!/usr/bin/env python3
"""Cache-aware routing on real llama.cpp servers: iopd's ``prefix`` and
``least_load`` policies against a client that pins each session to a replica.

One run, on loopback:

* ``llama-server`` built from the ``llama-cpp-python`` source distribution
  (or found: ``--server``, PATH, the cache), a random-weight GGUF written
  here (``scripts/llama_replicas.py``), ``--replicas`` replicas started cold
  for every target, one slot each with a bounded prompt cache
  (``--cache-ram`` MiB: a replica cannot hold every session, as a GPU's KV
  cache cannot) that every slot switch goes through (``--slot-similarity``);
* per target, the same seeded workload: ``agent`` (``--sessions`` concurrent
  sessions of ``--turns`` turns over ``--system-prompts`` shared system
  prompts of ``--system-tokens`` tokens, each turn adding a tool output of
  ``--turn-tokens`` tokens and the reply) and ``unique`` (the same number of
  one-turn requests, no prefix shared by any two);
* targets: ``oracle`` (session i straight to replica i mod N), and
  ``python -m iopd edge`` with an embedded node in front of the replicas
  (``type: openai`` passthrough, ``capacity: 1``) with ``models[].routing``
  ``prefix`` and ``least_load``.

It prints, side by side: wall time, requests/s, time to first token p50/p99
(the first streamed chunk) and the fraction of prompt tokens the replicas
served from their cache (``timings.cache_n`` / (``cache_n`` + ``prompt_n``)).

    .venv/bin/python scripts/bench_routing.py            # 3 replicas, 12 sessions x 6 turns
    .venv/bin/python scripts/bench_routing.py --quick    # a smaller run
    .venv/bin/python scripts/bench_routing.py --json

The cache (the source, the build, the model) is ``$IOPD_BENCH_CACHE`` or
``~/.cache/iopd-bench-routing``; the build runs once, niced, ``-j1``
(``IOPD_BENCH_JOBS``).  Needs ``numpy`` and ``gguf``: ``.venv/bin/pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_replicas import find_or_build_server, replicas, write_model  # noqa: E402

WORDS = "abcdefghijklmnopqrstuvwxyz"


@dataclass
class Turn:
    ttft: float
    total: float
    cache_n: int
    prompt_n: int
    ok: bool = True
    session: int = -1
    request_id: str = ""
    replica: str = ""  # which replica served it (the oracle's URL, the edge's log)


@dataclass
class Result:
    wall: float = 0.0
    turns: list[Turn] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        ok = [t for t in self.turns if t.ok]
        ttfts = sorted(t.ttft for t in ok)
        cached = sum(t.cache_n for t in ok)
        prompt = sum(t.cache_n + t.prompt_n for t in ok)
        return {
            "wall_s": round(self.wall, 2),
            "req_per_s": round(len(ok) / self.wall, 3) if self.wall else 0.0,
            "ttft_p50_s": round(_pct(ttfts, 0.50), 3),
            "ttft_p99_s": round(_pct(ttfts, 0.99), 3),
            "cached_fraction": round(cached / prompt, 4) if prompt else 0.0,
            "requests": len(ok),
            "errors": len(self.turns) - len(ok),
            **_placement(ok),
        }


def _placement(turns: list[Turn]) -> dict[str, str | int]:
    """Where the sessions went: first turns per replica, and the turns served
    by another replica than their session's previous turn."""
    if not all(t.replica for t in turns):
        return {}
    by_session: dict[int, list[str]] = {}
    for t in turns:
        by_session.setdefault(t.session, []).append(t.replica)
    firsts = Counter(served[0] for served in by_session.values())
    moves = sum(a != b for served in by_session.values() for a, b in itertools.pairwise(served))
    return {"first_turns": "/".join(str(n) for _, n in firsts.most_common()), "moves": moves}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))]


def _text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of the benchmark model's vocabulary (one per character)."""
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < tokens:
        out.append("".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9))))
    return " ".join(out)[:tokens]


# ------------------------------------------------------------ the client


def _chat(url: str, messages: list[dict[str, str]], args: argparse.Namespace) -> tuple[Turn, str]:
    body = json.dumps(
        {
            "model": "bench",
            "messages": messages,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    request = urllib.request.Request(
        url + "/v1/chat/completions", body, {"content-type": "application/json"}
    )
    started = time.monotonic()
    ttft = 0.0
    text: list[str] = []
    timings: dict[str, int] = {}
    try:
        with urllib.request.urlopen(request, timeout=args.request_timeout) as reply:
            request_id = reply.headers.get("x-request-id", "")
            for raw in reply:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                if not ttft:
                    ttft = time.monotonic() - started
                chunk = json.loads(line[5:])
                timings = chunk.get("timings") or timings
                for choice in chunk.get("choices") or ():
                    text.append((choice.get("delta") or {}).get("content") or "")
    except (OSError, urllib.error.HTTPError, ValueError) as e:
        print(f"  request failed: {e}", file=sys.stderr, flush=True)
        return Turn(0.0, time.monotonic() - started, 0, 0, ok=False), ""
    turn = Turn(
        ttft or time.monotonic() - started,
        time.monotonic() - started,
        int(timings.get("cache_n", 0)),
        int(timings.get("prompt_n", 0)),
        request_id=request_id,
    )
    return turn, "".join(text)


def _workload(kind: str, args: argparse.Namespace) -> list[list[list[dict[str, str]]]]:
    """Per session, the new messages of each turn (seeded: every target gets the same)."""
    rng = random.Random(args.seed)
    systems = [_text(rng, args.system_tokens) for _ in range(args.system_prompts)]
    sessions = []
    for s in range(args.sessions):
        if kind == "agent":
            first = [
                {"role": "system", "content": systems[s % len(systems)]},
                {"role": "user", "content": f"task {s}: " + _text(rng, args.turn_tokens)},
            ]
            later = [
                [{"role": "user", "content": "tool output: " + _text(rng, args.turn_tokens)}]
                for _ in range(args.turns - 1)
            ]
            sessions.append([first, *later])
        else:  # unique: one-turn requests, no prefix shared by any two
            sessions.append(
                [
                    [
                        {"role": "system", "content": _text(rng, args.system_tokens)},
                        {"role": "user", "content": _text(rng, args.turn_tokens)},
                    ]
                    for _ in range(args.turns)
                ]
            )
    return sessions


def run_workload(kind: str, urls: list[str], args: argparse.Namespace) -> Result:
    """Every session in its own thread, its turns one after another; session i
    goes to ``urls[i % len(urls)]`` (one URL: the gateway)."""
    result = Result()
    lock = threading.Lock()
    plan = _workload(kind, args)

    def session(i: int) -> None:
        url = urls[i % len(urls)]
        history: list[dict[str, str]] = []
        for new in plan[i]:
            messages = [*history, *new] if kind == "agent" else new
            turn, reply = _chat(url, messages, args)
            turn.session = i
            if len(urls) > 1:
                turn.replica = url
            with lock:
                result.turns.append(turn)
            if kind == "agent":
                history = [*messages, {"role": "assistant", "content": reply}]

    started = time.monotonic()
    threads = [threading.Thread(target=session, args=(i,)) for i in range(len(plan))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.wall = time.monotonic() - started
    return result


# ------------------------------------------------------------ the gateway

EDGE_YAML = """\
edge:
  id: bench-routing
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
  log_level: warning
openai:
  listen: 127.0.0.1:0
  request_timeout: {timeout}
provider_pool:
  max_queue: 1024
  queue_timeout: {timeout}
  routing:
    prefill_tokens_per_second: {prefill_rate}
models:
  - id: bench
    routing: {policy}
    providers: {{{providers}}}
nodes:
  - id: bench-node
    embedded: true
    providers:
{provider_entries}"""

PROVIDER_ENTRY = """\
      - id: r{i}
        type: openai
        base_url: http://127.0.0.1:{port}/v1
        models: [bench]
        capacity: 1
        read_timeout: {timeout}
        health_interval: 2
"""


def _edge(
    policy: str, ports: list[int], args: argparse.Namespace, tmp: Path
) -> subprocess.Popen[bytes]:
    config = tmp / f"edge-{policy}.yaml"
    config.write_text(
        EDGE_YAML.format(
            timeout=args.request_timeout,
            prefill_rate=args.prefill_rate,
            policy=policy,
            providers=", ".join(f"r{i}: bench" for i in range(len(ports))),
            provider_entries="".join(
                PROVIDER_ENTRY.format(i=i, port=p, timeout=args.request_timeout)
                for i, p in enumerate(ports)
            ),
        )
    )
    log = tmp / f"edge-{policy}.log"
    cmd = [sys.executable, "-m", "iopd", "edge", "--config", str(config), "--log-level", "info"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(
            r"event=edge_started .*\bopenai=\S+:(\d+)", log.read_text(errors="replace")
        )
        if found:
            proc.openai_url = f"http://127.0.0.1:{found.group(1)}"  # type: ignore[attr-defined]
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    sys.exit(f"bench_routing: the edge did not start; see {log}")


def _served_by(log: Path) -> dict[str, str]:
    """request id -> provider, from the edge's request log lines."""
    found = re.finditer(
        r"event=request request_id=(\S+) .*?\bprovider=(\S+)", log.read_text(errors="replace")
    )
    return {m.group(1): m.group(2) for m in found}


def _ready(url: str, args: argparse.Namespace, n: int) -> None:
    """Until every replica answered through the gateway (a one-token prompt each)."""
    deadline = time.monotonic() + 60
    ok = 0
    while ok < n and time.monotonic() < deadline:
        turn, _ = _chat(url, [{"role": "user", "content": "hi"}], args)
        ok = ok + 1 if turn.ok else 0
        if not turn.ok:
            time.sleep(0.5)
    if ok < n:
        sys.exit("bench_routing: the gateway never answered")


def run_target(
    target: str, kind: str, server: Path, model: Path, args: argparse.Namespace, tmp: Path
) -> Result:
    with replicas(
        server,
        model,
        n=args.replicas,
        ctx=args.ctx,
        cache_ram_mib=args.cache_ram,
        slot_similarity=args.slot_similarity,
        threads=args.threads,
        log_dir=tmp,
    ) as ports:
        if target == "oracle":
            return run_workload(kind, [f"http://127.0.0.1:{p}" for p in ports], args)
        edge = _edge(target, ports, args, tmp)
        try:
            url = edge.openai_url  # type: ignore[attr-defined]
            _ready(url, args, args.replicas)
            result = run_workload(kind, [url], args)
        finally:
            edge.terminate()
            try:
                edge.wait(10)
            except subprocess.TimeoutExpired:
                edge.kill()
        served = _served_by(tmp / f"edge-{target}.log")  # complete once the edge has exited
        for turn in result.turns:
            turn.replica = served.get(turn.request_id, "")
        return result


# ------------------------------------------------------------ main


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-prompts", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=5000)
    p.add_argument("--turn-tokens", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--ctx", type=int, default=12288, help="context per replica (its one slot)")
    p.add_argument(
        "--cache-ram",
        type=int,
        default=128,
        help="prompt cache per replica, MiB (128: about four sessions' prompts of the "
        "default workload, of the twelve)",
    )
    p.add_argument(
        "--slot-similarity",
        type=float,
        default=0.0,
        help="llama-server --slot-prompt-similarity (0: every new prompt saves the slot's "
        "to the prompt cache and restores the best cached one; llama-server's own default, "
        "0.1, reuses the one slot without looking at the cache whenever the new prompt "
        "keeps half of it, so a session sharing a system prompt with the last one loses "
        "the rest of its own)",
    )
    p.add_argument("--threads", type=int, default=1, help="CPU threads per replica")
    p.add_argument(
        "--prefill-rate",
        type=float,
        default=500.0,
        help="provider_pool.routing.prefill_tokens_per_second, in the gateway's estimated "
        "tokens (4 bytes each): the random model's vocabulary has a token per byte, so "
        "about a quarter of the replicas' measured prompt tokens/s",
    )
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--targets", default="oracle,prefix,least_load")
    p.add_argument("--workloads", default="agent,unique")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--server", help="a llama-server binary to use instead of building one")
    p.add_argument("--quick", action="store_true", help="6 sessions x 4 turns, 2000-token prompts")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.sessions, args.turns, args.system_tokens = 6, 4, 2000
    cache = Path(os.environ.get("IOPD_BENCH_CACHE", Path.home() / ".cache" / "iopd-bench-routing"))
    server = find_or_build_server(cache, args.server)
    model = write_model(cache / "bench-random-llama.gguf")
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        for kind in args.workloads.split(","):
            for target in args.targets.split(","):
                print(f"bench_routing: {kind} via {target} ...", file=sys.stderr, flush=True)
                summary = run_target(target, kind, server, model, args, Path(tmp)).summary()
                print(f"  {json.dumps(summary)}", file=sys.stderr, flush=True)
                by_target = results.setdefault(kind, {})
                name = target  # a target named twice (interleaved runs): target-2, ...
                while name in by_target:
                    name = f"{target}-{len([k for k in by_target if k.startswith(target)]) + 1}"
                by_target[name] = summary
    if args.json:
        print(json.dumps(results, indent=2))
        return
    _report(results, args)


def _report(results: dict[str, dict[str, dict[str, float]]], args: argparse.Namespace) -> None:
    print(
        f"{args.replicas} replicas (1 slot, --cache-ram {args.cache_ram} MiB), "
        f"{args.sessions} sessions x {args.turns} turns, {args.system_prompts} system prompts "
        f"of {args.system_tokens} tokens, {args.turn_tokens} tokens a turn, seed {args.seed}"
    )
    rows = [
        ("wall_s", "wall time (s)"),
        ("req_per_s", "requests/s"),
        ("ttft_p50_s", "TTFT p50 (s)"),
        ("ttft_p99_s", "TTFT p99 (s)"),
        ("cached_fraction", "cached fraction"),
        ("errors", "errors"),
        ("first_turns", "first turns"),
        ("moves", "turns moved"),
    ]
    for kind, by_target in results.items():
        targets = list(by_target)
        print(f"\nworkload {kind}")
        width = max(12, *(len(t) + 2 for t in targets))
        print(f"  {'':18}" + "".join(f"{t:>{width}}" for t in targets))
        for key, name in rows:
            if kind != "agent" and key in ("first_turns", "moves"):
                continue  # no sessions there: each request is its own
            cells = (str(by_target[t].get(key, "-")) for t in targets)
            print(f"  {name:18}" + "".join(f"{c:>{width}}" for c in cells))
        if {"prefix", "least_load"} <= set(targets):
            a, b = by_target["prefix"], by_target["least_load"]
            print(f"  prefix vs least_load wall time: {b['wall_s'] / max(a['wall_s'], 1e-9):.2f}x")
        if {"prefix", "oracle"} <= set(targets):
            a, o = by_target["prefix"], by_target["oracle"]
            print(f"  prefix / oracle wall time: {a['wall_s'] / max(o['wall_s'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
