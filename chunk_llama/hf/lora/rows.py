"""Each sequence's adapter in a `ChunkCache`, and the step's rows by adapter (`AdapterRows`,
a mixin of it).

Where the engine assigns adapters per request (`cache.adapters`, an `AdapterRegistry` that
manages rows), a sequence is inserted under its adapter's identity (the prefix tree's key),
and every step built for the engine carries its rows' adapters (`step.lora`: in a decode
step the plan's order, in a prefill the packed order, which puts each adapter's sequences
together). Before each step, K/V that no weights compute any more are forgotten: those of an
adapter PEFT wrote in place, everything when PEFT merged adapters into the base.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from chunk_llama.ops.lora import LoraRows

logger = logging.getLogger(__name__)


class AdapterRows:
    """The adapter bookkeeping of `ChunkCache` (which holds `tree`)."""

    adapters = None  # an AdapterRegistry, set by the engine

    @property
    def rows_managed(self) -> bool:
        """Whether this cache's steps assign adapters per row (the engine's, over a registry)."""
        return self.adapters is not None and self.adapters.rows_managed

    def adapter_of(self, seq_id: int):
        """The adapter a sequence runs under (None: the base)."""
        return self._lora_of.get(seq_id)

    @staticmethod
    def key_of(adapter) -> str | None:
        """The prefix tree's key for K/V an adapter computes (None: the base weights)."""
        return None if adapter is None else adapter.identity

    def _note_adapter(self, seq_id: int, adapter) -> None:
        if adapter is not None:
            if not self.rows_managed:
                raise ValueError("this cache runs no adapter per sequence (create it through an engine)")
            self._lora_of[seq_id] = adapter

    def _forget_adapter(self, seq_id: int) -> None:
        self._lora_of.pop(seq_id, None)

    def _forget_changed_weights(self) -> None:
        """(between steps) No K/V of weights that changed in place is matched again."""
        if not self.rows_managed:
            return
        base_changed, stale = self.adapters.take_stale()
        if base_changed:
            freed = self.tree.forget_prefixes()
            logger.info("chunk-llama: PEFT changed the base weights (merged adapters): the prefix cache forgot what "
                        "it held (%d retained chunks freed)", freed)
        for identity in stale:
            freed = self.tree.forget_key(identity)
            logger.info("chunk-llama: an adapter's weights were written in place: its cached prefixes are forgotten "
                        "(%d retained chunks freed)", freed)
        if len(self._lora_of) > 2 * self.tree.num_seqs + 64:  # (sequences a rolled-back step inserted)
            self._lora_of = {s: a for s, a in self._lora_of.items() if s in self.tree}

    def _packing_order(self, seq_ids: list[int], tokens_of: dict[int, list[int]]) -> list[int]:
        """A prefill's sequences in packed order: by key (the tree's root order), then tokens
        (a common prefix's sequences are neighbours and read it together)."""
        rank = {key: i for i, key in enumerate(self.tree.keys())}
        return sorted(seq_ids, key=lambda s: (rank[self.tree.key_of(s)], tokens_of[s]))

    def _lora_rows(self, runs: Iterable[tuple[int, int, int]], num_rows: int) -> LoraRows:
        """The step's rows by adapter from (seq_id, first row, rows) in row order (the step
        builder's, where `rows_managed`, which a cache's registry fixes when it is made). With
        no sequence under an adapter (a base-only engine) the runs are not read."""
        if not self._lora_of:
            return LoraRows((), num_rows)
        return LoraRows.from_runs([(start, start + count, self._lora_of.get(s)) for s, start, count in runs],
                                  num_rows)
