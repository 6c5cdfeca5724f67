"""The quantized linear kernel over a whole model's GGUF weights, as a decode step reads them.

    python scripts/bench_quant_linear.py                   # rows 1 4 8 16, the default model
    python scripts/bench_quant_linear.py --rows 1 --model path/to/model.gguf
    python scripts/bench_quant_linear.py --rows 1 --model gemma3-270m --by-type   # each format's share
    python scripts/bench_quant_linear.py --rows 1 --random Q4_K Q6_K --shape 4096x4096  # one matrix per format
    python scripts/bench_quant_linear.py --rows 1 300 --activations float32 int8 int16 --model 1b.gguf  # the modes

Every Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/K-quant/F16/BF16 matrix of the file (the layers' projections
and the LM head; an embedding tied to the head counts once), each called once per pass with
`--rows` rows of random float32 activations through `ops/cpu/quant_linear.py` (the path the
engine's op-by-op layers and the LM head take; the fused layers call the same kernel from
C). The weights of a pass do not fit any cache, so each pass reads them from memory, as a
decode step does. Reports the fastest and the median pass, and the blocks' bytes over the
fastest pass (GB/s); `--by-type`: also each format's matrices alone. The Python call per
matrix (a few microseconds) is included.

`--random FORMAT...` times one `--shape` matrix of random blocks per format instead (every
bit pattern of the packed weights, the fp16 scales finite, as the tests draw them; copies
of it, 256 MB in all, taken in turn so that each call reads its blocks from memory): the
median and fastest call, GB/s of blocks and Gweights/s, for a model size no file here has.
`--in-cache` calls that one matrix every time instead (a shape that fits L2 then measures the
kernel's own rate, Python's call included, about 10 us).
`--activations`: what the blocks multiply (`--gguf-activations`'s float32, int8 and int16), each in turn.
`--layout`: integer activations on blocks tiled as the engine tiles them (`ops/cpu/tiles.py`,
the default), in the file's rows, or each in turn.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from chunk_llama.gguf.file import file_tensors
from chunk_llama.loading import model_path
from chunk_llama.ops.cpu import isa, tiles
from chunk_llama.ops.cpu.activations import INTEGER_MODES
from chunk_llama.ops.cpu.attention import build
from chunk_llama.ops.cpu.quant_linear import GGML_TYPES, QuantLinear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file or gemma3-270m (default: the default model's)")
    parser.add_argument("--by-type", action="store_true", help="also time each format's matrices alone")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--random", nargs="+", metavar="FORMAT", choices=sorted([*RANDOM_SCALES, *HALF_DTYPES]),
                        help="time one matrix of random blocks per format instead of a file's")
    parser.add_argument("--shape", default="4096x4096", help="--random's matrix: OUTxIN (out_features x in_features)")
    parser.add_argument("--in-cache", action="store_true", help="--random: the same matrix every call (no copies)")
    parser.add_argument("--activations", nargs="+", default=["float32"], choices=["float32", *INTEGER_MODES])
    parser.add_argument("--layout", nargs="+", default=["tiled"], choices=["tiled", "rows"],
                        help="integer activations' blocks: tiled (as the engine holds them) or in rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if build() is None:
        raise SystemExit("the CPU kernels did not build here")
    if args.random:
        return random_matrices(args)
    kept = set(GGML_TYPES.values())
    _, tensors, _ = file_tensors(model_path(args.model))
    weights = []  # (ggml type, in_features, blocks [out_features, row_bytes] uint8)
    for tensor in tensors:
        kind = int(tensor.tensor_type)
        if kind in kept and tensor.data.ndim == 2:
            blocks = torch.from_numpy(tensor.data.copy()).view(torch.uint8)  # (F16/BF16: their bytes)
            block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            weights.append((kind, blocks.shape[1] // block_bytes * block_elems, blocks))
    total_bytes = sum(blocks.numel() for _, _, blocks in weights)
    print(f"{len(weights)} matrices, {total_bytes / 1e6:.1f} MB of blocks, variant {isa.selected_variant()}, "
          f"{args.threads} threads")
    kinds = sorted({kind for kind, _, _ in weights}) if args.by_type else []
    for rows, (activations, layout), kind in itertools.product(args.rows, _modes(args), [None, *kinds]):
        chosen = [w for w in weights if kind in (None, w[0])]
        calls = [(*_layer(k, features, activations, layout, blocks), torch.randn(rows, features))
                 for k, features, blocks in chosen]
        calls = [(layer, x, blocks) for layer, blocks, x in calls]

        def one_pass(calls=calls):
            for layer, x, blocks in calls:
                layer(x, blocks, None)

        for _ in range(2):
            one_pass()
        times = []
        for _ in range(args.passes):
            start = time.perf_counter()
            one_pass()
            times.append(time.perf_counter() - start)
        best, size = min(times), sum(blocks.numel() for _, _, blocks in chosen)
        what = "all" if kind is None else f"{GGMLQuantizationType(kind).name} x{len(chosen)}"
        macs = rows * sum(blocks.shape[0] * features for _, features, blocks in chosen)
        print(f"rows {rows:3d}, {activations}{_named(activations, layout)}, {what}: fastest {best * 1e3:.2f} ms, median "
              f"{statistics.median(times) * 1e3:.2f} ms, {size / best / 1e9:.1f} GB/s of blocks, "
              f"{2 * macs / best / 1e9:.0f} GFLOP/s")


# the formats --random draws, by where their fp16 scales sit in a block
RANDOM_SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
                 "Q5_K": (0, 2), "Q6_K": (208,)}
HALF_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16}  # weights of one value each: normal ones, rounded


def random_blocks(name: str, out_features: int, in_features: int, rng: np.random.Generator) -> torch.Tensor:
    """[out_features, row_bytes] uint8: random bytes, the scales uniform in +-0.05 (16-bit
    weights: normal ones, times 0.05, rounded)."""
    if name in HALF_DTYPES:
        weights = torch.from_numpy(rng.standard_normal((out_features, in_features), dtype=np.float32)) * 0.05
        return weights.to(HALF_DTYPES[name]).view(torch.uint8)
    block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    if in_features % block_elems:
        raise SystemExit(f"{name} rows hold whole blocks of {block_elems}: --shape's IN must be a multiple")
    blocks = rng.integers(0, 256, (out_features, in_features // block_elems, block_bytes), dtype=np.uint8)
    for offset in RANDOM_SCALES[name]:
        halves = rng.uniform(-0.05, 0.05, blocks.shape[:2]).astype(np.float16)
        blocks[..., offset:offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return torch.from_numpy(blocks.reshape(out_features, -1))


def _modes(args) -> list[tuple[str, str]]:
    """(activations, layout) to time: float32 reads rows; the integer modes each layout asked for."""
    return [(a, layout) for a in args.activations for layout in (["rows"] if a == "float32" else args.layout)]


def _named(activations: str, layout: str) -> str:
    return "" if activations == "float32" else f" {layout}"


def _layer(kind: int, in_features: int, activations: str, layout: str, blocks: torch.Tensor):
    """(the layer, its blocks) as the engine holds a weight of `kind` for `activations` in `layout`."""
    name = GGMLQuantizationType(kind).name
    tiled = layout == "tiled" and activations in INTEGER_MODES and tiles.tileable(name, blocks.shape[0])
    return QuantLinear(kind, in_features, activations, tiled), tiles.tile(blocks, name) if tiled else blocks


def random_matrices(args) -> None:
    out_features, in_features = (int(n) for n in args.shape.lower().split("x"))
    rng = np.random.default_rng(0)
    print(f"{args.shape} random blocks, variant {isa.selected_variant()}, {args.threads} threads")
    for name in args.random:
        blocks = random_blocks(name, out_features, in_features, rng)
        copies = [blocks] if args.in_cache else [  # (well past any cache)
            blocks.clone() for _ in range(max(2, (256 << 20) // blocks.numel()))]
        for rows, (activations, layout) in itertools.product(args.rows, _modes(args)):
            made = [_layer(int(GGMLQuantizationType[name]), in_features, activations, layout, c) for c in copies]
            layer, held = made[0][0], [b for _, b in made]
            x = torch.randn(rows, in_features)
            for copy in held[:2]:
                layer(x, copy, None)
            times = []
            for i in range(max(args.passes, len(copies))):
                start = time.perf_counter()
                layer(x, held[i % len(held)], None)
                times.append(time.perf_counter() - start)
            median, best = statistics.median(times), min(times)
            print(f"rows {rows:3d}, {activations}{_named(activations, layout)}, {name}: median {median * 1e6:.1f} us (fastest {best * 1e6:.1f}), "
                  f"{blocks.numel() / median / 1e9:.1f} GB/s of blocks, "
                  f"{out_features * in_features / median / 1e9:.1f} Gweights/s")


if __name__ == "__main__":
    main()
