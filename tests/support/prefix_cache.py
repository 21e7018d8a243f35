"""A provider with a bounded prompt cache, for the cache-aware routing's tests.

``PrefixCache`` is a ``MockOpenAIServer.handler``: it keeps the last
``slots`` chat prompts it served (least recently used out), reuses the
longest prefix a new prompt shares with one of them, counts the cached and
the total bytes, and answers after a delay that grows with the uncached
bytes (``seconds_per_kib``), as an inference server's prefill does.  Its
reply reports ``usage.prompt_tokens_details.cached_tokens`` (bytes / 4).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict

from tests.support.mock_providers import MockReply, RecordedRequest

__all__ = ["PrefixCache", "cached_fraction"]


class PrefixCache:
    def __init__(self, *, slots: int = 2, seconds_per_kib: float = 0.002) -> None:
        self.slots = slots
        self.seconds_per_kib = seconds_per_kib
        self.prompts: OrderedDict[bytes, None] = OrderedDict()
        self.cached_bytes = 0
        self.prompt_bytes = 0
        self.requests = 0

    def __call__(self, req: RecordedRequest) -> MockReply | None:
        if req.method != "POST" or req.path != "/v1/chat/completions":
            return None
        body = req.json() or {}
        prompt = json.dumps(body.get("messages"), separators=(",", ":")).encode()
        best = max((p for p in self.prompts), key=lambda p: _common(p, prompt), default=b"")
        hit = _common(best, prompt)
        if hit and hit == len(best):
            self.prompts.pop(best)  # this prompt extends it: its entry becomes this one
        self.prompts[prompt] = None
        while len(self.prompts) > self.slots:
            self.prompts.popitem(last=False)
        self.cached_bytes += hit
        self.prompt_bytes += len(prompt)
        self.requests += 1
        reply = {
            "id": "chatcmpl-cache",
            "object": "chat.completion",
            "created": 1,
            "model": body.get("model", ""),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt) // 4,
                "completion_tokens": 1,
                "total_tokens": len(prompt) // 4 + 1,
                "prompt_tokens_details": {"cached_tokens": hit // 4},
            },
        }
        data = json.dumps(reply).encode()
        delay = (len(prompt) - hit) / 1024 * self.seconds_per_kib
        return MockReply(chunks=[data[:1], data[1:]], chunk_delay=delay)


def _common(a: bytes, b: bytes) -> int:
    return len(os.path.commonprefix([a, b]))


def cached_fraction(caches: list[PrefixCache]) -> float:
    total = sum(c.prompt_bytes for c in caches)
    return sum(c.cached_bytes for c in caches) / total if total else 0.0
