"""Decode-attention kernel benchmark (the paper's section 4.1), baselines in the same run.

    python scripts/bench_kernel.py --batch 32 --n-prompt 2048 --n-shared 2048 --device cuda
    python scripts/bench_kernel.py --grid paper --device cuda --out docs/bench  (+ plots, BENCHMARKS.md table)
    CHUNK_LLAMA_CPU_ISA=generic python scripts/bench_kernel.py --grid paper --gqa  (docs/bench/kernel_cpu_generic.*)
    python scripts/bench_kernel.py --grid paper --gqa --kv-dtype bfloat16  (float32 queries, bfloat16 pool)

Workload: `batch` sequences of `n_prompt` context tokens, the first `n_shared` of
them common to all, one new query token each. Implementations:
  naive           matmul, softmax, matmul per sequence on its dense K/V (Python loop)
  sdpa_dense      scaled_dot_product_attention on padded dense K/V (what stock HF runs)
  paged_no_share  per-sequence attention over its own chunks, nothing shared (PagedAttention analogue)
  tpp_reference   two-phase partition in PyTorch over the prefix tree
  tpp_cuda        the CUDA two-phase kernels (on a GPU)
  tpp_cpu         the C++ kernel, in the variant CHUNK_LLAMA_CPU_ISA selects (default: the best
                  this CPU runs); the header and every row's "isa" name it
  sdpa_window_slice  (--window only) SDPA on each sequence's last `window` keys, what a
                  cache that drops keys behind the window (stock's sliding-window layers) runs
With `--window W` every implementation attends to the W latest positions (a sliding-window
layer): SDPA takes the window as a boolean mask, the tree's kernels skip the chunks behind it.
`ms` is the median of `--repeat` timed runs; `gbps` counts the K/V bytes each
implementation must read (unique K/V for the tree, every sequence's copy otherwise);
`max_abs_err` is against sdpa_dense. Floors: unique K/V bytes / measured copy
bandwidth, and FLOPs / measured matmul throughput, on this machine.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chunk_llama.kv import ChunkPool, PrefixTree  # noqa: E402
from chunk_llama.ops import reference  # noqa: E402
from chunk_llama.step import build_decode_plan  # noqa: E402


def machine_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    return f"{model or platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeat: int) -> float:
    """Median ms. On CUDA: GPU time between events around each call, after flushing
    the L2 cache (as triton's do_bench), so host overhead and a warm cache do not count."""
    fn()
    sync(device)
    if device.type == "cuda":
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)
        events = []
        for _ in range(repeat):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        sync(device)
        return statistics.median(s.elapsed_time(e) for s, e in events)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def machine_limits(device, dtype) -> tuple[float, float]:
    """(copy bandwidth in GB/s counting read + write, matmul throughput in GFLOP/s)."""
    n = 256 * 2**20 // 4 if device.type == "cuda" else 64 * 2**20 // 4
    x = torch.ones(n, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), device, 10)  # counts read + write
    bandwidth = 2 * x.numel() * 4 / ms / 1e6
    size = 8192 if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=dtype)
    ms = timed(lambda: a @ a, device, 5)
    return bandwidth, 2 * size**3 / ms / 1e6


def build_tree(batch, n_prompt, n_shared, kv_heads, head_dim, chunk, dtype, device, share=True):
    per_seq = -(-n_prompt // chunk)
    shared_chunks = n_shared // chunk if share else 0
    capacity = shared_chunks + (per_seq - shared_chunks) * batch + 1
    pool = ChunkPool(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, chunk_size=chunk,
                     capacity=capacity, dtype=dtype, device=device)
    pool.k.normal_()
    pool.v.normal_()
    tree = PrefixTree(pool)
    for s in range(batch):
        prefix = list(range(n_shared)) if share else [10**7 * (s + 1) + t for t in range(n_shared)]
        tree.insert(s, prefix + [10**6 * (s + 1) + t for t in range(n_prompt - n_shared)])
    return pool, tree


def run_one(args, device, dtype, batch, n_prompt, n_shared, limits, variant=None) -> list[dict]:
    heads, kv_heads, d, c = args.heads, args.kv_heads, args.head_dim, args.chunk_size
    group = heads // kv_heads
    scale = d**-0.5
    kv_dtype = getattr(torch, args.kv_dtype) if args.kv_dtype else dtype
    pool, tree = build_tree(batch, n_prompt, n_shared, kv_heads, d, c, kv_dtype, device)
    plan = build_decode_plan(tree, tree.seq_ids, device=device, group=group)
    q = torch.randn(batch, heads, d, device=device, dtype=dtype)
    # dense K/V per sequence in plan order, in q's dtype (stock's cache): [batch, kv_heads, n_prompt, d]
    k_dense = torch.stack([reference.gather_dense(pool.k[0], tree.segments(s), n_prompt) for s in plan.seq_ids])
    v_dense = torch.stack([reference.gather_dense(pool.v[0], tree.segments(s), n_prompt) for s in plan.seq_ids])
    k_dense, v_dense = k_dense.to(dtype), v_dense.to(dtype)

    window = args.window or None
    keys = min(window or n_prompt, n_prompt)  # keys each query sees
    # [1, 1, 1, n_prompt]: the window as stock's SDPA path gets it, a boolean mask
    mask = (torch.arange(n_prompt, device=device) >= n_prompt - keys)[None, None, None]

    # CUDA's SDPA kernels take a mask or GQA, not both: with a window, stock repeats the
    # KV heads (transformers' repeat_kv); done once here, outside the timing
    repeat_heads = device.type == "cuda" and window and group > 1
    k_mask, v_mask = (k_dense.repeat_interleave(group, 1), v_dense.repeat_interleave(group, 1)) if repeat_heads \
        else (k_dense, v_dense)

    def sdpa_dense():
        return F.scaled_dot_product_attention(q[:, :, None], k_mask, v_mask, scale=scale,
                                              attn_mask=mask if window else None,
                                              enable_gqa=group > 1 and not repeat_heads)[:, :, 0]

    def sdpa_window_slice():
        return F.scaled_dot_product_attention(q[:, :, None], k_dense[:, :, -keys:], v_dense[:, :, -keys:],
                                              scale=scale, enable_gqa=group > 1)[:, :, 0]

    def naive():
        out = []
        for i in range(batch):
            k = k_dense[i, :, -keys:].repeat_interleave(group, 0)
            v = v_dense[i, :, -keys:].repeat_interleave(group, 0)
            w = torch.softmax((q[i, :, None].float() @ k.float().transpose(-1, -2)) * scale, -1)
            out.append((w @ v.float())[:, 0].to(dtype))
        return torch.stack(out)

    # Nothing shared: every sequence holds its own copy of the same K/V values.
    pool_ns, tree_ns = build_tree(batch, n_prompt, n_shared, kv_heads, d, c, kv_dtype, device, share=False)
    for s in range(batch):
        chunks, slots = tree_ns.slots(s, 0, n_prompt)
        pool_ns.k[0][chunks, :, slots] = k_dense[plan.row_of[s]].transpose(0, 1).to(kv_dtype)
        pool_ns.v[0][chunks, :, slots] = v_dense[plan.row_of[s]].transpose(0, 1).to(kv_dtype)
    plan_ns = build_decode_plan(tree_ns, tree_ns.seq_ids, device=device, group=group)
    row = {s: r for r, s in enumerate(plan.seq_ids)}
    to_ns = torch.tensor([row[s] for s in plan_ns.seq_ids], device=device)
    q_ns = q[to_ns].contiguous()
    from_ns = torch.argsort(to_ns)
    from chunk_llama.ops import decode_backend, tpp_decode_attention

    # The slow Python implementations go last: the gigabytes of temporaries they free
    # slowed whatever was timed right after them (tpp_cpu 67 ms instead of 39 at
    # b=32, n_p=1024, n_s=0), which would measure their churn, not the kernel.
    impls = {"sdpa_dense": sdpa_dense}
    if window:
        impls["sdpa_window_slice"] = sdpa_window_slice
    backend = decode_backend(q, pool.k[0])
    if backend != "reference":
        impls[f"tpp_{backend}"] = lambda: tpp_decode_attention(q, pool.k[0], pool.v[0], plan, scale, window)
    impls["paged_no_share"] = lambda: tpp_decode_attention(q_ns, pool_ns.k[0], pool_ns.v[0], plan_ns, scale, window)
    impls["tpp_reference"] = lambda: reference.tpp_decode_attention(q, pool.k[0], pool.v[0], plan, scale,
                                                                    window or 0)
    impls["naive"] = naive
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        plain = impls["sdpa_dense"]

        def flash():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                return plain()

        impls["sdpa_dense"] = flash
    if args.impls:
        impls = {k: v for k, v in impls.items() if k in args.impls or k == "sdpa_dense"}

    per_token = {t: 2 * kv_heads * d * torch.empty((), dtype=t).element_size() for t in (dtype, kv_dtype)}
    # K/V in the window: the shared part once, each sequence's own part once per sequence
    own = min(keys, n_prompt - n_shared)
    unique_tokens = (keys - own) + batch * own if batch > 1 else keys
    bytes_all = batch * keys * per_token[dtype]
    bytes_unique = unique_tokens * per_token[kv_dtype]
    flops = 4 * batch * heads * keys * d
    bandwidth, matmul = limits
    expected = sdpa_dense().float()
    rows = []
    for name, fn in impls.items():
        ms = timed(fn, device, args.repeat)
        result = fn()[from_ns] if name == "paged_no_share" else fn()
        moved = bytes_unique if name.startswith("tpp_") else \
            batch * keys * per_token[kv_dtype] if name == "paged_no_share" else bytes_all
        rows.append(dict(
            impl=name, batch=batch, n_prompt=n_prompt, n_shared=n_shared, heads=heads, kv_heads=kv_heads,
            head_dim=d, chunk_size=c, window=window, dtype=str(dtype).replace("torch.", ""), device=device.type,
            kv_dtype=str(kv_dtype).replace("torch.", ""),
            isa=variant if name in ("tpp_cpu", "paged_no_share") and backend == "cpu" else None,
            ms=ms, gbps=moved / ms / 1e6, max_abs_err=(result.float() - expected).abs().max().item(),
            floor_bandwidth_ms=bytes_unique / bandwidth / 1e6, floor_flops_ms=flops / matmul / 1e6,
        ))
    base = next(r["ms"] for r in rows if r["impl"] == "sdpa_dense")
    for r in rows:
        r["speedup_vs_sdpa_dense"] = base / r["ms"]
    return rows


def paper_grid(args):
    """Table 3, Figure 3 (decoding proceeds at n_s = 2048), Figure 4 (batch sizes), a GQA shape."""
    points = []
    for n_p in (1024, 2048, 4096):
        for n_s in (0, n_p // 2, 3 * n_p // 4, n_p):
            points.append(("table3", dict(batch=32, n_prompt=n_p, n_shared=n_s)))
    for n_c in (0, 256, 512, 1024, 2048):
        points.append(("figure3", dict(batch=32, n_prompt=2048 + n_c, n_shared=2048)))
    for b in (8, 16, 32, 48, 64, 96):
        points.append(("figure4", dict(batch=b, n_prompt=2048 + 64, n_shared=2048)))
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--n-prompt", type=int, default=2048)
    parser.add_argument("--n-shared", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--dtype", default=None, help="default: float16 on CUDA, float32 on the CPU")
    parser.add_argument("--kv-dtype", default=None, help="the tree's pool (default: --dtype; bfloat16 under float32 "
                                                         "queries: the engine's kv_dtype; SDPA gets it widened)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--impls", nargs="*", help="only these implementations (sdpa_dense always runs)")
    parser.add_argument("--grid", choices=["paper"])
    parser.add_argument("--gqa", action="store_true", help="with --grid: add the default model's shape (9/3 heads, d=64)")
    parser.add_argument("--out", default="docs/bench", help="with --grid: folder for the CSV and markdown")
    parser.add_argument("--window", type=int, default=0, help="a sliding window of this many positions (0: none)")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float16" if device.type == "cuda" else "float32"))
    args.kv_heads = args.kv_heads or args.heads
    variant = None
    if device.type == "cpu":
        from chunk_llama.ops import prepare_backend
        from chunk_llama.ops.cpu import isa

        variant = isa.selected_variant()
        # build (first use) before any timing; says why if the kernel cannot run here
        info = prepare_backend(device, dtype, args.head_dim, args.chunk_size,
                               getattr(torch, args.kv_dtype) if args.kv_dtype else None)
        if info["backend"] != "cpu":
            print(f"the CPU kernel does not run here: {info['reason']}", flush=True)
    limits = machine_limits(device, dtype)
    kernel = f", CPU kernel variant {variant}" if variant else ""
    print(f"device {device} ({machine_name(device)}{kernel}), "
          f"copy bandwidth {limits[0]:.0f} GB/s, matmul {limits[1]:.0f} GFLOP/s ({dtype})", flush=True)

    rows = []
    points = paper_grid(args) if args.grid else [("single", dict(batch=args.batch, n_prompt=args.n_prompt,
                                                                 n_shared=args.n_shared))]
    shapes = [(args.heads, args.kv_heads, args.head_dim, None, points)]
    if args.grid and args.gqa:
        # the default model's shape on the Table 3 points; Llama-3-8B's geometry on
        # 2,560-token prompts with nothing, 2,048 or all of them shared
        shapes.append((9, 3, 64, "gqa_9_3_d64", [p for p in points if p[0] == "table3"]))
        shapes.append((32, 8, 128, "llama3_8b_32_8_d128",
                       [("", dict(batch=32, n_prompt=2560, n_shared=n_s)) for n_s in (0, 2048, 2560)]))
    for heads, kv_heads, head_dim, label, shape_points in shapes:
        args.heads, args.kv_heads, args.head_dim = heads, kv_heads, head_dim
        for experiment, point in shape_points:
            for r in run_one(args, device, dtype, **point, limits=limits, variant=variant):
                r["experiment"] = label or experiment
                rows.append(r)
                print(f"{r['experiment']:>12} b={r['batch']:3d} n_p={r['n_prompt']:5d} n_s={r['n_shared']:5d} "
                      f"{r['impl']:>15} {r['ms']:9.3f} ms {r['gbps']:8.1f} GB/s x{r['speedup_vs_sdpa_dense']:6.2f} "
                      f"err {r['max_abs_err']:.1e} floors {r['floor_bandwidth_ms']:.3f}/{r['floor_flops_ms']:.3f} ms",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: r[k] for k in ("impl", "ms", "gbps", "max_abs_err")} | r for r in rows], f, indent=1)
    if args.grid:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"kernel_{device.type}" + (f"_{variant}" if variant else "") + \
            (f"_kv_{args.kv_dtype}" if args.kv_dtype else "")
        with open(out / f"{stem}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        with open(out / f"{stem}.md", "w") as f:
            env = f"CHUNK_LLAMA_CPU_ISA={variant} " if variant else ""
            f.write(f"Command: `{env}python scripts/bench_kernel.py {' '.join(sys.argv[1:])}` on {machine_name(device)}"
                    f"{kernel}, "
                    f"torch {torch.__version__}, {date.today()}, {dtype}; copy bandwidth {limits[0]:.0f} GB/s, "
                    f"matmul {limits[1]:.0f} GFLOP/s.\n\n")
            f.write("| experiment | b | n_p | n_s | impl | ms | GB/s | vs sdpa_dense | max err | floor BW ms | floor FLOP ms |\n")
            f.write("|---|---|---|---|---|---|---|---|---|---|---|\n")
            for r in rows:
                f.write(f"| {r['experiment']} | {r['batch']} | {r['n_prompt']} | {r['n_shared']} | {r['impl']} | "
                        f"{r['ms']:.3f} | {r['gbps']:.0f} | {r['speedup_vs_sdpa_dense']:.2f}x | {r['max_abs_err']:.1e} | "
                        f"{r['floor_bandwidth_ms']:.3f} | {r['floor_flops_ms']:.3f} |\n")
        import plot_bench

        plot_bench.main(str(out / f"{stem}.csv"))


if __name__ == "__main__":
    main()
