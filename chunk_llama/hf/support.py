"""What chunk-llama supports, by capability (`check_supported`), and the K/V geometry,
placement and budget of a model: read by the cache, the patch and the loader."""

from __future__ import annotations

import functools
import json
import threading

import psutil
import torch

from chunk_llama.hf.families import FAMILIES

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TESTED_MODEL_TYPES = tuple(FAMILIES)  # tested on tiny models of each (tests/families.py)
PROBE = "chunk_llama_probe"  # the attention implementation `declared_windows` registers


def check_supported(config) -> None:
    """Raise ValueError naming the feature when `config`'s model cannot run on chunk-llama.

    Accepted by capability, not by name: a decoder-only causal LM whose attention goes
    through transformers' attention interface, with RoPE applied before it (so the
    cache holds rotated keys) and causal self-attention, full or in a sliding window
    that the layer passes to the attention function. Tested families: `TESTED_MODEL_TYPES`.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(f"{model_type}: encoder-decoder models and cross-attention are not supported")
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None:
        raise ValueError(f"{model_type}: not a causal language model of transformers (no *ForCausalLM class)")
    if not getattr(model_class, "_supports_attention_backend", False):
        raise ValueError(
            f"{model_type}: its attention does not go through transformers' attention interface, "
            "which chunk-llama replaces"
        )
    unsupported = {
        "attention logit softcapping": getattr(config, "attn_logit_softcapping", None) is not None,
        "bidirectional attention": bool(getattr(config, "use_bidirectional_attention", False)),
        "multi-head latent attention": getattr(config, "kv_lora_rank", None) is not None,
        "ALiBi": bool(getattr(config, "alibi", False)),
        "positions without RoPE": getattr(config, "rope_parameters", None) is None
        and getattr(config, "rope_theta", None) is None,
    }
    for feature, present in unsupported.items():
        if present:
            raise ValueError(f"{model_type}: {feature} is not supported by chunk-llama's attention kernels")
    window = sliding_window(config)
    # the kernels apply a layer's window when its attention passes it, as stock SDPA's masks do
    if window is not None and not any(declared_windows(config)):
        raise ValueError(
            f"{model_type}: sliding-window attention (window {window}) whose attention layers do not pass "
            "their window to the attention function is not supported"
        )
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if kv_heads and heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")


_probe_lock = threading.Lock()


def declared_windows(config) -> tuple[int | None, ...]:
    """The sliding window each attention layer of `config`'s model passes to the attention
    function (None: the whole context), as its modules declare it when they run: the model
    is built on the meta device (no memory, no weights) and one forward of two tokens goes
    through a probe attention that records what each layer passes. Cached per config."""
    return _declared_windows(config.to_json_string(use_diff=False), type(config))


@functools.cache
def _declared_windows(config_json: str, config_class: type) -> tuple[int | None, ...]:
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface

    config = config_class.from_dict(json.loads(config_json))
    seen: dict[int, int | None] = {}

    def probe(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = kwargs.get("sliding_window")
        batch, heads, length, dim = query.shape
        return query.new_empty(batch, length, heads, dim), None

    with _probe_lock:  # the registry is global: one probe at a time
        AttentionInterface.register(PROBE, probe)
        AttentionMaskInterface.register(PROBE, lambda *args, **kwargs: None)
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, attn_implementation=PROBE)
                model(input_ids=torch.zeros(1, 2, dtype=torch.long))
        except Exception as error:  # noqa: BLE001 - any failure: the layers' windows are unknown
            raise ValueError(f"{config.model_type}: could not find which sliding window each attention layer "
                             f"passes (a forward on the meta device failed: {error})") from error
    return tuple(seen.get(layer) for layer in range(config.num_hidden_layers))


def sliding_window(config) -> int | None:
    """The window of the model's sliding-window layers, or None when every layer attends
    to the whole context (no window, or one no prompt can exceed)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types and "sliding_attention" not in layer_types):
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    if window >= getattr(config, "max_position_embeddings", float("inf")):
        return None
    return window


def rope_switch_length(config) -> int | None:
    """The total length past which the model's rotary embedding turns keys by other
    frequencies, or None. LongRoPE (Phi-3-mini-128k, Phi-3.5) uses its short factors while a
    sequence holds at most `original_max_position_embeddings` tokens and its long ones past
    that, for every position: stock generate then recomputes the whole cache with the long
    factors. Keys cached (and shared) under the short factors would be wrong there, so the
    engine keeps sequences within this length (`engine.py`) and the patched generate runs
    stock past it. (Dynamic NTK scaling changes only past max_position_embeddings, which
    nothing here exceeds.)"""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_type = parameters.values() if parameters and "rope_type" not in parameters else [parameters]
    switches = [p.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
                for p in per_type if isinstance(p, dict) and p.get("rope_type") == "longrope"]
    limit = getattr(config, "max_position_embeddings", None)
    switches = [s for s in switches if s and (limit is None or s < limit)]
    return min(switches) if switches else None


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; use one of {SUPPORTED_DTYPES}")


def resolve_kv_dtype(kv_dtype: str | torch.dtype | None, model_dtype: torch.dtype | None,
                     device: torch.device, integer_activations: bool = False) -> torch.dtype:
    """The K/V pool's dtype: `auto` (or None) the model's (float32 where `model_dtype` is
    None: unknown), but float16 under a float32 model on the CPU whose GGUF blocks multiply
    integer activations (`integer_activations`: `gguf_activations` int8 or int16, what `auto`
    picks), whose error with float16 K/V stays within `auto`'s bound (docs/BENCHMARKS.md,
    "16-bit K/V under int16 activations"), in half the bytes, as llama.cpp holds K/V; else
    the named dtype, which must be the model's or, under a float32 model on the CPU,
    bfloat16 or float16 (K/V stored rounded to it, attention computed in float32: half the
    pool's bytes and the attention's reads; the CPU kernels widen them in registers).
    Resolved once, when the cache is made: activations switched later keep its pool."""
    if kv_dtype is None or kv_dtype == "auto":
        if integer_activations and device.type == "cpu" and model_dtype in (None, torch.float32):
            return torch.float16
        return model_dtype or torch.float32
    if isinstance(kv_dtype, str):
        resolved = getattr(torch, kv_dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"kv_dtype must be auto or one of float32, bfloat16, float16, got {kv_dtype!r}")
        kv_dtype = resolved
    if not isinstance(kv_dtype, torch.dtype):
        raise TypeError(f"kv_dtype must be a torch.dtype or its name, got {type(kv_dtype).__name__}")
    name = lambda t: str(t).removeprefix("torch.")  # noqa: E731
    if model_dtype is None:
        check_dtype(kv_dtype)
    elif kv_dtype != model_dtype and not (device.type == "cpu" and model_dtype == torch.float32
                                        and kv_dtype in (torch.bfloat16, torch.float16)):
        raise ValueError(f"kv_dtype={name(kv_dtype)} under a {name(model_dtype)} model on {device.type}: the K/V "
                         f"pool holds the model's dtype, or bfloat16 or float16 under a float32 model on the CPU")
    return kv_dtype


def kv_geometry(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a model config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def layer_devices(model, num_layers: int) -> list[torch.device]:
    """The device each attention layer computes on: accelerate's execution device where a
    hook moves the layer's weights in (`device_map` with offload), else its weights'
    device; layers not found on the model's device. A model split over
    GPUs by `device_map` keeps each layer's K/V where that layer runs."""
    devices: list[torch.device | None] = [None] * num_layers
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and 0 <= index < num_layers and devices[index] is None:
            devices[index] = _execution_device(module)
    fallback = torch.device(getattr(model, "device", "cpu"))
    return [d if d is not None else fallback for d in devices]


def _execution_device(module) -> torch.device | None:
    for sub in module.modules():
        hook = getattr(sub, "_hf_hook", None)
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    for parameter in module.parameters():
        return parameter.device
    return None


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return psutil.virtual_memory().available


def default_kv_cache_bytes(config, device: torch.device, bytes_per_token: int) -> int:
    """A budget for the chunk pool: 40% of free memory (50% on a GPU), and never
    more than 64 full-length sequences would take. CPU pages are committed only
    when written, so an unused budget costs address space, not RAM."""
    fraction = 0.5 if device.type == "cuda" else 0.4
    cap = 64 * getattr(config, "max_position_embeddings", 8192) * bytes_per_token
    return int(min(_available_memory(device) * fraction, cap))
