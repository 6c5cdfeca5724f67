"""`StepBuilder`: a tree's steps, each built complete (`StepContext`, `context.py`).

A step is built in one place: the tree's new slots and the plan (kept between decode steps
and advanced, rebuilt when sequences join or leave), the inputs and writes copied into the
builder's `StaticBuffers` (one copy each, at fixed addresses), then the attention backend the
cache's `StepBackends` chooses, planned on the step's plan (the step's calls), the linear
path read once for the step, and the same for every other device a model split by
device_map keeps K/V on.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Protocol

import torch

from chunk_llama.kv import PrefixTree
from chunk_llama.step.buffers import StaticBuffers
from chunk_llama.step.context import StepContext, StepWrites
from chunk_llama.step.decode_plan import DecodePlan, build_decode_plan
from chunk_llama.step.prefill_plan import PrefillPlan, build_prefill_plan


class StepBackends(Protocol):
    """What a step runs, chosen by the cache once per step (`ops/dispatch.py` `CacheBackends`)."""

    q_dtype: torch.dtype  # what the attention takes queries in

    def attention(self, plan: DecodePlan | PrefillPlan, device: torch.device, capacity: int, writes: StepWrites,
                  row_order: torch.Tensor | None):
        """The backend for `plan` on `device`, planned: the step's calls (`run` per layer)."""

    def linear(self) -> Callable | None:
        """The model's linear path for this step (None: F.linear)."""


class StepBuilder:
    """Makes the `StepContext`s of one tree; owns the decode plan between steps and the
    step's buffers (`buffers`: given to share them with the backends' workspace).
    `lora_rows(runs, num_rows)`: the step's rows by adapter (`ops/lora.py`'s `LoraRows`) from
    an iterable of (seq_id, first row, rows) in row order; None where no registry assigns
    adapters per row (`step.lora` None: the layers compute as they are, and the runs are not
    listed)."""

    def __init__(self, tree: PrefixTree, group: int, backends: StepBackends, buffers: StaticBuffers | None = None,
                 lora_rows: Callable[[list[tuple[int, int, int]], int], object] | None = None):
        self.tree = tree
        self.pool = tree.pool
        self.device = tree.pool.device
        self.group = group  # query heads per KV head
        self.backends = backends
        self.buffers = buffers or StaticBuffers(self.device)
        self.lora_rows = lora_rows
        self.plan: DecodePlan | None = None
        self.num_plan_rebuilds = 0
        self.num_plan_updates = 0

    def prefill(self, segments: list[tuple[int, int, int, int, int]], num_q_tokens: int, past_len: int = 0,
                inputs: tuple[list[int], list[int]] | None = None, columns: int | None = None) -> StepContext:
        """segments: (seq_id, token_start, q_start, num_tokens, write_from) each, over a
        flattened batch of `num_q_tokens` tokens; inputs: the batch's token ids and
        positions, to fill `input_ids` and `position_ids` ([1, num_q_tokens]).

        Token `token_start + j` of the flattened batch is position `q_start + j` of its
        sequence; positions from `write_from` on are new and get their K/V stored.
        Sequences that share a prefix and lie next to each other in the batch read it
        together (the context phase of the CPU kernel, `prefill_schedule.py`).
        """
        index, chunks, offsets = [], [], []
        for seq_id, token_start, q_start, num_tokens, write_from in segments:
            seq_chunks, seq_offsets = self.tree.slots(seq_id, write_from, q_start + num_tokens)
            index.extend(range(token_start + write_from - q_start, token_start + num_tokens))
            chunks.extend(seq_chunks)
            offsets.extend(seq_offsets)
        plan = build_prefill_plan(
            [[(id(n), n.chunk_id, n.start, len(n.tokens)) for n in self.tree.path(s)] for s, *_ in segments],
            [(t, q, n) for _, t, q, n, _ in segments], self.group, num_q_tokens=num_q_tokens,
            num_kv_heads=self.pool.num_kv_heads, device=self.device, chunk_size=self.tree.chunk_size,
            buffers=self.buffers,
        )
        writes, _, _ = self._writes(index, chunks, offsets)
        lora = None if self.lora_rows is None else \
            self.lora_rows(((s, token_start, n) for s, token_start, _, n, _ in segments), num_q_tokens)
        return self._context(self._inputs(inputs, (1, num_q_tokens)), writes, prefill=plan, past_len=past_len,
                             columns=columns, lora=lora)

    def decode(self, tokens_by_seq: dict[int, int], positions: dict[int, int] | None = None,
               batch_rows: dict[int, int] | None = None, past_len: int = 0,
               columns: int | None = None) -> StepContext:
        """Append one token to each sequence; the step's plan orders them depth-first, and
        `input_ids` / `position_ids` ([num_seqs, 1], in that order) hold the tokens and
        `positions` (if given). batch_rows: each sequence's row in the caller's batch (stock
        generate's rows), when the batch keeps its own order: plan row i is then batch row
        `row_order[i]`, whose K/V it writes.

        Raises `KVCacheFull` (nothing changed) when a new chunk is needed and none is free.
        """
        seq_ids = list(tokens_by_seq)
        chunk_ids, offsets = self.tree.append(seq_ids, [tokens_by_seq[s] for s in seq_ids])
        slot = dict(zip(seq_ids, zip(chunk_ids, offsets)))
        plan = self._decode_plan(seq_ids)
        order = plan.seq_ids
        inputs = None
        if positions is not None:
            inputs = ([tokens_by_seq[s] for s in order], [positions[s] for s in order])
        rows = list(range(len(order))) if batch_rows is None else [batch_rows[s] for s in order]
        reordered = rows != list(range(len(order)))
        writes, row_order, inverse = self._writes(rows, [slot[s][0] for s in order], [slot[s][1] for s in order],
                                                  reordered)
        lora = None if self.lora_rows is None else \
            self.lora_rows(((s, row, 1) for row, s in enumerate(order)), len(order))
        return self._context(self._inputs(inputs, (len(order), 1)), writes, decode=plan, row_order=row_order,
                             inverse_row_order=inverse, past_len=past_len, columns=columns, lora=lora)

    def discard_plan(self) -> None:
        """After a rollback: the plan's lengths and chunk tables ran ahead of the tree."""
        self.plan = None

    def _context(self, inputs, writes: StepWrites, **fields) -> StepContext:
        """The step, complete: its backend chosen and planned on this device and on every other
        device the pool keeps layers on (each with its writes and plan copied there once)."""
        plan = fields.get("decode") or fields["prefill"]
        backends, capacity, linear = self.backends, self.pool.capacity, self.backends.linear()
        devices = {}
        for device in dict.fromkeys(self.pool.layer_devices):
            if device == self.device:
                continue
            moved = {key: _moved(value, device) for key, value in fields.items()}
            moved_writes = writes.to(device)
            devices[device] = StepContext(
                self.pool, None, None, moved_writes,
                backends.attention(moved.get("decode") or moved["prefill"], device, capacity, moved_writes,
                                   moved.get("row_order")), backends.q_dtype, linear, **moved)
        attention = backends.attention(plan, self.device, capacity, writes, fields.get("row_order"))
        return StepContext(self.pool, *inputs, writes, attention, backends.q_dtype, linear,
                           devices=MappingProxyType(devices), **fields)

    def _inputs(self, inputs, shape) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if inputs is None:
            return None, None
        ids, positions = inputs
        both = self.buffers.fill("inputs", ids + positions)  # one copy for the two
        return both[: len(ids)].view(shape), both[len(ids):].view(shape)

    def _writes(self, index, chunks: list[int], offsets: list[int], reordered: bool = False):
        """The step's writes (`StepWrites`: each written token's flattened index, chunk, slot and
        pool rows) and, where `reordered`, the row order (`index`: plan row i's batch row) and
        its inverse: one copy, views of one buffer."""
        index = list(index)
        n, heads, chunk_size = len(index), self.pool.num_kv_heads, self.pool.chunk_size
        pool_rows = [(chunk * heads + head) * chunk_size + offset for chunk, offset in zip(chunks, offsets)
                     for head in range(heads)]
        order = []
        if reordered:
            inverse = [0] * n
            for plan_row, batch_row in enumerate(index):
                inverse[batch_row] = plan_row
            order = index + inverse
        values = self.buffers.fill("writes", index + chunks + offsets + pool_rows + order)
        ends = [n, 2 * n, 3 * n, 3 * n + len(pool_rows)]
        writes = StepWrites(values[:ends[0]], values[ends[0]:ends[1]], values[ends[1]:ends[2]],
                            values[ends[2]:ends[3]])
        if not reordered:
            return writes, None, None
        return writes, values[ends[3]: ends[3] + n], values[ends[3] + n:]

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
        self.plan = build_decode_plan(self.tree, seq_ids, device=self.device, group=self.group, buffers=self.buffers)
        self.num_plan_rebuilds += 1
        return self.plan


def _moved(value, device: torch.device):
    """A step field on `device`: tensors copied (asynchronously), plans repacked there."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    return value.to(device) if isinstance(value, (DecodePlan, PrefillPlan)) else value
