"""Two-phase partition attention in plain PyTorch: the oracle and the fallback.

All math runs in fp32 whatever the storage dtype; results are cast back to the
query dtype. Shapes follow the pool layout: a layer's cache is
`[capacity, num_kv_heads, chunk_size, head_dim]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chunk_llama.step.decode_plan import NO_POSITION, DecodePlan
from chunk_llama.step.prefill_plan import PrefillPlan


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
    """Phase 1: every shared segment against the queries of all sequences under it.

    q: [num_seqs, num_heads, head_dim] (fp32, plan order)
    window: sliding window (0: none); a key before a row's window is masked
    returns per (shared segment, sequence) pair: o [num_pairs, num_heads, head_dim], m, n [num_pairs, num_heads]
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, chunk_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_shared, rows = plan.num_shared, plan.max_rows_per_shared
    row_index = plan.shared_begin[:, None] + torch.arange(rows, device=q.device)
    row_index = row_index.clamp_max(num_seqs - 1)  # padding rows are computed, never read
    # One matrix per (segment, KV head): rows of all covering sequences times the GQA group.
    qs = q[row_index].view(num_shared, rows, num_kv_heads, group, head_dim)
    qs = qs.permute(0, 2, 1, 3, 4).reshape(num_shared, num_kv_heads, rows * group, head_dim)
    ks = k_cache[plan.shared_chunk_ids].float()  # [num_shared, num_kv_heads, chunk_size, head_dim]
    vs = v_cache[plan.shared_chunk_ids].float()
    scores = (qs @ ks.transpose(-1, -2)) * scale  # [num_shared, kv, rows * group, chunk_size]
    slot = torch.arange(chunk_size, device=q.device)
    start = plan.shared_start[:, None]
    inside = (slot >= start) & (slot < start + plan.shared_len[:, None])  # [num_shared, chunk_size]
    hidden = ~inside[:, None, :].expand(num_shared, rows, chunk_size)
    if window:
        key_pos = plan.shared_pos[:, None] + slot - start
        first = window_start(plan.seq_lens[row_index] - 1, window)  # [num_shared, rows]
        hidden = hidden | (key_pos[:, None, :] < first[:, :, None])
    hidden = hidden.repeat_interleave(group, dim=1)[:, None]  # [num_shared, 1, rows * group, chunk_size]
    scores = scores.masked_fill(hidden, float("-inf"))
    # slots outside the segment may be unwritten pool memory (NaN): zero weights would not hide them
    vs = vs.masked_fill(~inside[:, None, :, None], 0.0)
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
    """Phase 2 (first half): each sequence against its private segments (the keys in its
    sliding window, if `window`).

    q: [num_seqs, num_heads, head_dim] (fp32)
    returns o [num_seqs, num_heads, head_dim], m, n [num_seqs, num_heads]
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, chunk_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    width = plan.private_chunk_ids.shape[1]
    num_keys = width * chunk_size

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # [num_seqs, width, kv, chunk, d] -> [num_seqs, kv, width * chunk, d]
        x = cache[plan.private_chunk_ids].float().permute(0, 2, 1, 3, 4)
        return x.reshape(num_seqs, num_kv_heads, num_keys, head_dim)

    qg = q.view(num_seqs, num_kv_heads, group, head_dim)
    scores = (qg @ gather(k_cache).transpose(-1, -2)) * scale  # [num_seqs, kv, group, num_keys]
    slot = torch.arange(chunk_size, device=q.device)
    start = plan.private_start[:, :, None]
    position = (plan.private_pos[:, :, None] + slot - start).reshape(num_seqs, num_keys)
    # a segment ends where the next begins, the last at the sequence's length
    next_pos = torch.cat([plan.private_pos[:, 1:], torch.full_like(plan.private_pos[:, :1], NO_POSITION)], dim=1)
    end = torch.minimum(next_pos, plan.seq_lens[:, None])[:, :, None].expand(-1, -1, chunk_size).reshape(num_seqs, -1)
    visible = (slot >= start).reshape(num_seqs, num_keys) & (position < end)  # [num_seqs, num_keys]
    visible &= position >= window_start(plan.seq_lens - 1, window)[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    # Slots outside the segments (and padding entries) may be uninitialised pool
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


def kv_slots(seg_chunk: torch.Tensor, seg_start: torch.Tensor, seg_pos: torch.Tensor, length: int):
    """(chunk, slot) of positions 0 .. length - 1 of a sequence whose segments are
    seg_chunk, seg_start, seg_pos [num_segments] (positions ascending)."""
    position = torch.arange(length, device=seg_pos.device)
    index = torch.searchsorted(seg_pos, position, right=True) - 1
    return seg_chunk[index], seg_start[index] + position - seg_pos[index]


def gather_dense(cache: torch.Tensor, segments, length: int) -> torch.Tensor:
    """One sequence's K or V as a dense tensor.

    cache: [capacity, num_kv_heads, chunk_size, head_dim]
    segments: its (chunk, first slot, number of tokens) runs, as `PrefixTree.segments` gives
    returns [num_kv_heads, length, head_dim]
    """
    chunks, starts, positions, position = [], [], [], 0
    for chunk, start, count in segments:
        chunks.append(chunk)
        starts.append(start)
        positions.append(position)
        position += count
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=cache.device)  # noqa: E731
    chunk, slot = kv_slots(as_long(chunks), as_long(starts), as_long(positions), length)
    return cache[chunk, :, slot].transpose(0, 1)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its whole context (over the
    keys in each query's sliding window, if `window`).

    q: [num_new, num_heads, head_dim] at positions q_start .. q_start + num_new - 1
    k, v: [num_kv_heads, q_start + num_new, head_dim] the sequence's keys and values
    returns [num_new, num_heads, head_dim]
    """
    length = k.shape[1]
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
    """Prefill attention of every sequence of a step, one `prefill_attention` each over its
    K/V gathered dense.

    q: [num_q_tokens, num_heads, head_dim], sequence s at rows plan.segments[s][0] ..
    returns [num_q_tokens, num_heads, head_dim]; rows of no sequence are left uninitialised
    """
    out = torch.empty_like(q)
    tables = plan.tables()
    for seq, (token_start, q_start, num_tokens) in enumerate(plan.segments):
        rows = slice(token_start, token_start + num_tokens)
        chunk, slot = kv_slots(tables.seg_chunk[seq], tables.seg_start[seq], tables.seg_pos[seq], q_start + num_tokens)
        k = k_cache[chunk, :, slot].transpose(0, 1).to(q.dtype)  # a bfloat16 pool under float32 queries: widened
        v = v_cache[chunk, :, slot].transpose(0, 1).to(q.dtype)
        out[rows] = prefill_attention(q[rows], k, v, q_start, scale, window)
    return out


class ReferencePlanned:
    """A reference backend's step: `run(q, k_cache, v_cache, scale, window, new_kv)` per layer
    calls `attention` on the step's plan."""

    backend = "reference"
    has_writes = False  # (no fused layer runs on the reference)

    def __init__(self, attention, plan):
        self._attention, self._plan = attention, plan

    def run(self, q, k_cache, v_cache, scale: float, window: int = 0, new_kv=None) -> torch.Tensor:
        return self._attention(q, k_cache, v_cache, self._plan, scale, window)


class ReferenceDecode:
    """`tpp_decode_attention` as a backend (the convention: `plan` once per step returns the
    step's calls, run per layer)."""

    backend = "reference"

    def plan(self, plan: DecodePlan, capacity: int = 0, writes=None, row_order=None) -> ReferencePlanned:
        return ReferencePlanned(tpp_decode_attention, plan)


class ReferencePrefill:
    """`packed_prefill_attention` as a backend."""

    backend = "reference"

    def plan(self, plan: PrefillPlan, capacity: int = 0, writes=None, row_order=None) -> ReferencePlanned:
        plan.tables()  # (built once per step, read by every layer)
        return ReferencePlanned(packed_prefill_attention, plan)
