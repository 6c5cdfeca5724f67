"""The modules that hold a GGUF model's weights in their GGML blocks: `GGUFLinear` (an
`nn.Linear`) and `GGUFEmbedding` (an `nn.Embedding`, or the table of a tied LM head), and
`set_gguf_activations`, what their blocks multiply with (float32, int8 or int16 activations,
`ops/cpu/activations.py`), the integer formats' blocks tiled for their kernel
(`ops/cpu/tiles.py`). `gguf/weights.py` and `gguf/load.py` decide which weights a model keeps
in these modules.
"""

from __future__ import annotations

import torch
from torch import nn

from chunk_llama.ops.cpu import quant_linear as ops
from chunk_llama.ops.cpu import tiles
from chunk_llama.ops.cpu.activations import INT8_TYPES
from chunk_llama.ops.cpu.activations import resolve as resolve_activations


class GGUFLinear(nn.Module):
    """`nn.Linear` whose weight stays in GGML blocks: `blocks` [out_features, row_bytes]
    uint8 of format `ggml_type` (gguf-py's name); x [..., in_features] -> [..., out_features].
    `weight` decodes a float32 copy on each access (for code that reads it; not the forward's
    path). `activations`: what the blocks multiply x with, "float32", "int8" or "int16" once resolved
    (`ops/cpu/activations.py`: "auto", or None for `CHUNK_LLAMA_GGUF_ACTIVATIONS`, else auto;
    `set_activations` changes it); a format without integer codes keeps float32. `tiled`:
    whether `blocks` are tiled for the integer kernel (`ops/cpu/tiles.py`; `set_gguf_activations`
    tiles a model's)."""

    def __init__(self, blocks: torch.Tensor, ggml_type: str, in_features: int, bias: torch.Tensor | None = None,
                 activations: str | None = None):
        super().__init__()
        self.in_features, self.out_features, self.ggml_type = in_features, blocks.shape[0], ggml_type
        self.register_buffer("blocks", blocks)
        self.bias, self.tiled = bias, False
        self.set_activations(activations)

    def set_activations(self, activations: str | None) -> bool:
        """Multiply with `activations` from now on; whether that changed anything (a fused layer
        described with the other activations must then be described again: `set_gguf_activations`
        does that for a model). Tiled blocks go back to rows for float32."""
        resolved = resolve_activations(activations)  # (ValueError naming a bad choice)
        resolved = resolved if self.ggml_type in INT8_TYPES else "float32"
        if resolved == "float32" and self.tiled:
            self.hold_blocks(tiles.untile(self.blocks, self.ggml_type), tiled=False)
        if getattr(self, "activations", None) == resolved and self._op.tiled == self.tiled:
            return False
        self.activations = resolved
        self._op = ops.QuantLinear(ops.GGML_TYPES[self.ggml_type], self.in_features, resolved, self.tiled)
        return True

    def hold_blocks(self, blocks: torch.Tensor, tiled: bool) -> None:
        """Hold `blocks` (the same weight, `tiled` or in rows); `set_activations` then makes the op
        that reads them."""
        self.blocks, self.tiled = blocks, tiled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.blocks, self.bias)

    @property
    def weight(self) -> torch.Tensor:
        return ops.dequantize(_rows(self), ops.GGML_TYPES[self.ggml_type], self.in_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        _save_as_float32(self, destination, prefix, keep_vars)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"ggml_type={self.ggml_type}")


class GGUFEmbedding(nn.Module):
    """`nn.Embedding` whose table stays in GGML blocks: ids [...] -> [..., embedding_dim],
    each looked-up row decoded to float32 (times `scale` where the model scales its
    embeddings, as Gemma's do)."""

    def __init__(self, blocks: torch.Tensor, ggml_type: str, embedding_dim: int, scale: torch.Tensor | None = None,
                 padding_idx: int | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.ggml_type = blocks.shape[0], embedding_dim, ggml_type
        self.padding_idx, self.tiled = padding_idx, False  # (tiled: the table of a tied LM head, tiles.py)
        self.register_buffer("blocks", blocks)
        self.register_buffer("scale", None if scale is None else scale.detach().clone(), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).to(self.blocks.device)
        rows = tiles.take_rows(self.blocks, self.ggml_type, ids) if self.tiled else self.blocks.index_select(0, ids)
        out = ops.dequantize(rows, ops.GGML_TYPES[self.ggml_type], self.embedding_dim)
        if self.scale is not None:
            out = out * self.scale.to(out.dtype)
        return out.view(*input_ids.shape, self.embedding_dim)

    def hold_blocks(self, blocks: torch.Tensor, tiled: bool) -> None:
        """Look up in `blocks` (the same table, `tiled` or in rows) from now on."""
        self.blocks, self.tiled = blocks, tiled

    @property
    def weight(self) -> torch.Tensor:
        return ops.dequantize(_rows(self), ops.GGML_TYPES[self.ggml_type], self.embedding_dim)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        _save_as_float32(self, destination, prefix, keep_vars)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, ggml_type={self.ggml_type}"


def set_gguf_activations(model: nn.Module, activations: str | None = None) -> str:
    """Make every `GGUFLinear` of `model` multiply with `activations` (`ops/cpu/activations.py`:
    auto, float32, int8 or int16; None: `CHUNK_LLAMA_GGUF_ACTIVATIONS`, else auto), resolved for
    this CPU; returns what it resolved to ("float32", "int8" or "int16"). The blocks of integer
    activations are tiled for their kernel, the others kept in rows (`_tile_blocks`)."""
    resolved = resolve_activations(activations)
    _tile_blocks(model, resolved)
    changed = [m.set_activations(resolved) for m in model.modules() if isinstance(m, GGUFLinear)]
    if any(changed):
        # a new view of each module's blocks (one per tensor: a tied embedding and LM head keep
        # sharing one): a fused layer described with the other activations sees its buffers
        # change (hf/fused/snapshot.py compares them by identity) and describes itself again
        views = {}
        for module in model.modules():
            if isinstance(module, (GGUFLinear, GGUFEmbedding)):
                old = module._buffers["blocks"]
                module._buffers["blocks"] = views.setdefault(id(old), (old, old.view(old.shape)))[1]
    return resolved


def _tile_blocks(model: nn.Module, activations: str) -> None:
    """Tile the blocks that `activations` ("float32", "int8" or "int16") multiplies with integers
    (`ops/cpu/tiles.py`: whole tiles of an integer format), and put the others back in rows; a
    tensor shared by several modules (a tied embedding and LM head) once, for all of them."""
    holders: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        if isinstance(module, (GGUFLinear, GGUFEmbedding)):
            holders.setdefault(id(module.blocks), []).append(module)
    for modules in holders.values():
        first = modules[0]
        integer = activations != "float32" and first.ggml_type in INT8_TYPES
        want = integer and any(isinstance(m, GGUFLinear) for m in modules) and tiles.tileable(
            first.ggml_type, first.blocks.shape[0])
        if want != first.tiled:
            blocks = (tiles.tile if want else tiles.untile)(first.blocks, first.ggml_type)
            for module in modules:
                module.hold_blocks(blocks, want)


def _rows(module: nn.Module) -> torch.Tensor:
    """A GGUF module's blocks in rows."""
    return tiles.untile(module.blocks, module.ggml_type) if module.tiled else module.blocks


def _save_as_float32(module: nn.Module, destination: dict, prefix: str, keep_vars: bool) -> None:
    """A state dict as the float32 module's (`weight` decoded, `bias`), not the blocks: what
    `save_pretrained` writes is then a checkpoint transformers loads, with the weights the
    model computes with (the blocks load back only through chunk-llama's loaders)."""
    destination[prefix + "weight"] = module.weight
    bias = module.__dict__.get("bias", module._parameters.get("bias"))
    if bias is not None:
        destination[prefix + "bias"] = bias if keep_vars else bias.detach()
