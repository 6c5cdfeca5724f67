"""A decode step's whole stack of fused decoder layers in one call of the CPU library.

`hf/fused/layers.py` runs each decoder layer of a decode step as one C call; at batch 1 on
a small model the Python around those calls (the module call, the checks, the ctypes
arguments: about 20 us a layer, 0.6 ms a step of the default model) is still a tenth of
the step. Where the model's forward is transformers' plain loop (`STACK_MODELS`: every
layer of `layers[:num_hidden_layers]` in order, each given the previous one's output and
the rotary embedding of its layer type, nothing in between), the first layer's call runs
them all (`chunk_llama_cpu_decoder_stack_run`: the same C function per layer, in a
row) and the others pass its output on. Each later layer checks that what it is given is
exactly that output (the same tensor object): anything else would mean the loop is not
the one assumed, and the step fails loudly rather than compute from K/V written for
other inputs.

The first layer is given only its own rotary embedding. Most families have one for all
layers; Gemma 3 (`ROTARY_PER_LAYER_TYPE`) has one per layer type (`config.layer_types`:
sliding layers turn by one base, global ones by another), and the stack computes the
other types' from the layer's position_ids with the model's own `rotary_emb`, as its
forward does before the loop. Each layer keeps its own attention window.

It applies only where every layer would fuse on its own (the same description and checks,
`layers._fused`), with one attention scale, and no hook on a layer module (a hook
on layer i would see the stack's output); otherwise each layer runs its own fused call,
as before. `CHUNK_LLAMA_FUSED_STACK=0` turns it off.
"""

from __future__ import annotations

import logging
import operator
import weakref

import torch
from torch import nn

from chunk_llama.hf.families import ROTARY_PER_LAYER_TYPE, STACK_MODELS
from chunk_llama.hf.fused.snapshot import Snapshot
from chunk_llama.logs import log_once
from chunk_llama.ops.build.jit import setting
from chunk_llama.ops.cpu.planned import DecoderStack

logger = logging.getLogger(__name__)
ENV = "CHUNK_LLAMA_FUSED_STACK"
_TRAINING = operator.attrgetter("training")


class Stack:
    """A model's decoder stack: the layers its forward runs, and the C call's arrays for
    the current descriptions and pools (rebuilt when either changes)."""

    def __init__(self, owner: nn.Module):
        self.owner = weakref.ref(owner)  # (the layers point at the stack: no cycle through it)
        self._arrays: tuple | None = None  # (descriptions, pool.k, pool.v, the KvTable, DecoderStack)
        self._described: tuple | None = None  # (layers, descriptions, Snapshot of layers 1 on)
        self._warm: tuple | None = None  # (the `_described` it is for, its prefetch call)

    def __deepcopy__(self, memo) -> "Stack | None":
        """The copied owner's stack, where `copy.deepcopy` of the model copied the owner first
        (it does, before its layers); None for a layer copied alone (it then runs its own call)."""
        owner = memo.get(id(self.owner()))
        return None if owner is None else Stack(owner)

    def layers(self) -> list | None:
        """The layers the forward will run, or None if the owner is gone or changed."""
        owner = self.owner()
        layers = None if owner is None else owner._modules.get("layers")
        if not isinstance(layers, nn.ModuleList):
            return None
        return list(layers)[: owner.config.num_hidden_layers]

    def described(self, layers: list, first) -> list | None:
        """The descriptions `remember` was given for these layers, if layer 0's is still
        `first` and nothing the others were read from changed (one snapshot for them all:
        `snapshot.py`) and no layer is training; else None (describe them again)."""
        remembered = self._described
        if (remembered is None or remembered[1][0] is not first or len(remembered[0]) != len(layers)
                or not all(map(operator.is_, remembered[0], layers)) or remembered[2].stale()
                or any(map(_TRAINING, layers))):
            return None
        return remembered[1]

    def remember(self, layers: list, described: list) -> None:
        """Keep these current descriptions of `layers` (each layer's own hooks included in
        what makes them stale)."""
        rest = [d.snapshot for d in described[1:]] + [
            Snapshot((), (), (), tuple(d for layer in layers for d in (layer._forward_hooks, layer._forward_pre_hooks)))]
        self._described = (tuple(layers), described, Snapshot.joined(rest))

    def warm(self, planned) -> None:
        """Fetch what the next step's checks read (every layer's snapshot: about 1,700 addresses
        at 1B) into the caches at once, through the step's CPU library (`planned`, a
        `CpuPlanned`). Called after the step's last weights (the LM head), whose stream evicted
        them: one by one those misses were 0.1 ms of a 1B step (docs/BENCHMARKS.md)."""
        remembered = self._described
        if remembered is None:
            return
        if self._warm is None or self._warm[0] is not remembered:
            addresses = Snapshot.joined((remembered[1][0].snapshot, remembered[2])).addresses()
            self._warm = (remembered, planned.prefetch_call(addresses))
        self._warm[1]()

    def arrays(self, described: list, pool, kvs) -> DecoderStack:
        """The C call's arrays for these layer descriptions over `pool`'s K/V, each layer's pool
        struct from `kvs` (the step's backend's `structs.KvTable`: one per pool, scale and
        window); made again when a description, the pool's tensors or the table change."""
        arrays = self._arrays
        if (arrays is None or arrays[1] is not pool.k or arrays[2] is not pool.v or arrays[3] is not kvs
                or len(arrays[0]) != len(described) or any(a is not b for a, b in zip(arrays[0], described))):
            layer_kvs = [kvs.get(pool.k[i], pool.v[i], d.scale, d.window)
                         for i, d in zip((d.modules[1].layer_idx for d in described), described)]
            arrays = self._arrays = (described, pool.k, pool.v, kvs,
                                     DecoderStack([d.struct for d in described], layer_kvs))
        return arrays[4]

    def rotary(self, layers: list, hidden: torch.Tensor, first: tuple, position_ids) -> tuple | str:
        """Each layer's cos and sin for this step, as the owner's forward gives them: `first`,
        layer 0's, for all, or, where the rotary embedding is per layer type, each type's
        (computed here from position_ids but for layer 0's); or why not."""
        owner = self.owner()
        if type(owner).__name__ not in ROTARY_PER_LAYER_TYPE:
            return (first[0],) * len(layers), (first[1],) * len(layers)
        if position_ids is None:
            return "the first layer was given no position_ids to turn the other layer types' rotary by"
        types = owner.config.layer_types[: len(layers)]
        tables = {types[0]: first}
        for layer_type in types:
            if layer_type not in tables:
                table = tables[layer_type] = owner.rotary_emb(hidden, position_ids, layer_type)
                if not all(map(_fits, table, first)):
                    return f"the {layer_type} rotary embedding is not a CPU tensor of layer 0's dtype and shape"
        return tuple(tables[t][0] for t in types), tuple(tables[t][1] for t in types)


def find_stacks(model: nn.Module, families: dict) -> None:
    """Mark every layer of each plain-loop decoder stack of `model` with its stack and index
    (`_chunk_llama_stack`; idempotent)."""
    for module in model.modules():
        if type(module).__name__ not in STACK_MODELS or not type(module).__module__.startswith("transformers."):
            continue
        layers = module._modules.get("layers")
        if not isinstance(layers, nn.ModuleList) or not all(type(layer).__name__ in families for layer in layers):
            continue
        stack = Stack(module)
        for index, layer in enumerate(layers):
            layer._chunk_llama_stack = (stack, index)


def run(stack: Stack, layer: nn.Module, first, step, hidden: torch.Tensor, position_embeddings, position_ids,
        describe, lora=None) -> torch.Tensor | None:
    """Every layer of the stack for this decode step, called from its first layer (`layer`,
    described as `first`, whose own checks passed: `hidden`, cos and sin fit it; given
    position_ids), or None where the stack does not apply this step (each layer then runs
    its own call). `describe(layer)` gives a layer's current description (`describe.current`);
    lora: the step's rows under adapters for this stack (`lora.py`: layer i is index i), or None.
    The output is float32 (a 16-bit model's hidden states and tables are widened first)."""
    if setting(ENV, "1") == "0":
        return None
    layers = stack.layers()
    if not layers or layers[0] is not layer:
        return None
    described = stack.described(layers, first)
    if described is None:
        described = []
        for each in layers:
            if each._forward_hooks or each._forward_pre_hooks or each.training or \
                    "_chunk_llama_fused" not in each.__dict__:
                return _log_stack_falls_back("a decoder layer has a hook, is training or is not wrapped")
            one = first if each is layer else describe(each)
            if one.reason is not None:
                return None  # (the layer's own call logs its reason)
            described.append(one)
        if any(d.scale != first.scale or d.head_dim != first.head_dim or d.hidden_size != first.hidden_size
               for d in described):
            return _log_stack_falls_back("its layers differ in attention scale or sizes")
        stack.remember(layers, described)
    if step.linear is None and any(d.float32_weights for d in described):
        return None  # (float32 projections run F.linear here: the layers' own calls log it)
    if step.lora is None and any(d.wrappers for d in described):
        return None  # (PEFT's LoRA layers run PEFT's forward here: the layers' own calls log it)
    planned = step.attention
    try:
        arrays = stack.arrays(described, step.pool, planned.kvs)
    except (TypeError, ValueError) as error:  # e.g. pools on several devices
        return _log_stack_falls_back(f"its K/V pools do not fit one call ({error})")
    rotary = stack.rotary(layers, hidden, position_embeddings, position_ids)
    if isinstance(rotary, str):
        return _log_stack_falls_back(rotary)
    # each distinct table once (most families give every layer the same two): widened where the model is
    # 16-bit, as [rows, head_dim]
    flat = {id(t): t for t in (*rotary[0], *rotary[1])}
    flat = {key: t.float().view(-1, first.head_dim) for key, t in flat.items()}
    cos, sin = ([flat[id(t)] for t in tables] for tables in rotary)
    out = planned.decoder_stack(arrays, hidden.view(-1, hidden.shape[2]).float(), cos, sin, lora)
    return out.view(hidden.shape)


def _fits(table, like: torch.Tensor) -> bool:
    """Whether a rotary table is what the C call reads as `like` (layer 0's, which it checked)."""
    return isinstance(table, torch.Tensor) and table.dtype is like.dtype and table.is_cpu and \
        table.shape == like.shape and table.is_contiguous()


def _log_stack_falls_back(reason: str) -> None:
    log_once(logger, "chunk-llama: the decoder layers run one call each, not one for the stack: %s", reason,
             level=logging.INFO)
