"""The node keeps as many idle provider connections as the edge may use at once.

With a smaller idle pool, a provider busy at full capacity had half of its
connections closed and re-dialled on every request (bench_gateway c16).
"""

from __future__ import annotations

from iopd.node.adapters.openai import OpenAIAdapter
from wire.messages import ProviderSpec


def test_idle_pool_covers_capacity_plus_the_probe() -> None:
    big = OpenAIAdapter(ProviderSpec(id="p", type="openai", base_url="http://x:1", capacity=32))
    assert big.client.max_idle_connections == 33
    small = OpenAIAdapter(ProviderSpec(id="q", type="openai", base_url="http://x:1", capacity=1))
    assert small.client.max_idle_connections == 8
