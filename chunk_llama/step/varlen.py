"""The CUDA prefill's view of a step: every sequence's context as one packed varlen batch.

Every sequence prefilled in a step becomes one varlen entry: its new query rows and
its whole context's K/V (cached prefix and new tokens), gathered from the pool by an
index built once per step and read by every layer (`ops/cuda/prefill.py` runs it).
Where every sequence's context is whole chunks from slot 0 (the CUDA cache shares by
whole chunks) the gather copies whole chunks (one index per chunk) and FlashAttention
reads only each sequence's first `seqused_k` keys of them; otherwise it gathers slot by
slot. Where no sequence has cached positions (`fresh`) the keys are the step's own K/V
as the layer computed them, packed like the queries: nothing to gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        queries (cu_k == cu_q), read from the layer's new K/V instead of gathered
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
