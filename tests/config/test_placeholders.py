"""Example tokens cannot open a deployed edge: the list of placeholders and its refusals.

``iopd/config/placeholders.py`` lists every token the docs and examples
show; the config rules refuse each (or its SHA-256) wherever a token or a
token hash is accepted, naming the path and ``iopd token``.  The scan below
keeps the list honest: every token-looking literal in the docs' code blocks,
the README, ``configs/`` and the systemd env examples must be on it, and no
example holds a usable hash or verifier at all.
"""

from __future__ import annotations

import hashlib
import re

import pytest

from iopd.config.load import ConfigError, parse_edge_config, parse_node_config
from iopd.config.placeholders import PLACEHOLDER_TOKENS, is_placeholder_hash, is_placeholder_token
from tests.support.paths import ROOT

REFUSED_HASH = (
    "is the SHA-256 of a placeholder token from the docs or examples; "
    "run `iopd token` to make a real one"
)
REFUSED_TOKEN = "is a placeholder from the docs or examples, not a secret; run `iopd token` to make a real one"


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def edge_yaml(*, principal: str, node: str, admin: str, bearer: str) -> str:
    return f"""
edge:
  id: e
  node_listen: 0.0.0.0:7070
  admin_listen: 127.0.0.1:7071
  admin_token_hash_sha256: {admin}
openai:
  listen: 0.0.0.0:8080
  bearer_token: {bearer}
  principal_tokens:
    - {{token_ref: app-1, token_hash_sha256: {principal}, principal_ref: team}}
models:
  - id: echo
    providers: {{echo-1: echo}}
nodes:
  - id: node-b
    token_hash_sha256: {node}
    providers: [{{id: echo-1, type: echo, models: [echo]}}]
"""


def test_every_place_a_token_is_accepted_refuses_the_examples() -> None:
    yaml_text = edge_yaml(
        principal=sha("example-app-1"),
        node=sha("example-node-b"),
        admin=sha("changeme"),
        bearer="demo",
    )
    with pytest.raises(ConfigError) as info:
        parse_edge_config(yaml_text, env={})
    assert info.value.errors == [
        f"edge.admin_token_hash_sha256: {REFUSED_HASH}",
        f"nodes[0].token_hash_sha256: {REFUSED_HASH}",
        f"openai.bearer_token: {REFUSED_TOKEN}",
        f"openai.principal_tokens[0].token_hash_sha256: {REFUSED_HASH}",
    ]
    assert not any(sha("example-app-1") in line for line in info.value.errors)
    with pytest.raises(ConfigError) as node_info:
        parse_node_config("node: {id: n, edge: 'h:1', token: ' Change-Me '}", env={})
    assert node_info.value.errors == [f"node.token: {REFUSED_TOKEN}"]


def test_real_random_tokens_pass() -> None:
    import secrets

    tokens = [secrets.token_urlsafe(32) for _ in range(4)]
    cfg = parse_edge_config(
        edge_yaml(
            principal=sha(tokens[0]), node=sha(tokens[1]), admin=sha(tokens[2]), bearer=tokens[3]
        ),
        env={},
    )
    assert cfg.openai.bearer_token == tokens[3]
    assert parse_node_config(f"node: {{id: n, edge: 'h:1', token: {tokens[0]}}}", env={})


# ------------------------------------------------------ the list stays honest

#: Where code or config writes a token (group 1: the literal written); looked
#: for outside ``#`` comments, whose prose says "token: ..." too.
CODE_SPOTS = [
    re.compile(r'api_key\s*=\s*"([^"]*)"'),
    re.compile(r"\bapi_key:\s*['\"]?([^\s'\"#,}]+)"),
    re.compile(r"Bearer\s+([^\s\"'\\`]+)"),
    re.compile(r"\b(?:bearer_)?token:\s*['\"]?([^\s'\"#,}]+)"),
    re.compile(r"TOKEN=['\"]?([^\s'\"]+)"),
    re.compile(r"echo -n ['\"]?([^\s'\"|]+)"),
]
#: Where a comment names a token too: ``sha256("...")``, an ``example-...`` word.
ANY_SPOTS = [
    re.compile(r'sha256\("([^"]+)"\)'),
    re.compile(r"\b(example-[a-z0-9-]*[a-z0-9])"),
]
COMMENT = re.compile(r"(?:^|\s)#.*$", flags=re.M)
HEX64 = re.compile(r"\b[0-9a-f]{64}\b")
VERIFIER = re.compile(r"SCRAM-SHA-256\$\d+:[A-Za-z0-9+/]{8,}={0,2}\$")


def example_texts() -> dict[str, str]:
    """The code of every doc (its fenced blocks) and every example file, by name."""
    texts = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        blocks = re.findall(r"^```[^\n]*\n(.*?)^```", path.read_text(), flags=re.M | re.S)
        texts[path.relative_to(ROOT).as_posix()] = "\n".join(blocks)
    examples = [
        *sorted((ROOT / "configs").glob("*.yaml")),
        *sorted((ROOT / "scripts" / "systemd").glob("*.example")),
        ROOT / "iopd" / "demo.yaml",
    ]
    for path in examples:
        texts[path.relative_to(ROOT).as_posix()] = path.read_text()
    return texts


def written_tokens(text: str) -> set[str]:
    """The literal tokens ``text`` writes: not ``${ENV}``, ``<placeholder>`` nor cut ``iop_3q…``."""
    code = COMMENT.sub("", text)
    hits = [v for spot in CODE_SPOTS for v in spot.findall(code)]
    hits += [v for spot in ANY_SPOTS for v in spot.findall(text)]
    return {v for v in hits if v and v[0] not in "$<" and "…" not in v}


def test_the_scan_finds_what_an_example_would_write() -> None:
    sample = """
      -H "Authorization: Bearer sk-live-1"
      token: my-node-token
      client = OpenAI(api_key="abc")
      export IOP_ADMIN_TOKEN=hunter2
      # sha256("example-app-9"), give it the token: as said
      token: ${IOP_NODE_TOKEN}
      token_hash_sha256: "<token_hash_sha256 from iopd token>"
    """
    assert written_tokens(sample) == {
        "sk-live-1", "my-node-token", "abc", "hunter2", "example-app-9",
    }


def test_every_token_the_docs_and_examples_write_is_a_listed_placeholder() -> None:
    unlisted = {
        name: sorted(t for t in written_tokens(text) if not is_placeholder_token(t))
        for name, text in example_texts().items()
    }
    assert {k: v for k, v in unlisted.items() if v} == {}


def test_no_example_holds_a_usable_hash_or_verifier() -> None:
    for name, text in example_texts().items():
        assert HEX64.findall(text) == [], name  # not even a refused one: nothing to copy
        assert not VERIFIER.search(text), name


def test_placeholders_are_written_as_compared() -> None:
    assert all(t == t.strip().lower() and t for t in PLACEHOLDER_TOKENS)
    assert all(is_placeholder_hash(sha(t)) for t in PLACEHOLDER_TOKENS)
