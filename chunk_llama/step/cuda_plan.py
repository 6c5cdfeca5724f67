"""The CUDA decode kernels' view of a decode plan: its int32 arrays in one device tensor.

A chunk-aligned plan on a GPU (`decode_plan.py`: every segment a whole chunk but each
sequence's last) also holds, in `cuda_index`, the arrays `csrc/include/chunk_attn/
plan_layout.h` names (CudaDecodeLayout), and in `cuda_layout` their counts and offsets. The
chunk-first kernel writes partial rows in 16-row tiles: each shared chunk's rows (its
sequences times the GQA group, per KV head) padded to 16, and a CSR list of each sequence's
partial rows tells the second phase where to read.
"""

from __future__ import annotations

import torch

from chunk_llama.step.buffers import pack

PARTIAL_ROW_ALIGN = 16  # the CUDA chunk-first kernel writes 16-row tiles
# The CUDA decode op's int32 arrays, in the order of chunk_attn/plan_layout.h (CudaDecodeLayout).
CUDA_DECODE_ARRAYS = ("shared_chunk_ids", "shared_begin", "shared_end", "shared_row_offset", "shared_depth",
                      "private_chunk_ids", "num_shared_tokens", "seq_lens", "seq_partial_ptr", "seq_partial_rows")

# cuda_layout (chunk_attn/plan_layout.h CudaDecodeLayout): these counts, then the offset of each
# CUDA_DECODE_ARRAYS array in cuda_index
CUDA_COUNTS = ("num_seqs", "num_shared", "width", "max_rows_per_shared", "max_pairs_per_seq", "num_partial_rows",
               "max_private_tokens")


def add_cuda_index(plan) -> None:
    """The CUDA kernels' int32 arrays of an aligned `DecodePlan` (shared chunk s holds positions
    shared_depth[s] * chunk_size ..): partial rows per KV head, each shared chunk's rows
    padded to 16, and a CSR list of each sequence's partial rows."""
    a, group = plan.arrays, plan.group
    row_offset, total = [], 0
    for b, e in zip(a["shared_begin"], a["shared_end"]):
        row_offset.append(total)
        total += -(-(e - b) * group // PARTIAL_ROW_ALIGN) * PARTIAL_ROW_ALIGN
    partial_rows = [row_offset[s] + r * group for s, r in zip(a["pair_shared"], a["pair_row"])]
    lengths = [n + plan.num_advances for n in a["seq_lens"]]
    values = dict(shared_chunk_ids=a["shared_chunk_ids"], shared_begin=a["shared_begin"],
                  shared_end=a["shared_end"], shared_row_offset=row_offset, shared_depth=a["shared_depth"],
                  private_chunk_ids=a["private_chunk_ids"], num_shared_tokens=a["num_shared_tokens"],
                  seq_lens=lengths, seq_partial_ptr=a["seq_pair_ptr"], seq_partial_rows=partial_rows)
    plan.cuda_index, offsets = pack(values, torch.int32, plan.device, plan.buffers, "decode_plan_cuda")
    plan.cuda_arrays = {name: plan.cuda_index[offsets[name]: offsets[name] + len(v)] for name, v in values.items()}
    ptr = a["seq_pair_ptr"]
    max_pairs = max((ptr[i + 1] - ptr[i] for i in range(plan.num_seqs)), default=0)
    plan.cuda_layout = [plan.num_seqs, plan.num_shared, plan.width, plan.max_rows_per_shared, max_pairs, total,
                        plan.max_private_tokens] + [offsets[name] for name in CUDA_DECODE_ARRAYS]
