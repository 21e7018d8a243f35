"""Where the repository's own files are, for the tests that read them (docs, configs, scripts)."""

from __future__ import annotations

from pathlib import Path

#: The repository root: tests/support/paths.py is two folders below it.
ROOT = Path(__file__).resolve().parents[2]
