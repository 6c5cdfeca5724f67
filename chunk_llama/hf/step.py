"""Building a step: the per-forward metadata, made once from the tree and read by all layers.

`StepBuilder` turns the tree's state into a `ForwardStep`: which K/V slots the
forward writes, and how each layer attends (a decode plan, or a packed prefill plan). The decode plan is
rebuilt only after joins and leaves; otherwise its lengths advance in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunk_llama.kv import PrefixTree, build_decode_plan
from chunk_llama.kv.plan import DecodePlan, to_device
from chunk_llama.ops.prefill_plan import PrefillPlan, build_prefill_plan


@dataclass
class ForwardStep:
    """Everything the layers need for one forward pass.

    write_token_index: [num_writes] flattened token indices whose K/V are stored
    write_chunk, write_offset: [num_writes] the slot of each stored token
    plan / row_order: decode only; plan rows are batch rows `row_order` (None: same order)
    prefill: prefill (or multi-token extension) only: every sequence's new tokens, one plan
        for all layers (`ops/prefill_plan.py`)
    past_len: tokens cached before this step (what `get_seq_length` reports meanwhile)
    """

    write_token_index: torch.Tensor
    write_chunk: torch.Tensor
    write_offset: torch.Tensor
    plan: DecodePlan | None = None
    row_order: torch.Tensor | None = None
    inverse_row_order: torch.Tensor | None = None
    prefill: PrefillPlan | None = None
    past_len: int = 0

    @property
    def is_decode(self) -> bool:
        return self.plan is not None


class StepBuilder:
    """Makes the `ForwardStep`s of one tree; owns the decode plan between steps."""

    def __init__(self, tree: PrefixTree, device: torch.device, group: int):
        self.tree = tree
        self.device = device
        self.group = group  # query heads per KV head
        self.plan: DecodePlan | None = None
        self.num_plan_rebuilds = 0
        self.num_plan_updates = 0

    def prefill(self, segments: list[tuple[int, int, int, int, int]], num_q_tokens: int,
                past_len: int = 0) -> ForwardStep:
        """segments: (seq_id, token_start, q_start, num_tokens, write_from) each, over a
        flattened batch of `num_q_tokens` tokens.

        Token `token_start + j` of the flattened batch is position `q_start + j` of its
        sequence; positions from `write_from` on are new and get their K/V stored.
        Sequences that share a prefix and lie next to each other in the batch read it
        together (the context phase of `ops/prefill_plan.py`).
        """
        index, chunks, offsets = [], [], []
        for seq_id, token_start, q_start, num_tokens, write_from in segments:
            seq_chunks, seq_offsets = self.tree.slots(seq_id, write_from, q_start + num_tokens)
            index.extend(range(token_start + write_from - q_start, token_start + num_tokens))
            chunks.extend(seq_chunks)
            offsets.extend(seq_offsets)
        write_index, write_chunk, write_offset = to_device([index, chunks, offsets], torch.long, self.device)
        return ForwardStep(
            write_token_index=write_index,
            write_chunk=write_chunk,
            write_offset=write_offset,
            prefill=build_prefill_plan(
                [[(id(n), n.chunk_id, n.start, len(n.tokens)) for n in self.tree.path(s)] for s, *_ in segments],
                [(t, q, n) for _, t, q, n, _ in segments], self.group, num_q_tokens=num_q_tokens,
                num_kv_heads=self.tree.pool.num_kv_heads, device=self.device, chunk_size=self.tree.chunk_size,
            ),
            past_len=past_len,
        )

    def decode(self, tokens_by_seq: dict[int, int]) -> ForwardStep:
        """Append one token to each sequence; the step's plan orders them depth-first.

        Raises `KVCacheFull` (nothing changed) when a new chunk is needed and none is free.
        """
        seq_ids = list(tokens_by_seq)
        chunk_ids, offsets = self.tree.append(seq_ids, [tokens_by_seq[s] for s in seq_ids])
        slot = dict(zip(seq_ids, zip(chunk_ids, offsets)))
        plan = self._decode_plan(seq_ids)
        write_chunk, write_offset = to_device(
            [[slot[s][0] for s in plan.seq_ids], [slot[s][1] for s in plan.seq_ids]], torch.long, self.device
        )
        return ForwardStep(
            write_token_index=torch.arange(len(seq_ids), device=self.device),
            write_chunk=write_chunk,
            write_offset=write_offset,
            plan=plan,
        )

    def discard_plan(self) -> None:
        """After a rollback: the plan's lengths and chunk tables ran ahead of the tree."""
        self.plan = None

    def _decode_plan(self, seq_ids: list[int]) -> DecodePlan:
        """The plan for this decode step: rebuilt after joins and leaves, else updated."""
        events = self.tree.take_node_events()
        plan = self.plan
        if (
            plan is not None
            and plan.structure_version == self.tree.structure_version
            and len(seq_ids) == plan.num_seqs
            and all(s in plan.row_of for s in seq_ids)
        ):
            if events:
                plan.add_private_nodes(events)
                self.num_plan_updates += 1
            plan.advance()
            return plan
        self.plan = build_decode_plan(self.tree, seq_ids, device=self.device, group=self.group)
        self.num_plan_rebuilds += 1
        return self.plan
