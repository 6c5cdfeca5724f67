"""The quantized linear kernel over a whole model's GGUF weights, as a decode step reads them.

    python scripts/bench_quant_linear.py                   # rows 1 4 8 16, the default model
    python scripts/bench_quant_linear.py --rows 1 --model path/to/model.gguf

Every Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/K-quant/F16/BF16 matrix of the file (the layers' projections
and the LM head; an embedding tied to the head counts once), each called once per pass with
`--rows` rows of random float32 activations through `ops/quant_linear.py` (the path the
engine's op-by-op layers and the LM head take; the fused layers call the same kernel from
C). The weights of a pass do not fit any cache, so each pass reads them from memory, as a
decode step does. Reports the fastest and the median pass, and the blocks' bytes over the
fastest pass (GB/s). The Python call per matrix (a few microseconds) is included.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from chunk_llama.hf.gguf_file import file_tensors
from chunk_llama.models import default_model_path
from chunk_llama.ops import isa
from chunk_llama.ops.cpu import build
from chunk_llama.ops.quant_linear import GGML_TYPES, QuantLinear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file (default: the default model's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if build() is None:
        raise SystemExit("the CPU kernels did not build here")
    kept = set(GGML_TYPES.values())
    _, tensors, _ = file_tensors(args.model or default_model_path())
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
    for rows in args.rows:
        calls = [(QuantLinear(kind, features), torch.randn(rows, features), blocks)
                 for kind, features, blocks in weights]

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
        best = min(times)
        print(f"rows {rows:3d}: fastest {best * 1e3:.2f} ms, median {statistics.median(times) * 1e3:.2f} ms, "
              f"{total_bytes / best / 1e9:.1f} GB/s of blocks")


if __name__ == "__main__":
    main()
