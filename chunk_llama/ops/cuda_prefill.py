"""Packed prefill attention on CUDA: the step's contexts gathered into one varlen batch
for the FlashAttention-2 kernel that PyTorch ships (`aten::_flash_attention_forward`).

Every sequence prefilled in a step becomes one varlen entry: its new query rows and
its whole context's K/V (cached prefix and new tokens), gathered from the pool by an
index built once per step (`VarlenContext`) and read by every layer. Where every
sequence's context is whole chunks from slot 0 (the CUDA cache shares by whole chunks)
the gather copies whole chunks (one index per chunk) and FlashAttention reads only each
sequence's first `seqused_k` keys of them; otherwise it gathers slot by slot. Where no
sequence has cached positions (`fresh`: new prompts, the first piece of a long one)
there is nothing to gather: the keys are the step's own K/V as the layer computed them,
packed like the queries, the same call stock transformers makes. Causal
masking is bottom-right aligned (a query at position p sees keys 0 .. p), a sliding
window goes in as FlashAttention's left window, GQA as its KV-head groups. The gather
costs one pass over the context's K/V per layer, memory linear in the step's context,
against attention's O(new x context) work; an in-place kernel over chunk tables would
save that pass (not built yet).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@dataclass
class VarlenContext:
    """kv_chunk, kv_slot: [total_keys] pool slot of each packed key, sequence by sequence; or
        kv_chunk: [total_chunks] each sequence's whole chunks and kv_slot None, with
        seqused_k: [num_seqs] int32 the keys of each sequence's chunks it reads
    q_rows: [total_queries] row of each packed query in the step's flattened queries, or
        None when the sequences' rows are already 0 .. total_queries - 1 in order
    cu_q, cu_k: [num_seqs + 1] int32 offsets of each sequence's queries and keys
    max_q, max_k: the longest sequence's query and key counts; total_q: all queries
    fresh: no sequence has a cached position: its keys are its new tokens, packed as the
        queries (cu_k == cu_q), which `packed_prefill_attention_varlen` reads from the
        layer's new K/V when it is given them instead of gathering
    """

    kv_chunk: torch.Tensor
    kv_slot: torch.Tensor | None
    seqused_k: torch.Tensor | None
    q_rows: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    total_q: int
    fresh: bool = False


def build_varlen_context(kv_segments: list[list[tuple[int, int, int]]], segments: list[tuple[int, int, int]],
                         chunk_size: int | None, device: torch.device | str) -> VarlenContext:
    """kv_segments: each sequence's (chunk, first slot, tokens) runs in position order;
    segments: (token_start, q_start, num_tokens) each; a sequence's context is its
    first q_start + num_tokens positions; chunk_size: the pool's (None: gather slot by slot)."""
    runs_of, q_rows, cu_q = [], [], [0]
    for runs, (token_start, q_start, num_tokens) in zip(kv_segments, segments):
        length, clipped = q_start + num_tokens, []
        for chunk, start, count in runs:
            if length <= 0:
                break
            clipped.append((chunk, start, min(count, length)))
            length -= count
        if length > 0:
            raise ValueError(f"a sequence's segments hold {q_start + num_tokens - length} positions, "
                             f"fewer than its {q_start + num_tokens}")
        runs_of.append(clipped)
        cu_q.append(cu_q[-1] + num_tokens)
        q_rows.extend(range(token_start, token_start + num_tokens))
    lengths_k = [q + n for _, q, n in segments]
    as_int = lambda x: torch.tensor(x, dtype=torch.int32).to(device)  # noqa: E731
    whole_chunks = chunk_size is not None and all(start == 0 and (count == chunk_size or i == len(runs) - 1)
                       for runs in runs_of for i, (_, start, count) in enumerate(runs))
    if whole_chunks:
        kv_chunk = torch.tensor([chunk for runs in runs_of for chunk, _, _ in runs], dtype=torch.long)
        kv_slot, seqused_k = None, as_int(lengths_k)
        padded = [len(runs) * chunk_size for runs in runs_of]
    else:
        flat = [run for runs in runs_of for run in runs]
        counts = torch.tensor([count for _, _, count in flat], dtype=torch.long)
        # slot of key j of run r: run_start[r] + j, j counted from the run's first packed key
        first_key = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        kv_chunk = torch.repeat_interleave(torch.tensor([c for c, _, _ in flat], dtype=torch.long), counts)
        kv_slot = (torch.repeat_interleave(torch.tensor([s for _, s, _ in flat], dtype=torch.long), counts)
                   + torch.arange(int(counts.sum())) - first_key).to(device)
        seqused_k, padded = None, lengths_k
    cu_k = [0]
    for n in padded:
        cu_k.append(cu_k[-1] + n)
    identity = q_rows == list(range(len(q_rows)))
    return VarlenContext(
        kv_chunk=kv_chunk.to(device), kv_slot=kv_slot, seqused_k=seqused_k,
        q_rows=None if identity else torch.tensor(q_rows, dtype=torch.long).to(device),
        cu_q=as_int(cu_q), cu_k=as_int(cu_k), max_q=max((n for *_, n in segments), default=0),
        max_k=max(padded, default=0), total_q=cu_q[-1], fresh=all(q_start == 0 for _, q_start, _ in segments),
    )


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
    from chunk_llama.ops.reference import prefill_attention  # the reference imports this module's plan

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
