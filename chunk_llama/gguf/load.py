"""A GGUF model loaded one tensor at a time, its quantized tensors kept in blocks: `load_gguf_model`.

transformers' GGUF loader (`load_gguf_checkpoint`, which reads Llama, Mistral, Qwen2/3,
Gemma 3 files and most others) dequantizes every tensor of the file into one float32 state
dict before the model takes it: the default model's 98 MB file needs about 1.1 GB on the
way, an 8B model's 5 GB Q4 file over 32 GB, more than the machine may have. Here the model is
built with its parameters on the meta device (accelerate's `init_empty_weights`; buffers
such as the rotary frequencies are computed as usual) and the file is read one tensor at a
time, through the same name map and tensor processor transformers loads with: each tensor
becomes the parameter transformers would have made of it, and then, where
`gguf_weights.keep_blocks` accepts it (its blocks decode to that parameter), the module's
blocks replace it. At most one tensor is float32 beside the blocks at any moment.

Where transformers does more than this for a file (its newer per-architecture conversions,
a tensor processor that does more than reorder rows, a parameter the file lacks), the model
is not built here: `load_gguf_model` returns None and why, and `load_model` loads it through
`from_pretrained` as before.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np
import torch
from torch import nn

from chunk_llama.gguf import weights as gguf_weights
from chunk_llama.gguf.direct import keep_file_blocks
from chunk_llama.gguf.file import FileTensor, file_tensors

logger = logging.getLogger(__name__)


def _plain_processors() -> tuple[type, ...]:
    """transformers' tensor processors that only reorder a tensor (Llama's q/k rows) or
    shift it (Gemma's norms): the model's parameters are then exactly what `process` returns."""
    from transformers.modeling_gguf_pytorch_utils import (
        Gemma2TensorProcessor,
        LlamaTensorProcessor,
        TensorProcessor,
    )

    return TensorProcessor, LlamaTensorProcessor, Gemma2TensorProcessor


def load_gguf_model(gguf_path: str, config, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    **from_config_kwargs) -> tuple[nn.Module | None, str]:
    """(model, what was kept) for the `.gguf` file at `gguf_path` with transformers'
    `config` of it, in eval mode: the parameters transformers' `from_pretrained(...,
    dtype=dtype)` gives, on `device`. On the CPU in float32, each quantized tensor that
    `gguf_weights.keep_blocks` accepts is kept in its blocks; elsewhere ("none" kept) each
    tensor is cast and moved as it is read. (None, why) where this file needs
    `from_pretrained` (module doc). `from_config_kwargs` (`attn_implementation`,
    `trust_remote_code`) go to `from_config`."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.integrations.gguf import is_gguf_arch_supported
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    device = torch.device(device)
    blocks = device.type == "cpu" and dtype is torch.float32
    reason = gguf_weights.ops.unavailable_reason() if blocks else None
    if reason is not None:
        return None, f"the quantized kernels are not available ({reason})"
    try:
        architecture, tensors, keys = file_tensors(gguf_path)
    except ValueError as error:  # not a file this reader reads (from_pretrained says what it makes of it)
        return None, str(error)
    if is_gguf_arch_supported(architecture):  # transformers' newer per-architecture conversions
        return None, f"transformers converts {architecture} files with its own per-architecture conversions"
    processor_class = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    if processor_class not in _plain_processors():
        return None, f"transformers' {processor_class.__name__} does more than reorder or shift a tensor"
    heads = {f"{architecture}.attention.head_count", f"{architecture}.attention.head_count_kv"}
    if not heads <= keys:  # transformers' processor then reorders no rows (its config lacks the heads)
        return None, f"the file does not give {' and '.join(sorted(heads - keys))}"
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **from_config_kwargs)
    model.tie_weights()  # tied parameters are one Parameter, loaded once under each name
    processor = processor_class(config=model.config.to_dict())
    try:
        parameter_of = gguf_weights.hf_weights_map(model, processor)  # GGUF tensor name -> the model's name
    except NotImplementedError as error:  # gguf-py does not know the model type
        return None, str(error)
    tied = {}  # parameter name -> all names of its Parameter (tied weights share one)
    for names in _names_by_parameter(model):
        tied.update(dict.fromkeys(names, names))
    kept = gguf_weights.KeptBlocks()
    loaded: set[str] = set()
    for tensor in tensors:
        # what load_gguf_checkpoint does with each tensor (a plain processor keeps its name), one at a time
        if tensor.name not in parameter_of:
            continue
        if blocks:  # a quantized tensor straight into its module's blocks, where it can (gguf/direct.py)
            name = parameter_of[tensor.name]
            replaced = keep_file_blocks(model, name, tensor, processor)
            if replaced:
                kept.add(tensor, replaced)
                loaded.update(tied.get(name, (name,)))
                continue
        processed = processor.process(weights=_dequantized(tensor), name=tensor.name,
                                      tensor_key_mapping=parameter_of, parsed_parameters={"tensors": {}})
        name = parameter_of[processed.name]
        # as load_gguf_checkpoint: float32, then the model's dtype
        value = torch.from_numpy(np.ascontiguousarray(processed.weights, dtype=np.float32))
        problem = _load(model, name, value if blocks else value.to(device, dtype), tied.get(name, (name,)), loaded)
        if problem is not None:
            return None, f"the file's {tensor.name}: {problem}"
        if blocks:
            kept.add(tensor, gguf_weights.keep_blocks(model, name, tensor, processor))
        del processed, value
        _return_freed_memory()
    missing = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        return None, f"the file has no tensor for {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
    kept.warn_refused()
    return model.to(device).eval(), gguf_weights.describe_kept(kept.counts)


def _dequantized(tensor: FileTensor) -> np.ndarray:
    """gguf-py's `dequantize` of the tensor (what load_gguf_checkpoint runs), into a new
    float32 array a slice of rows at a time: its temporaries (three times the float32
    size: Gemma 3's 262,144-row embedding would take 2 GB) never exist for the whole."""
    from gguf import dequantize

    if tensor.data.ndim < 2:
        return np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    first = dequantize(tensor.data[:1], tensor.tensor_type)
    out = np.empty((tensor.data.shape[0], *first.shape[1:]), dtype=np.float32)
    rows = max(1, (1 << 22) // first.size)  # 16 MB of float32 a slice
    for start in range(0, out.shape[0], rows):
        out[start:start + rows] = dequantize(tensor.data[start:start + rows], tensor.tensor_type)
    return out


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def _return_freed_memory() -> None:
    """Give the float32 transients of the last tensor back to the system: glibc keeps freed
    blocks under 32 MB in its heap, where the blocks kept between them fragment it, and the
    load's peak would grow by about the float32 model's size (measured: 359 MiB against
    203 MiB for tests/test_gguf_load.py's 73 MB file)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _names_by_parameter(model: nn.Module) -> list[tuple[str, ...]]:
    """Each Parameter's names (more than one for tied weights)."""
    names: dict[int, tuple] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names[id(parameter)] = (*names.get(id(parameter), ()), name)
    return list(names.values())


def _load(model: nn.Module, name: str, value: torch.Tensor, names: tuple, loaded: set[str]) -> str | None:
    """Set parameter or buffer `name` and the parameters tied to it (`names`) to `value`;
    or why not: it was loaded already (a tensor for each of two tied names), it is neither
    (its module holds blocks already), or its shape is not the value's."""
    module = model.get_submodule(name.rpartition(".")[0])
    attribute = name.rpartition(".")[2]
    if name in loaded:
        return f"{name} was loaded already (tied to {', '.join(names)})"
    current = module._parameters.get(attribute, module._buffers.get(attribute))
    if current is None:
        return f"{name} is not a parameter or buffer of {type(module).__name__}"
    if current.shape != value.shape:
        return f"shape {tuple(value.shape)}, the model's {name} {tuple(current.shape)}"
    loaded.update(names)
    if attribute in module._buffers:
        module._buffers[attribute] = value  # persistent or not, as it was
        return None
    parameter = nn.Parameter(value, requires_grad=current.requires_grad)
    for tied in names:
        owner, _, tied_attribute = tied.rpartition(".")
        setattr(model.get_submodule(owner), tied_attribute, parameter)
    return None
