"""Attention kernels over the chunk pool, with backend dispatch."""

from chunk_llama.ops.reference import gather_dense, prefill_attention, tpp_decode_attention

__all__ = ["gather_dense", "prefill_attention", "tpp_decode_attention"]
