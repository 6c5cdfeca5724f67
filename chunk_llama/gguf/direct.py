"""A GGUF tensor's blocks into its module without the float32 copy: `keep_file_blocks`.

`gguf/load.py` used to give every tensor to gguf-py's numpy dequantizer and to transformers'
tensor processor, load the float32 result into the model, and only then replace the module by
one holding the blocks (`weights.keep_blocks`, which checks that the blocks decode to that
weight). At 8B that is 7 billion weights through numpy: minutes, where llama.cpp maps the file
in seconds. Here a quantized tensor headed for a plain `nn.Linear` or embedding goes straight
to its blocks: the processor is run on the row numbers (`weights.row_permutation`: it must
only reorder rows, as Llama's q/k processor does), the rows are copied out of the file in that
order, and a sample of rows is decoded by the CPU kernel and by gguf-py (what transformers
loads the file with) and compared, so the module computes with transformers' weights as
before. Anything else (float tensors, biases not loaded yet, a processor that changes values, a
sample that differs) returns None and takes the float32 path.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from chunk_llama.gguf import modules, weights
from chunk_llama.gguf.file import FileTensor, populate_pages, release_pages
from chunk_llama.ops.cpu import quant_linear as ops

SAMPLE_ROWS = 16  # rows decoded both ways per tensor: the first, the last and evenly between


def keep_file_blocks(model: nn.Module, name: str | None, tensor: FileTensor, processor) -> int | None:
    """Replace the (meta) module whose parameter `name` the quantized `tensor` would be loaded
    into by one holding its blocks; returns how many modules hold them (2 for an embedding tied
    to the LM head), or None where the float32 path must load it (module doc). The tensor's
    file pages are released once copied."""
    ggml_type = tensor.tensor_type.name
    if name is None or not name.endswith(".weight") or ggml_type not in ops.GGML_TYPES \
            or ggml_type in weights.HALF_TYPES.values():
        return None
    module_name = name.removesuffix(".weight")
    module = model.get_submodule(module_name)
    reproducible, scale = weights.embedding_scale(module)
    bias = module._parameters.get("bias")
    if not (type(module) is nn.Linear or reproducible) or (bias is not None and bias.is_meta):
        return None
    rows, in_features = module.weight.shape
    data = tensor.data  # [rows, row_bytes] uint8, memory-mapped
    if data.ndim != 2 or data.shape[0] != rows or data.shape[1] != _row_bytes(ggml_type, in_features):
        return None
    permutation = weights.row_permutation(processor, tensor.name, rows)
    if permutation is None:
        return None
    blocks = torch.empty(data.shape, dtype=torch.uint8)
    populate_pages(data)
    if np.array_equal(permutation, np.arange(rows)):
        blocks.numpy()[...] = data  # one copy (np.take row by row ran at a third of its speed)
    else:
        np.take(data, permutation, axis=0, out=blocks.numpy())
    if not _sample_matches(blocks, data, permutation, ggml_type, in_features):
        return None
    release_pages(data)
    if type(module) is nn.Linear:
        weights.replace_module(model, module_name, modules.GGUFLinear(blocks, ggml_type, in_features, bias))
        return 1
    replaced = 1
    output = model.get_output_embeddings()
    if isinstance(output, nn.Linear) and output.weight is module.weight:  # a tied LM head: the same blocks
        weights.replace_module(model, weights.name_of(model, output),
                         modules.GGUFLinear(blocks, ggml_type, output.in_features, output.bias))
        replaced += 1
    weights.replace_module(model, module_name, modules.GGUFEmbedding(blocks, ggml_type, in_features, scale,
                                                               module.padding_idx))
    return replaced


def _row_bytes(ggml_type: str, in_features: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    return in_features // block_elems * block_bytes if in_features % block_elems == 0 else -1


def _sample_matches(blocks: torch.Tensor, data: np.ndarray, permutation: np.ndarray, ggml_type: str,
                    in_features: int) -> bool:
    """Whether sampled rows of `blocks` decode (CPU kernel) to what gguf-py decodes the file's
    rows they came from to."""
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize

    sample = np.unique(np.linspace(0, blocks.shape[0] - 1, SAMPLE_ROWS).round().astype(np.int64))
    try:
        ours = ops.dequantize(blocks[torch.from_numpy(sample)].contiguous(), ops.GGML_TYPES[ggml_type], in_features)
    except ValueError:  # the row is not whole blocks of this format at this width
        return False
    truth = torch.from_numpy(np.array(gguf_dequantize(data[permutation[sample]], GGMLQuantizationType[ggml_type]),
                                      dtype=np.float32)).reshape(ours.shape)
    scale = truth.abs().max().item() or 1.0
    return bool(torch.isfinite(truth).all()) and (ours - truth).abs().max().item() <= weights.MATCH_TOLERANCE * scale
