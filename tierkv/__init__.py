"""tierkv: a hierarchical prefix KV cache (device, host and storage tiers) for LLM inference."""

__version__ = "0.1.0"
