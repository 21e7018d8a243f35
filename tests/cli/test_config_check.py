"""``iopd config check PATH`` through ``iopd.cli.main``: exit codes and output."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from iopd.cli import main
from tests.support.example_configs import CONFIGS, EXAMPLE_ENV, write_filled_example

H = hashlib.sha256(b"n").hexdigest()

DANGLING = f"""
edge: {{id: e, node_listen: "127.0.0.1:7070", admin_listen: "0.0.0.0:7071"}}
models:
  - id: g
    providers: {{vllm-a: m}}
nodes:
  - id: n
    token_hash_sha256: {H}
    providers: [{{id: echo-1, type: echo, models: [echo]}}]
"""


def test_good_edge_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_filled_example("edge.yaml", tmp_path)
    assert main(["config", "check", str(path)]) == 0
    assert capsys.readouterr().out == (
        f"OK: edge config {path} (2 nodes, 4 providers, 3 model groups)\n"
        "provider vllm-a (openai): requests go to http://127.0.0.1:8000/v1/chat/completions\n"
        "provider ollama-a (ollama): requests go to http://127.0.0.1:11434/api/chat\n"
        "provider echo-a (echo): answered inside the node\n"
        "provider codex-b (cli): runs codex\n"
    )


def test_good_node_config(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("IOP_NODE_TOKEN", EXAMPLE_ENV["IOP_NODE_TOKEN"])
    path = CONFIGS / "demo-node.yaml"
    assert main(["config", "check", str(path)]) == 0
    assert capsys.readouterr().out == f"OK: node config {path} (node demo-node, edges 127.0.0.1:7070)\n"


def test_demo_config_singular_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_filled_example("demo.yaml", tmp_path)
    assert main(["config", "check", str(path)]) == 0
    assert "(1 node, 1 provider, 1 model group)" in capsys.readouterr().out


def test_dangling_reference_exits_1_listing_every_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "edge.yaml"
    path.write_text(DANGLING)
    assert main(["config", "check", str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{path}: 2 problems found"
    assert lines[1:] == [
        "edge.admin_listen: must be a loopback address (127.0.0.0/8, ::1 or localhost), "
        "got '0.0.0.0:7071'",
        "models[0].providers.vllm-a: provider 'vllm-a' is not defined under nodes[].providers",
    ]


def test_missing_file_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "absent.yaml"
    assert main(["config", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"(file): cannot read {path}: No such file or directory" in out
    assert "Traceback" not in out


def test_unknown_kind_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("listen: 1\n")
    assert main(["config", "check", str(path)]) == 1
    assert "(document): expected a top-level key 'edge'" in capsys.readouterr().out


def test_unchanged_examples_are_refused_with_one_line_each(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Started unchanged, the production examples cannot accept an example's token."""
    monkeypatch.delenv("IOP_NODE_TOKEN", raising=False)
    assert main(["config", "check", str(CONFIGS / "edge.yaml")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == [
        f"{path}: is the example's placeholder; run `iopd token` and paste what it prints"
        for path in (
            "nodes[0].token_verifier",
            "nodes[1].token_hash_sha256",
            "openai.principal_tokens[0].token_hash_sha256",
            "openai.principal_tokens[1].token_hash_sha256",
        )
    ]
    assert main(["config", "check", str(CONFIGS / "node.yaml")]) == 1
    assert capsys.readouterr().out.splitlines()[1:] == [
        "node.token: is a placeholder from the docs or examples, not a secret; "
        "run `iopd token` to make a real one"
    ]
