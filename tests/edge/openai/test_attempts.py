"""The retry policy the paths report to (``attempts.Attempts``), on its own.

A real runtime (its retry budget and metrics) and leases that hold no pool
grant (the pool's verdicts are then no-ops): each report's verdict, and
why a safe retry is refused (the ``retry=no(...)`` of its log line).
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from iopd.edge.openai.attempts import Attempts, AttemptVerdict
from iopd.edge.openai.lifecycle import Call, Outcome
from iopd.edge.pool.pool import Lease
from iopd.edge.pool.retry_rules import AttemptFailure, FailureKind
from iopd.edge.runtime.edge_runtime import EdgeRuntime
from tests.support.configs import echo_provider, edge_yaml, model, node
from tests.support.gateway import edge_config

RETRY, FINAL = AttemptVerdict.RETRY, AttemptVerdict.FINAL
CONNECT = AttemptFailure(FailureKind.CONNECT_FAILED)


def _provider(pid: str, base_url: str) -> dict[str, Any]:
    return {"id": pid, "type": "openai", "base_url": base_url, "models": ["served"]}


def policy(
    *, provider_auth: bool = False, **pool: Any
) -> tuple[Attempts, EdgeRuntime]:
    """Group ``g``: echo-1, echo-2, and passthrough providers on two origins
    (``oa-a`` and ``oa-a2`` on one, ``oa-b`` on the other)."""
    providers = {"echo-1": "echo", "echo-2": "echo", "oa-a": "served", "oa-a2": "served"}
    providers["oa-b"] = "served"
    yaml_text = edge_yaml(
        provider_pool=pool or None,
        models=[model("g", providers)],
        nodes=[
            node(
                providers=[
                    echo_provider("echo-1"),
                    echo_provider("echo-2"),
                    _provider("oa-a", "http://a.example:8000/v1"),
                    _provider("oa-a2", "http://A.example:8000/other/v1"),
                    _provider("oa-b", "http://b.example:8000/v1"),
                ]
            )
        ],
    )
    rt = EdgeRuntime.create(edge_config(yaml_text))
    call = Call(rt.snapshot, Outcome(request_id="req-1"), trio.CancelScope())
    return Attempts(rt, call, "g", (), provider_auth), rt


def lease(pid: str, provider_type: str = "echo") -> Lease:
    return Lease(pid, "node-a", provider_type, "served", False, 0.0, "g")


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage().split("retry=")[1].split(" ")[0]
        for r in caplog.records
        if r.getMessage().startswith("event=attempt_failed")
    ]


async def test_a_failure_before_any_byte_is_retried_while_attempts_are_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="iopd.edge.request")
    attempts, _rt = policy(retry_attempts=1)
    attempts.begin(lease("echo-1"), relay=False)
    assert attempts.failed(CONNECT, caller_saw_bytes=False) is RETRY
    attempts.begin(lease("echo-2"), relay=False)
    assert attempts.failed(CONNECT, caller_saw_bytes=False) is FINAL  # one retry, spent
    assert refusals(caplog) == ["yes", "no(attempts)"]
    assert attempts.exclude() == frozenset({"echo-1", "echo-2"})  # never again


async def test_once_the_caller_saw_a_byte_nothing_is_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="iopd.edge.request")
    attempts, _rt = policy()
    attempts.begin(lease("echo-1"), relay=False)
    assert attempts.failed(CONNECT, caller_saw_bytes=True) is FINAL
    (why,) = refusals(caplog)
    assert why.startswith("no(") and why != "no(attempts)"


async def test_a_busy_node_is_leased_again_without_spending_a_retry() -> None:
    attempts, _rt = policy(retry_attempts=0)
    busy = AttemptFailure(FailureKind.NODE_BUSY)
    for _ in range(3):
        attempts.begin(lease("echo-1"), relay=False)
        assert attempts.failed(busy, caller_saw_bytes=False) is RETRY
    assert attempts.exclude() == frozenset()  # not a failure of the provider


async def test_only_the_first_report_of_an_attempt_counts() -> None:
    attempts, _rt = policy()
    attempts.begin(lease("echo-1"), relay=False)
    attempts.succeeded()
    assert attempts.failed(CONNECT, caller_saw_bytes=False) is FINAL
    assert attempts.exclude() == frozenset()
    attempts.end()  # the lease is given back: nothing more is reported for it
    assert attempts.failed(CONNECT, caller_saw_bytes=False) is FINAL


async def test_no_retry_without_a_candidate_left(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="iopd.edge.request")
    attempts, _rt = policy(retry_attempts=5)
    for pid in ("echo-1", "echo-2", "oa-a", "oa-a2", "oa-b"):
        attempts.begin(lease(pid), relay=False)
        attempts.failed(CONNECT, caller_saw_bytes=False)
    assert refusals(caplog) == ["yes", "yes", "yes", "yes", "no(no_candidate)"]


async def test_no_retry_past_the_groups_budget(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="iopd.edge.request")
    attempts, _rt = policy(retry_budget=0, retry_budget_min=0)
    attempts.begin(lease("echo-1"), relay=False)
    assert attempts.failed(CONNECT, caller_saw_bytes=False) is FINAL
    assert refusals(caplog) == ["no(budget)"]


async def test_the_callers_credential_never_goes_to_another_origin() -> None:
    attempts, _rt = policy(provider_auth=True)
    attempts.begin(lease("oa-a", "openai"), relay=True)
    assert attempts.failed(CONNECT, caller_saw_bytes=False) is RETRY
    # Only oa-a2 (the same origin, whatever the path and case) is left:
    # oa-b (another origin) and the echo providers (no base_url) are out.
    assert attempts.exclude() == frozenset({"oa-a", "oa-b", "echo-1", "echo-2"})
    attempts.begin(lease("oa-a2", "openai"), relay=True)
    assert attempts.failed(CONNECT, caller_saw_bytes=False) is FINAL  # none left
