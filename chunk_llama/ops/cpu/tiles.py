"""GGML blocks with their rows tiled for the integer kernel (`csrc/cpu/quant_params.h`, kTiled).

The integer kernel (`--gguf-activations int8|int16`, `csrc/cpu/quant_act.h`) multiplies a
column vector of 16 (AVX-512; AVX2 8) weight rows at a time, each lane one row: in the file's
layout each dword it needs lies in another row, and putting 16 rows' dwords side by side took
a 16 x 8 dword transposition (24 permutes per 512 bytes), the bound of a one-row decode step.
Tiled, the same bytes are stored 16 rows at a time, block by block, each dword of the block as
the 16 rows' in turn (the formats' lone fp16 scale, Q4_0, Q5_0 and Q8_0's d and Q6_K's, first
as the 16 rows' halves): the kernel's reads are plain loads, as llama.cpp's repacked blocks.

A tiled weight takes the bytes of its rows, so row r's tile starts where row 16 * (r // 16)
did, and a slice of whole tiles is a tiled weight. Only the integer kernel reads tiles; the
float32 kernel, `dequantize` and the embedding's lookup read rows (`untile`, `take_rows`).
`tile`, `untile` and `take_rows` run in the CPU library (an 8B model's 4.6 GB in about 2 s on 2 cores); the
`reference_` ones are the same layout in torch (the tests' oracle).
"""

from __future__ import annotations

import torch

from chunk_llama.ops.cpu.activations import INT8_TYPES

TILE_ROWS = 16
TILED = 256  # added to a GGML type id: the kernel reads the blocks as tiles
# where a format's lone fp16 lies in its block (the rest is whole dwords)
_LONE_HALF_AT = {"Q4_0": 0, "Q5_0": 0, "Q8_0": 0, "Q6_K": 208}
TILED_TYPES = INT8_TYPES  # the formats with integer codes


def tileable(ggml_type: str, out_features: int) -> bool:
    """Whether a weight of `out_features` rows in `ggml_type` can be tiled (whole tiles of an
    integer format)."""
    return ggml_type in TILED_TYPES and out_features % TILE_ROWS == 0 and out_features > 0


def _geometry(blocks: torch.Tensor, ggml_type: str) -> tuple[int, int, int, int]:
    """(tiles, blocks per row, block bytes, where the lone fp16 lies or -1)."""
    if blocks.dim() != 2 or blocks.dtype is not torch.uint8 or ggml_type not in TILED_TYPES or blocks.shape[0] % TILE_ROWS:
        raise ValueError(f"tiles: a {ggml_type} weight of {list(blocks.shape)} {blocks.dtype} is not whole tiles of "
                         f"{TILE_ROWS} rows of an integer format")
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # (an extra: present wherever blocks are)

    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]][1]
    if blocks.shape[1] % block_bytes:
        raise ValueError(f"tiles: rows of {blocks.shape[1]} bytes are not whole {ggml_type} blocks of {block_bytes}")
    return blocks.shape[0] // TILE_ROWS, blocks.shape[1] // block_bytes, block_bytes, _LONE_HALF_AT.get(ggml_type, -1)


def _split(rows: torch.Tensor, half_at: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """rows [..., block_bytes] -> (the lone fp16's 2 bytes [..., 2] or None, the dwords [..., n, 4])."""
    if half_at < 0:
        return None, rows.unflatten(-1, (-1, 4))
    rest = torch.cat([rows[..., :half_at], rows[..., half_at + 2:]], -1) if half_at else rows[..., 2:]
    return rows[..., half_at:half_at + 2], rest.unflatten(-1, (-1, 4))


def tile(blocks: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """blocks [rows, row_bytes] uint8 in the file's layout -> the same bytes tiled (a new tensor)."""
    _geometry(blocks, ggml_type)
    return _library().tile_rows(blocks.contiguous(), _type_id(ggml_type))


def untile(tiled: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """A tiled weight back in the file's layout (a new tensor)."""
    _geometry(tiled, ggml_type)
    return _library().tile_rows(tiled.contiguous(), _type_id(ggml_type), untile=True)


def _type_id(ggml_type: str) -> int:
    from gguf import GGMLQuantizationType  # (GGML's type ids, as the C library takes them)

    return GGMLQuantizationType[ggml_type].value


def _library():
    from chunk_llama.ops.cpu.attention import build

    library = build()
    if library is None:  # (blocks are tiled only where the integer kernel runs)
        raise ValueError("tiles: the CPU kernels are not available")
    return library


def reference_tile(blocks: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """`tile` in torch."""
    tiles, per_row, block_bytes, half_at = _geometry(blocks, ggml_type)
    rows = blocks.view(tiles, TILE_ROWS, per_row, block_bytes).transpose(1, 2)  # [tiles, block, row, bytes]
    half, dwords = _split(rows, half_at)
    parts = [dwords.transpose(2, 3).flatten(2)]  # [tiles, block, dword * row * 4]
    if half is not None:
        parts.insert(0, half.flatten(2))  # [tiles, block, row * 2]
    return torch.cat(parts, -1).view(blocks.shape)


def take_rows(tiled: torch.Tensor, ggml_type: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [n] of a tiled weight in the file's layout: [n, row_bytes] uint8 (one call of
    the C library: `reference_take_rows`' dozen torch ops cost about 0.1 ms a decode step)."""
    _geometry(tiled, ggml_type)
    return _library().take_rows(tiled.contiguous(), _type_id(ggml_type), ids.reshape(-1))


def reference_take_rows(tiled: torch.Tensor, ggml_type: str, ids: torch.Tensor) -> torch.Tensor:
    """`take_rows` in torch."""
    tiles, per_row, block_bytes, half_at = _geometry(tiled, ggml_type)
    view = tiled.view(tiles, per_row, block_bytes * TILE_ROWS)
    tile_of, lane = ids // TILE_ROWS, ids % TILE_ROWS
    halves = 2 * TILE_ROWS if half_at >= 0 else 0
    dwords = view[:, :, halves:].unflatten(-1, (-1, TILE_ROWS, 4))[tile_of, :, :, lane].flatten(2)  # [n, block, bytes]
    if half_at >= 0:
        half = view[:, :, :halves].unflatten(-1, (TILE_ROWS, 2))[tile_of, :, lane]  # [n, block, 2]
        dwords = torch.cat([dwords[..., :half_at], half, dwords[..., half_at:]], -1)
    return dwords.reshape(ids.shape[0], per_row * block_bytes)


def reference_untile(tiled: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """`untile` in torch."""
    return reference_take_rows(tiled, ggml_type, torch.arange(tiled.shape[0]))
