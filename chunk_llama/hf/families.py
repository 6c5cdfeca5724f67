"""The model families chunk-llama knows by their classes: one table, read by the support
check (which families are tested), the fused decoder layers (what a layer is made of), the
fused stack and the engine's decode forward (which stacks and causal LMs are transformers'
plain loop), and the tests (one tiny model per family).

Any other causal LM that `support.check_supported` accepts runs too, op by op; a family
here additionally runs as one C call per layer (or per stack) on the CPU kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

_PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
_LLAMA_NORMS = ("input_layernorm", None, "post_attention_layernorm", None)


def _no_window(attn) -> int:
    return 0


def _layer_window(attn) -> int:
    return attn.sliding_window or 0


def _config_window(attn) -> int:
    return getattr(attn.config, "sliding_window", None) or 0


@dataclass(frozen=True)
class Family:
    """One model family as transformers defines it, and what its decoder layer is made of,
    as the C layer computes it.

    model_type: the config's `model_type`; causal_lm, model, layer: its `*ForCausalLM`, its
    decoder stack (whose forward is the plain loop over the layers) and its decoder layer
    class names; attention, mlp, norm: the layer's module classes; norms: the layer's norms
    by attribute (input, attention output, MLP input, MLP output; None where the family has
    none); qk_norms: the attention has q/k norms; eps: the norm's epsilon attribute;
    norm_offset: Llama's w * t is 0, Gemma's (1 + w) t is 1; activation: the MLP's (as the C
    layer names it) and `act` its attribute; window: the attention's sliding window (0:
    none); projections: q, k, v, o, gate, up, down by (owner, attribute), the same attribute
    for several where one weight holds them (Phi-3's qkv_proj, gate_up_proj);
    rotary_per_layer_type: the stack has one rotary embedding per layer type (Gemma 3);
    softcapped_logits: the LM head's logits may be soft-capped (config.final_logit_softcapping).
    """

    model_type: str
    causal_lm: str
    model: str
    layer: str
    attention: str
    mlp: str
    norm: str
    norms: tuple = _LLAMA_NORMS
    qk_norms: bool = False
    eps: str = "variance_epsilon"
    norm_offset: float = 0.0
    activation: str = "silu"
    window: Callable = _layer_window
    projections: tuple = _PROJECTIONS
    act: str = "act_fn"
    rotary_per_layer_type: bool = False
    softcapped_logits: bool = False


def _family(model_type: str, prefix: str, **kwargs) -> Family:
    return Family(model_type, f"{prefix}ForCausalLM", kwargs.pop("model", f"{prefix}Model"), f"{prefix}DecoderLayer",
                  f"{prefix}Attention", f"{prefix}MLP", f"{prefix}RMSNorm", **kwargs)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    _family("llama", "Llama", window=_no_window),
    _family("mistral", "Mistral", window=_config_window),
    _family("qwen2", "Qwen2"),
    _family("qwen3", "Qwen3", qk_norms=True),
    _family("gemma3_text", "Gemma3", model="Gemma3TextModel",
            norms=("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                   "post_feedforward_layernorm"), qk_norms=True, eps="eps", norm_offset=1.0, activation="gelu_tanh",
            rotary_per_layer_type=True, softcapped_logits=True),
    _family("phi3", "Phi3", window=_config_window, act="activation_fn",
            projections=(*(("self_attn", "qkv_proj"),) * 3, ("self_attn", "o_proj"), *(("mlp", "gate_up_proj"),) * 2,
                         ("mlp", "down_proj"))),
)}
BY_LAYER: dict[str, Family] = {f.layer: f for f in FAMILIES.values()}  # decoder layer class name -> Family
STACK_MODELS = frozenset(f.model for f in FAMILIES.values())
CAUSAL_LMS = frozenset(f.causal_lm for f in FAMILIES.values())
ROTARY_PER_LAYER_TYPE = frozenset(f.model for f in FAMILIES.values() if f.rotary_per_layer_type)
SOFTCAPPED_LOGITS = frozenset(f.causal_lm for f in FAMILIES.values() if f.softcapped_logits)
