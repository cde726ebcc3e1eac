"""tierkv: a hierarchical prefix KV cache (device, host and storage tiers) for LLM inference."""

from tierkv import _moved

__version__ = "0.1.0"

_moved.install()  # old module paths (tierkv.hicache, tierkv.config, ...) import with a DeprecationWarning
