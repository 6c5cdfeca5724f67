"""Prefix-aware KV storage: the chunk pool and the prefix tree (it knows no kernel)."""

from chunk_llama.kv.pool import ChunkPool, KVCacheFull
from chunk_llama.kv.tree import PrefixTree

__all__ = ["ChunkPool", "KVCacheFull", "PrefixTree"]
