"""Half-precision logits against the float32 truth: chunk-llama's error beside stock's own.

    python scripts/half_precision_errors.py --seeds 8
    python scripts/half_precision_errors.py --default-model --seeds 2

For each seed: a random tiny Llama (the shape of tests/test_hf_patch.py's shared-prefix
batch) or the default model, converted to bf16 and fp16; three rows of which two share
a prefix; teacher-forced logits of stock transformers (SDPA) and of the patched model on
a ChunkCache, each compared with the same (rounded) weights in float32. Prints the worst and mean
absolute errors and ours / stock, the ratios the tests' STOCK_FACTOR bounds
(tests/tolerances.py). The row "fp32, bf16 K/V" is ours in float32 on those weights with a
bfloat16 KV cache (`kv_dtype`), beside stock's bfloat16. Run it on each CPU the suite must
pass on.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from helpers import tiny_llama  # noqa: E402

import chunk_llama  # noqa: E402
from chunk_llama import ChunkCache, patch_model  # noqa: E402
from chunk_llama.ops.cpu import isa  # noqa: E402


def cast(model, dtype):
    """A copy of `model` in `dtype`, parameter by parameter (transformers refuses `.float()` on
    a model it loaded from GGUF)."""
    model = copy.deepcopy(model)
    for tensor in model.parameters():  # buffers (RoPE frequencies) keep their dtype, as from_pretrained does
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(dtype)
    return model


@torch.no_grad()
def errors(model, ids, dtype, kv_dtype=None):
    """Worst and mean errors of ours and stock's, in `dtype`; with `kv_dtype`, ours runs in
    float32 on the same rounded weights with its K/V in `kv_dtype`."""
    stock = cast(model, dtype)
    truth = cast(stock, torch.float32)(input_ids=ids).logits.double()  # the half weights, in float32
    ours = patch_model(copy.deepcopy(stock) if kv_dtype is None else cast(stock, torch.float32))
    stock_out = stock(input_ids=ids).logits.double()
    cache = ChunkCache(ours, chunk_size=16, kv_cache_bytes=1 << 26, kv_dtype=kv_dtype)
    ours_out = ours(input_ids=ids, past_key_values=cache).logits
    err_stock, err_ours = (stock_out - truth).abs(), (ours_out.double() - truth).abs()
    return err_ours.max().item(), err_stock.max().item(), err_ours.mean().item(), err_stock.mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--default-model", action="store_true", help="SmolLM2-135M instead of the tiny Llama")
    args = parser.parse_args()
    print(f"# {isa.describe_host()}, torch {torch.__version__}, CPU kernel variant {isa.selected_variant()}")
    print("| model | dtype | seed | worst ours | worst stock | ratio | mean ours | mean stock | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    # dequantized: cast() rounds every weight to the half dtype, which GGUF blocks (kept by default) are not
    default = chunk_llama.load_model(None, dtype=torch.float32, gguf_weights="dequantized")[0] \
        if args.default_model else None
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        model = default or tiny_llama(num_heads=6, num_kv_heads=2, head_dim=64, init=0.1, seed=seed)
        vocab = model.config.vocab_size
        ids = torch.randint(6, min(vocab, 96) if default is None else vocab, (1, 45 if default is None else 300))
        ids = ids.repeat(3, 1)
        ids[1, ids.shape[1] // 2:] = torch.randint(6, 96, (ids.shape[1] - ids.shape[1] // 2,))
        for label, dtype, kv_dtype in (("bfloat16", torch.bfloat16, None), ("float16", torch.float16, None),
                                       ("fp32, bf16 K/V", torch.bfloat16, torch.bfloat16)):
            w_ours, w_stock, m_ours, m_stock = errors(model, ids, dtype, kv_dtype)
            name = "default" if default is not None else "tiny 6/2x64"
            print(f"| {name} | {label} | {seed} | {w_ours:.4f} | {w_stock:.4f} | {w_ours / w_stock:.2f} | "
                  f"{m_ours:.5f} | {m_stock:.5f} | {m_ours / m_stock:.2f} |", flush=True)


if __name__ == "__main__":
    main()
