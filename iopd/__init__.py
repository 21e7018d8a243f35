"""iopd: a self-hosted OpenAI-compatible LLM gateway (edge + node daemons)."""

__version__ = "0.1.0"
