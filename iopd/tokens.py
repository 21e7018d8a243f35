"""The one input-token estimate used everywhere.

ceil(code points of all text parts / 4).  Text parts are string message
contents, the ``text`` of content parts, and string ``input`` of /v1/responses.
Where it is used: docs/ARCHITECTURE.md, "The input-token estimate".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def estimate_tokens_from_chars(chars: int) -> int:
    """ceil(chars / 4) without floats."""
    return (chars + 3) // 4


def content_parts(content: Any) -> Iterable[str]:
    """Yield the text parts of one message ``content``: a string, or a list of parts."""
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    yield text


def content_text(content: Any) -> str:
    """One message's text: string content, or its text parts joined ("" otherwise)."""
    return content if isinstance(content, str) else "".join(content_parts(content))


def text_parts(messages: Iterable[Any]) -> Iterable[str]:
    """Yield every text part of OpenAI-shaped chat messages."""
    for msg in messages:
        if isinstance(msg, dict):
            yield from content_parts(msg.get("content"))


def estimate_input_tokens(messages: Iterable[Any]) -> int:
    """The estimate over all text parts of ``messages``."""
    return estimate_tokens_from_chars(sum(len(t) for t in text_parts(messages)))
