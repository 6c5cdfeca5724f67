"""A decoder layer as the CPU library's fused call takes it (`structs.DecoderLayer`), or why
it cannot: read from the layer's modules once and kept until a snapshot of what it was
read from changes (`snapshot.py`).

A layer fuses where it is what `csrc/cpu/layer.cpp` computes: its family's attention and
MLP classes (`families.py`), RMSNorms with plain float weights of one epsilon, a rotary
embedding that turns whole heads, the family's activation, no hook inside it, and each
projection a plain `nn.Linear` (float32, or 16-bit read as BF16 / F16 blocks) or a
`GGUFLinear` (GGML blocks), biases allowed; Phi-3's fused qkv and gate/up projections as
row ranges of one weight.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from chunk_llama.gguf.modules import GGUFLinear
from chunk_llama.hf.families import BY_LAYER, Family
from chunk_llama.hf.fused.snapshot import GLOBAL_HOOKS, Snapshot
from chunk_llama.hf.lora.layers import lora_key, peft_linear
from chunk_llama.ops.cpu import linear as linear_ops
from chunk_llama.ops.cpu import quant_linear as quant_ops
from chunk_llama.ops.cpu import tiles
from chunk_llama.ops.cpu.structs import ACTIVATIONS as STRUCT_ACTIVATIONS
from chunk_llama.ops.cpu.structs import DecoderLayer, Weight

# the dtypes a fused layer reads (its hidden states, norms, biases and weights): a 16-bit
# model's are widened to float32, computed in it, and its output rounded back
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # chunk_llama_cpu_decoder_layer.activation
_WEIGHT_FIELDS = ("q", "k", "v", "o", "gate", "up", "down")  # DecoderLayer's
_NUM_FIXED = 4 + 4 + 2  # layer, attention, MLP, activation; the four norm slots; q and k norms


def current(layer: nn.Module) -> "Described":
    """The layer's description, made again if what it was read from changed."""
    described = layer._chunk_llama_fused
    if described is None or described.snapshot.stale():
        described = layer._chunk_llama_fused = describe(layer)
    return described


class Described:
    """A layer as the C function takes it (`struct`), or why it cannot (`reason`), and a
    snapshot of the modules, tensors and hooks it was read from, compared at each call (a
    module or tensor replaced, a tensor's memory moved, or a hook added or removed makes
    the description stale: the struct holds raw pointers; `snapshot.py`)."""

    def __init__(self, modules: tuple, reason: str | None, struct: "DecoderLayer | None" = None,
                 window: int = 0, widened: "_Widened | None" = None, spans: tuple = (), wrappers: tuple = ()):
        self.modules, self.reason, self.struct, self.window = modules, reason, struct, window
        # each projection's (module adapters key it by, first row, end row in its weight): where
        # an adapter's factors of that module apply (`lora.py`)
        self.spans = spans
        # PEFT LoRA layers read as their base layers (`_peft_wrappers`): the description holds only
        # in steps whose rows the engine assigns to adapters (PEFT's forward runs elsewhere)
        self.wrappers = wrappers
        self.widened = widened  # (keeps alive the float32 copies the struct points at)
        present = [module for module in modules if module is not None]
        parts = list({id(module): module for module in modules[4:] if module is not None}.values())
        self.snapshot = Snapshot(
            tuple(module._modules for module in (*present[:3], *wrappers)) + tuple(
                d for module in parts for d in (module._parameters, module._buffers)),
            tuple(module.__dict__ for module in parts),  # (a bias kept as a plain attribute)
            _tensors(modules),
            tuple(d for module in (*present[1:], *wrappers)
                  for d in (module._forward_hooks, module._forward_pre_hooks)),
            () if widened is None else tuple(widened.copies))
        if struct is not None:
            self.scale, self.head_dim = float(modules[1].scaling), struct.head_dim
            self.hidden_size = struct.hidden_size
            self.float32_weights = any(getattr(struct, field).type == 0 for field in _WEIGHT_FIELDS)

    def __deepcopy__(self, memo) -> None:
        return None  # a copy of the model describes its layers again (this points at the original's tensors)


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


def describe(layer: nn.Module) -> Described:
    """The layer's description (with the reason it does not fuse, if it does not)."""
    family = BY_LAYER[type(layer).__name__]
    modules = _modules(layer, family)
    wrappers = _peft_wrappers(modules)
    if wrappers:
        modules = tuple(module.get_base_layer() if i in wrappers else module for i, module in enumerate(modules))
    described = functools.partial(Described, wrappers=tuple(dict.fromkeys(wrappers.values())))
    reason = _why_not(modules, family) or _hooks_of(wrappers.values())
    if reason is not None:
        return described(modules, reason)
    attn, widened = modules[1], _Widened()
    norms = [None if norm is None else widened(norm.weight).data_ptr() for norm in modules[4:_NUM_FIXED]]
    projections, config = modules[_NUM_FIXED:], attn.config
    rows = _row_ranges(projections, config, int(attn.head_dim))
    if isinstance(rows, str):
        return described(modules, rows)
    weights = [_weight(module, *span, widened) for module, span in zip(projections, rows)]
    for (_, name), weight in zip(family.projections, weights):
        if isinstance(weight, str):
            return described(modules, f"{name}: {weight}")
    integer = {module.activations for module in projections if type(module) is GGUFLinear} - {"float32"}
    if len(integer) > 1:
        return described(modules, f"its projections multiply {' and '.join(sorted(integer))} activations")
    struct = DecoderLayer(
        hidden_size=int(modules[4].weight.shape[0]), num_heads=int(config.num_attention_heads),
        num_kv_heads=int(config.num_key_value_heads), head_dim=int(attn.head_dim),
        intermediate_size=rows[4][1] - rows[4][0], activation=ACTIVATIONS[family.activation],
        norm_eps=float(getattr(modules[4], family.eps)), norm_offset=family.norm_offset,
        input_norm=norms[0], attn_out_norm=norms[1], mlp_norm=norms[2], mlp_out_norm=norms[3], q_norm=norms[4],
        k_norm=norms[5], **dict(zip(_WEIGHT_FIELDS, weights)),
        activations=STRUCT_ACTIVATIONS[integer.pop() if integer else "float32"])
    spans = tuple((wrappers.get(_NUM_FIXED + i, module), *span)  # (PEFT's layer holds the key)
                  for i, (module, span) in enumerate(zip(projections, rows)))
    return described(modules, None, struct, int(family.window(attn)), widened, spans)


def _peft_wrappers(modules: tuple) -> dict:
    """{index in modules: PEFT LoRA layer} for each projection that is a PEFT LoRA linear layer
    the engine adds adapters to per row (`hf/lora/layers.py` attached it): in the engine's
    steps it computes its base layer plus the rows' deltas, which the C call computes too."""
    lora_linear = peft_linear()
    if lora_linear is None:
        return {}
    return {i: module for i, module in enumerate(modules) if i >= _NUM_FIXED and type(module) is lora_linear
            and lora_key(module) is not None}


def _hooks_of(wrappers) -> str | None:
    return "a hook runs inside it" if any(w._forward_hooks or w._forward_pre_hooks for w in wrappers) else None


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
        if type(norm).__name__ != family.norm or not _plain(weight) or weight.dim() != 1:
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


def _plain(tensor) -> bool:
    """A plain float32, bfloat16 or float16 CPU tensor (not a subclass: a quantized or
    offloaded one computes its values)."""
    return (type(tensor) in (nn.Parameter, torch.Tensor) and tensor.dtype in FLOAT_DTYPES and tensor.is_cpu
            and tensor.is_contiguous())


class _Widened:
    """Float32 copies of the 16-bit norm weights and biases a layer's struct points at (a
    bfloat16 or float16 model's: the C function reads float32 ones), by source tensor."""

    def __init__(self):
        self.copies: dict[torch.Tensor, torch.Tensor] = {}

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` itself if float32, else its float32 copy (made once)."""
        if tensor.dtype is torch.float32:
            return tensor
        if tensor not in self.copies:
            self.copies[tensor] = tensor.detach().float()
        return self.copies[tensor]


def _weight(module: nn.Module, start: int, stop: int, widened: _Widened) -> "Weight | str":
    """Rows [start, stop) of a projection's weight (and bias, float32 or `widened`) as the C
    function takes them, or why it cannot."""
    bias = module.__dict__.get("bias", module._parameters.get("bias"))
    if bias is not None and not (_plain(bias) and bias.dim() == 1):
        return "its bias is not a floating-point CPU vector"
    bias_ptr = None if bias is None else widened(bias).data_ptr() + 4 * start
    if type(module) is GGUFLinear:
        blocks = module.blocks
        if not (blocks.dtype is torch.uint8 and blocks.is_cpu and blocks.is_contiguous() and blocks.dim() == 2):
            return "its GGUF blocks are not a contiguous uint8 CPU matrix"
        row_bytes, kind = blocks.shape[1], quant_ops.GGML_TYPES[module.ggml_type]
        if module.tiled:  # (a span of whole tiles is a tiled weight: ops/cpu/tiles.py)
            if start % tiles.TILE_ROWS or stop % tiles.TILE_ROWS:
                return f"its rows {start}-{stop} split a tile of {tiles.TILE_ROWS} tiled rows"
            kind |= tiles.TILED
        return Weight(blocks.data_ptr() + start * row_bytes, bias_ptr, kind, stop - start, module.in_features,
                      (stop - start) * row_bytes)
    if type(module) is nn.Linear and "_hf_hook" not in module.__dict__ and _plain(module.weight):
        weight, width = module.weight, module.weight.shape[1]
        if weight.dtype is not torch.float32 and width % 32:  # (read as BF16 / F16 blocks: groups of 32)
            return f"its {str(weight.dtype).removeprefix('torch.')} weight is {width} wide, not whole groups of 32"
        size = weight.element_size()  # a 16-bit weight is read as BF16 / F16 blocks: widened in registers
        kind = 0 if size == 4 else linear_ops.HALF_BLOCKS[weight.dtype]
        return Weight(weight.data_ptr() + size * start * width, bias_ptr, kind, stop - start, width,
                              (stop - start) * width * size)
    return f"a {type(module).__name__} (adapters, quantized or offloaded layers run their own forward)"
