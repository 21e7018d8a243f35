"""The per-group retry budget: ratio plus minimum over a sliding minute, time passed in."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from iopd.edge.pool.retry_budget import BUCKETS, RetryBudget, RetryBudgetPolicy


def spend(budget: RetryBudget, group: str, now: float, n: int) -> int:
    """Try ``n`` retries at ``now``; how many were allowed."""
    return sum(budget.try_retry(group, now) for _ in range(n))


def test_minimum_is_always_allowed() -> None:
    budget = RetryBudget(RetryBudgetPolicy(ratio=0.2, minimum=10))
    assert spend(budget, "g", 0.0, 15) == 10  # no requests at all: only the minimum
    assert budget.counts("g", 0.0) == (0, 10)


def test_ratio_adds_to_the_minimum() -> None:
    budget = RetryBudget(RetryBudgetPolicy(ratio=0.2, minimum=10))
    for _ in range(100):
        budget.note_request("g", 1.0)
    assert spend(budget, "g", 1.5, 50) == 30  # 0.2 * 100 + 10


def test_fractional_allowance_rounds_down() -> None:
    budget = RetryBudget(RetryBudgetPolicy(ratio=0.2, minimum=0))
    for _ in range(9):
        budget.note_request("g", 0.0)
    assert spend(budget, "g", 0.0, 5) == 1  # 1.8 retries: one


def test_zero_budget_allows_nothing() -> None:
    budget = RetryBudget(RetryBudgetPolicy(ratio=0.0, minimum=0))
    budget.note_request("g", 0.0)
    assert not budget.try_retry("g", 0.0)
    assert budget.counts("g", 0.0) == (1, 0)  # a refused retry spends nothing


def test_groups_are_separate() -> None:
    budget = RetryBudget(RetryBudgetPolicy(ratio=0.0, minimum=2))
    assert spend(budget, "a", 0.0, 5) == 2
    assert spend(budget, "b", 0.0, 5) == 2


def test_window_slides_by_the_second() -> None:
    budget = RetryBudget(RetryBudgetPolicy(ratio=0.0, minimum=3))
    assert spend(budget, "g", 10.2, 3) == 3
    assert not budget.try_retry("g", 69.9)  # second 69 still holds second 10
    assert budget.try_retry("g", 70.0)  # second 10 left the window
    assert budget.counts("g", 70.0) == (0, 1)


def test_requests_leave_the_window_too() -> None:
    budget = RetryBudget(RetryBudgetPolicy(ratio=1.0, minimum=0))
    for t in range(5):
        budget.note_request("g", float(t))
    assert budget.counts("g", 59.0) == (5, 0)
    assert budget.counts("g", 62.0) == (2, 0)  # seconds 3 and 4 remain
    assert spend(budget, "g", 62.0, 5) == 2


def test_a_long_gap_clears_everything() -> None:
    budget = RetryBudget(RetryBudgetPolicy(ratio=1.0, minimum=0))
    budget.note_request("g", 0.0)
    assert budget.try_retry("g", 0.0)
    assert budget.counts("g", 1e9) == (0, 0)


def test_a_clock_that_steps_back_stands_still() -> None:
    budget = RetryBudget(RetryBudgetPolicy(ratio=0.0, minimum=1))
    assert budget.try_retry("g", 100.0)
    assert not budget.try_retry("g", 50.0)  # counted in second 100, which is still current
    assert budget.counts("g", 50.0) == (0, 1)


def test_policy_change_applies_to_the_next_check() -> None:
    budget = RetryBudget(RetryBudgetPolicy(ratio=0.0, minimum=1))
    assert spend(budget, "g", 0.0, 3) == 1
    budget.set_policy(RetryBudgetPolicy(ratio=0.0, minimum=3))
    assert spend(budget, "g", 0.0, 3) == 2  # the one spent still counts


def test_retain_forgets_removed_groups() -> None:
    budget = RetryBudget(RetryBudgetPolicy(ratio=0.0, minimum=1))
    assert budget.try_retry("a", 0.0) and budget.try_retry("b", 0.0)
    budget.retain(["b"])
    assert budget.counts("a", 0.0) == (0, 0)
    assert budget.counts("b", 0.0) == (0, 1)
    assert budget.try_retry("a", 0.0)


# A naive reference: every event with its time, the window recomputed from scratch.
EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["request", "retry"]),
        st.sampled_from(["a", "b"]),
        st.floats(0, 5, allow_nan=False),  # time step
    ),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(
    events=EVENTS,
    ratio=st.sampled_from([0.0, 0.2, 0.5, 1.0, 2.0]),
    minimum=st.integers(0, 4),
)
def test_matches_a_naive_sliding_window(
    events: list[tuple[str, str, float]], ratio: float, minimum: int
) -> None:
    policy = RetryBudgetPolicy(ratio=ratio, minimum=minimum)
    budget = RetryBudget(policy)
    log: list[tuple[str, str, int]] = []  # (kind, group, second)
    now = 0.0
    for kind, group, step in events:
        now += step
        second = int(now)

        def in_window(k: str, g: str = group, s: int = second) -> int:
            return sum(1 for kk, gg, ss in log if kk == k and gg == g and s - BUCKETS < ss <= s)

        if kind == "request":
            budget.note_request(group, now)
            log.append(("request", group, second))
        else:
            expected = policy.allowed(in_window("request"), in_window("retry"))
            assert budget.try_retry(group, now) == expected
            if expected:
                log.append(("retry", group, second))
        assert budget.counts(group, now) == (in_window("request"), in_window("retry"))


def test_memory_is_fixed_per_group() -> None:
    budget = RetryBudget(RetryBudgetPolicy(ratio=1.0, minimum=0))
    for t in range(10_000):
        budget.note_request("g", t * 0.37)
        budget.try_retry("g", t * 0.37)
    window = budget._windows["g"]
    assert len(window.requests) == len(window.retries) == BUCKETS
    assert len(budget._windows) == 1
