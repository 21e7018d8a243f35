"""AdapterRegistry: build by type, run accounting, swap-and-drain through the executor."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iopd.node.adapters.base import Adapter
from iopd.node.adapters.cli import CliAdapter
from iopd.node.adapters.echo import EchoAdapter
from iopd.node.adapters.ollama import OllamaAdapter
from iopd.node.adapters.openai import OpenAIAdapter
from iopd.node.executor import NodeExecutor
from iopd.node.registry import AdapterRegistry, RegistryError
from tests.support.node_parts import ListSender, run_req
from wire.messages import NodeConfig, ProviderSpec


def test_build_picks_adapter_by_type() -> None:
    registry = AdapterRegistry.build(
        [
            ProviderSpec(id="a", type="openai", base_url="http://127.0.0.1:8000"),
            ProviderSpec(id="b", type="ollama", base_url="http://127.0.0.1:11434"),
            ProviderSpec(id="c", type="cli", command=["true"]),
            ProviderSpec(id="d", type="echo"),
        ],
        version=3,
    )
    assert [type(registry.get(i)) for i in "abcd"] == [
        OpenAIAdapter,
        OllamaAdapter,
        CliAdapter,
        EchoAdapter,
    ]
    assert registry.get("zzz") is None
    assert registry.version == 3


def test_build_rejects_bad_specs() -> None:
    with pytest.raises(RegistryError, match="base_url"):
        AdapterRegistry.build([ProviderSpec(id="a", type="openai", base_url="ftp://x")])
    with pytest.raises(RegistryError, match="twice"):
        AdapterRegistry.build([ProviderSpec(id="e", type="echo")] * 2)


async def test_retire_without_runs_closes_at_once() -> None:
    registry = AdapterRegistry.build([ProviderSpec(id="e", type="echo")])
    await registry.retire()
    assert registry.closed.is_set()
    assert registry.adapters["e"].closed


async def test_retire_waits_for_last_run() -> None:
    registry = AdapterRegistry.build([ProviderSpec(id="e", type="echo")])
    async with registry.use():
        async with registry.use():
            await registry.retire()
            assert not registry.closed.is_set()
        assert registry.active_runs == 1 and not registry.closed.is_set()
    assert registry.active_runs == 0
    assert registry.closed.is_set()


async def test_failing_close_does_not_keep_others_open() -> None:
    class Bad(Adapter):
        async def aclose(self) -> None:
            raise RuntimeError("close failed")

    good = EchoAdapter(ProviderSpec(id="g", type="echo"))
    registry = AdapterRegistry({"b": Bad(ProviderSpec(id="b", type="echo")), "g": good})
    await registry.aclose()
    assert good.closed and registry.closed.is_set()


async def test_swap_with_run_in_flight_finishes_on_old_adapter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    executor = NodeExecutor()
    v1 = NodeConfig(
        stream_id=1, version=1, providers=[ProviderSpec(id="echo", type="echo", delay_ms=100)]
    )
    v2 = NodeConfig(
        stream_id=2, version=2, providers=[ProviderSpec(id="echo", type="echo", delay_ms=1)]
    )
    assert (await executor.on_config(v1)).ok
    old = executor.registry
    assert old is not None
    old_adapter = old.adapters["echo"]
    in_flight = ListSender()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(executor.serve_stream, run_req("one two three four"), in_flight)
            await in_flight.sent.wait()
            assert (await executor.on_config(v2)).ok
            new = executor.registry
            assert new is not None and new is not old
            assert old.retired and old.active_runs == 1, (in_flight.kinds, trio.current_time())
            assert not old_adapter.closed and not old.closed.is_set()
            # a new run goes to the new adapter while the old one is still busy
            fresh = ListSender()
            await executor.serve_stream(run_req("quick", sid=2), fresh)
            assert fresh.kinds[-1] == "complete"
            assert new.active_runs == 0 and not old_adapter.closed
            await old.closed.wait()
        assert in_flight.kinds == ["text"] * 4 + ["usage", "complete"]
        # the in-flight run kept the old adapter's pacing (100 ms per chunk)
        assert trio.current_time() >= 0.4
    assert old_adapter.closed
    assert not new.adapters["echo"].closed
