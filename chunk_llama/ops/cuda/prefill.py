"""Packed prefill attention on CUDA: the step's contexts as one varlen batch
(`step/varlen.py`) for the FlashAttention-2 kernel that PyTorch ships
(`aten::_flash_attention_forward`).

Causal masking is bottom-right aligned (a query at position p sees keys 0 .. p), a
sliding window goes in as FlashAttention's left window, GQA as its KV-head groups.
Where sequences have cached positions the gather costs one pass over the context's
K/V per layer, memory linear in the step's context, against attention's
O(new x context) work; an in-place kernel over chunk tables would save that pass (not
built yet). Where none has (`fresh`), the keys are the layer's new K/V as it computed
them, the same call stock transformers makes.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from chunk_llama.ops.reference import prefill_attention
from chunk_llama.step.prefill_plan import PrefillPlan
from chunk_llama.step.varlen import VarlenContext

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@functools.cache
def unsupported_reason(device_index: int | None, dtype: torch.dtype, cache_dtype: torch.dtype,
                       head_dim: int) -> str | None:
    """Why the CUDA prefill cannot take these tensors (the reference runs), or None."""
    if dtype not in SUPPORTED_DTYPES:
        return f"FlashAttention supports float16 and bfloat16, not {str(dtype).replace('torch.', '')}"
    if cache_dtype != dtype:
        return f"q is {dtype} but the KV cache is {cache_dtype}"
    if head_dim > MAX_HEAD_DIM or head_dim % 8:
        return f"FlashAttention takes head dims up to {MAX_HEAD_DIM} in multiples of 8, not {head_dim}"
    major, _ = torch.cuda.get_device_capability(device_index)
    if major < 8:
        return f"FlashAttention needs compute capability 8.0 or newer, this GPU has {major}.x"
    if not flash_varlen_available():
        return "this build of torch has no aten::_flash_attention_forward"
    return None


@functools.cache
def flash_varlen_available() -> bool:
    return hasattr(torch.ops.aten, "_flash_attention_forward") and torch.backends.cuda.is_flash_attention_available()


def flash_varlen(q, k, v, ctx: VarlenContext, scale: float, window: int) -> torch.Tensor:
    """PyTorch's FlashAttention-2 varlen forward, causal bottom-right, left window `window - 1`.

    q: [total_queries, num_heads, head_dim]; k, v: [total_keys, num_kv_heads, head_dim]
    """
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, ctx.cu_q, ctx.cu_k, ctx.max_q, ctx.max_k, 0.0, True, False, scale=scale,
        window_size_left=window - 1 if window else -1, window_size_right=0, seqused_k=ctx.seqused_k,
    )
    return out[0]


def sdpa_varlen(q, k, v, ctx: VarlenContext, scale: float, window: int) -> torch.Tensor:
    """What `flash_varlen` computes, the reference's `prefill_attention` per sequence: the
    oracle of the packing on any device."""
    out = torch.empty_like(q)
    cu_q, cu_k = ctx.cu_q.tolist(), ctx.cu_k.tolist()
    used = None if ctx.seqused_k is None else ctx.seqused_k.tolist()
    for s in range(len(cu_q) - 1):
        num_q, num_k = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s] if used is None else used[s]
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s] + num_k)
        out[rows] = prefill_attention(q[rows], k[keys].transpose(0, 1), v[keys].transpose(0, 1), num_k - num_q,
                                      scale, window)
    return out


def packed_prefill_attention_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                    ctx: VarlenContext, scale: float, window: int = 0,
                                    attend=flash_varlen, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None
                                    ) -> torch.Tensor:
    """`ops.packed_prefill_attention` through a varlen kernel (`attend`) over the gathered contexts.

    q: [num_q_tokens, num_heads, head_dim]; k_cache, v_cache: [capacity, num_kv_heads, chunk_size, head_dim]
    new_kv: K and V of the step's tokens, [num_q_tokens, num_kv_heads, head_dim] each, as the
        layer computed them (and stored them in the pool): read instead of the pool when
        `ctx.fresh`; None: always gather
    returns [num_q_tokens, num_heads, head_dim] (rows of no sequence uninitialised)
    """
    pack = (lambda x: x[: ctx.total_q]) if ctx.q_rows is None else (lambda x: x[ctx.q_rows])  # noqa: E731
    if ctx.fresh and new_kv is not None:
        k, v = pack(new_kv[0]), pack(new_kv[1])  # [total_q, num_kv_heads, head_dim]
        ctx = dataclasses.replace(ctx, cu_k=ctx.cu_q, max_k=ctx.max_q, seqused_k=None)
    elif ctx.kv_slot is None:
        # [capacity, chunk_size, num_kv_heads, head_dim] views; gathered: [total_keys, num_kv_heads, head_dim]
        k, v = k_cache.transpose(1, 2)[ctx.kv_chunk].flatten(0, 1), v_cache.transpose(1, 2)[ctx.kv_chunk].flatten(0, 1)
    else:
        k, v = k_cache.transpose(1, 2)[ctx.kv_chunk, ctx.kv_slot], v_cache.transpose(1, 2)[ctx.kv_chunk, ctx.kv_slot]
    packed_q = pack(q)
    out = attend(packed_q.contiguous(), k, v, ctx, scale, window)
    if ctx.q_rows is None and ctx.total_q == q.shape[0]:
        return out
    full = torch.empty_like(q)
    if ctx.q_rows is None:
        full[: ctx.total_q] = out
    else:
        full[ctx.q_rows] = out
    return full


class CudaPrefill:
    """Packed prefill on a GPU through FlashAttention-2 varlen: `plan` once per step returns
    the step's calls (the varlen batch, built once and read by every layer), `run` per layer."""

    backend = "cuda"

    def __init__(self, attend=flash_varlen):
        self.attend = attend

    def plan(self, plan: PrefillPlan, capacity: int = 0, writes=None, row_order=None) -> "CudaPrefillPlanned":
        return CudaPrefillPlanned(self.attend, plan.device, plan.varlen())


class CudaPrefillPlanned:
    """One step of `CudaPrefill`: its varlen batch, run per layer."""

    backend = "cuda"
    has_writes = False

    def __init__(self, attend, device: torch.device, context: VarlenContext):
        self.attend, self._device, self._context = attend, device, context

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int = 0,
            new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q: [num_q_tokens, num_heads, head_dim]; new_kv: the layer's new K and V
        ([num_q_tokens, num_kv_heads, head_dim] each) -> [num_q_tokens, num_heads, head_dim]"""
        plan_device = self._device  # ("cuda" means the current device, as a tensor's "cuda:0" does)
        if plan_device.type != q.device.type or plan_device.index not in (None, q.device.index):
            # (FlashAttention would name a tensor of the plan's, not why)
            where = "the CPU" if plan_device.type == "cpu" else str(plan_device)
            raise ValueError(f"the prefill plan was built for {where}, q is on {q.device}: build it there "
                             f"(build_prefill_plan(..., device=...) or PrefillPlan.to)")
        return packed_prefill_attention_varlen(q, k_cache, v_cache, self._context, scale, window, self.attend,
                                               new_kv)
