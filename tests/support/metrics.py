"""``/metrics`` read back: one scrape parsed into samples, the series that moved between two."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway import Gateway, http_request

LabelSet = frozenset[tuple[str, str]]


class Scrape:
    """One parsed ``/metrics`` body: sample name + label set -> value."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: dict[tuple[str, LabelSet], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def get(self, name: str, **labels: str) -> float:
        """The sum of ``name`` over the series whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)

    def series(self, name: str) -> dict[LabelSet, float]:
        return {ls: v for (n, ls), v in self.samples.items() if n == name}


async def scrape(gw: Gateway) -> Scrape:
    r = await http_request(gw.handle.admin, "GET", "/metrics")
    assert r.status == 200
    return Scrape(r.body.decode())


def changes(before: Scrape, after: Scrape, name: str) -> dict[LabelSet, float]:
    """Every series of ``name`` that moved between two scrapes, with its delta."""
    old = before.series(name)
    moved = {}
    for ls, v in after.series(name).items():
        d = v - old.get(ls, 0.0)
        if d:
            moved[ls] = d
    return moved
