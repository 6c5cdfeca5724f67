"""transformers integration: the cache, the attention hook and `patch_model`."""

from chunk_llama.hf.cache import ChunkCache
from chunk_llama.hf.patch import is_patched, patch_model

__all__ = ["ChunkCache", "is_patched", "patch_model"]
