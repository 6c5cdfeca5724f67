"""Prefix-aware KV cache: chunk pool, prefix tree and the decode plan."""

from chunk_llama.kv.plan import DecodePlan, build_decode_plan
from chunk_llama.kv.pool import ChunkPool, KVCacheFull
from chunk_llama.kv.tree import PrefixTree

__all__ = ["ChunkPool", "DecodePlan", "KVCacheFull", "PrefixTree", "build_decode_plan"]
