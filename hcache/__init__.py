"""hcache: a stateful LLM serving engine that restores KV caches from hidden states, KV and tokens."""

__version__ = "0.1.0"
