"""chunk-llama: prefix-aware chunked KV cache and two-phase-partition attention
(ChunkAttention, Ye et al., ACL 2024) for Hugging Face transformers models."""

from chunk_llama.engine import ChunkLlamaEngine, Grammar, RequestOutput
from chunk_llama.hf import ChunkCache, patch_model
from chunk_llama.hf.integration import install as _install_transformers_integration
from chunk_llama.kv import KVCacheFull
from chunk_llama.loading import load_default_model, load_model
from chunk_llama.version import __version__

_install_transformers_integration()  # attn_implementation="chunk_llama" in from_pretrained

__all__ = [
    "__version__",
    "ChunkCache",
    "ChunkLlamaEngine",
    "Grammar",
    "KVCacheFull",
    "RequestOutput",
    "load_default_model",
    "load_model",
    "patch_model",
]
