"""HealthMonitor: unknown before the first probe, change-only reports, registry swaps."""

from __future__ import annotations

import trio
import trio.testing

from iopd.node.adapters.base import Adapter
from iopd.node.adapters.ollama import OllamaAdapter
from iopd.node.adapters.openai import OpenAIAdapter
from iopd.node.health import HealthMonitor
from iopd.node.registry import AdapterRegistry
from tests.support.mock_providers import MockOllamaServer, MockOpenAIServer
from wire.messages import Health, ProviderHealth, ProviderSpec, ProviderStatus


class ListSink:
    """A StatusSink that records every ProviderStatus."""

    def __init__(self) -> None:
        self.msgs: list[ProviderStatus] = []
        self.changed = trio.Event()

    def send_status(self, msg: ProviderStatus) -> None:
        self.msgs.append(msg)
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, count: int) -> None:
        while len(self.msgs) < count:
            await self.changed.wait()

    def flat(self) -> list[tuple[str, str]]:
        return [(p.provider_id, p.health) for m in self.msgs for p in m.providers]


class ToggleAdapter(Adapter):
    """probe() answers whatever ``state`` says; counts probes."""

    def __init__(self, spec: ProviderSpec) -> None:
        super().__init__(spec)
        self.state: tuple[Health, str] = ("healthy", "")
        self.probes = 0

    async def probe(self) -> tuple[Health, str]:
        self.probes += 1
        if self.state[0] == "crash":  # type: ignore[comparison-overlap]
            raise RuntimeError("probe bug")
        return self.state


def toggle_registry(
    *ids: str, interval: float = 10
) -> tuple[AdapterRegistry, dict[str, ToggleAdapter]]:
    adapters = {
        i: ToggleAdapter(ProviderSpec(id=i, type="echo", health_interval=interval)) for i in ids
    }
    return AdapterRegistry(dict(adapters)), adapters


async def test_unknown_until_first_probe_then_changes_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    monitor = HealthMonitor()
    registry, adapters = toggle_registry("a", "b")
    monitor.set_registry(registry)
    assert monitor.current_status() == ProviderStatus(
        providers=[ProviderHealth(provider_id="a"), ProviderHealth(provider_id="b")]
    )
    sink = ListSink()
    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            await nursery.start(monitor.run, sink)
            await sink.wait_for(2)
            assert sorted(sink.flat()) == [("a", "healthy"), ("b", "healthy")]
            assert all(len(m.providers) == 1 for m in sink.msgs)
            await trio.sleep(35)  # three more probes each, nothing changed
            assert len(sink.msgs) == 2 and adapters["a"].probes == 4
            adapters["a"].state = ("unhealthy", "connection refused")
            await sink.wait_for(3)
            assert sink.msgs[-1].providers == [
                ProviderHealth(provider_id="a", health="unhealthy", last_error="connection refused")
            ]
            assert monitor.health_of("a") == "unhealthy" and monitor.health_of("b") == "healthy"
            adapters["a"].state = ("healthy", "")
            await sink.wait_for(4)
            assert sink.flat()[-1] == ("a", "healthy")
            adapters["b"].state = ("crash", "")  # type: ignore[assignment]
            await sink.wait_for(5)
            assert sink.msgs[-1].providers[0].health == "unhealthy"
            assert "probe failed" in sink.msgs[-1].providers[0].last_error
            nursery.cancel_scope.cancel()


async def test_swap_restarts_probes_and_keeps_unchanged_health(
    autojump_clock: trio.testing.MockClock,
) -> None:
    monitor = HealthMonitor()
    first, _ = toggle_registry("keep", "drop")
    monitor.set_registry(first)
    sink = ListSink()
    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            await nursery.start(monitor.run, sink)
            await sink.wait_for(2)
            second, adapters = toggle_registry("keep", "new")
            adapters["new"].state = ("unhealthy", "down")
            monitor.set_registry(second)
            status = {p.provider_id: p.health for p in monitor.current_status().providers}
            assert status == {"keep": "healthy", "new": "unknown"}
            await sink.wait_for(3)
            assert sink.flat()[2] == ("new", "unhealthy")
            assert adapters["keep"].probes >= 1  # the new adapter is probed too
            nursery.cancel_scope.cancel()


async def test_real_probe_flips_with_mock_toggle() -> None:
    async with trio.open_nursery() as nursery:
        mock = await nursery.start(MockOpenAIServer().serve)
        spec = ProviderSpec(id="vllm", type="openai", base_url=mock.base_url, health_interval=0.05)
        monitor = HealthMonitor()
        monitor.set_registry(AdapterRegistry({"vllm": OpenAIAdapter(spec)}))
        sink = ListSink()
        with trio.fail_after(10):
            await nursery.start(monitor.run, sink)
            await sink.wait_for(1)
            mock.healthy = False
            await sink.wait_for(2)
            mock.healthy = True
            await sink.wait_for(3)
        assert sink.flat() == [("vllm", "healthy"), ("vllm", "unhealthy"), ("vllm", "healthy")]
        assert "503" in sink.msgs[1].providers[0].last_error
        assert all(r.path == "/v1/models" for r in mock.requests)
        nursery.cancel_scope.cancel()


async def test_an_ollama_probe_reports_the_served_models_entries_and_their_changes() -> None:
    async with trio.open_nursery() as nursery:
        mock = MockOllamaServer()
        mock.listed = ["llama3:latest", "other:7b"]
        mock.tag_entries["llama3:latest"] = {"size": 7, "details": {"family": "llama"}}
        await nursery.start(mock.serve)
        spec = ProviderSpec(
            id="ol", type="ollama", base_url=mock.base_url, models=["llama3"], health_interval=0.05
        )
        monitor = HealthMonitor()
        monitor.set_registry(AdapterRegistry({"ol": OllamaAdapter(spec)}))
        sink = ListSink()
        with trio.fail_after(10):
            await nursery.start(monitor.run, sink)
            await sink.wait_for(1)
            (first,) = sink.msgs[0].providers
            assert first.health == "healthy"
            assert [(m.name, m.size, m.details.family) for m in first.models] == [
                ("llama3", 7, "llama")
            ]
            mock.tag_entries["llama3:latest"]["size"] = 8  # re-pulled: same health
            await sink.wait_for(2)
        (second,) = sink.msgs[1].providers
        assert second.health == "healthy" and second.models[0].size == 8
        (current,) = monitor.current_status().providers
        assert current.models == second.models  # sent again after a reconnect
        nursery.cancel_scope.cancel()
