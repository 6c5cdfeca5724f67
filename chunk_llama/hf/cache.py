"""`ChunkCache`: a transformers `Cache` whose storage is the chunk pool and prefix tree.

Two ways to drive it:
- the engine calls `add_sequence` / `begin_prefill` / `begin_decode` / `remove_sequence`
  around each forward pass, with sequences identified by id;
- stock `model.generate(..., past_key_values=ChunkCache(model))` on a patched model:
  the patched forward (see `patch.py`) passes `input_ids` to `begin_rows`, and each
  batch row is one sequence. Rows with equal prefixes share chunks.

Every forward is one atomic step of the tree: the first change after the last
step ended opens it, and `end_step` ends it, committed when the forward completed
(and, in the engine, its tokens were chosen) or rolled back when anything raised,
so no later request can ever read K/V that a failed forward left half written.
Under stock `generate` the patched forward ends its steps; the engine ends its own. Each
step is a `StepContext` (`step/context.py`), built complete once per forward by the step
builder, with the attention backend `CacheBackends` chooses planned for it
(`ops/dispatch.py`); the layers store their K/V through `update` and attend through
`hf/attention.py`, both on that context.
"""

from __future__ import annotations

import logging

import torch
from transformers.cache_utils import Cache

from chunk_llama.gguf.weights import integer_activations
from chunk_llama.hf.adapters import WeightsKey
from chunk_llama.hf.cache_api import CacheApi
from chunk_llama.hf.lora.rows import AdapterRows
from chunk_llama.hf.rows import GenerateRows
from chunk_llama.hf.support import (
    check_supported,
    default_kv_cache_bytes,
    kv_geometry,
    layer_devices,
    resolve_kv_dtype,
)
from chunk_llama.kv import ChunkPool, PrefixTree
from chunk_llama.ops.dispatch import CacheBackends, Geometry
from chunk_llama.step import StaticBuffers, StepBuilder, StepContext

logger = logging.getLogger(__name__)


class ChunkCache(GenerateRows, AdapterRows, CacheApi, Cache):
    """Prefix-aware KV cache for a causal LM that `patch_model` accepts.

    Args:
        model: the (patched or not) model, or its config.
        chunk_size: tokens per chunk (positive).
        kv_cache_bytes: memory budget for K and V of all layers; default from free memory.
        kv_dtype: the pool's dtype: auto (default: the model's, float16 where its GGUF blocks
            multiply integer activations on the CPU), or bfloat16 or float16 under a float32
            model on the CPU (`hf.support.resolve_kv_dtype`).
        device: of the pool; default the model's.
        retain_prefixes: keep finished sequences' chunks as an LRU prefix cache.
        token_granular: share a common prefix to the token, also where it ends inside a
            chunk (default: yes, but on CUDA, whose kernels take whole chunks only).
        adapters: the engine's `AdapterRegistry` (`hf/lora/`): its sequences run under
            adapters of their own, each keyed by its identity (None: the model as it is).
    """

    def __init__(
        self,
        model,
        *,
        chunk_size: int = 64,
        kv_cache_bytes: int | None = None,
        kv_dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        retain_prefixes: bool = False,
        token_granular: bool | None = None,
        adapters=None,
    ):
        config = getattr(model, "config", model)
        check_supported(config)
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        num_layers, num_kv_heads, head_dim = kv_geometry(config)
        placed = None  # each layer's K/V where that layer runs (a model split by device_map)
        if device is None and isinstance(model, torch.nn.Module):
            placed = layer_devices(model, num_layers)
        device = torch.device(device or (placed[0] if placed else getattr(model, "device", "cpu")))
        model_dtype = model.dtype if isinstance(model, torch.nn.Module) else None
        integer = isinstance(model, torch.nn.Module) and integer_activations(model)
        dtype = resolve_kv_dtype(kv_dtype, model_dtype, device, integer)
        model_dtype = model_dtype or dtype  # a config alone: the model computes in the pool's dtype
        per_chunk = ChunkPool.bytes_per_chunk_for(num_layers, num_kv_heads, head_dim, chunk_size, dtype)
        if kv_cache_bytes is None:
            kv_cache_bytes = default_kv_cache_bytes(config, device, per_chunk // chunk_size)
        if not isinstance(kv_cache_bytes, int) or isinstance(kv_cache_bytes, bool):
            raise TypeError(f"kv_cache_bytes must be an int, got {type(kv_cache_bytes).__name__}")
        if kv_cache_bytes < per_chunk:
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} is too small: one chunk of {chunk_size} tokens "
                f"takes {per_chunk} bytes across {num_layers} layers"
            )
        super().__init__(layers=[])
        self.config = config
        self.num_layers = num_layers
        self.pool = ChunkPool(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            chunk_size=chunk_size,
            capacity=kv_cache_bytes // per_chunk,
            dtype=dtype,
            device=device,
            layer_devices=placed,
        )
        if token_granular is None:
            token_granular = device.type != "cuda"
            if not token_granular:
                logger.info("chunk-llama: prefixes are shared by whole chunks on %s (its kernels take whole chunks)",
                            device)
        self.tree = PrefixTree(self.pool, retain_prefixes=retain_prefixes, token_granular=token_granular)
        self.geometry = Geometry(self.pool.device, model_dtype, config.num_attention_heads, num_kv_heads,
                                 head_dim, chunk_size, dtype)
        self.adapters = adapters
        buffers = StaticBuffers(self.pool.device)  # the steps' inputs and plans, and the kernels' workspace
        self._builder = StepBuilder(self.tree, config.num_attention_heads // num_kv_heads,
                                    CacheBackends(self.geometry, buffers), buffers,
                                    lora_rows=self._lora_rows if self.rows_managed else None)
        # (PEFT's adapters applied to every row: a change forgets everything; not where the engine
        # assigns adapters per row, whose K/V are keyed by each adapter's identity)
        self._weights_key = WeightsKey(model) if isinstance(model, torch.nn.Module) and not self.rows_managed \
            else None
        self._weights_seen = self._weights_key() if self._weights_key is not None else None
        self._lora_of: dict = {}  # sequence -> its adapter, where the engine assigns them (`lora/rows.py`)
        self._plan_counters_at_open = (0, 0)
        self._step: StepContext | None = None
        self._row_seq_ids: list[int] = []  # generate mode: sequence of each batch row
        self._columns = 0  # generate mode: columns of the batch so far, left padding included

    # ------------------------------------------------------------ engine API
    @property
    def chunk_size(self) -> int:
        return self.pool.chunk_size

    @property
    def in_step(self) -> bool:
        """Whether a forward step is prepared (the layers attend through the tree)."""
        return self._step is not None

    @property
    def step(self) -> StepContext | None:
        """The prepared step (what the next forward's layers read), or None."""
        return self._step

    def _begin(self, step: StepContext) -> StepContext:
        """`step` (built complete: its backend chosen and planned) becomes the prepared one."""
        self._step = step
        return step

    @property
    def num_plan_rebuilds(self) -> int:
        return self._builder.num_plan_rebuilds

    @property
    def num_plan_updates(self) -> int:
        return self._builder.num_plan_updates

    def add_sequence(self, seq_id: int, tokens: list[int], adapter=None) -> int:
        """Insert a new sequence, computed under `adapter` (a `LoraAdapter` of the engine's
        registry; None: the base); returns how many leading tokens need no compute (K/V the
        same adapter computed for the same prefix).

        The last token is always computed so that the forward yields its logits.
        Raises `KVCacheFull` (nothing changed) when the pool cannot hold it.
        """
        self._open_step()
        cached = self.tree.insert(seq_id, tokens, max_match=len(tokens) - 1, key=self.key_of(adapter))
        self._note_adapter(seq_id, adapter)
        return cached

    def extend_sequence(self, seq_id: int, tokens: list[int]) -> None:
        """Add the next piece of a sequence's prompt (chunked prefill), to be computed by
        `begin_prefill` from its old length. Raises `KVCacheFull` (nothing changed)."""
        self._open_step()
        self.tree.extend(seq_id, tokens)

    def append_tokens(self, tokens_by_seq: dict[int, int]) -> None:
        """Append one token to each sequence, to be computed by the next `begin_prefill`
        (a mixed step: decode tokens beside prompt pieces). Raises `KVCacheFull` (nothing
        changed) when a new chunk is needed and none is free."""
        self._open_step()
        self.tree.append(list(tokens_by_seq), list(tokens_by_seq.values()))

    def remove_sequence(self, seq_id: int) -> None:
        self.tree.remove(seq_id)
        self._forget_adapter(seq_id)

    def begin_prefill(self, seq_ids: list[int], starts: list[int]):
        """Prepare a packed prefill of tokens `[start, len)` of each sequence.

        returns input_ids [1, num_tokens], position_ids [1, num_tokens] and
        last_index [num_seqs] (the flattened index of each sequence's last token, in the
        order of `seq_ids`).
        """
        ids, positions, last_of, segments = [], [], {}, []
        tokens_of = {s: self.tree.tokens(s) for s in seq_ids}
        start_of = dict(zip(seq_ids, starts))
        # packed by key, then in token order: sequences with a common prefix are neighbours and read
        # it together, and each adapter's rows are one run
        for seq_id in self._packing_order(seq_ids, tokens_of):
            tokens, start = tokens_of[seq_id], start_of[seq_id]
            segments.append((seq_id, len(ids), start, len(tokens) - start, start))
            ids.extend(tokens[start:])
            positions.extend(range(start, len(tokens)))
            last_of[seq_id] = len(ids) - 1
        step = self._begin(self._builder.prefill(segments, len(ids), inputs=(ids, positions)))
        last_index = torch.tensor([last_of[s] for s in seq_ids], device=self.pool.device)
        return step.input_ids, step.position_ids, last_index

    def begin_decode(self, tokens_by_seq: dict[int, int], positions: dict[int, int] | None = None) -> list[int]:
        """Append one token to each sequence and prepare a decode step (`step.input_ids` and,
        given each sequence's position, `step.position_ids` hold the batch's inputs).

        Returns the sequence ids in the row order the batch must use (depth-first,
        which lets the kernel slice queries per shared chunk). Raises `KVCacheFull`
        (nothing changed) when a new chunk is needed and none is free.
        """
        self._open_step()
        return self._begin(self._builder.decode(tokens_by_seq, positions)).decode.seq_ids

    def end_step(self, completed: bool) -> None:
        """End the step: commit it if its forward completed, else roll it back, so the
        tree, the pool and the counters are as they were before it (a no-op when no step
        is open, e.g. when it was already ended)."""
        step, self._step = self._step, None
        if not self.tree.in_step:
            return
        if completed:
            self.tree.commit()
            if step is not None and step.columns is not None:
                self._columns = step.columns  # stock generate's rows: columns seen, padding included
            return
        self.tree.rollback()
        self._builder.discard_plan()
        self._builder.num_plan_rebuilds, self._builder.num_plan_updates = self._plan_counters_at_open
        if any(seq_id not in self.tree for seq_id in self._row_seq_ids):
            self._row_seq_ids, self._columns = [], 0  # the first forward of stock generate failed

    def savepoint(self) -> int:
        """A mark in the current step (opened if needed) for `rollback_to`."""
        self._open_step()
        return self.tree.savepoint()

    def rollback_to(self, savepoint: int) -> None:
        """Undo what the current step did after `savepoint` (e.g. a request that does not fit)."""
        self.tree.rollback(savepoint)

    def _open_step(self) -> None:
        if not self.tree.in_step:
            self._forget_changed_weights()
            key = self._weights_key() if self._weights_key is not None else None
            if key != self._weights_seen:  # adapters changed: no K/V of the old weights is served again
                freed = self.tree.forget_prefixes()
                logger.info("chunk-llama: the model's adapters changed: the prefix cache forgot what it held "
                            "(%d retained chunks freed)", freed)
                self._weights_seen = key
            self.tree.begin_step()
            self._plan_counters_at_open = (self._builder.num_plan_rebuilds, self._builder.num_plan_updates)
