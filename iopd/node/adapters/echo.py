"""The built-in ``echo`` provider: answers with the last user message.

Chunks are ``re.findall(r"\\S+\\s*", text)``; ``delay_ms`` is waited before
each chunk.  Usage: input = the input-token estimate (``iopd.tokens``) over all text parts as
received, output = chunks sent so far (so a cancelled run reports exactly
the chunks the caller got).
"""

from __future__ import annotations

import re

import trio

from iopd.json_types import JSONObject
from iopd.node.adapters.base import Adapter, RunOutput
from iopd.tokens import content_text, estimate_input_tokens
from wire.messages import Health, RunRequest

_CHUNK = re.compile(r"\S+\s*")


def last_user_text(messages: list[JSONObject]) -> str:
    """Text of the last ``user`` message: string content, or its text parts joined."""
    for msg in reversed(messages):
        if isinstance(msg, dict) and msg.get("role") == "user":
            return content_text(msg.get("content"))
    return ""


class EchoAdapter(Adapter):
    """Streams the last user message back, word by word."""

    async def run(self, req: RunRequest, out: RunOutput) -> None:
        out.usage.input_tokens = estimate_input_tokens(req.messages)
        out.usage.output_tokens = 0
        delay = self.spec.delay_ms / 1000.0
        for chunk in _CHUNK.findall(last_user_text(req.messages)):
            if delay > 0:
                await trio.sleep(delay)
            else:
                await trio.lowlevel.checkpoint()
            await out.text(chunk)
            out.usage.output_tokens += 1
        out.finish_reason = "stop"

    async def probe(self) -> tuple[Health, str]:
        return "healthy", ""
