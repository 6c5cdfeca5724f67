"""The step context: everything one forward's layers read, built once per forward.

`StepBuilder` turns the tree's state into a `StepContext`: the forward's inputs, which
K/V slots it writes, its plan (decode or prefill) and the attention backend the cache
chose for it, already planned. While the forward runs, the context is this thread's
current step (`current_step()`), which the attention function and the linear layers
read; nano-vllm's `get_context()` is the model for this. The tensors a step fills sit
in the builder's `StaticBuffers`, at fixed addresses from step to step (what CUDA
graphs need).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from chunk_llama.kv import ChunkPool, PrefixTree
from chunk_llama.step.buffers import StaticBuffers
from chunk_llama.step.decode_plan import DecodePlan, build_decode_plan
from chunk_llama.step.prefill_plan import PrefillPlan, build_prefill_plan


@dataclass
class StepContext:
    """One forward's inputs, writes, plan and backend.

    input_ids, position_ids: [1, num_tokens] (prefill: sequences packed) or [batch, 1]
    write_token_index, write_chunk, write_offset: [num_writes] flattened token indices whose
        K/V are stored, and the slot of each
    decode / prefill: the step's plan (one of them); in decode, plan row i is batch row
        row_order[i] (None: the same order)
    attention: the backend chosen for the step, planned (`ops/dispatch.py`)
    linear: what the model's linear layers run in this forward (`ops/cpu/linear.py`), or None
        for F.linear
    past_len: tokens cached before this step (what `get_seq_length` reports meanwhile)
    q_dtype: what the attention takes queries in (the model's dtype; None: the pool's)
    lora: which rows run under which adapter (`ops/lora.py`), or None
    """

    pool: ChunkPool
    input_ids: torch.Tensor | None
    position_ids: torch.Tensor | None
    write_token_index: torch.Tensor
    write_chunk: torch.Tensor
    write_offset: torch.Tensor
    decode: DecodePlan | None = None
    prefill: PrefillPlan | None = None
    row_order: torch.Tensor | None = None
    inverse_row_order: torch.Tensor | None = None
    attention: object = None
    linear: Callable | None = None
    past_len: int = 0
    q_dtype: torch.dtype | None = None
    columns: int | None = None  # stock generate's rows: the batch's columns after this step
    # the rows' LoRA adapters (`ops/lora.py`'s LoraRows) where the engine assigns them per
    # request (no segment: every row runs the base); None: the layers compute as they are
    lora: object = None
    # layers whose K/V sit on another device (a model split by device_map): this step there
    for_device: Callable[["StepContext", torch.device], "StepContext"] | None = None
    moved: dict = field(default_factory=dict)
    # the fused decoder layers' K/V slots (token, chunk, offset), or why this step has none:
    # made by the first layer (`hf/fused/layers.py`)
    fused_writes: tuple | str | None = None
    # (Stack, its output) once a plain-loop decoder stack ran in one call (`hf/fused/stack.py`)
    fused_stack: tuple | None = None
    _rows: torch.Tensor | None = field(default=None, init=False, repr=False)  # not copied by dataclasses.replace

    def on(self, device: torch.device) -> "StepContext":
        """This step with its tensors and plan on `device`, made once per step and device."""
        step = self.moved.get(device)
        if step is None:
            step = self.moved[device] = self.for_device(self, device)
        return step

    @property
    def is_decode(self) -> bool:
        return self.decode is not None

    def store(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write this layer's new K/V into their slots.

        key_states, value_states: [batch, num_kv_heads, q_len, head_dim]
        """
        if key_states.device != self.write_chunk.device:
            return self.on(key_states.device).store(layer, key_states, value_states)
        rows = self._write_rows()
        if rows is None:
            return
        batch, num_kv_heads, q_len, head_dim = key_states.shape
        for cache, states in ((self.pool.k[layer], key_states), (self.pool.v[layer], value_states)):
            # [batch * q_len, num_kv_heads, head_dim] -> the written tokens' rows, [num_writes * num_kv_heads, head_dim]
            flat = states.transpose(1, 2).reshape(batch * q_len, num_kv_heads, head_dim)[self.write_token_index]
            # (a bfloat16 pool under a float32 model: rounded to nearest even, as the fused layer does)
            cache.view(-1, head_dim).index_copy_(0, rows, flat.reshape(-1, head_dim).to(cache.dtype))

    def _write_rows(self) -> torch.Tensor | None:
        """[num_writes * num_kv_heads] the written slots as rows of a layer's pool viewed as
        [capacity * num_kv_heads * chunk_size, head_dim] (one index_copy_ per layer and
        tensor, the same rows in every layer): computed once per step; None if nothing is written."""
        if self._rows is None and self.write_token_index.numel():
            heads = torch.arange(self.pool.num_kv_heads, device=self.write_chunk.device)
            chunk_size = self.pool.chunk_size
            self._rows = ((self.write_chunk[:, None] * self.pool.num_kv_heads + heads) * chunk_size
                          + self.write_offset[:, None]).reshape(-1)
        return self._rows

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               window: int = 0) -> torch.Tensor:
        """Attention of this step's queries over the cache of one layer (a query sees its
        `window` latest positions on a sliding-window layer; every earlier one if 0). `key`,
        `value`: the layer's new K/V as it computed them (the CUDA prefill of fresh prompts
        reads them instead of the pool).

        query: [batch, num_heads, q_len, head_dim]; key, value: [batch, num_kv_heads, q_len,
        head_dim]; returns [batch, q_len, num_heads, head_dim]
        """
        k_layer, v_layer = self.pool.k[layer], self.pool.v[layer]
        if k_layer.device != self.write_chunk.device:
            return self.on(k_layer.device).attend(layer, query, key, value, scale, window)
        batch, num_heads, q_len, head_dim = query.shape
        if self.decode is not None:
            q = query[:, :, 0, :]  # [num_seqs, num_heads, head_dim]
            if self.row_order is not None:
                q = q[self.row_order]
            out = self.attention.run(q.to(self.q_dtype or k_layer.dtype), k_layer, v_layer, scale, window)
            if self.inverse_row_order is not None:
                out = out[self.inverse_row_order]
            return out.to(query.dtype).unsqueeze(1)
        # [batch * q_len, num_heads, head_dim] and [batch * q_len, num_kv_heads, head_dim]
        flat = lambda x: x.transpose(1, 2).reshape(batch * q_len, x.shape[1], head_dim)  # noqa: E731
        out = self.attention.run(flat(query).to(self.q_dtype or k_layer.dtype), k_layer, v_layer, scale, window,
                                 (flat(key), flat(value)))
        return out.view(batch, q_len, num_heads, head_dim).to(query.dtype)


class StepBuilder:
    """Makes the `StepContext`s of one tree; owns the decode plan between steps and the
    step's buffers."""

    def __init__(self, tree: PrefixTree, group: int):
        self.tree = tree
        self.pool = tree.pool
        self.device = tree.pool.device
        self.group = group  # query heads per KV head
        self.buffers = StaticBuffers(self.device)
        self.plan: DecodePlan | None = None
        self.num_plan_rebuilds = 0
        self.num_plan_updates = 0

    def prefill(self, segments: list[tuple[int, int, int, int, int]], num_q_tokens: int, past_len: int = 0,
                inputs: tuple[list[int], list[int]] | None = None) -> StepContext:
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
        return StepContext(self.pool, *self._inputs(inputs, (1, num_q_tokens)), *self._writes(index, chunks, offsets),
                           prefill=plan, past_len=past_len)

    def decode(self, tokens_by_seq: dict[int, int], positions: dict[int, int] | None = None) -> StepContext:
        """Append one token to each sequence; the step's plan orders them depth-first, and
        `input_ids` / `position_ids` ([num_seqs, 1], in that order) hold the tokens and
        `positions` (if given).

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
        return StepContext(self.pool, *self._inputs(inputs, (len(order), 1)),
                           *self._writes(range(len(order)), [slot[s][0] for s in order],
                                         [slot[s][1] for s in order]), decode=plan)

    def discard_plan(self) -> None:
        """After a rollback: the plan's lengths and chunk tables ran ahead of the tree."""
        self.plan = None

    def _inputs(self, inputs, shape) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if inputs is None:
            return None, None
        ids, positions = inputs
        both = self.buffers.fill("inputs", ids + positions)  # one copy for the two
        return both[: len(ids)].view(shape), both[len(ids):].view(shape)

    def _writes(self, index, chunks, offsets) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The flattened token index, chunk and slot of each K/V write: one copy, three views."""
        index = list(index)
        n = len(index)
        writes = self.buffers.fill("writes", index + chunks + offsets)
        return writes[:n], writes[n: 2 * n], writes[2 * n:]

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


_current = threading.local()


def current_step() -> StepContext | None:
    """The step whose forward this thread is running, or None (a stock forward)."""
    return getattr(_current, "step", None)


@contextlib.contextmanager
def running(step: StepContext):
    """Make `step` this thread's current step for the duration of its forward."""
    outer = current_step()
    _current.step = step
    try:
        yield step
    finally:
        _current.step = outer
