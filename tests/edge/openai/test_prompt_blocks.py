"""A request's prompt as the prefix index reads it: prompt order, growth at the end,
the salt first, the bound, and nothing for an endpoint without a prompt."""

from __future__ import annotations

from iopd.edge.openai.incoming.prompt_blocks import prompt_bytes


def test_prompt_bytes_follow_prompt_order_not_key_order() -> None:
    a = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"t": 1}], "temperature": 1}
    b = {"temperature": 0.2, "tools": [{"t": 1}], "messages": [{"role": "user", "content": "hi"}]}
    assert prompt_bytes("/v1/chat/completions", a, 10_000) == prompt_bytes(
        "/v1/chat/completions", b, 10_000
    )
    assert prompt_bytes("/v1/chat/completions", a, 10_000).startswith(b'{"t":1}\n')


def test_prompt_bytes_grow_at_the_end_as_a_conversation_goes_on() -> None:
    turn1 = {"instructions": "be brief", "input": [{"role": "user", "content": "a"}]}
    turn2 = {
        "instructions": "be brief",
        "input": turn1["input"] + [{"role": "user", "content": "b"}],
    }
    one = prompt_bytes("/v1/responses", turn1, 10_000)
    assert prompt_bytes("/v1/responses", turn2, 10_000).startswith(one)


def test_prompt_bytes_are_salted_bounded_and_empty_where_unknown() -> None:
    body = {"messages": [{"role": "user", "content": "x" * 1000}], "cache_salt": "s1"}
    assert prompt_bytes("/v1/chat/completions", body, 10_000).startswith(b'"s1"\n')
    assert len(prompt_bytes("/v1/chat/completions", body, 100)) == 100
    assert prompt_bytes("/v1/embeddings", body, 100) == b""
    assert prompt_bytes("/v1/chat/completions", None, 100) == b""
    assert prompt_bytes("/v1/messages", {"system": "s", "messages": []}, 100) == b'"s"\n'
