"""The engine's decode steps under CUDA graphs, one set per batch-size bucket (piecewise).

A decode step is a replay, not a Python walk through the layers: at start-up the decode
forward (`hf/graph_forward.py` `decode_logits`) is traced by `torch.compile(fullgraph=True)`
once per bucket (1, 2, 4, 8, then multiples of 8 up to the engine's batch, as vLLM sizes
them), the FX graph is split at every attention op (`chunk_llama::decode_attention`,
`ops/attention_op.py`), and each piece between two attentions (the norms, projections,
rotary, MLP, residuals; the embedding before the first, the norm and LM head after the last)
is captured as a CUDA graph into one memory pool. A step copies its token ids and
positions into the graphs' static inputs (padding rows: token 0 at position 0, whose
attention is zeros and whose logits are dropped), then the compiled graph replays piece,
attention, piece, ...; the attention runs eagerly on the step's plan.

Why piecewise and not the whole step in one graph: the attention kernels' launches are
sized on the host from the step's plan (shared chunks, partial rows, the split of each
sequence's private tail by its length, `ops/cuda/binding.py` `plan_make`); captured inside a
graph those sizes are baked in and change whenever sequences join, leave or grow, and a
replay with a stale size silently computes wrong attention (transformers PR #45323). Kept
out of the graphs, the plan stays on the host and the attention is correct for any plan,
on any backend (the CUDA kernels, the reference), with the existing kernels; the pieces
depend on nothing but the bucket, so every graph is captured at start-up and none is ever
stale. The cost is a launch of each piece and the attention's per layer instead of one
replay (about 2 x layers launches against about 530 eager ones at Llama-3.2-1B's
geometry). The whole step in one graph needs kernels that read the plan's sizes from device
memory (FlashInfer's `use_cuda_graph` wrappers): a next step, measured against this.

Dynamo traces the step once with the batch dimension dynamic (and once more for one row,
which it specialises); each piece is captured per bucket. A piece's graph is keyed by what
its capture bakes in besides its inputs' contents: its tensor inputs' shapes and dtypes and
its integer inputs (the batch as a symbolic size), so per bucket (`GraphKey`: bucket,
dtype, device); nothing of the plan is inside a piece. Every tensor input of a piece is
checked at each replay: one at another address than at capture (the attention's output, a
weight replaced) is copied into the captured one, never read from a stale address.

Steps that run eager, logged once with the reason: a batch above the largest bucket, rows
under LoRA adapters, a model split over devices, a model `hf/graph_forward.py` cannot stand
for (hooks, training, an unknown family). Off by default (`enforce_eager=True`) until the capture is measured on a GPU: `--cuda-graphs` turns it on.
Without CUDA (`capture=False`) the same compiled, split graph runs its pieces eagerly: what
the CPU tests check (logits, no graph break, no reallocation, buckets, fallbacks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn

from chunk_llama.hf import compat, graph_forward
from chunk_llama.logs import log_once
from chunk_llama.ops import attention_op
from chunk_llama.step import running

logger = logging.getLogger(__name__)
ATTENTION = torch.ops.chunk_llama.decode_attention.default  # (registered by `attention_op`'s import)


def bucket_sizes(max_batch_size: int, sizes: Sequence[int] | None = None) -> tuple[int, ...]:
    """The batch sizes captured: `sizes` (positive, sorted, deduplicated), or 1, 2, 4, 8, then
    multiples of 8 up to `max_batch_size`, which is always one."""
    if sizes is None:
        sizes = [s for s in (1, 2, 4) if s < max_batch_size] + list(range(8, max_batch_size, 8)) + [max_batch_size]
    sizes = sorted(set(sizes))
    if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s <= 0 for s in sizes):
        raise ValueError(f"graph batch sizes must be positive integers, got {list(sizes)!r}")
    return tuple(sizes)


def choose_bucket(sizes: Sequence[int], rows: int) -> int | None:
    """The smallest bucket that holds `rows` sequences, or None (the step runs eager)."""
    return next((s for s in sizes if s >= rows), None)


@dataclass(frozen=True)
class GraphKey:
    """What a captured piece bakes in besides its inputs: the padded batch (every shape),
    the dtype and the device. (The attention and its plan are outside every piece.)"""

    rows: int
    dtype: torch.dtype
    device: torch.device


class _Captured:
    """One CUDA graph of a piece, for one key: the inputs it reads (kept alive at their
    addresses) and the outputs it writes."""

    def __init__(self, module: fx.GraphModule, args: tuple, pool):
        self.inputs = args
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = module(*args)

    def replay(self, args: tuple):
        for arg, kept in zip(args, self.inputs):
            if isinstance(arg, torch.Tensor) and arg.data_ptr() != kept.data_ptr():
                kept.copy_(arg)  # (the attention's output; a replaced weight): never a stale address
        self.graph.replay()
        return self.outputs


class Piece(nn.Module):
    """One piece of the split graph between attentions. With a memory `pool`, per key (its
    inputs' shapes and dtypes and its integer arguments: everything a capture bakes in) it
    runs eagerly once (warm-up), is captured as a CUDA graph on the next call and replayed
    after; without, it runs eagerly."""

    def __init__(self, module: fx.GraphModule, pool=None):
        super().__init__()
        self.module = module
        self.pool = pool
        self.graphs: dict[tuple, _Captured | None] = {}  # key -> its graph (None: warmed up, not captured)

    def forward(self, *args):
        if self.pool is None:
            return self.module(*args)
        key = tuple((a.shape, a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
        if key not in self.graphs:
            self.graphs[key] = None
            return self.module(*args)
        captured = self.graphs[key]
        if captured is None:
            captured = self.graphs[key] = _Captured(self.module, args, self.pool)
        return captured.replay(args)


def split_at_attention(gm: fx.GraphModule, pool=None) -> tuple[fx.GraphModule, int]:
    """`gm` split into pieces at each attention op (each piece a `Piece`, the ops between them
    as they are); returns the split module and the number of attention ops."""
    count = [0]

    def partition(node: fx.Node) -> int:
        if node.op == "call_function" and node.target is ATTENTION:
            count[0] += 1
            return 2 * count[0] - 1
        return 2 * count[0]

    split = fx.passes.split_module.split_module(gm, None, partition, keep_original_order=True)
    for name, child in list(split.named_children()):
        if not any(n.op == "call_function" and n.target is ATTENTION for n in child.graph.nodes):
            setattr(split, name, Piece(child, pool))
    return split, count[0]


class DecodeGraphs:
    """The engine's decode steps per batch-size bucket (see the module's docstring).

    model: the patched model; max_batch_size: the engine's; sizes: the buckets (default
    `bucket_sizes`); capture: CUDA graphs around the pieces (default: on a CUDA model).
    `run(step)` gives a decode step's logits, or None where the step runs eager."""

    def __init__(self, model: nn.Module, max_batch_size: int, sizes: Sequence[int] | None = None,
                 capture: bool | None = None):
        self.model = model
        self.device = model.device
        self.sizes = bucket_sizes(max_batch_size, sizes)
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {self.device}")
        self.unsupported = graph_forward.unsupported_reason(model)
        self._cache_argument = compat.cache_argument(model)
        largest = self.sizes[-1]
        # the static inputs: a step's rows first, padding (token 0 at position 0) after
        self.input_ids = torch.zeros(largest, 1, dtype=torch.long, device=self.device)
        self.position_ids = torch.zeros(largest, 1, dtype=torch.long, device=self.device)
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.splits: list[tuple[fx.GraphModule, int]] = []  # what the compiler made (rows dynamic; 1 apart)
        self.keys: set[GraphKey] = set()  # the buckets run (captured, with `capture`)
        self.counters = dict(graph_steps=0, eager_steps=0)
        _raise_recompile_limit()
        # traced once with the rows dynamic (and once more for 1 row, which Dynamo specialises);
        # each piece is captured per bucket
        self._compiled = torch.compile(self._forward, backend=self._backend, fullgraph=True, dynamic=True)

    def key(self, rows: int) -> GraphKey:
        return GraphKey(rows, self.model.dtype, self.device)

    def eager_reason(self, step) -> str | None:
        """Why this decode step runs eager, or None."""
        if self.unsupported:
            return self.unsupported
        if step.decode.num_seqs > self.sizes[-1]:
            return f"a batch of more than {self.sizes[-1]} sequences (the largest graph's)"
        if step.lora is not None and step.lora.segments:
            return "the step has rows under LoRA adapters"
        if step.devices:
            return "the model's layers are on several devices"
        if step.input_ids is None or step.position_ids is None:
            return "the step has no inputs of its own"
        if torch.is_grad_enabled():
            return "autograd is on"
        return None

    def run(self, step) -> torch.Tensor | None:
        """Logits [num_seqs, vocab] of decode step `step` (rows in plan order; valid until the
        next step), or None: the step runs eager (why logged once)."""
        reason = self.eager_reason(step)
        if reason is not None:
            log_once(logger, "chunk-llama: a decode step runs eager, without graphs: %s", reason)
            self.counters["eager_steps"] += 1
            return None
        rows = step.decode.num_seqs
        bucket = choose_bucket(self.sizes, rows)
        self.input_ids[:rows].copy_(step.input_ids)
        self.position_ids[:rows].copy_(step.position_ids)
        if rows < bucket:  # (the last step's rows: padding again)
            self.input_ids[rows:bucket].zero_()
            self.position_ids[rows:bucket].zero_()
        with running(step):
            logits = self._compiled(self.input_ids[:bucket], self.position_ids[:bucket])
        self.keys.add(self.key(bucket))
        self.counters["graph_steps"] += 1
        return logits[:rows]

    def warm_up(self) -> dict:
        """Compile and capture every bucket, largest first (the smaller ones reuse its pool);
        logs and returns the time and the device memory it took."""
        start = time.perf_counter()
        memory = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        with torch.no_grad(), running(attention_op.WARM_UP):
            for rows in reversed(self.sizes):
                for _ in range(2 if self.capture else 1):  # eager, then captured
                    self._compiled(self.input_ids[:rows], self.position_ids[:rows])
                self.keys.add(self.key(rows))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            memory = torch.cuda.memory_reserved(self.device) - memory
        figures = dict(seconds=time.perf_counter() - start, memory_bytes=memory, buckets=list(self.sizes),
                       captured=self.capture)
        logger.info("chunk-llama: decode step %s for batch sizes %s in %.1f s, %.0f MiB of device memory",
                    "captured in CUDA graphs" if self.capture else "compiled", ", ".join(map(str, self.sizes)),
                    figures["seconds"], memory / 2**20)
        return figures

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return graph_forward.decode_logits(self.model, input_ids, position_ids, self._cache_argument)

    def _backend(self, gm: fx.GraphModule, example_inputs) -> fx.GraphModule:
        split, num_attention = split_at_attention(gm, self.pool)
        self.splits.append((split, num_attention))
        return split


def _raise_recompile_limit() -> None:
    """Dynamo traces the step twice per `DecodeGraphs` (its guards hold the model): allow that
    on top of what earlier ones used."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, getattr(config, name) + 2)
