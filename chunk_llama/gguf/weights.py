"""A GGUF model's quantized weights kept in their blocks: `keep_gguf_quantized`.

transformers loads a GGUF file by dequantizing every tensor to float32: the default model's
98 MB file becomes 540 MB of weights, and a decode step, which reads every weight once,
reads those. This module gives the quantized tensors back their blocks: each `nn.Linear`
(and the token embedding, and a tied LM head) whose GGUF tensor is in a format the CPU
kernel decodes (`ops/cpu/quant_linear.py`) is replaced by a `GGUFLinear` (`GGUFEmbedding`,
`gguf/modules.py`) holding that tensor's bytes, and the float32 copy is dropped.

Nothing is trusted to a name alone: transformers' name map (`get_gguf_hf_weights_map`,
what its loader maps with) says which module a tensor is, transformers' tensor processor,
run on the row numbers, how it reordered the rows (Llama's query and key heads), and each
kept tensor is decoded and compared with the float32 weight transformers loaded for that
module: a tensor that does not match stays float32, with a warning. So the model computes
with the weights stock transformers computes with, up to the order of rounding.
`gguf/load.py` loads a file the same way one tensor at a time (`keep_blocks`,
`file_tensors`).
"""

from __future__ import annotations

import collections
import functools
import logging
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from chunk_llama.gguf.file import FileTensor, file_tensors
from chunk_llama.gguf.modules import GGUFEmbedding, GGUFLinear
from chunk_llama.ops.cpu import quant_linear as ops

logger = logging.getLogger(__name__)
# How far a decoded weight may be from transformers' (relative to the tensor's largest): on
# x86 none (quant.h rounds a product before its add, as gguf-py's numpy does); aarch64's
# compiler may fuse the generic lanes' multiply-add into an FMA (1 ulp).
MATCH_TOLERANCE = 1e-6


def embedding_scale(module: nn.Module) -> tuple[bool, torch.Tensor | None]:
    """(whether the embedding's forward is one GGUFEmbedding reproduces, its scale)."""
    if getattr(module, "max_norm", None) is not None:  # renormalizes the rows it looks up
        return False, None
    if type(module) is nn.Embedding:
        return True, None
    # Gemma's: nn.Embedding's lookup times embed_scale (a buffer); checked against it below.
    if isinstance(module, nn.Embedding) and type(module).__name__.endswith("ScaledWordEmbedding"):
        return True, module.embed_scale
    return False, None


def hf_weights_map(model: nn.Module, processor) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name, as transformers maps them
    (`get_gguf_hf_weights_map`). It walks every submodule and builds gguf-py's name map (every
    layer's every name) again for each: 423 times, 11 s, for an 8B Llama. The map is the same
    for all, so it is built once here."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    build = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(build)  # (read by the function at each call)
    try:
        return get_gguf_hf_weights_map(model, processor)
    finally:
        gguf.get_tensor_name_map = build


def row_permutation(processor, gguf_name: str, num_rows: int) -> np.ndarray | None:
    """The rows transformers reorders a tensor's by on loading (Llama's q/k heads), found by
    running its own processor on the row numbers; None if it does more than reorder rows."""
    rows = np.arange(num_rows, dtype=np.float32).reshape(num_rows, 1)
    processed = np.asarray(processor.process(rows, gguf_name).weights)
    if processed.shape != rows.shape or not np.array_equal(np.sort(processed[:, 0]), rows[:, 0]):
        return None
    return processed[:, 0].astype(np.int64)


def _close(value: torch.Tensor, truth: torch.Tensor) -> bool:
    if value.shape != truth.shape:
        return False
    scale = truth.abs().max().item() or 1.0
    return (value - truth.float()).abs().max().item() <= MATCH_TOLERANCE * scale


def _matches(blocks: torch.Tensor, ggml_type: str, weight: torch.Tensor) -> bool:
    if blocks.shape[0] != weight.shape[0] or weight.dim() != 2 or weight.numel() == 0:
        return False
    if not torch.isfinite(weight).all():  # (the portable lanes decode an fp16 infinity as a finite number)
        return False
    low, high = torch.aminmax(weight)
    scale = max(-low.item(), high.item()) or 1.0
    rows = max(1, (1 << 20) // weight.shape[1])  # a slice at a time: no second float32 copy of a large table
    for start in range(0, weight.shape[0], rows):
        try:
            decoded = ops.dequantize(blocks[start:start + rows], ops.GGML_TYPES[ggml_type], weight.shape[1])
        except ValueError:  # the row is not whole blocks of this format at this width
            return False
        if (decoded - weight[start:start + rows]).abs().max().item() > MATCH_TOLERANCE * scale:
            return False
    return True


def keep_gguf_quantized(model: nn.Module, gguf_path: str) -> dict[str, int]:
    """Replace the float32 weights transformers loaded from `gguf_path` by the file's blocks
    wherever the CPU kernel decodes them (module doc). The model must be on the CPU in
    float32 (ValueError otherwise). Returns how many tensors of each GGML type were kept;
    empty, with a warning, where the kernels are not available. (`gguf/load.py` does the
    same while it loads, without transformers' float32 copy of the whole file.)"""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or parameter.dtype != torch.float32:
        raise ValueError(f"GGUF weights stay quantized only on a float32 CPU model, not {parameter.dtype} on "
                         f"{parameter.device}")
    reason = ops.unavailable_reason()
    if reason is not None:
        logger.warning("chunk-llama: the GGUF weights are dequantized to float32: %s", reason)
        return {}
    try:
        architecture, tensors, _ = file_tensors(gguf_path)
    except ValueError as error:
        logger.warning("chunk-llama: the GGUF weights are dequantized to float32: %s", error)
        return {}
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    try:
        parameter_of = hf_weights_map(model, processor)
    except NotImplementedError as error:  # gguf-py does not know the model type
        logger.warning("chunk-llama: the GGUF weights are dequantized to float32: %s", error)
        return {}
    kept = KeptBlocks()
    for tensor in tensors:
        kept.add(tensor, keep_blocks(model, parameter_of.get(tensor.name), tensor, processor))
    kept.warn_refused()
    return dict(kept.counts)


HALF_TYPES = {torch.bfloat16: "BF16", torch.float16: "F16"}  # the 16-bit checkpoints float32 holds exactly


class _TypeName(NamedTuple):
    name: str


def keep_half_precision(model: nn.Module, dtype: torch.dtype) -> int:
    """Keep in `dtype` (bfloat16 or float16) each linear layer's (and the token
    embedding's) weight of a float32 CPU model whose values are `dtype` ones (a checkpoint
    of that dtype loaded in float32, as transformers upcasts it: exactly), as BF16 / F16
    blocks that the kernel widens back in registers: the same float32 weights, half the
    bytes kept and read. A weight that is not exactly `dtype` values, or whose width is not
    whole groups of 32, stays float32. Returns how many modules now hold `dtype` (0 where
    the kernels are not available)."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor

    if ops.unavailable_reason() is not None:
        return 0
    ggml_type = _TypeName(HALF_TYPES[dtype])  # (keep_blocks reads its name; gguf-py is not needed here)
    replaced = 0
    for name, module in list(model.named_modules()):
        weight = getattr(module, "weight", None)
        if not (isinstance(weight, torch.Tensor) and weight.dtype is torch.float32 and weight.is_cpu
                and weight.dim() == 2 and weight.shape[1] % 32 == 0) or model.get_submodule(name) is not module:
            continue  # (a module already replaced, as a tied LM head is with its embedding, is skipped)
        if module._forward_hooks or module._forward_pre_hooks or "_hf_hook" in module.__dict__:
            continue  # a hook may compute or move the weight (weight_norm, offloading): the module's own forward
        half = weight.detach().to(dtype)
        if not torch.equal(half.float(), weight):
            continue
        tensor = FileTensor(name, ggml_type, half.view(torch.uint8).numpy())
        replaced += keep_blocks(model, f"{name}.weight", tensor, TensorProcessor()) or 0
    return replaced


def keep_blocks(model: nn.Module, name: str | None, tensor, processor) -> int | None:
    """Replace the module whose parameter `name` the GGUF `tensor` (a `FileTensor`)
    was loaded into (by transformers' `processor`) with one holding the tensor's blocks,
    if they decode to that parameter. Returns how many modules now hold them (2 for an
    embedding tied to the LM head), 0 where they do not decode to it (it stays float32),
    None where they cannot replace it (not a `.weight`, a format the kernel does not
    decode, a module whose forward is not a plain lookup or product)."""
    ggml_type = tensor.tensor_type.name
    if name is None or ggml_type not in ops.GGML_TYPES or not name.endswith(".weight"):
        return None
    module_name = name.removesuffix(".weight")
    module = model.get_submodule(module_name)
    reproducible, scale = embedding_scale(module)
    if not (type(module) is nn.Linear or reproducible):
        return None
    if ggml_type in HALF_TYPES.values() and module.weight.shape[-1] % 32:
        return None  # (GGML's 16-bit blocks are of one value; the kernel's groups are of 32)
    permutation = row_permutation(processor, tensor.name, tensor.data.shape[0])
    # [rows, row_bytes], a copy (an F16 tensor's data are float16 values: their bytes)
    blocks = torch.from_numpy(np.array(tensor.data).view(np.uint8).reshape(tensor.data.shape[0], -1))
    if permutation is not None:
        blocks = blocks[torch.from_numpy(permutation)].contiguous()
    if permutation is None or not _matches(blocks, ggml_type, module.weight):
        return 0
    if type(module) is nn.Linear:
        replace_module(model, module_name, GGUFLinear(blocks, ggml_type, module.in_features, module.bias))
        return 1
    replacement = GGUFEmbedding(blocks, ggml_type, module.embedding_dim, scale, module.padding_idx)
    ids = torch.randint(0, module.num_embeddings, (64,), generator=torch.Generator().manual_seed(0))
    if not _close(replacement(ids), module(ids)):  # the lookup, and the scale, as the module's own
        return 0
    replaced = 1
    output = model.get_output_embeddings()
    if isinstance(output, nn.Linear) and output.weight is module.weight:  # a tied LM head: the same blocks
        replace_module(model, name_of(model, output), GGUFLinear(blocks, ggml_type, output.in_features, output.bias))
        replaced += 1
    replace_module(model, module_name, replacement)
    return replaced


class KeptBlocks:
    """What `keep_blocks` made of a file's tensors: how many modules hold blocks, by GGML
    type (`counts`), and the tensors whose blocks did not decode to their weight (`refused`)."""

    def __init__(self):
        self.counts: collections.Counter[str] = collections.Counter()
        self.refused: list[str] = []

    def add(self, tensor, replaced: int | None) -> None:
        """`tensor` (a `FileTensor`) and what `keep_blocks` returned for it."""
        if replaced:
            self.counts[tensor.tensor_type.name] += replaced
        elif replaced == 0:
            self.refused.append(tensor.name)

    def warn_refused(self) -> None:
        if self.refused:
            logger.warning("chunk-llama: %d GGUF tensors stay float32: their decoded blocks differ from the weights "
                           "transformers loaded (%s)", len(self.refused), ", ".join(self.refused[:5]))


def describe_kept(counts: dict[str, int]) -> str:
    """The blocks kept, by GGML type, as "210 Q4_1, 2 Q8_0" ("none" where none were)."""
    return ", ".join(f"{n} {t}" for t, n in sorted(counts.items())) or "none"


def integer_activations(model: nn.Module) -> bool:
    """Whether any of the model's GGUF layers multiplies integer activations (int8 or int16)."""
    return any(m.activations != "float32" for m in model.modules() if isinstance(m, GGUFLinear))


def gguf_blocks(model: nn.Module) -> dict[str, int]:
    """How many of the model's layers hold GGML blocks, by type (empty for none)."""
    return dict(collections.Counter(m.ggml_type for m in model.modules() if isinstance(m, (GGUFLinear, GGUFEmbedding))))


def name_of(model: nn.Module, target: nn.Module) -> str:
    return next(name for name, module in model.named_modules() if module is target)


def replace_module(model: nn.Module, name: str, replacement: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, replacement)
