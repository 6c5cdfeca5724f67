"""The step context: everything one forward's layers read, built complete once per forward,
then frozen.

`StepBuilder` (`builder.py`) turns the tree's state into a `StepContext`: the forward's
inputs, which K/V slots it writes, its plan (decode or prefill), the attention backend
chosen for it and already planned (the step's calls), the linear path, the query dtype, and
the same step for every other device the model's layers sit on. Nothing is added to it
afterwards (assigning to a field raises `dataclasses.FrozenInstanceError`); what a layer
works out once per step for itself lives with that layer's code (`hf/fused/per_step.py`).
While the forward runs, the context is this thread's current step (`current_step()`), which
the attention function and the linear layers read; nano-vllm's `get_context()` is the model
for this. The tensors a step fills sit in the builder's `StaticBuffers`, at fixed addresses
from step to step (what CUDA graphs need).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from chunk_llama.kv import ChunkPool
from chunk_llama.step.decode_plan import DecodePlan
from chunk_llama.step.prefill_plan import PrefillPlan

_NO_DEVICES: Mapping = MappingProxyType({})


@dataclass(frozen=True, eq=False)
class StepWrites:
    """The step's K/V writes, views of one buffer:
    token_index, chunk, offset: [num_writes] the flattened token index whose K/V are stored,
        and its slot
    pool_rows: [num_writes * num_kv_heads] those slots as rows of a layer's pool viewed as
        [capacity * num_kv_heads * chunk_size, head_dim] (one index_copy_ per layer and tensor)
    """

    token_index: torch.Tensor
    chunk: torch.Tensor
    offset: torch.Tensor
    pool_rows: torch.Tensor

    @property
    def slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token_index, chunk, offset): what a backend's plan takes for the fused layers."""
        return self.token_index, self.chunk, self.offset

    def to(self, device: torch.device) -> "StepWrites":
        return StepWrites(*(t.to(device, non_blocking=True) for t in (self.token_index, self.chunk, self.offset,
                                                                       self.pool_rows)))


@dataclass(frozen=True, eq=False)
class StepContext:
    """One forward's inputs, writes, plan and backend (identity-hashed: per-step state of
    other code is keyed by it).

    input_ids, position_ids: [1, num_tokens] (prefill: sequences packed) or [batch, 1], or None
        (the caller passes its own)
    writes: the K/V slots the step stores (`StepWrites`)
    decode / prefill: the step's plan (one of them); in decode, plan row i is batch row
        row_order[i] (None: the same order); inverse_row_order [batch]: its inverse
    attention: the step's calls of the backend chosen for it, planned (`ops/dispatch.py`):
        `run(q, k_cache, v_cache, scale, window, new_kv)` per layer
    linear: what the model's linear layers run in this forward (`ops/cpu/linear.py`), or None
        for F.linear
    q_dtype: what the attention takes queries in (the model's dtype)
    past_len: tokens cached before this step (what `get_seq_length` reports meanwhile)
    columns: stock generate's rows: the batch's columns after this step, or None
    lora: which rows run under which adapter (`ops/lora.py`'s `LoraRows`) where the engine
        assigns them per request (no segment: every row runs the base), or None: the layers
        compute as they are
    devices: this step for the layers whose K/V sit on another device (a model split by
        device_map), by device: its writes, plan and backend there
    """

    pool: ChunkPool
    input_ids: torch.Tensor | None
    position_ids: torch.Tensor | None
    writes: StepWrites
    attention: object
    q_dtype: torch.dtype
    linear: Callable | None = None
    decode: DecodePlan | None = None
    prefill: PrefillPlan | None = None
    row_order: torch.Tensor | None = None
    inverse_row_order: torch.Tensor | None = None
    past_len: int = 0
    columns: int | None = None
    lora: object = None
    devices: Mapping[torch.device, "StepContext"] = field(default_factory=lambda: _NO_DEVICES, repr=False)

    @property
    def is_decode(self) -> bool:
        return self.decode is not None

    @property
    def device(self) -> torch.device:
        """Where this step's writes and plan live."""
        return self.writes.chunk.device

    def on(self, device: torch.device) -> "StepContext":
        """This step for the layers on `device` (made when the step was built)."""
        step = self.devices.get(device)
        if step is None:
            raise RuntimeError(f"this step was built for {self.device} and {list(self.devices)}, not {device}: the "
                               f"cache's pool puts no layer there")
        return step

    def store(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write this layer's new K/V into their slots.

        key_states, value_states: [batch, num_kv_heads, q_len, head_dim]
        """
        if key_states.device != self.device:
            return self.on(key_states.device).store(layer, key_states, value_states)
        rows = self.writes.pool_rows
        if not rows.numel():
            return
        batch, num_kv_heads, q_len, head_dim = key_states.shape
        for cache, states in ((self.pool.k[layer], key_states), (self.pool.v[layer], value_states)):
            # [batch * q_len, num_kv_heads, head_dim] -> the written tokens' rows, [num_writes * num_kv_heads, head_dim]
            flat = states.transpose(1, 2).reshape(batch * q_len, num_kv_heads, head_dim)[self.writes.token_index]
            # (a 16-bit pool under a float32 model: rounded to nearest even, as the fused layer does)
            cache.view(-1, head_dim).index_copy_(0, rows, flat.reshape(-1, head_dim).to(cache.dtype))

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
        if k_layer.device != self.device:
            return self.on(k_layer.device).attend(layer, query, key, value, scale, window)
        batch, num_heads, q_len, head_dim = query.shape
        if self.decode is not None:
            q = query[:, :, 0, :]  # [num_seqs, num_heads, head_dim]
            if self.row_order is not None:
                q = q[self.row_order]
            out = self.attention.run(q.to(self.q_dtype), k_layer, v_layer, scale, window)
            if self.inverse_row_order is not None:
                out = out[self.inverse_row_order]
            return out.to(query.dtype).unsqueeze(1)
        # [batch * q_len, num_heads, head_dim] and [batch * q_len, num_kv_heads, head_dim]
        flat = lambda x: x.transpose(1, 2).reshape(batch * q_len, x.shape[1], head_dim)  # noqa: E731
        out = self.attention.run(flat(query).to(self.q_dtype), k_layer, v_layer, scale, window,
                                 (flat(key), flat(value)))
        return out.view(batch, q_len, num_heads, head_dim).to(query.dtype)


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
