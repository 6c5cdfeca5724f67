"""A Llama-family decoder layer's decode step in one call of the CPU library.

At batch 1 on the CPU a decode step of the default model spends more time in Python and
torch's dispatch around its kernels (about 30 ops and 7 linear calls per layer) than
reading the weights. In a decode step on the CPU kernels, a decoder layer whose structure
`csrc/cpu/layer.cpp` computes (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3: RMSNorm,
rotate-half rotary attention, a gated SiLU or GELU-tanh MLP, per-head q/k norms and sandwich
norms where the family has them; float32 or GGUF-block weights, biases allowed; Phi-3's
fused qkv and gate/up projections as row ranges of one weight) runs as one
call instead: the same linear and attention kernels the op-by-op path runs, and the
elementwise steps in transformers' order, so results equal that path's up to the float32
rounding of the norms' sums and of the activation's exp or tanh.

Everything else runs the layer's own forward: prefill, other devices and dtypes, more rows
than `SMALL_ROWS`, autograd, `CHUNK_LLAMA_FUSED_LAYERS=0`, float32 projections where the
op-by-op path runs them with `F.linear` (`CHUNK_LLAMA_LINEAR=torch`, CPUs other than
x86-64; GGUF blocks run the same kernel either way), and a layer
that is no longer the one described (a projection wrapped by an adapter, a replaced
weight, a hook on a submodule: their effect would be skipped). Why a layer of a supported
class does not fuse is logged once per reason.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from chunk_llama.hf import fused_stack
from chunk_llama.hf.gguf_weights import GGUFLinear
from chunk_llama.hf.snapshot import GLOBAL_HOOKS, Snapshot
from chunk_llama.ops import cpu_lib
from chunk_llama.ops import quant_linear as quant_ops
from chunk_llama.ops.cpu import CpuDecode
from chunk_llama.ops.jit import setting
from chunk_llama.ops.linear import SMALL_ROWS
from chunk_llama.step import current_step

logger = logging.getLogger(__name__)
ENV = "CHUNK_LLAMA_FUSED_LAYERS"


@dataclass(frozen=True)
class Family:
    """What a decoder layer class is made of, as the C function computes it: its attention,
    MLP and norm classes, the layer's norms by attribute (input, attention output, MLP
    input, MLP output; None where the family has none), whether the attention has q/k
    norms, the norm's epsilon attribute and offset (Llama's w * t: 0, Gemma's (1 + w) t:
    1), the MLP's activation (`ACTIVATIONS`) and its attribute, the attention's window (0:
    none), and the seven projections q, k, v, o, gate, up, down by (owner, attribute): the
    same attribute for several where one weight holds them (Phi-3's qkv_proj, gate_up_proj),
    each then a range of its rows (`_row_ranges`)."""

    attention: str
    mlp: str
    norm: str
    norms: tuple
    qk_norms: bool = False
    eps: str = "variance_epsilon"
    norm_offset: float = 0.0
    activation: str = "silu"
    window: Callable = lambda attn: attn.sliding_window or 0
    projections: tuple = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                          ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
    act: str = "act_fn"


_LLAMA_NORMS = ("input_layernorm", None, "post_attention_layernorm", None)


def _config_window(attn) -> int:
    return getattr(attn.config, "sliding_window", None) or 0


FAMILIES = {  # decoder layer class -> Family
    "LlamaDecoderLayer": Family("LlamaAttention", "LlamaMLP", "LlamaRMSNorm", _LLAMA_NORMS, window=lambda attn: 0),
    "MistralDecoderLayer": Family("MistralAttention", "MistralMLP", "MistralRMSNorm", _LLAMA_NORMS,
                                  window=_config_window),
    "Qwen2DecoderLayer": Family("Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm", _LLAMA_NORMS),
    "Qwen3DecoderLayer": Family("Qwen3Attention", "Qwen3MLP", "Qwen3RMSNorm", _LLAMA_NORMS, qk_norms=True),
    "Gemma3DecoderLayer": Family("Gemma3Attention", "Gemma3MLP", "Gemma3RMSNorm",
                                 ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                  "post_feedforward_layernorm"), qk_norms=True, eps="eps", norm_offset=1.0,
                                 activation="gelu_tanh"),
    "Phi3DecoderLayer": Family("Phi3Attention", "Phi3MLP", "Phi3RMSNorm", _LLAMA_NORMS, window=_config_window,
                               projections=(*(("self_attn", "qkv_proj"),) * 3, ("self_attn", "o_proj"),
                                            *(("mlp", "gate_up_proj"),) * 2, ("mlp", "down_proj")),
                               act="activation_fn"),
}
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # chunk_llama_cpu_decoder_layer.activation
_WEIGHT_FIELDS = tuple(name.removesuffix("_proj") for _, name in Family.projections)  # cpu_lib.DecoderLayer's
_NUM_FIXED = 4 + 4 + 2  # layer, attention, MLP, activation; the four norm slots; q and k norms


def fuse_decoder_layers(model: nn.Module) -> int:
    """Wrap the forward of every decoder layer of a supported class (idempotent); returns
    how many are wrapped. The wrapped forward is the layer's own outside the cases above."""
    wrapped = 0
    for module in model.modules():
        if type(module).__name__ in FAMILIES and "_chunk_llama_fused" not in module.__dict__:
            module._chunk_llama_fused = None  # described on first use
            module.forward = functools.partial(_forward, module, module.forward)
        wrapped += "_chunk_llama_fused" in module.__dict__
    fused_stack.find_stacks(model, FAMILIES)
    return wrapped


def _forward(layer: nn.Module, original, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    step = current_step()
    if step is not None and step.decode is not None:
        stack = layer.__dict__.get("_chunk_llama_stack")  # (Stack, index) in a plain-loop stack
        ran = step.fused_stack
        if stack is not None and stack[1] > 0 and ran is not None and ran[0] is stack[0]:
            if hidden_states is not ran[1]:  # (K/V of this layer were written from the stack's inputs)
                raise RuntimeError(f"decoder layer {stack[1]} was given another input than the fused stack's "
                                   f"output: the model's forward is not the loop fused_stack assumes; set "
                                   f"{fused_stack.ENV}=0")
            return hidden_states  # computed by the stack's call in layer 0
        out = _fused(layer, step, hidden_states, kwargs.get("position_embeddings"), stack)
        if out is not None:
            return out
    return original(hidden_states, *args, **kwargs)


def _fused(layer: nn.Module, step, hidden: torch.Tensor, position_embeddings, stack=None) -> torch.Tensor | None:
    """The layer's output through one call, or None where it does not apply; the first
    layer of a plain-loop stack (`stack`: its Stack and index 0) runs all of them."""
    writes = step.fused_writes
    if writes is None:  # once per step
        reason = _step_reason(step)
        if reason is not None and isinstance(step.attention, CpuDecode) and not reason.startswith(ENV):
            _log_once(reason)  # (an attention that is not the CPU kernel's says why itself)
        writes = step.fused_writes = reason or (step.write_token_index, step.write_chunk, step.write_offset)
    if isinstance(writes, str) or position_embeddings is None or torch.is_grad_enabled() or layer.training:
        return None  # (the C function records no autograd graph, and runs no dropout)
    described = _current(layer)
    if described.reason is not None:
        return _log_once(f"{type(layer).__name__}: {described.reason}")
    if described.float32_weights and step.linear is None:
        # float32 projections op by op run F.linear here (CHUNK_LLAMA_LINEAR=torch, or not x86-64);
        # GGUF blocks run the same kernel either way
        return _log_once("float32 linear layers run F.linear here (CHUNK_LLAMA_LINEAR=torch or not x86-64)")
    cos, sin = position_embeddings
    rows = hidden.shape[0]
    if not (hidden.dtype is torch.float32 and hidden.is_cpu and hidden.dim() == 3 and hidden.shape[1] == 1
            and hidden.shape[2] == described.hidden_size and rows <= SMALL_ROWS and hidden.is_contiguous()
            and cos.dtype is torch.float32 and cos.is_cpu and sin.dtype is torch.float32
            and cos.shape == (rows, 1, described.head_dim) and cos.is_contiguous()
            and sin.shape == cos.shape and sin.is_contiguous()):
        return None
    if stack is not None and stack[1] == 0:
        out = fused_stack.run(stack[0], layer, described, step, hidden, position_embeddings, _current)
        if out is not None:
            step.fused_stack = (stack[0], out)
            return out
    pool, index = step.pool, layer.self_attn.layer_idx
    call = step.attention.call(described.scale, described.window)
    return call.decoder_layer(described.struct, hidden, cos, sin, writes, step.row_order, pool.k[index],
                              pool.v[index])


def _current(layer: nn.Module) -> "_Described":
    """The layer's description, made again if what it was read from changed."""
    described = layer._chunk_llama_fused
    if described is None or described.snapshot.stale():
        described = layer._chunk_llama_fused = _describe(layer)
    return described


def _step_reason(step) -> str | None:
    """Why this decode step's layers run op by op, or None when they may fuse."""
    if setting(ENV, "1") == "0":
        return f"{ENV}=0"
    if not isinstance(step.attention, CpuDecode):
        return f"the step's attention runs on {getattr(step.attention, 'backend', type(step.attention).__name__)}"
    if step.pool.dtype != torch.float32:
        return f"the KV pool is {step.pool.dtype}"
    indices = (step.write_token_index, step.write_chunk, step.write_offset,
               *(() if step.row_order is None else (step.row_order,)))
    if any(t.dtype != torch.int64 or not t.is_cpu or not t.is_contiguous() for t in indices):
        return "the step's write slots or row order are not contiguous int64 CPU tensors"
    return None


class _Described:
    """A layer as the C function takes it (`struct`), or why it cannot (`reason`), and a
    snapshot of the modules, tensors and hooks it was read from, compared at each call (a
    module or tensor replaced, a tensor's memory moved, or a hook added or removed makes
    the description stale: the struct holds raw pointers; `snapshot.py`)."""

    def __init__(self, modules: tuple, reason: str | None, struct: "cpu_lib.DecoderLayer | None" = None,
                 window: int = 0):
        self.modules, self.reason, self.struct, self.window = modules, reason, struct, window
        present = [module for module in modules if module is not None]
        parts = list({id(module): module for module in modules[4:] if module is not None}.values())
        self.snapshot = Snapshot(
            tuple(module._modules for module in present[:3]) + tuple(
                d for module in parts for d in (module._parameters, module._buffers)),
            tuple(module.__dict__ for module in parts),  # (a bias kept as a plain attribute)
            _tensors(modules),
            tuple(d for module in present[1:] for d in (module._forward_hooks, module._forward_pre_hooks)))
        if struct is not None:
            self.scale, self.head_dim = float(modules[1].scaling), struct.head_dim
            self.hidden_size = struct.hidden_size
            self.float32_weights = any(getattr(struct, field).type == 0 for field in _WEIGHT_FIELDS)


def _modules(layer: nn.Module, family: Family) -> tuple:
    """(layer, attention, MLP, activation, the four norm slots, q and k norms, the seven
    projections), None where the layer has none."""
    attn, mlp = layer._modules.get("self_attn"), layer._modules.get("mlp")
    if attn is None or mlp is None:
        return ()
    qk = (attn._modules.get("q_norm"), attn._modules.get("k_norm")) if family.qk_norms else (None, None)
    return (layer, attn, mlp, mlp._modules.get(family.act),
            *(None if name is None else layer._modules.get(name) for name in family.norms), *qk,
            *((attn if owner == "self_attn" else mlp)._modules.get(name) for owner, name in family.projections))


def _tensors(modules: tuple) -> tuple:
    """Every tensor the C function reads, by module, as the modules hold them now."""
    return tuple(tensor for module in modules[4:] if module is not None
                 for tensor in (*module._parameters.values(), *module._buffers.values(), module.__dict__.get("bias"))
                 if tensor is not None)


def _hooked(modules: tuple) -> bool:
    """Whether a hook would run inside the layer (the fused call would skip it)."""
    return any(module._forward_hooks or module._forward_pre_hooks for module in modules[1:] if module is not None) \
        or any(GLOBAL_HOOKS)


def _describe(layer: nn.Module) -> _Described:
    """The layer's description (with the reason it does not fuse, if it does not)."""
    family = FAMILIES[type(layer).__name__]
    modules = _modules(layer, family)
    reason = _why_not(modules, family)
    if reason is not None:
        return _Described(modules, reason)
    attn = modules[1]
    norms = [None if norm is None else norm.weight.data_ptr() for norm in modules[4:_NUM_FIXED]]
    projections, config = modules[_NUM_FIXED:], attn.config
    rows = _row_ranges(projections, config, int(attn.head_dim))
    if isinstance(rows, str):
        return _Described(modules, rows)
    weights = [_weight(module, *span) for module, span in zip(projections, rows)]
    for (_, name), weight in zip(family.projections, weights):
        if isinstance(weight, str):
            return _Described(modules, f"{name}: {weight}")
    struct = cpu_lib.DecoderLayer(
        hidden_size=int(modules[4].weight.shape[0]), num_heads=int(config.num_attention_heads),
        num_kv_heads=int(config.num_key_value_heads), head_dim=int(attn.head_dim),
        intermediate_size=rows[4][1] - rows[4][0], activation=ACTIVATIONS[family.activation],
        norm_eps=float(getattr(modules[4], family.eps)), norm_offset=family.norm_offset,
        input_norm=norms[0], attn_out_norm=norms[1], mlp_norm=norms[2], mlp_out_norm=norms[3], q_norm=norms[4],
        k_norm=norms[5], **dict(zip(_WEIGHT_FIELDS, weights)))
    return _Described(modules, None, struct, int(family.window(attn)))


def _row_ranges(projections: tuple, config, head_dim: int) -> list[tuple[int, int]] | str:
    """Each projection's rows in its weight: all of them, or, where one module holds several
    (q, k, v in qkv_proj; gate, up in gate_up_proj, as Phi-3 splits their outputs), its
    range; or why the fused weight is not that split."""
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    spans = [(0, int(module.out_features)) for module in projections]
    if projections[0] is projections[1]:  # q, k, v in one weight
        if not (projections[1] is projections[2] and spans[0][1] == q + 2 * kv):
            return f"its fused qkv projection has {spans[0][1]} rows, not {q} + 2 x {kv}"
        spans[:3] = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    if projections[4] is projections[5]:  # gate, up in one weight
        if spans[4][1] % 2:
            return f"its fused gate/up projection has an odd number of rows ({spans[4][1]})"
        half = spans[4][1] // 2
        spans[4:6] = [(0, half), (half, 2 * half)]
    return spans


def _why_not(modules: tuple, family: Family) -> str | None:
    """Why a layer of a supported class is not what the C function computes, or None."""
    if not modules:
        return "it has no self_attn or mlp"
    expected = (*family.norms, *(("q_norm", "k_norm") if family.qk_norms else (None, None)))
    for name, module in zip(expected, modules[4:_NUM_FIXED]):
        if name is not None and module is None:
            return f"it has no {name}"
    if None in modules[_NUM_FIXED:] or modules[3] is None:
        return "a projection or the activation is missing"
    _, attn, mlp, act = modules[:4]
    if type(attn).__name__ != family.attention or type(mlp).__name__ != family.mlp:
        return f"its attention or MLP is {type(attn).__name__} / {type(mlp).__name__}"
    if _activation(act) != family.activation:
        return f"its activation is {type(act).__name__}, not {family.activation}"
    if _hooked(modules):
        return "a hook runs inside it"
    config = attn.config
    partial = getattr(config, "partial_rotary_factor", None) or (getattr(config, "rope_parameters", None) or {}).get(
        "partial_rotary_factor", 1.0)
    if partial != 1.0:
        return "its rotary embedding turns part of each head only"
    norms = [module for module in modules[4:_NUM_FIXED] if module is not None]
    for norm in norms:
        weight = norm._parameters.get("weight")
        if type(norm).__name__ != family.norm or not _plain_float32(weight) or weight.dim() != 1:
            return f"a norm is {type(norm).__name__} with a weight it does not read"
    if len({getattr(norm, family.eps, None) for norm in norms}) != 1:
        return "its norms have different epsilons"
    return None


def _activation(act: nn.Module) -> str | None:
    """The activation module's kind as `ACTIVATIONS` names it, or None."""
    name = type(act).__name__
    if name in ("SiLUActivation", "SiLU"):
        return "silu"
    # transformers' GELUTanh runs F.gelu(approximate="tanh") unless built with its Python formula
    gelu = getattr(act, "act", None)
    if name == "GELUTanh" and isinstance(gelu, functools.partial) and gelu.keywords == {"approximate": "tanh"}:
        return "gelu_tanh"
    return None


def _plain_float32(tensor) -> bool:
    return (type(tensor) in (nn.Parameter, torch.Tensor) and tensor.dtype is torch.float32 and tensor.is_cpu
            and tensor.is_contiguous())


def _weight(module: nn.Module, start: int, stop: int) -> "cpu_lib.Weight | str":
    """Rows [start, stop) of a projection's weight (and bias) as the C function takes them,
    or why it cannot."""
    bias = module.__dict__.get("bias", module._parameters.get("bias"))
    if bias is not None and not (_plain_float32(bias) and bias.dim() == 1):
        return "its bias is not a float32 CPU vector"
    bias_ptr = None if bias is None else bias.data_ptr() + 4 * start
    if type(module) is GGUFLinear:
        blocks = module.blocks
        if not (blocks.dtype is torch.uint8 and blocks.is_cpu and blocks.is_contiguous() and blocks.dim() == 2):
            return "its GGUF blocks are not a contiguous uint8 CPU matrix"
        row_bytes = blocks.shape[1]
        return cpu_lib.Weight(blocks.data_ptr() + start * row_bytes, bias_ptr, quant_ops.GGML_TYPES[module.ggml_type],
                              stop - start, module.in_features, (stop - start) * row_bytes)
    if type(module) is nn.Linear and "_hf_hook" not in module.__dict__ and _plain_float32(module.weight):
        weight, width = module.weight, module.weight.shape[1]
        return cpu_lib.Weight(weight.data_ptr() + 4 * start * width, bias_ptr, 0, stop - start, width,
                              (stop - start) * width * 4)
    return f"a {type(module).__name__} (adapters, quantized or offloaded layers run their own forward)"


@functools.cache
def _log_once(message: str) -> None:
    logger.warning("chunk-llama: decoder layer runs op by op: %s", message)
