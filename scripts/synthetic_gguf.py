"""Write a Llama GGUF of any size with random quantized weights, to time models larger than any
file on this machine (a 1B model in Q4_K_M: 0.7 GB of blocks a decode step reads) against
llama.cpp on the same file. Its text is noise; its speed is a real model's of that shape.

    python scripts/synthetic_gguf.py --out /tmp/llama-1b-q4km.gguf            # 1.2B, Llama 3.2 1B's shape
    python scripts/bench_single.py --model /tmp/llama-1b-q4km.gguf --systems chunk-llama llama.cpp

Shapes default to Llama 3.2 1B's (16 layers, hidden 2,048, MLP 8,192, 32 query and 8 KV
heads of 64); the vocabulary and tokenizer are the default model's (copied from its GGUF), so
the prompts tokenize as in the other benchmarks. Formats as llama.cpp's Q4_K_M assigns them:
Q6_K for attn_v, ffn_down and the (tied) token embedding, Q4_K for every other projection,
float32 norms. The blocks are random bytes with scales drawn so that the weights have about
the standard deviation of a trained model's (0.02): the hidden states stay finite.
(`bench_gguf_load.py --synthetic` instead quantizes a random float32 model with gguf-py:
the formats gguf-py quantizes, no tokenizer, and the whole model in float32 first.)
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter

from chunk_llama.loading import default_model_path

# Where each format's fp16 scales sit in a block, and the scale that gives weights of std ~0.02
# (Q4_K: d * scale (6 bits) * q (4 bits), and dmin * min; Q6_K: d * int8 scale * (q - 32))
SCALES = {"Q4_K": ((0, 2.5e-5), (2, 2.5e-5)), "Q6_K": ((208, 2.5e-5),)}
Q4_K_M = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
          "ffn_up": "Q4_K", "ffn_down": "Q6_K"}


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row_bytes] uint8 of `kind` blocks: random bytes, the fp16 scales as SCALES says."""
    block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, (rows, cols // block_elems, block_bytes), dtype=np.uint8)
    for offset, scale in SCALES[kind]:
        halves = (rng.uniform(0.5, 1.0, blocks.shape[:2]) * scale).astype(np.float16)
        blocks[..., offset:offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.hidden % 256 or args.ffn % 256 or args.heads * args.head_dim % 256:
        raise SystemExit("--hidden, --ffn and heads x head dim must be multiples of 256 (whole K-quant blocks)")
    source = GGUFReader(default_model_path())
    vocab = int(source.fields["llama.vocab_size"].contents())
    writer = GGUFWriter(args.out, "llama")
    writer.add_name(f"synthetic llama {args.layers}x{args.hidden} Q4_K_M (random weights)")
    writer.add_block_count(args.layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(args.hidden)
    writer.add_feed_forward_length(args.ffn)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(15)  # MOSTLY_Q4_K_M
    for key, field in source.fields.items():  # the default model's tokenizer
        if key.startswith("tokenizer."):
            types = field.types
            writer.add_key_value(key, field.contents(), types[0], sub_type=types[1] if len(types) > 1 else None)
    rng = np.random.default_rng(args.seed)
    q, kv = args.heads * args.head_dim, args.kv_heads * args.head_dim
    shapes = {"attn_q": (q, args.hidden), "attn_k": (kv, args.hidden), "attn_v": (kv, args.hidden),
              "attn_output": (args.hidden, q), "ffn_gate": (args.ffn, args.hidden),
              "ffn_up": (args.ffn, args.hidden), "ffn_down": (args.hidden, args.ffn)}
    writer.add_tensor("token_embd.weight", random_blocks("Q6_K", vocab, args.hidden, rng),
                      raw_dtype=GGMLQuantizationType.Q6_K)
    ones = np.ones(args.hidden, dtype=np.float32)
    for layer in range(args.layers):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", ones)
        for name, (rows, cols) in shapes.items():
            kind = Q4_K_M[name]
            writer.add_tensor(f"blk.{layer}.{name}.weight", random_blocks(kind, rows, cols, rng),
                              raw_dtype=GGMLQuantizationType[kind])
    writer.add_tensor("output_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(args.out)


if __name__ == "__main__":
    main()
