"""Fixtures shared by the whole suite (helpers live in tests/support, imported by name)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from tests.support.mock_providers import MockOllamaServer, MockOpenAIServer


@pytest.fixture
async def openai_mock() -> AsyncIterator[MockOpenAIServer]:
    """A mock OpenAI-compatible provider on a free loopback port, for the test's duration."""
    async with trio.open_nursery() as nursery:
        yield await nursery.start(MockOpenAIServer().serve)
        nursery.cancel_scope.cancel()


@pytest.fixture
async def ollama_mock() -> AsyncIterator[MockOllamaServer]:
    """A mock Ollama server on a free loopback port, for the test's duration."""
    async with trio.open_nursery() as nursery:
        yield await nursery.start(MockOllamaServer().serve)
        nursery.cancel_scope.cancel()
