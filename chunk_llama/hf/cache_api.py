"""The transformers `Cache` methods of `ChunkCache` (a mixin of it): what a forward's layers
and stock `generate` call on a cache. K/V are stored through the prepared step (the
layers' `update`); lengths are the step's or, under stock generate, the batch's columns;
what a chunk pool cannot do (beam search, cropping, reordering) says so.
"""

from __future__ import annotations

import torch

from chunk_llama.step import current_step


class CacheApi:
    """`Cache`'s methods for `ChunkCache` (which holds `_step`, `pool`, `geometry`,
    `num_layers` and `_columns`)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store this step's new K/V of one layer; returns them (the attention function
        receives them as `key`, `value`).

        key_states, value_states: [batch, num_kv_heads, q_len, head_dim]
        """
        step = self._step
        if step is None or current_step() is not step:
            raise RuntimeError(
                "ChunkCache.update outside a prepared step of a patched model's forward: call "
                "chunk_llama.patch_model(model) before using ChunkCache with the model"
            )
        k_layer = self.pool.k[layer_idx]
        if key_states.device != k_layer.device or key_states.dtype != self.geometry.dtype:
            raise ValueError(
                f"the model computes {key_states.dtype} on {key_states.device} but this ChunkCache was made for "
                f"{self.geometry.dtype} on {k_layer.device}; create the cache (or engine) after moving the model"
            )
        step.store(layer_idx, key_states, value_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens before the current step: under stock generate, the batch's columns so far
        (left padding included, as transformers counts them)."""
        if self._step is not None:
            return self._step.past_len
        return self._columns

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

    @property
    def is_croppable(self) -> bool:
        return False

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError(
            "ChunkCache does not support beam search, cache cropping or reordering "
            "(use greedy or sampling with num_return_sequences instead)"
        )

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported
