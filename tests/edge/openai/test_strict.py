"""Strict output: <completion> extraction, whole-text and streamed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iopd.config.schema import DEFAULT_STRICT_OUTPUT_INSTRUCTION
from iopd.edge.openai.outgoing.strict import (
    CLOSE_TAG,
    OPEN_TAG,
    StrictStreamFilter,
    extract_completion,
    strict_system_message,
)


def test_system_message() -> None:
    assert strict_system_message(DEFAULT_STRICT_OUTPUT_INSTRUCTION) == {
        "role": "system",
        "content": DEFAULT_STRICT_OUTPUT_INSTRUCTION,
    }
    assert "<completion>" in DEFAULT_STRICT_OUTPUT_INSTRUCTION


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("no element here", "no element here"),
        ("  keep  as is \n", "  keep  as is \n"),
        ("<completion>42</completion>", "42"),
        ("thinking... <completion>\n42\n</completion> bye", "42"),
        ("<completion>a</completion><completion>b</completion>", "a"),
        ("pre <completion>open to the end  ", "open to the end"),
        ("<completion></completion>", ""),
        ("<completion>x</complet", "x</complet"),  # a broken closing tag is content
        ("<complet", "<complet"),
        ("</completion> then <completion>y</completion>", "y"),
        ("<completion>multi\nline\n\ntext</completion>", "multi\nline\n\ntext"),
    ],
)
def test_extract_completion(text: str, expected: str) -> None:
    assert extract_completion(text) == expected


def run_filter(deltas: list[str]) -> tuple[list[str], str]:
    f = StrictStreamFilter()
    pieces = [f.feed(d) for d in deltas]
    pieces.append(f.flush())
    return pieces, "".join(pieces)


def test_stream_releases_inside_text_as_it_arrives() -> None:
    pieces, whole = run_filter(
        ["Sure. <compl", "etion>\nHel", "lo wor", "ld </comp", "letion> tail"]
    )
    assert whole == "Hello world"
    # Text before the tag is withheld, then inside text flows without waiting for the end.
    assert pieces == ["", "Hel", "lo wor", "ld", "", ""]


def test_stream_without_element_releases_everything_at_flush() -> None:
    pieces, whole = run_filter(["plain ", "answer <comp", "lete"])
    assert pieces == ["", "", "", "plain answer <complete"]


def test_stream_after_close_ignores_the_rest() -> None:
    f = StrictStreamFilter()
    assert f.feed("<completion>a</completion>") == "a"
    assert f.feed("<completion>b</completion>") == ""
    assert f.flush() == ""


def test_stream_missing_close_tag_is_tolerated() -> None:
    _, whole = run_filter(["<completion> partial answer ", " \n"])
    assert whole == "partial answer"


# Text built from fragments that exercise tags split at every position.
FRAGMENTS = st.sampled_from(
    [
        "<completion>",
        "</completion>",
        "<",
        "</",
        "<comp",
        "letion>",
        "</compl",
        " ",
        "\n",
        "a",
        "bc",
        "é",
    ]
)


@st.composite
def text_and_split(draw: st.DrawFn, require_tag: bool) -> tuple[str, list[str]]:
    parts = draw(st.lists(FRAGMENTS, max_size=20))
    if require_tag:
        at = draw(st.integers(0, len(parts)))
        parts.insert(at, "<completion>")
    text = "".join(parts)
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@given(text_and_split(require_tag=True))
def test_any_split_matches_extract_when_the_tag_is_present(case: tuple[str, list[str]]) -> None:
    text, deltas = case
    assert "".join(deltas) == text
    assert run_filter(deltas)[1] == extract_completion(text)


@given(text_and_split(require_tag=False))
def test_any_split_matches_extract_for_any_text(case: tuple[str, list[str]]) -> None:
    text, deltas = case
    assert run_filter(deltas)[1] == extract_completion(text)


@given(st.text(max_size=40), st.lists(st.integers(0, 60), max_size=6))
def test_any_split_of_arbitrary_text(text: str, cuts: list[int]) -> None:
    text = "x <completion>" + text
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert run_filter(deltas)[1] == extract_completion(text)


class ReferenceFilter:
    """The first StrictStreamFilter (it rescanned and recopied its buffer on every
    delta: quadratic), kept as the reference the linear one must equal."""

    def __init__(self) -> None:
        self._state = "search"
        self._buffer = ""
        self._emitted_any = False
        self._searched = 0

    def feed(self, delta: str) -> str:
        if self._state == "done" or not delta:
            return ""
        self._buffer += delta
        if self._state == "search":
            start = self._buffer.find(OPEN_TAG, self._searched)
            if start < 0:
                self._searched = max(0, len(self._buffer) - len(OPEN_TAG) + 1)
                return ""
            self._buffer = self._buffer[start + len(OPEN_TAG) :]
            self._state = "inside"
        end = self._buffer.find(CLOSE_TAG)
        if end >= 0:
            ready = self._buffer[:end].rstrip()
            self._buffer = ""
            self._state = "done"
            return self._release(ready)
        keep = next(
            (
                n
                for n in range(min(len(self._buffer), len(CLOSE_TAG) - 1), 0, -1)
                if self._buffer.endswith(CLOSE_TAG[:n])
            ),
            0,
        )
        ready = self._buffer[: len(self._buffer) - keep]
        stripped = ready.rstrip()
        self._buffer = self._buffer[len(stripped) :]
        return self._release(stripped)

    def _release(self, text: str) -> str:
        if not self._emitted_any:
            text = text.lstrip()
            if not text:
                return ""
            self._emitted_any = True
        return text

    def flush(self) -> str:
        if self._state == "search":
            rest, self._buffer = self._buffer, ""
            self._state = "done"
            return rest
        if self._state == "inside":
            rest, self._buffer = self._buffer.rstrip(), ""
            self._state = "done"
            return self._release(rest)
        return ""


@given(text_and_split(require_tag=False))
def test_every_delta_releases_what_the_reference_released(case: tuple[str, list[str]]) -> None:
    _, deltas = case
    f, ref = StrictStreamFilter(), ReferenceFilter()
    assert [f.feed(d) for d in deltas] + [f.flush()] == [ref.feed(d) for d in deltas] + [
        ref.flush()
    ]


def test_many_small_deltas() -> None:
    # Quadratic before (the buffer was copied on every delta): 200,000 deltas of
    # whitespace inside the element took 64 s, 200,000 without a tag 6 s.
    assert run_filter(["abcd "] * 200_000)[1] == "abcd " * 200_000
    pieces, whole = run_filter(["<completion>x", *["  "] * 200_000, "y</completion>"])
    assert whole == "x" + "  " * 200_000 + "y"
