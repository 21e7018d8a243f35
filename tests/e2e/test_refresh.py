"""Config refresh end to end: a real edge started from a config FILE.

Every test writes the edge YAML to ``tmp_path``, starts a whole gateway from
it (``running_gateway(..., config_path=...)``), rewrites the file and asks the
admin API to ``POST /refresh``.  What a refresh did is checked where an
operator would see it — ``/status``, ``/v1/models``, the answers to real
requests, the node's adapter registry, the ``NodeConfig`` a (fake) node
receives — not in the runtime's private state.

The listeners in the file are ``127.0.0.1:0`` because the gateway helper
forces port 0 anyway: the running config and the file then agree, and only
what a test changes shows up in the report.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from iopd.node.run import NodeHandle, run_node
from tests.support.edges import DEFAULTS, REPORT_KEYS, Edge, edge_yaml, running_edge
from tests.support.gateway import (
    Gateway,
    RawResponse,
    http_request,
    token_hash,
    wait_until,
)
from tests.support.wire_peers import FakeNode
from wire.messages import NodeConfig, NodeConfigAck, RunEvent, RunRequest


def text_of(r: RawResponse) -> str:
    assert r.status == 200, r.body
    content: str = r.json()["choices"][0]["message"]["content"]
    return content


async def which_provider_serves(edge: Edge, nursery: trio.Nursery, **extra: Any) -> str:
    """Start one slow request; return the provider it holds a lease on, then cancel it."""
    before = edge.in_flight()
    scope = trio.CancelScope()

    async def call() -> None:
        with scope:
            await edge.chat("slow " * 20, **extra)

    nursery.start_soon(call)
    await wait_until(lambda: edge.in_flight() != before)
    now = edge.in_flight()
    [pid] = [p for p in now if now[p] > before.get(p, 0)]
    scope.cancel()
    await edge.idle()
    return pid


def requests_total(gw: Gateway, **labels: str) -> float:
    """Sum of ``iop_openai_requests_total`` samples whose labels include ``labels``."""
    total = 0.0
    for family in gw.runtime.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "iop_openai_requests_total" and (
                labels.items() <= sample.labels.items()
            ):
                total += sample.value
    return total


@contextmanager
def not_before(event: trio.Event, what: str) -> Iterator[None]:
    """Assert that ``event`` has not happened yet when the block ends."""
    yield
    assert not event.is_set(), what


# ---------------------------------------------------------------- dry run


async def test_unchanged_file_dry_run_and_apply_report_nothing(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_edge(tmp_path) as edge:
            doc = await edge.refresh("dry_run")
            assert doc["applied"] is False
            assert all(doc[k] == [] for k in REPORT_KEYS - {"mode", "applied"})
            assert edge.gw.runtime.snapshot.version == 1
            doc = await edge.refresh("apply")
            assert doc["applied"] is True
            assert all(doc[k] == [] for k in REPORT_KEYS - {"mode", "applied"})
            assert edge.gw.runtime.snapshot.version == 1  # a no-change apply is invisible


async def test_dry_run_reports_changes_and_changes_nothing(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_edge(tmp_path) as edge:
            before = await edge.status()
            edge.write(
                cap1=5,
                prio2=7,
                threshold=10,
                max_queue=3,
                models=DEFAULTS["models"] + "  - id: only-b\n    providers: {echo-2: echo}\n",
            )
            doc = await edge.refresh("dry_run")
            assert doc == {
                "mode": "dry_run",
                "applied": False,
                "changed_nodes": ["node-a", "node-b"],
                "changed_providers": ["echo-1", "echo-2"],
                "changed_models": ["only-b"],
                "restart_required": [],
                "errors": [],
            }
            after = await edge.status()
            assert after == before
            rt = edge.gw.runtime
            assert rt.snapshot.version == 1
            assert rt.snapshot.config.openai.long_context_threshold_tokens == 100000
            r = await edge.chat("hi", model="only-b")
            assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"
            # Dry run again after apply: nothing left to change.
            await edge.refresh("apply")
            doc = await edge.refresh("dry_run")
            assert doc["changed_providers"] == [] and doc["changed_models"] == []


# ------------------------------------------------------------ live apply


async def test_apply_capacity_enabled_priority_long_slots_show_in_status(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_edge(tmp_path) as edge:
            doc = await edge.apply(cap1=6, en2="false", long2=1, prio1=3, max_queue=9)
            assert doc["changed_nodes"] == ["node-a", "node-b"]
            assert doc["changed_providers"] == ["echo-1", "echo-2"]
            status = await edge.status()
            provs = {p["id"]: p for p in status["providers"]}
            assert provs["echo-1"]["capacity"] == 6
            assert provs["echo-2"]["enabled"] is False
            assert provs["echo-2"]["long_context_capacity"] == 1
            assert status["queue"]["max_queue"] == 9
            assert status["config_version"] == 2
            assert edge.gw.runtime.pool.snapshot.providers["echo-1"].priority == 3


async def test_priority_change_moves_traffic(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_edge(tmp_path, delay1=100, delay2=100) as edge:
            async with trio.open_nursery() as n:
                assert await which_provider_serves(edge, n) == "echo-1"
                await edge.apply(delay1=100, delay2=100, prio1=5, prio2=1)
                assert await which_provider_serves(edge, n) == "echo-2"
                await edge.apply(delay1=100, delay2=100, prio1=0, prio2=1)
                assert await which_provider_serves(edge, n) == "echo-1"


async def test_enabled_change_moves_traffic_and_back(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_edge(tmp_path, delay1=100, delay2=100) as edge:
            async with trio.open_nursery() as n:
                await edge.apply(delay1=100, delay2=100, en1="false")
                for _ in range(3):
                    assert await which_provider_serves(edge, n) == "echo-2"
                await edge.apply(delay1=100, delay2=100, en1="true")
                assert await which_provider_serves(edge, n) == "echo-1"


async def test_model_mapping_added_changed_and_removed(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_edge(tmp_path, delay1=100, delay2=100) as edge:
            r = await edge.chat("hi", model="alt")
            assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"

            alt_b = DEFAULTS["models"] + "  - id: alt\n    providers: {echo-2: echo}\n"
            doc = await edge.apply(delay1=100, delay2=100, models=alt_b)
            assert doc["changed_models"] == ["alt"]
            assert doc["changed_nodes"] == [] and doc["changed_providers"] == []
            assert text_of(await edge.chat("one two", model="alt")) == "one two"
            models = await http_request(edge.gw.host_port, "GET", "/v1/models")
            assert [m["id"] for m in models.json()["data"]] == ["echo", "alt"]
            async with trio.open_nursery() as n:
                assert await which_provider_serves(edge, n, model="alt") == "echo-2"
                alt_a = DEFAULTS["models"] + "  - id: alt\n    providers: {echo-1: echo}\n"
                await edge.apply(delay1=100, delay2=100, models=alt_a)
                assert await which_provider_serves(edge, n, model="alt") == "echo-1"

            await edge.apply(delay1=100, delay2=100)
            r = await edge.chat("hi", model="alt")
            assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"
            models = await http_request(edge.gw.host_port, "GET", "/v1/models")
            assert [m["id"] for m in models.json()["data"]] == ["echo"]


async def test_threshold_change_makes_requests_long(tmp_path: Path) -> None:
    """Lowering long_context_threshold_tokens: the same request now takes a long slot."""
    with trio.fail_after(30):
        async with running_edge(tmp_path, delay1=100, delay2=100, long2=1) as edge:
            base: dict[str, Any] = dict(delay1=100, delay2=100, long2=1)
            loads = edge.gw.runtime.pool.provider_loads
            async with trio.open_nursery() as n:
                # Normal request: echo-1 (priority 0) serves, no long slot used.
                assert await which_provider_serves(edge, n) == "echo-1"
                doc = await edge.apply(**base, threshold=2)
                assert doc["changed_providers"] == [] and doc["restart_required"] == []
                scope = trio.CancelScope()

                async def call() -> None:
                    with scope:
                        await edge.chat("slow " * 20)

                n.start_soon(call)
                # Long now: only echo-2 has long slots, and it holds one of each.
                await wait_until(lambda: loads()["echo-2"].long_in_flight == 1)
                assert loads()["echo-2"].in_flight == 1 and loads()["echo-1"].in_flight == 0
                assert (await edge.provider("echo-2"))["long_in_flight"] == 1
                scope.cancel()


async def test_strict_output_toggles_live(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_edge(tmp_path) as edge:
            wrapped = "<completion>inner</completion>"
            assert text_of(await edge.chat(wrapped)) == wrapped
            await edge.apply(strict="true")
            assert text_of(await edge.chat(wrapped)) == "inner"
            await edge.apply(strict="false")
            assert text_of(await edge.chat(wrapped)) == wrapped


async def test_provider_pool_max_queue_live(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_edge(tmp_path, cap1=1, en2="false", delay1=100) as edge:
            base: dict[str, Any] = dict(cap1=1, en2="false", delay1=100)
            async with trio.open_nursery() as n:
                n.start_soon(edge.chat, "slow " * 20)
                await wait_until(lambda: edge.in_flight()["echo-1"] == 1)
                await edge.apply(**base, max_queue=0)
                assert (await edge.status())["queue"]["max_queue"] == 0
                r = await edge.chat("x")
                assert r.status == 429 and r.json()["error"]["code"] == "queue_full"
                n.cancel_scope.cancel()


async def test_generation_limits_live_on_passthrough(tmp_path: Path) -> None:
    from tests.support.mock_providers import MockOpenAIServer

    with trio.fail_after(30):
        async with trio.open_nursery() as outer:
            mock = MockOpenAIServer()
            await outer.start(mock.serve)
            remote = DEFAULTS["models"] + "  - id: remote\n    providers: {remote-1: remote}\n"
            base: dict[str, Any] = dict(remote_base=mock.base_url)
            async with running_edge(tmp_path, **base, models=remote) as edge:
                r = await edge.chat("hi", model="remote", max_tokens=100)
                assert r.status == 200, r.body
                limited = (
                    DEFAULTS["models"]
                    + "  - id: remote\n    providers: {remote-1: remote}\n"
                    + "    generation: {limits: {max_tokens: 50}}\n"
                )
                doc = await edge.apply(**base, models=limited)
                assert doc["changed_models"] == ["remote"]
                r = await edge.chat("hi", model="remote", max_tokens=100)
                assert r.status == 400
                assert r.json()["error"]["type"] == "invalid_request_error"
                r = await edge.chat("hi", model="remote", max_tokens=50)
                assert r.status == 200
            outer.cancel_scope.cancel()


# ------------------------------------------------------ refused applies


LIVE_TOO = dict(cap1=5)  # a live change riding along: refused with the rest


@pytest.mark.parametrize(
    ("over", "path"),
    [
        (dict(remote_base="http://127.0.0.1:10"), "nodes[0].providers[1].base_url"),
        (dict(delay1=5), "nodes[0].providers[0].delay_ms"),
        (dict(openai_listen="127.0.0.1:1"), "openai.listen"),
        (dict(edge_id="edge-other"), "edge.id"),
    ],
)
async def test_restart_required_refuses_the_whole_apply(
    tmp_path: Path, over: dict[str, Any], path: str
) -> None:
    with trio.fail_after(30):
        async with running_edge(tmp_path) as edge:
            before = await edge.status()
            edge.write(**LIVE_TOO, **over)
            for mode in ("dry_run", "apply"):
                doc = await edge.refresh(mode)
                assert doc["applied"] is False
                assert path in doc["restart_required"]
                assert doc["changed_providers"] == ["echo-1"]  # still reported
                assert doc["errors"] == []
            assert await edge.status() == before
            assert edge.gw.runtime.snapshot.version == 1
            assert (await edge.provider("echo-1"))["capacity"] == 2
            # No secret or value in the report, only paths.
            assert "127.0.0.1:10" not in str(doc) and token_hash("x") not in str(doc)


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        (edge_yaml(cap1=0), "nodes[0].providers[0].capacity: "),
        (edge_yaml(prio1=-1), "nodes[0].providers[0].priority: "),
        (edge_yaml(threshold=0), "openai.long_context_threshold_tokens: "),
        (
            edge_yaml(models="  - id: echo\n    providers: {nope: echo}\n"),
            "models[0].providers.nope: ",
        ),
        (edge_yaml().replace("  strict_output: false", "  strict_outptu: false"), "openai."),
        ("edge: [unclosed\n", ""),
    ],
)
async def test_validation_errors_refuse_and_change_nothing(
    tmp_path: Path, text: str, expect: str
) -> None:
    with trio.fail_after(30):
        async with running_edge(tmp_path) as edge:
            before = await edge.status()
            # A live change alongside the error must not slip through either.
            edge.path.write_text(text.replace("capacity: 2\n", "capacity: 3\n", 1))
            for mode in ("dry_run", "apply"):
                doc = await edge.refresh(mode)
                assert doc["applied"] is False
                assert doc["errors"], doc
                assert any(e.startswith(expect) for e in doc["errors"]), doc["errors"]
                for e in doc["errors"]:
                    path, sep, reason = e.partition(": ")
                    assert sep and path and reason, e
                    assert "Traceback" not in e
            assert await edge.status() == before
            assert edge.gw.runtime.snapshot.version == 1


async def test_missing_file_is_an_error_not_a_crash(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_edge(tmp_path) as edge:
            edge.path.unlink()
            doc = await edge.refresh("apply")
            assert doc["applied"] is False and len(doc["errors"]) >= 1
            edge.write(cap1=4)
            await edge.apply(cap1=4)
            assert (await edge.provider("echo-1"))["capacity"] == 4


# ------------------------------------------------------------- node push


async def start_real_node(gw: Gateway, node_id: str) -> NodeHandle:
    handle: NodeHandle = await gw.nursery.start(
        functools.partial(run_node, gw.node_config(node_id))
    )
    await wait_until(
        lambda: (
            gw.runtime.hub.connected_since(node_id) is not None
            and handle.executor.registry is not None
        )
    )
    return handle


async def test_changed_node_gets_new_registry_unchanged_node_does_not(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_edge(tmp_path, nodes=[]) as edge:
            a = await start_real_node(edge.gw, "node-a")
            b = await start_real_node(edge.gw, "node-b")
            assert a.executor.registry is not None and b.executor.registry is not None
            reg_a, reg_b = a.executor.registry, b.executor.registry
            assert reg_a.version == 1 and reg_b.version == 1

            doc = await edge.apply(cap1=5)
            assert doc["changed_nodes"] == ["node-a"]
            # The push is acked before the apply answers: the swap already happened.
            assert a.executor.registry is not reg_a
            assert a.executor.registry.version == 2
            assert a.executor.registry.get("echo-1").spec.capacity == 5  # type: ignore[union-attr]
            assert reg_a.retired
            with trio.fail_after(5):
                await reg_a.closed.wait()  # no run in flight: closed at once
            assert b.executor.registry is reg_b and reg_b.version == 1

            # The new registry serves.
            assert text_of(await edge.chat("still works")) == "still works"


async def test_fake_node_sees_pushes_only_when_changed(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_edge(tmp_path, nodes=["node-a"]) as edge:
            async with edge.fake_node() as fake:
                await wait_until(lambda: fake.config is not None)
                assert fake.config is not None and fake.config.version == 1

                def configs() -> list[NodeConfig]:
                    return [m for m in fake.received if isinstance(m, NodeConfig)]

                doc = await edge.apply()  # no change at all
                assert doc["changed_nodes"] == []
                doc = await edge.apply(cap1=3)  # node-a only
                assert doc["changed_nodes"] == ["node-a"]
                doc = await edge.apply(
                    cap1=3, models=DEFAULTS["models"].replace(", echo-2: echo", "")
                )
                assert doc["changed_models"] == ["echo"] and doc["changed_nodes"] == []
                await trio.sleep(0.2)  # a push, were one sent, would have arrived by now
                assert len(configs()) == 1

                doc = await edge.apply(cap1=3, cap2=4)
                assert doc["changed_nodes"] == ["node-b"]
                assert len(configs()) == 2
                pushed = configs()[-1]
                # Versions: 1 at start; the no-change apply keeps it; 3 applies changed it.
                assert pushed.version == edge.gw.runtime.snapshot.version == 4
                [spec] = pushed.providers
                assert spec.id == "echo-2" and spec.capacity == 4


async def test_push_rejected_by_node_is_logged_and_apply_still_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node that refuses a pushed NodeConfig does not undo the edge's apply.

    It accepted its first config (a node that rejects that one is never
    connected: tests/e2e/test_node_config_pushes.py), then rejects the refresh's push.
    """
    with trio.fail_after(30):
        async with running_edge(tmp_path, nodes=["node-a"]) as edge:
            async with edge.fake_node() as fake:
                await wait_until(lambda: edge.gw.runtime.hub.connected_since("node-b") is not None)
                fake._config_ok = False  # from now on every push is rejected
                caplog.clear()
                doc = await edge.apply(cap2=4)
                assert doc["applied"] is True
                assert fake.config is not None and fake.config.version == 2
                assert "event=node_config_push node=node-b outcome=rejected" in caplog.text


# ------------------------------------------------------ waiters on apply


async def test_disabling_last_provider_fails_waiters_at_once(tmp_path: Path) -> None:
    solo = DEFAULTS["models"] + "  - id: solo\n    providers: {echo-1: echo}\n"
    base: dict[str, Any] = dict(cap1=1, delay1=100, models=solo, queue_timeout=120)
    with trio.fail_after(30):
        async with running_edge(tmp_path, **base) as edge:
            first_done = trio.Event()
            results: dict[str, RawResponse] = {}

            async def first() -> None:
                results["first"] = await edge.chat("w " * 20, model="solo")  # ~2 s
                first_done.set()

            async with trio.open_nursery() as n:
                n.start_soon(first)
                await wait_until(lambda: edge.in_flight()["echo-1"] == 1)
                queued = [edge.chat("x", model="solo") for _ in range(3)]
                waiter_results: list[RawResponse] = []

                async def wait_one(coro: Any) -> None:
                    waiter_results.append(await coro)

                for c in queued:
                    n.start_soon(wait_one, c)
                await wait_until(lambda: edge.gw.runtime.pool.queue_depth == 3)

                with not_before(first_done, "waiters must fail before the running request ends"):
                    await edge.apply(**{**base, "en1": "false"})
                    await wait_until(lambda: len(waiter_results) == 3)
                for r in waiter_results:
                    assert r.status == 502
                    err = r.json()["error"]
                    assert err["code"] == "node_dispatch_error" and err["type"] == "server_error"
                # The request already running keeps its lease and finishes normally.
            assert results["first"].status == 200
            assert text_of(results["first"]) == "w " * 20
            await edge.idle()
            # The "echo" group still has echo-2: it was not failed.
            assert text_of(await edge.chat("ok")) == "ok"


async def test_capacity_increase_admits_queued_waiters_at_once(tmp_path: Path) -> None:
    base: dict[str, Any] = dict(cap1=1, en2="false", delay1=100)
    with trio.fail_after(30):
        async with running_edge(tmp_path, **base) as edge:
            first_done = trio.Event()
            done: list[str] = []

            async def call(name: str, text: str) -> None:
                r = await edge.chat(text)
                assert text_of(r) == text
                done.append(name)
                if name == "first":
                    first_done.set()

            async with trio.open_nursery() as n:
                n.start_soon(call, "first", "w " * 20)
                await wait_until(lambda: edge.in_flight()["echo-1"] == 1)
                for i in range(2):
                    n.start_soon(call, f"q{i}", "short")
                await wait_until(lambda: edge.gw.runtime.pool.queue_depth == 2)
                with not_before(first_done, "waiters must be admitted while the first runs"):
                    await edge.apply(**{**base, "cap1": 3})
                    # Admitted by the apply, not by the first lease's release.  The
                    # node owns admission: an open that overtakes the node's new
                    # config is answered Busy and leased again at the node's next
                    # load report, still while the first runs (hence a wait).
                    await wait_until(lambda: edge.in_flight()["echo-1"] == 3)
                    assert edge.gw.runtime.pool.queue_depth == 0
                    await wait_until(lambda: len(done) == 2)
                assert sorted(done) == ["q0", "q1"]
            assert done[-1] == "first"


# ------------------------------------------------------- apply under load


def load_variants() -> list[dict[str, Any]]:
    """Live configs to cycle through; every one keeps a live provider in group echo."""
    both = DEFAULTS["models"]
    only1 = "  - id: echo\n    providers: {echo-1: echo}\n"
    only2 = "  - id: echo\n    providers: {echo-2: echo}\n"
    alt = "  - id: alt\n    providers: {echo-1: echo}\n"
    out = []
    for cap1, cap2, (p1, p2), (en1, en2), models in itertools.product(
        (1, 3),
        (1, 4),
        ((0, 1), (2, 0)),
        (("true", "true"), ("false", "true"), ("true", "false")),
        (both, only1, only2, both + alt),
    ):
        if (models == only1 and en1 == "false") or (models == only2 and en2 == "false"):
            continue
        out.append(dict(cap1=cap1, cap2=cap2, prio1=p1, prio2=p2, en1=en1, en2=en2, models=models))
    return out


async def test_apply_under_load_drops_no_request(tmp_path: Path) -> None:
    total, concurrency = 200, 8
    delay: dict[str, Any] = dict(delay1=10, delay2=10)
    variants = load_variants()
    rng = random.Random(1234)
    with trio.fail_after(60):
        async with running_edge(tmp_path, **delay) as edge:
            failures: list[tuple[int, bytes]] = []
            finished = 0
            applies = 0
            next_id = itertools.count()

            async def worker() -> None:
                nonlocal finished
                while (i := next(next_id)) < total:
                    text = f"req {i} body"
                    stream = i % 4 == 0
                    r = await edge.chat(text, stream=stream)
                    if r.status != 200:
                        failures.append((r.status, r.body))
                    elif stream:
                        if b"data: [DONE]" not in r.body:
                            failures.append((r.status, r.body))
                    elif text_of(r) != text:
                        failures.append((r.status, r.body))
                    finished += 1

            max_depth = 0

            async def refresher(stop: trio.Event) -> None:
                nonlocal applies, max_depth
                while not stop.is_set():
                    over = rng.choice(variants)
                    max_depth = max(max_depth, edge.gw.runtime.pool.queue_depth)
                    await edge.apply(**delay, **over)
                    applies += 1
                    await trio.sleep(0.01)

            stop = trio.Event()
            async with trio.open_nursery() as n:
                n.start_soon(refresher, stop)
                async with trio.open_nursery() as workers:
                    for _ in range(concurrency):
                        workers.start_soon(worker)
                stop.set()

            assert failures == []
            assert finished == total
            assert applies >= 5, applies
            assert max_depth > 0  # applies did land while requests were queued
            await edge.idle()
            loads = edge.gw.runtime.pool.provider_loads()
            assert all(x.in_flight == 0 and x.long_in_flight == 0 for x in loads.values())
            status = await edge.status()
            assert all(p["in_flight"] == 0 for p in status["providers"])
            assert status["queue"]["depth"] == 0
            assert requests_total(edge.gw) == total
            assert requests_total(edge.gw, status="ok", model_group="echo") == total


async def test_removing_a_group_fails_its_waiters_at_once(tmp_path: Path) -> None:
    solo = DEFAULTS["models"] + "  - id: solo\n    providers: {echo-1: echo}\n"
    base: dict[str, Any] = dict(cap1=1, delay1=100, queue_timeout=120)
    with trio.fail_after(30):
        async with running_edge(tmp_path, **base, models=solo) as edge:
            first_done = trio.Event()
            waiter: list[RawResponse] = []

            async def first() -> None:
                assert text_of(await edge.chat("w " * 20, model="solo")) == "w " * 20
                first_done.set()

            async def queued() -> None:
                waiter.append(await edge.chat("x", model="solo"))

            async with trio.open_nursery() as n:
                n.start_soon(first)
                await wait_until(lambda: edge.in_flight()["echo-1"] == 1)
                n.start_soon(queued)
                await wait_until(lambda: edge.gw.runtime.pool.queue_depth == 1)
                with not_before(first_done, "the waiter must fail at the apply"):
                    doc = await edge.apply(**base)  # "solo" is gone
                    assert doc["changed_models"] == ["solo"]
                    await wait_until(lambda: len(waiter) == 1)
                [r] = waiter
                assert r.status == 502, r.body
                assert r.json()["error"]["code"] == "node_dispatch_error"


async def test_mapping_a_group_onto_a_disabled_provider_fails_its_waiters(tmp_path: Path) -> None:
    """The group keeps existing, but its only live provider is mapped away."""
    solo1 = DEFAULTS["models"] + "  - id: solo\n    providers: {echo-1: echo}\n"
    solo2 = DEFAULTS["models"] + "  - id: solo\n    providers: {echo-2: echo}\n"
    base: dict[str, Any] = dict(cap1=1, delay1=100, en2="false", queue_timeout=120)
    with trio.fail_after(30):
        async with running_edge(tmp_path, **base, models=solo1) as edge:
            waiter: list[RawResponse] = []

            async def queued() -> None:
                waiter.append(await edge.chat("x", model="solo"))

            async with trio.open_nursery() as n:
                n.start_soon(edge.chat, "w " * 20, "solo")
                await wait_until(lambda: edge.in_flight()["echo-1"] == 1)
                n.start_soon(queued)
                await wait_until(lambda: edge.gw.runtime.pool.queue_depth == 1)
                await edge.apply(**base, models=solo2)
                await wait_until(lambda: len(waiter) == 1)
                assert edge.in_flight()["echo-1"] == 1  # the first is still running
                [r] = waiter
                assert r.status == 502 and r.json()["error"]["code"] == "node_dispatch_error"
                n.cancel_scope.cancel()


async def test_long_slot_change_admits_a_long_waiter_at_once(tmp_path: Path) -> None:
    """Every request is long (threshold 1); echo-2 holds the only long slot.

    Dropping ``long_context_capacity`` to 0 means no provider has long slots,
    so long requests use normal slots: the waiter is admitted by the apply.
    """
    base: dict[str, Any] = dict(threshold=1, long2=1, cap2=4, delay2=100)
    with trio.fail_after(30):
        async with running_edge(tmp_path, **base) as edge:
            loads = edge.gw.runtime.pool.provider_loads
            async with trio.open_nursery() as n:
                n.start_soon(edge.chat, "w " * 20)
                await wait_until(lambda: loads()["echo-2"].long_in_flight == 1)
                n.start_soon(edge.chat, "w " * 20)
                await wait_until(lambda: edge.gw.runtime.pool.queue_depth == 1)
                # echo-1 and echo-2 both have free normal slots, yet the waiter waits.
                assert loads()["echo-1"].in_flight == 0 and loads()["echo-2"].in_flight == 1
                await edge.apply(**{**base, "long2": 0})
                assert edge.gw.runtime.pool.queue_depth == 0
                assert sum(edge.in_flight().values()) == 2
                n.cancel_scope.cancel()


async def test_request_in_flight_keeps_its_snapshot(tmp_path: Path) -> None:
    """strict_output switched on mid-request: that request still answers unstripped."""
    wrapped = "<completion>inner</completion> " + "w " * 10
    with trio.fail_after(30):
        async with running_edge(tmp_path, delay1=100, delay2=100) as edge:
            result: list[RawResponse] = []

            async def call() -> None:
                result.append(await edge.chat(wrapped))

            async with trio.open_nursery() as n:
                n.start_soon(call)
                await wait_until(lambda: sum(edge.in_flight().values()) == 1)
                await edge.apply(delay1=100, delay2=100, strict="true")
            assert text_of(result[0]) == wrapped
            assert text_of(await edge.chat("<completion>inner</completion>")) == "inner"


async def test_concurrent_refreshes_are_serialized(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_edge(tmp_path) as edge:
            edge.write(cap1=3)
            docs: list[dict[str, Any]] = []

            async def one() -> None:
                docs.append(await edge.refresh("apply"))

            async with trio.open_nursery() as n:
                for _ in range(4):
                    n.start_soon(one)
            assert [d["applied"] for d in docs] == [True] * 4
            # The first one applied the change; the rest found nothing left to change.
            assert sorted(len(d["changed_providers"]) for d in docs) == [0, 0, 0, 1]
            assert edge.gw.runtime.snapshot.version == 2  # only the changing apply counts


async def test_refresh_outcomes_are_counted_and_new_groups_are_labelled(tmp_path: Path) -> None:
    def refreshes(outcome: str) -> float:
        total = 0.0
        for family in edge.gw.runtime.metrics.registry.collect():
            for s in family.samples:
                if s.name == "iop_config_refresh_total" and s.labels.get("outcome") == outcome:
                    total += s.value
        return total

    with trio.fail_after(30):
        async with running_edge(tmp_path) as edge:
            await edge.refresh("dry_run")
            alt = DEFAULTS["models"] + "  - id: alt\n    providers: {echo-2: echo}\n"
            await edge.apply(models=alt)
            edge.write(models=alt, edge_id="other")
            await edge.refresh("apply")
            edge.write(cap1=0)
            await edge.refresh("apply")
            outcomes = ("dry_run", "applied", "refused", "failed")
            assert [refreshes(o) for o in outcomes] == [1, 1, 1, 1]
            assert text_of(await edge.chat("hi", model="alt")) == "hi"
            assert requests_total(edge.gw, model_group="alt", status="ok") == 1
            assert requests_total(edge.gw, model_group="unknown") == 0


# ----------------------------------------------- pushes to several nodes


@asynccontextmanager
async def silent_node_a(edge: Edge) -> AsyncIterator[FakeNode]:
    """A FakeNode for node-a that acks its handshake config, then never again."""
    async with edge.fake_node("node-a") as fake:
        await wait_until(lambda: edge.gw.runtime.hub.connected_since("node-a") is not None)
        fake._ack_config = False
        yield fake


def got_config(fake: FakeNode, version: int) -> bool:
    return any(isinstance(m, NodeConfig) and m.version == version for m in fake.received)


async def test_a_silent_node_does_not_hold_up_pushes_to_other_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("iopd.edge.runtime.edge_runtime.NODE_PUSH_TIMEOUT", 60.0)
    with trio.fail_after(30):
        async with running_edge(tmp_path, nodes=[]) as edge, silent_node_a(edge) as fake:
            b = await start_real_node(edge.gw, "node-b")
            edge.write(cap1=3, cap2=3)
            answered = trio.Event()

            async def refresh() -> None:
                await edge.refresh("apply")
                answered.set()

            async with trio.open_nursery() as n:
                n.start_soon(refresh)
                # node-a sorts first and never answers; node-b still gets its push now.
                with not_before(answered, "the report waits for node-a's ack or timeout"):
                    await wait_until(
                        lambda: b.executor.registry is not None and b.executor.registry.version == 2
                    )
                    await wait_until(lambda: got_config(fake, 2))
                n.cancel_scope.cancel()


async def test_refresh_completes_when_the_admin_caller_goes_away(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller hangs up while node-a's ack is pending: the apply still finishes.

    Every changed node gets its push, and the outcome is counted.
    """
    monkeypatch.setattr("iopd.edge.runtime.edge_runtime.NODE_PUSH_TIMEOUT", 1.0)

    def applied() -> float:
        return sum(
            s.value
            for f in edge.gw.runtime.metrics.registry.collect()
            for s in f.samples
            if s.name == "iop_config_refresh_total" and s.labels["outcome"] == "applied"
        )

    with trio.fail_after(30):
        async with running_edge(tmp_path, nodes=[]) as edge, silent_node_a(edge) as fake:
            b = await start_real_node(edge.gw, "node-b")
            edge.write(cap1=3, cap2=3)
            stream = await trio.open_tcp_stream(*edge.gw.handle.admin)
            body = b'{"mode": "apply"}'
            await stream.send_all(
                b"POST /refresh HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            await wait_until(lambda: got_config(fake, 2))
            await stream.aclose()
            await wait_until(
                lambda: b.executor.registry is not None and b.executor.registry.version == 2
            )
            await wait_until(lambda: applied() == 1)
            assert edge.gw.runtime.snapshot.version == 2


async def test_node_swaps_registry_and_drains_the_old_one_under_a_running_request(
    tmp_path: Path,
) -> None:
    with trio.fail_after(30):
        async with running_edge(tmp_path, nodes=[], delay1=100, en2="false") as edge:
            a = await start_real_node(edge.gw, "node-a")
            old = a.executor.registry
            assert old is not None
            result: list[RawResponse] = []

            async def call() -> None:
                result.append(await edge.chat("w " * 10))

            async with trio.open_nursery() as n:
                n.start_soon(call)
                await wait_until(lambda: old.active_runs == 1)
                await edge.apply(delay1=100, en2="false", cap1=4)
                new = a.executor.registry
                assert new is not old and new is not None and new.version == 2
                # Retired, but its adapter stays open for the run still on it.
                assert old.retired and not old.closed.is_set()
                # A new request runs on the new registry meanwhile.
                n.start_soon(call)
                await wait_until(lambda: new.active_runs == 1)
            assert [text_of(r) for r in result] == ["w " * 10] * 2
            with trio.fail_after(5):
                await old.closed.wait()
            assert not new.closed.is_set()


async def test_apply_during_a_node_handshake_reaches_that_node(tmp_path: Path) -> None:
    """The node has its handshake config (v1) but has not acked it when v2 is applied.

    The refresh skips the not-yet-ready session; the handshake must then
    deliver v2 before the node counts as connected, not leave it on v1.
    """
    with trio.fail_after(30):
        async with running_edge(tmp_path, nodes=["node-a"]) as edge:
            async with edge.fake_node(ack_config=False, timeout=3) as fake:
                first = await fake.receive(NodeConfig)
                assert first.version == 1 and first.providers[0].capacity == 2
                doc = await edge.apply(cap2=3)
                assert doc["changed_nodes"] == ["node-b"]
                assert edge.gw.runtime.hub.connected_since("node-b") is None
                await fake.send(NodeConfigAck(stream_id=first.stream_id, version=1))
                second = await fake.receive(NodeConfig)
                assert second.version == 2 and second.providers[0].capacity == 3
                await fake.send(NodeConfigAck(stream_id=second.stream_id, version=2))
                await wait_until(lambda: edge.gw.runtime.hub.connected_since("node-b") is not None)


async def test_lowering_max_queue_keeps_the_waiters_already_queued(tmp_path: Path) -> None:
    base: dict[str, Any] = dict(cap1=1, en2="false", delay1=50)
    with trio.fail_after(30):
        async with running_edge(tmp_path, **base) as edge:
            results: list[RawResponse] = []

            async def call(text: str) -> None:
                results.append(await edge.chat(text))

            async with trio.open_nursery() as n:
                n.start_soon(call, "w " * 10)
                await wait_until(lambda: edge.in_flight()["echo-1"] == 1)
                for i in range(3):
                    n.start_soon(call, f"q{i}")
                await wait_until(lambda: edge.gw.runtime.pool.queue_depth == 3)
                await edge.apply(**base, max_queue=1)
                r = await edge.chat("one too many")
                assert r.status == 429 and r.json()["error"]["code"] == "queue_full"
            assert sorted(text_of(r) for r in results) == ["q0", "q1", "q2", "w " * 10]


async def test_generation_defaults_and_limits_live_on_the_normalized_path(tmp_path: Path) -> None:
    """node-b is a FakeNode: the RunRequest it receives shows the applied policy."""

    def script(req: Any) -> list[RunEvent]:
        return [
            RunEvent(stream_id=req.stream_id, kind="text", text="ok"),
            RunEvent(stream_id=req.stream_id, kind="complete", finish_reason="stop"),
        ]

    def runs() -> list[RunRequest]:
        return [m for m in fake.received if isinstance(m, RunRequest)]

    only_b = "  - id: echo\n    providers: {echo-2: echo}\n"
    policy = only_b + "    generation: {defaults: {temperature: 0.25}, limits: {max_tokens: 64}}\n"
    with trio.fail_after(30):
        async with running_edge(tmp_path, nodes=["node-a"], models=only_b) as edge:
            async with edge.fake_node(responder=script) as fake:
                await wait_until(lambda: edge.gw.runtime.hub.connected_since("node-b") is not None)
                assert text_of(await edge.chat("hi", max_tokens=500)) == "ok"
                assert runs()[-1].params.get("max_tokens") == 500
                assert "temperature" not in runs()[-1].params

                doc = await edge.apply(models=policy)
                assert doc["changed_models"] == ["echo"]
                assert text_of(await edge.chat("hi", max_tokens=500)) == "ok"
                assert runs()[-1].params["max_tokens"] == 64  # capped, not refused
                assert runs()[-1].params["temperature"] == 0.25
                assert text_of(await edge.chat("hi", temperature=0.9)) == "ok"
                assert runs()[-1].params["temperature"] == 0.9  # the caller's value wins

                await edge.apply(models=only_b)
                assert text_of(await edge.chat("hi", max_tokens=500)) == "ok"
                assert runs()[-1].params.get("max_tokens") == 500
                assert "temperature" not in runs()[-1].params
