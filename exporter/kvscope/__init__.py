"""kvscope: observability for vLLM's KV-cache block pool."""

__version__ = "0.1.0"
