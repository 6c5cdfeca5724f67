"""Per-forward metadata: which K/V slots to write and how each layer attends.

Built once before a forward pass (by the engine, or from `input_ids` when stock
`generate` drives the cache) and read by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from chunk_llama.kv.plan import DecodePlan
from chunk_llama.kv.tree import PendingCopy


@dataclass
class Segment:
    """Consecutive query tokens of one sequence inside the flattened batch.

    token_start: index of the first token in the flattened [batch * q_len] axis
    q_start: position of that token in its sequence
    chunk_ids: [num_chunks] the sequence's path after this step's writes
    """

    token_start: int
    num_tokens: int
    q_start: int
    chunk_ids: torch.Tensor


@dataclass
class ForwardStep:
    """Everything the layers need for one forward pass.

    write_token_index: [num_writes] flattened token indices whose K/V are stored
    write_chunk, write_offset: [num_writes] the slot of each stored token
    copies: partial-chunk copies to run after each layer's writes
    plan / row_order: decode only; plan rows are batch rows `row_order` (None: same order)
    segments: prefill (or multi-token extension) only
    past_len: tokens cached before this step (what `get_seq_length` reports meanwhile)
    """

    write_token_index: torch.Tensor
    write_chunk: torch.Tensor
    write_offset: torch.Tensor
    copies: list[PendingCopy] = field(default_factory=list)
    plan: DecodePlan | None = None
    row_order: torch.Tensor | None = None
    inverse_row_order: torch.Tensor | None = None
    segments: list[Segment] = field(default_factory=list)
    past_len: int = 0

    @property
    def is_decode(self) -> bool:
        return self.plan is not None
