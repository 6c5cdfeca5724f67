"""`ChunkCache`: a transformers `Cache` whose storage is the chunk pool and prefix tree.

Two ways to drive it:
- the engine calls `add_sequence` / `begin_prefill` / `begin_decode` / `remove_sequence`
  around each forward pass, with sequences identified by id;
- stock `model.generate(..., past_key_values=ChunkCache(model))` on a patched model:
  a forward pre-hook (see `patch.py`) passes `input_ids` to `begin_rows`, and each
  batch row is one sequence. Rows with equal prefixes share chunks.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from chunk_llama.hf.step import ForwardStep, Segment
from chunk_llama.kv import ChunkPool, KVCacheFull, PrefixTree, build_decode_plan
from chunk_llama.kv.plan import DecodePlan, to_device
from chunk_llama.models import check_supported, default_kv_cache_bytes, kv_geometry
from chunk_llama.ops import prefill_attention, tpp_decode_attention


class ChunkCache(Cache):
    """Prefix-aware KV cache for a Llama-family model.

    Args:
        model: the (patched or not) model, or its config.
        chunk_size: tokens per chunk (positive).
        kv_cache_bytes: memory budget for K and V of all layers; default from free memory.
        dtype, device: of the pool; default the model's.
        retain_prefixes: keep finished sequences' full chunks as an LRU prefix cache.
    """

    def __init__(
        self,
        model,
        *,
        chunk_size: int = 64,
        kv_cache_bytes: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        retain_prefixes: bool = False,
    ):
        config = getattr(model, "config", model)
        check_supported(config)
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        dtype = dtype or getattr(model, "dtype", None) or torch.float32
        device = torch.device(device or getattr(model, "device", "cpu"))
        num_layers, num_kv_heads, head_dim = kv_geometry(config)
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
        )
        self.tree = PrefixTree(self.pool, retain_prefixes=retain_prefixes)
        self.num_plan_rebuilds = 0
        self.num_plan_updates = 0
        self._group = config.num_attention_heads // num_kv_heads
        self._plan: DecodePlan | None = None
        self._step: ForwardStep | None = None
        self._row_seq_ids: list[int] = []  # generate mode: sequence of each batch row

    # ------------------------------------------------------------ engine API
    @property
    def chunk_size(self) -> int:
        return self.pool.chunk_size

    @property
    def in_step(self) -> bool:
        return self._step is not None

    def add_sequence(self, seq_id: int, tokens: list[int]) -> int:
        """Insert a new sequence; returns how many leading tokens need no compute.

        The last token is always computed so that the forward yields its logits.
        Raises `KVCacheFull` (nothing changed) when the pool cannot hold it.
        """
        return self.tree.insert(seq_id, tokens, max_match=len(tokens) - 1)

    def remove_sequence(self, seq_id: int) -> None:
        self.tree.remove(seq_id)

    def begin_prefill(self, seq_ids: list[int], starts: list[int]):
        """Prepare a packed prefill of tokens `[start, len)` of each sequence.

        returns input_ids [1, num_tokens], position_ids [1, num_tokens] and
        last_index [num_seqs] (the flattened index of each sequence's last token).
        """
        ids, positions, last_index, segments = [], [], [], []
        for seq_id, start in zip(seq_ids, starts):
            tokens = self.tree.tokens(seq_id)
            segments.append((seq_id, len(ids), start, len(tokens) - start, start))
            ids.extend(tokens[start:])
            positions.extend(range(start, len(tokens)))
            last_index.append(len(ids) - 1)
        self._step = self._prefill_step(segments, past_len=0)
        device = self.pool.device
        return (
            torch.tensor([ids], device=device),
            torch.tensor([positions], device=device),
            torch.tensor(last_index, device=device),
        )

    def begin_decode(self, tokens_by_seq: dict[int, int]) -> list[int]:
        """Append one token to each sequence and prepare a decode step.

        Returns the sequence ids in the row order the batch must use (depth-first,
        which lets the kernel slice queries per shared chunk). Raises `KVCacheFull`
        (nothing changed) when a new chunk is needed and none is free.
        """
        seq_ids = list(tokens_by_seq)
        chunk_ids, offsets = self.tree.append(seq_ids, [tokens_by_seq[s] for s in seq_ids])
        slot = dict(zip(seq_ids, zip(chunk_ids, offsets)))
        plan = self._decode_plan(seq_ids)
        device = self.pool.device
        write_chunk, write_offset = to_device(
            [[slot[s][0] for s in plan.seq_ids], [slot[s][1] for s in plan.seq_ids]], torch.long, device
        )
        self._step = ForwardStep(
            write_token_index=torch.arange(len(seq_ids), device=device),
            write_chunk=write_chunk,
            write_offset=write_offset,
            plan=plan,
        )
        return plan.seq_ids

    def end_step(self) -> None:
        self._step = None

    # -------------------------------------------------- generate (row) mode
    def begin_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Prepare a forward of stock `generate`: each batch row is one sequence."""
        if input_ids is None:
            raise ValueError("ChunkCache needs input_ids (inputs_embeds are not supported)")
        if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
            raise ValueError(
                "ChunkCache does not support padded batches (attention_mask has zeros); "
                "use ChunkLlamaEngine for prompts of different lengths"
            )
        batch, q_len = input_ids.shape
        rows = input_ids.tolist()
        if not self._row_seq_ids:
            # negative ids: engine sequences are >= 0, so the two never collide
            self._row_seq_ids = [-1 - r for r in range(batch)]
            matched = self._insert_rows(rows)
            segments = [(s, r * q_len, 0, q_len, m) for r, (s, m) in enumerate(zip(self._row_seq_ids, matched))]
            self._step = self._prefill_step(segments, past_len=0)
            return
        if batch != len(self._row_seq_ids):
            raise ValueError(
                f"this ChunkCache holds {len(self._row_seq_ids)} sequences but the batch has {batch} rows; "
                "use a new ChunkCache per generate call (beam search is not supported)"
            )
        past_len = self.tree.seq_len(self._row_seq_ids[0])
        if q_len == 1:
            order = self.begin_decode(dict(zip(self._row_seq_ids, (r[0] for r in rows))))
            row_of = {s: r for r, s in enumerate(self._row_seq_ids)}
            row_order = torch.tensor([row_of[s] for s in order], device=self.pool.device)
            step = self._step
            if not torch.equal(row_order, torch.arange(batch, device=row_order.device)):
                step.row_order = row_order
                step.inverse_row_order = torch.argsort(row_order)
                step.write_token_index = row_order
            step.past_len = past_len
            return
        for seq_id, row in zip(self._row_seq_ids, rows):
            self.tree.extend(seq_id, row)
        segments = [(s, r * q_len, past_len, q_len, past_len) for r, s in enumerate(self._row_seq_ids)]
        self._step = self._prefill_step(segments, past_len=past_len)

    def _insert_rows(self, rows: list[list[int]]) -> list[int]:
        matched = []
        try:
            for seq_id, row in zip(self._row_seq_ids, rows):
                matched.append(self.tree.insert(seq_id, row))
        except KVCacheFull:
            for seq_id in self._row_seq_ids[: len(matched)]:
                self.tree.remove(seq_id)
            self._row_seq_ids = []
            raise
        return matched

    # ------------------------------------------------------------ internals
    def _prefill_step(self, segments, past_len: int) -> ForwardStep:
        """segments: (seq_id, token_start, q_start, num_tokens, write_from) each.

        Token `token_start + j` of the flattened batch is position `q_start + j` of its
        sequence; positions from `write_from` on are new and get their K/V stored.
        """
        device = self.pool.device
        index, chunks, offsets = [], [], []
        for seq_id, token_start, q_start, num_tokens, write_from in segments:
            end = q_start + num_tokens
            seq_chunks, seq_offsets = self.tree.slots(seq_id, write_from, end)
            index.extend(range(token_start + write_from - q_start, token_start + num_tokens))
            chunks.extend(seq_chunks)
            offsets.extend(seq_offsets)
        return ForwardStep(
            write_token_index=torch.tensor(index, dtype=torch.long, device=device),
            write_chunk=torch.tensor(chunks, dtype=torch.long, device=device),
            write_offset=torch.tensor(offsets, dtype=torch.long, device=device),
            copies=self.tree.take_pending_copies(),
            segments=[
                Segment(t, n, q, torch.tensor(self.tree.chunk_ids(s), device=device))
                for s, t, q, n, _ in segments
            ],
            past_len=past_len,
        )

    def _decode_plan(self, seq_ids: list[int]) -> DecodePlan:
        """The plan for this decode step: rebuilt after joins and leaves, else updated."""
        events = self.tree.take_chunk_events()
        plan = self._plan
        if (
            plan is not None
            and plan.structure_version == self.tree.structure_version
            and len(seq_ids) == plan.num_seqs
            and all(s in plan.row_of for s in seq_ids)
        ):
            if events:
                plan.add_private_chunks(events)
                self.num_plan_updates += 1
            plan.advance()
            return plan
        self._plan = build_decode_plan(self.tree, seq_ids, device=self.pool.device, group=self._group)
        self.num_plan_rebuilds += 1
        return self._plan

    # ------------------------------------------------- transformers Cache API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store this step's new K/V of one layer.

        key_states, value_states: [batch, num_kv_heads, q_len, head_dim]
        """
        step = self._step
        if step is None:
            raise RuntimeError(
                "ChunkCache.update outside a prepared step: call chunk_llama.patch_model(model) "
                "before using ChunkCache with the model"
            )
        batch, num_kv_heads, q_len, head_dim = key_states.shape
        k_layer, v_layer = self.pool.k[layer_idx], self.pool.v[layer_idx]
        if key_states.device != k_layer.device or key_states.dtype != k_layer.dtype:
            raise ValueError(
                f"the model computes {key_states.dtype} on {key_states.device} but this ChunkCache holds "
                f"{k_layer.dtype} on {k_layer.device}; create the cache (or engine) after moving the model"
            )
        if step.write_token_index.numel():
            # [batch * q_len, num_kv_heads, head_dim] rows of the tokens to store
            flat_k = key_states.transpose(1, 2).reshape(batch * q_len, num_kv_heads, head_dim)
            flat_v = value_states.transpose(1, 2).reshape(batch * q_len, num_kv_heads, head_dim)
            k_layer[step.write_chunk, :, step.write_offset] = flat_k[step.write_token_index]
            v_layer[step.write_chunk, :, step.write_offset] = flat_v[step.write_token_index]
        for copy in step.copies:
            k_layer[copy.dst, :, : copy.num_tokens] = k_layer[copy.src, :, : copy.num_tokens]
            v_layer[copy.dst, :, : copy.num_tokens] = v_layer[copy.src, :, : copy.num_tokens]
        return key_states, value_states

    def attend(self, layer_idx: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of this step's queries over the cache.

        query: [batch, num_heads, q_len, head_dim]; returns [batch, q_len, num_heads, head_dim]
        """
        step = self._step
        k_layer, v_layer = self.pool.k[layer_idx], self.pool.v[layer_idx]
        batch, num_heads, q_len, head_dim = query.shape
        if step.is_decode:
            q = query[:, :, 0, :]  # [num_seqs, num_heads, head_dim]
            if step.row_order is not None:
                q = q[step.row_order]
            out = tpp_decode_attention(q.to(k_layer.dtype), k_layer, v_layer, step.plan, scale)
            if step.inverse_row_order is not None:
                out = out[step.inverse_row_order]
            return out.to(query.dtype).unsqueeze(1)
        flat_q = query.transpose(1, 2).reshape(batch * q_len, num_heads, head_dim).to(k_layer.dtype)
        out = torch.empty_like(flat_q)
        for seg in step.segments:
            rows = slice(seg.token_start, seg.token_start + seg.num_tokens)
            out[rows] = prefill_attention(flat_q[rows], k_layer, v_layer, seg.chunk_ids, seg.q_start, scale)
        return out.view(batch, q_len, num_heads, head_dim).to(query.dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self._step is not None:
            return self._step.past_len
        if self._row_seq_ids:
            return self.tree.seq_len(self._row_seq_ids[0])
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length()

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    def __len__(self) -> int:
        return self.num_layers

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError(
            "ChunkCache does not support beam search, cache cropping or reordering "
            "(use greedy or sampling with num_return_sequences instead)"
        )

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported
