"""What a `ChunkCache` answers to transformers' `Cache` interface besides storing K/V
(`CacheAnswers`, a mixin of it): the lengths transformers reads while it builds a forward's
inputs, and the flags and operations it does not support."""

from __future__ import annotations


class CacheAnswers:
    """The `Cache` methods and properties of `ChunkCache` (which sets `_step`, `_columns`,
    `num_layers`)."""

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
