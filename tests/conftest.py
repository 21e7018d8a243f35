"""Fixtures shared by the whole suite (helpers live in tests/support, imported by name)."""
