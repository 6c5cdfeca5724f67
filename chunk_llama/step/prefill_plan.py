"""Prefill plan: what a packed prefill step computes, and each backend's arrays for it.

A step prefills several sequences at once; their new tokens are rows of one flattened
query tensor. The plan says, per sequence, where its tokens sit in that tensor and in
the sequence, and which pool slots hold its K/V (cached prefix and new tokens alike),
as segments: runs of slots of one chunk at consecutive positions (`decode_plan.py`).
It is built once per forward from the tree (host lists); the attention backend chosen
for the step asks it once for the arrays it reads, which every layer then shares:
- `cpu()`: the CPU kernel's index (segment tables, context phase, tiles:
  `prefill_schedule.py`) in one int64 tensor with its layout (`csrc/cpu/plan_layout.h`);
- `tables()`: the segment tables alone, for the PyTorch reference;
- `varlen()`: the contexts as one varlen batch, for the CUDA prefill (`varlen.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from chunk_llama.step.buffers import StaticBuffers, pack
from chunk_llama.step.decode_plan import NO_POSITION
from chunk_llama.step.prefill_schedule import Run, Segment, context_runs, context_work, merged, prefill_tiles
from chunk_llama.step.varlen import VarlenContext, build_varlen_context

# The arrays the CPU prefill op reads, in the order of csrc/cpu/plan_layout.h (PrefillLayout).
PREFILL_ARRAYS = ("seg_chunk", "seg_start", "seg_pos", "q_start", "num_tokens", "token_start", "tiles",
                  "token_pos", "ctx_end", "ctx_items", "ctx_levels", "seq_ctx_ptr", "seq_ctx_offset")
SEGMENT_TABLES = ("seg_chunk", "seg_start", "seg_pos")


class PackedArrays:
    """Named int arrays in one tensor (`index`); each name is also an attribute, a view of
    it ([n, k] for the 2-D ones); `layout`: the counts, then each array's offset."""

    def __init__(self, arrays: dict[str, list[int]], counts: list[int], widths: dict[str, int],
                 device: torch.device, buffers: StaticBuffers | None, name: str):
        self.index, offsets = pack(arrays, torch.long, device, buffers, name)
        for key, values in arrays.items():
            view = self.index[offsets[key]: offsets[key] + len(values)]
            setattr(self, key, view.view(-1, widths[key]) if key in widths else view)
        self.layout = counts + [offsets[key] for key in arrays]


@dataclass
class PrefillPlan:
    """paths: each sequence's nodes (identity, chunk, first slot, tokens), as
        `PrefixTree.path` gives them (the same identity on two paths: the same K/V)
    segments: (token_start, q_start, num_tokens) per sequence: its rows in the flattened
        queries start at token_start, at positions q_start .. of the sequence
    group: query heads per KV head; num_q_tokens: rows of the query tensor
    shared_context: False leaves every sequence's keys to its own tiles (no context phase)
    """

    paths: list[list[Run]]
    segments: list[Segment]
    group: int
    num_q_tokens: int
    num_kv_heads: int
    chunk_size: int | None = None
    device: torch.device = torch.device("cpu")
    buffers: StaticBuffers | None = None
    shared_context: bool = True
    _built: dict = field(default_factory=dict, repr=False, compare=False)  # each backend's arrays, once

    @property
    def num_seqs(self) -> int:
        return len(self.segments)

    def to(self, device: torch.device | str) -> "PrefillPlan":
        """This plan for `device` (the backends' arrays built there on demand)."""
        return dataclasses.replace(self, device=torch.device(device), buffers=None, _built={})

    @functools.cached_property
    def kv_segments(self) -> list[list[tuple[int, int, int]]]:
        """Each sequence's (chunk, first slot, tokens) segments in position order."""
        return [merged(path) for path in self.paths]

    def _segment_tables(self) -> tuple[dict[str, list[int]], int]:
        """seg_chunk, seg_start, seg_pos [num_seqs, width]: each sequence's segments in order
        (chunk, first slot, position of the first key), padded with position NO_POSITION (a
        segment runs to the next one's position); token_pos [num_q_tokens]."""
        width = max((len(runs) for runs in self.kv_segments), default=0) + 1  # an unused entry ends every walk
        chunks, starts, positions = [], [], []
        for runs in self.kv_segments:
            position = 0
            for chunk, start, count in runs:
                chunks.append(chunk)
                starts.append(start)
                positions.append(position)
                position += count
            pad = width - len(runs)
            chunks += [0] * pad
            starts += [0] * pad
            positions += [NO_POSITION] * pad
        token_pos = [0] * self.num_q_tokens
        for token_start, q_start, num_tokens in self.segments:
            token_pos[token_start: token_start + num_tokens] = range(q_start, q_start + num_tokens)
        return dict(seg_chunk=chunks, seg_start=starts, seg_pos=positions, token_pos=token_pos), width

    def tables(self) -> PackedArrays:
        """The segment tables and token positions (what the reference reads)."""
        if "tables" not in self._built:
            arrays, width = self._segment_tables()
            self._built["tables"] = PackedArrays(arrays, [self.num_seqs, width], dict.fromkeys(SEGMENT_TABLES, width),
                                                 self.device, self.buffers, "prefill_tables")
        return self._built["tables"]

    def cpu(self) -> PackedArrays:
        """The CPU kernel's arrays (PREFILL_ARRAYS; see csrc/cpu/prefill_params.h) and
        `num_partial_rows`: the context phase's states."""
        if "cpu" not in self._built:
            self._built["cpu"] = self._cpu_arrays()
        return self._built["cpu"]

    def _cpu_arrays(self) -> PackedArrays:
        tables, width = self._segment_tables()
        runs, ctx_end = (context_runs(self.paths, self.segments, self.group) if self.shared_context
                         else ([], [0] * self.num_seqs))
        items, levels, pieces_of, num_partial_rows = context_work(runs, self.segments, self.group)
        seq_ctx_ptr = [0]
        for offsets in pieces_of:
            seq_ctx_ptr.append(seq_ctx_ptr[-1] + len(offsets))
        arrays = dict(
            seg_chunk=tables["seg_chunk"], seg_start=tables["seg_start"], seg_pos=tables["seg_pos"],
            q_start=[s[1] for s in self.segments], num_tokens=[s[2] for s in self.segments],
            token_start=[s[0] for s in self.segments],
            tiles=[x for tile in prefill_tiles(self.segments, self.group, ctx_end) for x in tile],
            token_pos=tables["token_pos"], ctx_end=ctx_end, ctx_items=[x for item in items for x in item],
            ctx_levels=levels, seq_ctx_ptr=seq_ctx_ptr, seq_ctx_offset=[o for offsets in pieces_of for o in offsets],
        )
        counts = [self.num_seqs, width, self.num_q_tokens, len(arrays["tiles"]) // 3, len(items), len(levels) - 1,
                  num_partial_rows]
        widths = dict.fromkeys(SEGMENT_TABLES, width) | {"tiles": 3, "ctx_items": 7}
        packed = PackedArrays(arrays, counts, widths, self.device, self.buffers, "prefill_cpu")
        packed.num_partial_rows = num_partial_rows
        return packed

    def varlen(self) -> VarlenContext:
        """The contexts as one varlen batch (whole chunks where every path is whole chunks)."""
        if "varlen" not in self._built:
            self._built["varlen"] = build_varlen_context(self.kv_segments, self.segments, self.chunk_size,
                                                         self.device)
        return self._built["varlen"]


def build_prefill_plan(paths: list[list[Run]], segments: list[Segment], group: int,
                       num_q_tokens: int | None = None, num_kv_heads: int = 1, shared_context: bool = True,
                       device: torch.device | str = "cpu", chunk_size: int | None = None,
                       buffers: StaticBuffers | None = None) -> PrefillPlan:
    """A `PrefillPlan` (see its fields); num_q_tokens defaults to the last sequence's end."""
    if num_q_tokens is None:
        num_q_tokens = max((t + n for t, _, n in segments), default=0)
    return PrefillPlan(paths=paths, segments=list(segments), group=group, num_q_tokens=num_q_tokens,
                       num_kv_heads=num_kv_heads, chunk_size=chunk_size, device=torch.device(device),
                       buffers=buffers, shared_context=shared_context)
