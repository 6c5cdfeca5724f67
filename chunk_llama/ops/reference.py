"""Two-phase partition attention in plain PyTorch: the oracle and the fallback.

All math runs in fp32 whatever the storage dtype; results are cast back to the
query dtype. Shapes follow the pool layout: a layer's cache is
`[capacity, num_kv_heads, chunk_size, head_dim]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chunk_llama.kv.plan import DecodePlan
from chunk_llama.ops.prefill_plan import PrefillPlan


def _partial_softmax(scores: torch.Tensor, values: torch.Tensor):
    """Unnormalised attention over the last axis, for merging by online softmax.

    scores: [..., num_keys]; values: [..., num_keys, head_dim]
    returns o: [..., head_dim] (sum of exp(s - m) v), m: [...] (row max), n: [...] (sum of exp(s - m))
    Rows with no visible key get m = -inf, n = 0, o = 0.
    """
    m = scores.amax(dim=-1)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m_safe.unsqueeze(-1))
    return p @ values, m, p.sum(dim=-1)


def window_start(query_pos: torch.Tensor, window: int) -> torch.Tensor:
    """First key position a query at `query_pos` sees: a sliding window of `window`
    positions (the query's own included), as transformers' `sliding_window_overlay`;
    0 for no window."""
    return query_pos - window + 1 if window else torch.zeros_like(query_pos)


def chunk_first(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float,
                window: int = 0):
    """Phase 1: every shared chunk against the queries of all sequences under it.

    q: [num_seqs, num_heads, head_dim] (fp32, plan order)
    window: sliding window (0: none); a key before a row's window is masked
    returns per (shared chunk, sequence) pair: o [num_pairs, num_heads, head_dim], m, n [num_pairs, num_heads]
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    num_shared, rows = plan.num_shared, plan.max_rows_per_shared
    row_index = plan.shared_begin[:, None] + torch.arange(rows, device=q.device)
    row_index = row_index.clamp_max(num_seqs - 1)  # padding rows are computed, never read
    # One matrix per (chunk, KV head): rows of all covering sequences times the GQA group.
    qs = q[row_index].view(num_shared, rows, num_kv_heads, group, head_dim)
    qs = qs.permute(0, 2, 1, 3, 4).reshape(num_shared, num_kv_heads, rows * group, head_dim)
    ks = k_cache[plan.shared_chunk_ids].float()  # [num_shared, num_kv_heads, chunk_size, head_dim]
    vs = v_cache[plan.shared_chunk_ids].float()
    scores = (qs @ ks.transpose(-1, -2)) * scale  # [num_shared, kv, rows * group, chunk_size]
    if window:
        chunk_size = k_cache.shape[2]
        key_pos = plan.shared_depth[:, None] * chunk_size + torch.arange(chunk_size, device=q.device)
        first = window_start(plan.seq_lens[row_index] - 1, window)  # [num_shared, rows]
        hidden = key_pos[:, None, :] < first[:, :, None]  # [num_shared, rows, chunk_size]
        hidden = hidden.repeat_interleave(group, dim=1)[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    o, m, n = _partial_softmax(scores, vs)
    o = o.view(num_shared, num_kv_heads, rows, group, head_dim).permute(0, 2, 1, 3, 4)
    m = m.view(num_shared, num_kv_heads, rows, group).permute(0, 2, 1, 3)
    n = n.view(num_shared, num_kv_heads, rows, group).permute(0, 2, 1, 3)
    pair = (plan.pair_shared, plan.pair_row)
    return (
        o.reshape(num_shared, rows, num_heads, head_dim)[pair],
        m.reshape(num_shared, rows, num_heads)[pair],
        n.reshape(num_shared, rows, num_heads)[pair],
    )


def sequence_first(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float,
                   window: int = 0):
    """Phase 2 (first half): each sequence against its private chunks (those in its
    sliding window, if `window`).

    q: [num_seqs, num_heads, head_dim] (fp32)
    returns o [num_seqs, num_heads, head_dim], m, n [num_seqs, num_heads]
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, chunk_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_private = plan.private_chunk_ids.shape[1]
    if max_private == 0:
        return (
            q.new_zeros(num_seqs, num_heads, head_dim),
            q.new_full((num_seqs, num_heads), float("-inf")),
            q.new_zeros(num_seqs, num_heads),
        )
    num_keys = max_private * chunk_size

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # [num_seqs, max_private, kv, chunk, d] -> [num_seqs, kv, max_private * chunk, d]
        x = cache[plan.private_chunk_ids].float().permute(0, 2, 1, 3, 4)
        return x.reshape(num_seqs, num_kv_heads, num_keys, head_dim)

    qg = q.view(num_seqs, num_kv_heads, group, head_dim)
    scores = (qg @ gather(k_cache).transpose(-1, -2)) * scale  # [num_seqs, kv, group, num_keys]
    position = plan.num_shared_tokens[:, None] + torch.arange(num_keys, device=q.device)
    visible = position < plan.seq_lens[:, None]  # [num_seqs, num_keys]
    visible &= position >= window_start(plan.seq_lens - 1, window)[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    # Slots past a sequence's length (and padding chunks) are uninitialised pool
    # memory: their zero weights times a NaN there would still give NaN.
    values = gather(v_cache).masked_fill(~visible[:, None, :, None], 0.0)
    o, m, n = _partial_softmax(scores, values)
    return o.reshape(num_seqs, num_heads, head_dim), m.reshape(num_seqs, num_heads), n.reshape(num_seqs, num_heads)


def merge_partials(private, shared, pair_seq: torch.Tensor) -> torch.Tensor:
    """Phase 2 (second half): online-softmax merge of the shared partials into each sequence.

    private: (o [num_seqs, H, D], m, n [num_seqs, H]); shared: the same per pair.
    returns the normalised output [num_seqs, H, D].
    """
    o, m, n = private
    if pair_seq.numel() == 0:
        return o / n.unsqueeze(-1)
    o_pair, m_pair, n_pair = shared
    index = pair_seq[:, None].expand_as(m_pair)
    m_all = m.scatter_reduce(0, index, m_pair, reduce="amax", include_self=True)
    w = torch.exp(m - m_all)
    w_pair = torch.exp(m_pair - m_all[pair_seq])
    o_all = (o * w.unsqueeze(-1)).index_add_(0, pair_seq, o_pair * w_pair.unsqueeze(-1))
    n_all = (n * w).index_add_(0, pair_seq, n_pair * w_pair)
    return o_all / n_all.unsqueeze(-1)


def tpp_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float, window: int = 0
) -> torch.Tensor:
    """Decode attention through the tree, one query per sequence.

    q: [num_seqs, num_heads, head_dim], rows in `plan.seq_ids` order
    k_cache, v_cache: [capacity, num_kv_heads, chunk_size, head_dim]
    window: sliding window of the layer (0: none)
    returns [num_seqs, num_heads, head_dim] in q's dtype
    """
    qf = q.float()
    private = sequence_first(qf, k_cache, v_cache, plan, scale, window)
    shared = chunk_first(qf, k_cache, v_cache, plan, scale, window) if plan.num_shared else None
    return merge_partials(private, shared, plan.pair_seq).to(q.dtype)


def gather_dense(cache: torch.Tensor, chunk_ids: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's K or V as a dense tensor.

    cache: [capacity, num_kv_heads, chunk_size, head_dim]; chunk_ids: [num_chunks]
    returns [num_kv_heads, length, head_dim]
    """
    x = cache[chunk_ids].transpose(0, 1)  # [kv, num_chunks, chunk, d]
    return x.reshape(x.shape[0], -1, x.shape[-1])[:, :length]


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk_ids: torch.Tensor,
    q_start: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its whole context (over the
    keys in each query's sliding window, if `window`).

    q: [num_new, num_heads, head_dim] at positions q_start .. q_start + num_new - 1
    chunk_ids: [num_chunks] the sequence's path, holding K/V of all q_start + num_new tokens
    returns [num_new, num_heads, head_dim]
    """
    num_new = q.shape[0]
    length = q_start + num_new
    k = gather_dense(k_cache, chunk_ids, length)
    v = gather_dense(v_cache, chunk_ids, length)
    key_pos = torch.arange(length, device=q.device)
    query_pos = torch.arange(q_start, length, device=q.device)
    mask = key_pos[None, :] <= query_pos[:, None]  # [num_new, length]
    mask &= key_pos[None, :] >= window_start(query_pos, window)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=k.shape[0] != q.shape[1],
    )
    return out[0].transpose(0, 1)


def packed_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PrefillPlan, scale: float, window: int = 0
) -> torch.Tensor:
    """Prefill attention of every sequence of a step, one `prefill_attention` each.

    q: [num_q_tokens, num_heads, head_dim], sequence s at rows plan.segments[s][0] ..
    returns [num_q_tokens, num_heads, head_dim]; rows of no sequence are left uninitialised
    """
    out = torch.empty_like(q)
    chunk_size = k_cache.shape[2]
    for seq, (token_start, q_start, num_tokens) in enumerate(plan.segments):
        rows = slice(token_start, token_start + num_tokens)
        num_chunks = -(-(q_start + num_tokens) // chunk_size)
        out[rows] = prefill_attention(q[rows], k_cache, v_cache, plan.chunk_table[seq, :num_chunks], q_start, scale,
                                      window)
    return out
