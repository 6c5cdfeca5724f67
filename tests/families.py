"""Tiny random models of the families `chunk_llama.hf.families` names, for the tests: one
module, two tables of (config class name, geometry), each covering every family."""

import torch
import transformers

from chunk_llama.hf.families import FAMILIES

COMMON = dict(vocab_size=96, num_hidden_layers=2, max_position_embeddings=512, initializer_range=0.2,
              bos_token_id=1, eos_token_id=5, pad_token_id=0)

# The engine against stock generate (test_model_families): MHA, GQA and MQA; head dims 16 (the
# reference), 64, 96 (Phi-3 mini's) and 256 (the native CPU kernel); the default model is the Llama
ENGINE_MODELS = {
    "qwen2": ("Qwen2Config", dict(intermediate_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(intermediate_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=64)),
    "mistral": ("MistralConfig", dict(intermediate_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                      sliding_window=None)),
    "phi3": ("Phi3Config", dict(intermediate_size=128, hidden_size=192, num_attention_heads=2, num_key_value_heads=2)),
    "gemma3_text": ("Gemma3TextConfig", dict(intermediate_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                             head_dim=256, query_pre_attn_scalar=64,
                                             layer_types=["full_attention"] * 2)),
    # sliding windows shorter than the prompts (up to 65 tokens), on the native kernel and the reference
    "gemma3_text-windowed": ("Gemma3TextConfig", dict(intermediate_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                                      head_dim=256, query_pre_attn_scalar=64, sliding_window=13,
                                                      layer_types=["sliding_attention", "full_attention"])),
    "mistral-windowed": ("MistralConfig", dict(intermediate_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=64, sliding_window=21)),
    "qwen2-windowed": ("Qwen2Config", dict(intermediate_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                           use_sliding_window=True, sliding_window=9, max_window_layers=1)),
}

# The fused decoder layer (test_fused_layers, test_fused_half):
# odd sizes: hidden 96 with 3 query heads of 64 (q is wider than the hidden state), MLP 123
FUSED_MODELS = {
    "llama": ("LlamaConfig", dict(hidden_size=96, intermediate_size=123, num_attention_heads=3,
                                  num_key_value_heads=1, head_dim=64, mlp_bias=True)),
    "qwen2": ("Qwen2Config", dict(hidden_size=96, intermediate_size=37, num_attention_heads=3,
                                  num_key_value_heads=3)),  # head_dim 32, q/k/v biases
    "mistral-windowed": ("MistralConfig", dict(hidden_size=96, intermediate_size=123, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=64, sliding_window=7)),
    # a global layer, then a sliding one (window 7): the windows differ by layer
    "qwen2-windowed": ("Qwen2Config", dict(hidden_size=96, intermediate_size=37, num_attention_heads=3,
                                           num_key_value_heads=1, use_sliding_window=True, sliding_window=7,
                                           max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(hidden_size=96, intermediate_size=123, num_attention_heads=3,
                                  num_key_value_heads=1, head_dim=64)),  # per-head q/k norms
    # (1 + w) norms around both blocks, GELU-tanh, a sliding layer (window 13) and a global one
    # (each with its rotary embedding), soft-capped logits
    "gemma3_text": ("Gemma3TextConfig", dict(hidden_size=96, intermediate_size=123, num_attention_heads=2,
                                             num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=64,
                                             sliding_window=13, layer_types=["sliding_attention", "full_attention"],
                                             final_logit_softcapping=30.0)),
    # q, k, v in one qkv_proj, gate and up in one gate_up_proj (row ranges of one weight), window 7
    "phi3": ("Phi3Config", dict(hidden_size=96, intermediate_size=123, num_attention_heads=3, num_key_value_heads=1,
                                sliding_window=7)),
}


def model_type(name: str) -> str:
    """The family's model_type of a table's entry ("qwen2-windowed" -> "qwen2")."""
    return name.split("-")[0]


def tiny_config(table: dict, name: str, **overrides):
    config_name, geometry = table[name]
    return getattr(transformers, config_name)(**{**COMMON, **geometry, **overrides})


def tiny_model(table: dict, name: str, **overrides) -> torch.nn.Module:
    """A float32 model of `table[name]` in eval mode, its weights from seed 0."""
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(table, name, **overrides)).float().eval()


def uncovered_families() -> dict[str, set[str]]:
    """Families of `chunk_llama.hf.families` a table has no model of (the default model is the
    engine's Llama)."""
    return {table: set(FAMILIES) - {model_type(n) for n in models} - ({"llama"} if table == "ENGINE_MODELS" else set())
            for table, models in (("ENGINE_MODELS", ENGINE_MODELS), ("FUSED_MODELS", FUSED_MODELS))}
