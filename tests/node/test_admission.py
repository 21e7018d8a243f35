"""The node's slot table: admission across edges, offers in order."""

from __future__ import annotations

from iopd.node.edges.admission import OFFER_HOLD, WITHDRAW_GRACE, Slot, SlotTable
from wire.messages import SlotLoad


def table(capacity: int = 1, long_capacity: int = 0) -> SlotTable:
    t = SlotTable(lambda pid: (capacity, long_capacity) if pid == "p" else None)
    for edge in ("a", "b", "c"):
        t.add_edge(edge)
    return t


def freed_while_b_then_c_wait() -> SlotTable:
    """One slot, taken by edge a; b, then c, start waiting; a releases it (held for b)."""
    t = table()
    slot = t.admit("a", "p", False, 0.0)
    assert isinstance(slot, Slot)
    t.set_waiting("b", "p", True, 0.0)
    t.set_waiting("c", "p", True, 0.0)
    t.release(slot, 0.0)
    return t


def test_a_full_provider_answers_busy_with_what_the_edge_must_count() -> None:
    t = table(capacity=2)
    assert isinstance(t.admit("a", "p", False, 0.0), Slot)
    assert isinstance(t.admit("b", "p", False, 0.0), Slot)
    busy = t.admit("a", "p", False, 0.0)
    assert busy == SlotLoad(provider_id="p", in_flight=1)  # b's stream; a counts its own
    assert t.admit("a", "unknown", False, 0.0) is None  # not served here: nothing counted


def test_long_context_slots_are_counted_apart() -> None:
    t = table(capacity=3, long_capacity=1)
    assert isinstance(t.admit("a", "p", True, 0.0), Slot)
    assert isinstance(t.admit("b", "p", True, 0.0), SlotLoad)
    assert isinstance(t.admit("b", "p", False, 0.0), Slot)
    assert t.totals("p") == (2, 1)


def test_a_freed_slot_is_held_for_one_waiting_edge_at_a_time_in_order() -> None:
    t = freed_while_b_then_c_wait()
    # Held for b (first to wait): c sees it taken and is refused; b gets it.
    assert t.view("c", "p").offered == 1 and t.view("b", "p").offered == 0
    assert isinstance(t.admit("c", "p", False, 0.0), SlotLoad)
    second = t.admit("b", "p", False, 0.0)
    assert isinstance(second, Slot)
    t.release(second, 0.0)
    assert t.view("b", "p").offered == 1  # now c's turn (b went to the back)
    assert t.take_reports("b") and not t.take_reports("b")  # due once, then not


def test_an_unused_offer_lapses_and_goes_to_the_next_edge() -> None:
    t = freed_while_b_then_c_wait()
    assert t.next_expiry() == OFFER_HOLD
    t.expire(OFFER_HOLD)
    assert t.view("b", "p").offered == 1  # c holds it now
    t.set_waiting("c", "p", False, 1.5)  # c no longer waits: it lapses soon after
    assert t.next_expiry() == 1.5 + WITHDRAW_GRACE


def test_an_edge_lost_gives_its_offer_to_the_next_edge() -> None:
    t = freed_while_b_then_c_wait()
    t.remove_edge("b", 0.0)
    assert t.view("a", "p").offered == 1 and t.view("c", "p").offered == 0


def test_with_one_edge_nothing_is_reported_until_a_busy() -> None:
    t = SlotTable(lambda pid: (1, 0))
    t.add_edge("a")
    slot = t.admit("a", "p", False, 0.0)
    assert isinstance(slot, Slot)
    assert not t.dirty
    assert isinstance(t.admit("a", "p", False, 0.0), SlotLoad)
    assert not t.dirty
    t.release(slot, 0.0)  # the report owed after Busy: the edge may try again
    assert t.take_reports("a") == [SlotLoad(provider_id="p")]
