"""CUDA prefill attention against flash SDPA on the same tokens (issue 15's GPU target).

    python scripts/bench_prefill_cuda.py [--dtype bfloat16] [--repeat 20]

Cases: one sequence of `new` tokens after `cached` ones, or `num_seqs` sequences of
`new` tokens each after one shared cached prefix (held once in the pool), in the
default model's (9/3 heads, d=64), Llama 3 8B's (32/8, d=128) and Gemma 3's (4/1,
d=256, window 512) attention shapes. Implementations, over the same queries and K/V:
  chunk     `ops.packed_prefill_attention` on the pool (chunks in random pool order): the
            step's contexts gathered into one varlen batch, FlashAttention-2 varlen; with
            nothing cached the step's own K/V (given as the engine gives them), no gather
  flash     `F.scaled_dot_product_attention` under the flash backend on K/V already
            dense per sequence (what stock runs: its own K/V copy per sequence, not timed
            as a gather), causal bottom-right, the window as FlashAttention's own
`ms`: median of CUDA-event timings; TFLOP/s counts the visible (causal, windowed) keys.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chunk_llama.kv import ChunkPool, PrefixTree  # noqa: E402
from chunk_llama.ops import packed_prefill_attention, reference  # noqa: E402
from chunk_llama.ops.cuda.prefill import flash_varlen  # noqa: E402
from chunk_llama.step import build_prefill_plan  # noqa: E402
from chunk_llama.step.varlen import VarlenContext  # noqa: E402

GEOMETRIES = {"default": (9, 3, 64, 0), "llama3-8b": (32, 8, 128, 0), "gemma3": (4, 1, 256, 512)}
# (geometry, sequences, new tokens each, cached (shared) prefix)
CASES = [(g, 1, n, 0) for g in GEOMETRIES for n in (512, 2048, 8192)] + \
        [(g, 1, 512, 1536) for g in GEOMETRIES] + [(g, 16, 64, 2000) for g in GEOMETRIES] + \
        [(g, 32, 512, 2000) for g in GEOMETRIES]


def timed(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def visible_keys(cached: int, new: int, window: int) -> int:
    return sum(min(cached + i + 1, window) if window else cached + i + 1 for i in range(new))


def run_case(geometry, num_seqs, new, cached, dtype, chunk_size, repeat) -> dict:
    num_heads, num_kv_heads, head_dim, window = GEOMETRIES[geometry]
    length, group = cached + new, num_heads // num_kv_heads
    capacity = -(-cached // chunk_size) + num_seqs * (-(-new // chunk_size) + 1) + 2
    pool = ChunkPool(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, chunk_size=chunk_size,
                     capacity=capacity, dtype=dtype, device="cuda")
    pool.k.normal_()
    pool.v.normal_()
    tree = PrefixTree(pool, token_granular=False)
    for s in range(num_seqs):
        tree.insert(s, list(range(cached)) + [10**6 + s] * new)
    paths = [[(id(n), n.chunk_id, n.start, len(n.tokens)) for n in tree.path(s)] for s in range(num_seqs)]
    plan = build_prefill_plan(paths, [(s * new, cached, new) for s in range(num_seqs)], group,
                              num_kv_heads=num_kv_heads, device="cuda", chunk_size=chunk_size)
    q = torch.randn(num_seqs * new, num_heads, head_dim, device="cuda", dtype=dtype)
    scale = head_dim**-0.5
    # stock's layout: every sequence's own dense K/V, [num_seqs, kv, length, d]
    k_dense = torch.stack([reference.gather_dense(pool.k[0], tree.segments(s), length) for s in range(num_seqs)])
    v_dense = torch.stack([reference.gather_dense(pool.v[0], tree.segments(s), length) for s in range(num_seqs)])
    q_dense = q.view(num_seqs, new, num_heads, head_dim)
    k_flat, v_flat = k_dense.transpose(1, 2).flatten(0, 1), v_dense.transpose(1, 2).flatten(0, 1)
    k_heads, v_heads = k_dense.repeat_interleave(group, 1), v_dense.repeat_interleave(group, 1)

    dense = VarlenContext(kv_chunk=None, kv_slot=None, seqused_k=None, q_rows=None,
                          cu_q=torch.arange(0, num_seqs * new + 1, new, device="cuda", dtype=torch.int32),
                          cu_k=torch.arange(0, num_seqs * length + 1, length, device="cuda", dtype=torch.int32),
                          max_q=new, max_k=length, total_q=num_seqs * new)

    def flash():  # the flash kernel, on the dense per-sequence K/V (no gather)
        return flash_varlen(q, k_flat, v_flat, dense, scale, window)

    def flash_sdpa():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            mask = causal_lower_right(new, length)
            return torch.nn.functional.scaled_dot_product_attention(
                q_dense.transpose(1, 2), k_heads, v_heads, attn_mask=mask, scale=scale)

    # the step's own K/V, [num_seqs * new, kv, d], as the layers hand them to the cache
    new_kv = (k_dense[:, :, cached:].transpose(1, 2).flatten(0, 1).contiguous(),
              v_dense[:, :, cached:].transpose(1, 2).flatten(0, 1).contiguous())

    def chunk():
        return packed_prefill_attention(q, pool.k[0], pool.v[0], plan, scale, window or None, new_kv=new_kv)

    out = chunk()
    want = reference.packed_prefill_attention(q, pool.k[0], pool.v[0], plan, scale, window)
    row = dict(geometry=geometry, num_seqs=num_seqs, new=new, cached=cached, window=window,
               error=(out.float() - want.float()).abs().max().item(),
               flops=4.0 * num_heads * head_dim * num_seqs * visible_keys(cached, new, window))
    row["chunk"] = timed(chunk, repeat)
    row["flash"] = timed(flash, repeat)
    if not window:  # SDPA's own API has no window: the same kernel through SDPA, for the dispatch overhead
        row["flash_sdpa"] = timed(flash_sdpa, repeat)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"# {torch.cuda.get_device_name()}, {args.dtype}, chunk size {args.chunk_size}, torch {torch.__version__}; "
          f"ms = median of {args.repeat}")
    print("| geometry (H/KV, d, window) | sequences x new | cached | chunk ms | flash ms | flash via SDPA ms "
          "| flash / chunk | chunk TFLOP/s | max abs err vs reference |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in CASES:
        row = run_case(*case, dtype, args.chunk_size, args.repeat)
        h, kv, d, w = GEOMETRIES[row["geometry"]]
        sdpa = f"{row['flash_sdpa']:.3f}" if "flash_sdpa" in row else "-"
        print(f"| {row['geometry']} ({h}/{kv}, {d}, {w or '-'}) | {row['num_seqs']} x {row['new']} | {row['cached']} | "
              f"{row['chunk']:.3f} | {row['flash']:.3f} | {sdpa} | {row['flash'] / row['chunk']:.2f}x | "
              f"{row['flops'] / row['chunk'] / 1e9:.1f} | {row['error']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
