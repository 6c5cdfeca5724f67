"""The C++/OpenMP CPU kernel, every variant this CPU runs, against the PyTorch reference
and dense SDPA (built with ninja on first use; one build holds every variant)."""

import random

import pytest
import torch
from helpers import assert_decode_matches, check_native_kernel, make_tree, random_token_lists, run_planned
from tolerances import assert_kernel_close

from chunk_llama.ops.cpu import isa
from chunk_llama.ops.cpu.structs import DECODE_PLAN
from chunk_llama.step import build_decode_plan


def _variant_params():
    params = []
    for name in isa.compiled_variants():
        runs = name in isa.host_variants()
        params.append(pytest.param(name, marks=[] if runs else pytest.mark.skip(
            reason=f"this CPU cannot run the {name} variant ({isa.describe_host()}); its code is tested on "
                   "SIMDe's portable AVX-512 by test_cpu_kernel_driver.py" if name == "avx512" else
                   f"this CPU cannot run the {name} variant ({isa.describe_host()})")))
    return params


@pytest.fixture(params=_variant_params())
def variant(request, monkeypatch):
    """Runs the test with CHUNK_LLAMA_CPU_ISA naming one variant."""
    monkeypatch.setenv(isa.ENV, request.param)
    return request.param


def check(tokens, **case):
    return check_native_kernel(tokens, backend="cpu", **case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("chunk_size", [16, 48, 64, 128])
def test_random_trees(variant, dtype, head_dim, group, chunk_size):
    """Random trees shared to the token (segments that begin and end inside chunks); in the
    second trial some sequences have left, so others hold short segments mid-path."""
    rng = random.Random(head_dim * 1000 + group * 10 + chunk_size)
    for trial in range(2):
        num_seqs = rng.choice([1, 17, 37])
        tokens = random_token_lists(rng, num_seqs, rng.choice([37, 123, 300]), vocab=3)
        remove = tuple(range(1, num_seqs, 3)) if trial else ()
        check(tokens, chunk_size=chunk_size, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, seed=trial,
              remove=remove)


@pytest.mark.parametrize("num_seqs", [1, 17, 37])
def test_everything_and_nothing_shared(variant, num_seqs):
    plan = check([[7] * 300 + [i] for i in range(num_seqs)], chunk_size=32, num_kv_heads=3, group=3, head_dim=64,
                 dtype=torch.float32)
    # the 12 tokens of the common prefix past the last full chunk are shared too
    assert plan.num_shared == (-(-300 // 32) if num_seqs > 1 else 0)
    plan = check([[i] * 123 for i in range(num_seqs)], chunk_size=32, num_kv_heads=3, group=3, head_dim=64,
                 dtype=torch.float32)
    assert plan.num_shared == 0


def branching_tokens(num_seqs: int) -> list[list[int]]:
    """A long run of chunks shared by all, then two branches with runs of their own
    (one deep enough to span several segments), then private tails."""
    root = [7] * 300
    return [root + [1 + i % 2] * (130 if i % 2 else 40) + [100 + i] * (i % 23) for i in range(num_seqs)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (80, 4), (96, 3), (128, 1), (256, 2)])
@pytest.mark.parametrize("max_blocks_per_item", [1, 2, 5, 1000])
def test_segments_of_shared_runs(variant, dtype, head_dim, group, max_blocks_per_item):
    """Phase 1 takes up to `max_blocks_per_item` shared blocks of a run per work item; 50
    sequences x group rows also split a run's rows across items (more than 128)."""
    from chunk_llama.ops import reference
    from chunk_llama.ops.cpu.attention import tpp_decode_attention_cpu

    pool, tree = make_tree(branching_tokens(50), chunk_size=16, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    plan = build_decode_plan(tree, tree.seq_ids, group=group)
    assert plan.num_shared > 20
    q = torch.randn(plan.num_seqs, 2 * group, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = tpp_decode_attention_cpu(q, pool.k[0], pool.v[0], plan, head_dim**-0.5, max_blocks_per_item, variant)
    ref = reference.tpp_decode_attention(q, pool.k[0], pool.v[0], plan, head_dim**-0.5)
    assert_decode_matches(out, q, pool, tree, plan, head_dim**-0.5, reference_out=ref)
    # how the shared blocks are cut into items changes no number (blocks.h)
    assert torch.equal(out, tpp_decode_attention_cpu(q, pool.k[0], pool.v[0], plan, head_dim**-0.5, 3, variant))


def test_variants_agree_on_one_plan():
    """Every variant this CPU runs gives the same output to within fp32 rounding."""
    from chunk_llama.ops.cpu.attention import tpp_decode_attention_cpu

    pool, tree = make_tree(branching_tokens(21), chunk_size=32, num_kv_heads=3, head_dim=64)
    plan = build_decode_plan(tree, tree.seq_ids, group=3)
    q = torch.randn(plan.num_seqs, 9, 64, generator=torch.Generator().manual_seed(2))
    outs = {v: tpp_decode_attention_cpu(q, pool.k[0], pool.v[0], plan, 0.125, variant=v) for v in isa.host_variants()}
    assert len(outs) >= 2 if isa.host_arch() in ("x86_64", "aarch64") else len(outs) == 1
    base = outs["generic"]
    for name, out in outs.items():
        assert (out - base).abs().max().item() <= 2e-6, name


def widened_pool(pool):
    """A float32 copy of a 16-bit pool (guard chunk included: the kernel's extent check)."""
    from chunk_llama.kv import ChunkPool

    copy = ChunkPool(num_layers=1, num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim,
                     chunk_size=pool.chunk_size, capacity=pool.capacity, dtype=torch.float32)
    copy.k.copy_(pool.k.float())
    copy.v.copy_(pool.v.float())
    return copy


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (80, 4), (128, 1), (256, 2)])
def test_queries_in_another_dtype_than_the_pool(variant, head_dim, group, pool_dtype):
    """Float32 queries over a bfloat16 or float16 pool (a float32 model's `kv_dtype`) give bit for
    bit the kernel's output over the same pool widened to float32 beforehand: K/V are widened
    in registers and the arithmetic is the same. Bfloat16 queries over a float32 pool give that
    output rounded to bfloat16."""
    from chunk_llama.ops.cpu.attention import tpp_decode_attention_cpu

    pool, tree = make_tree(branching_tokens(21), chunk_size=16, num_kv_heads=2, head_dim=head_dim,
                           dtype=pool_dtype)
    wide = widened_pool(pool)
    plan = build_decode_plan(tree, tree.seq_ids, group=group)
    q = torch.randn(plan.num_seqs, 2 * group, head_dim, generator=torch.Generator().manual_seed(3))
    out = tpp_decode_attention_cpu(q, pool.k[0], pool.v[0], plan, head_dim**-0.5, variant=variant)
    assert out.dtype == torch.float32 and not out.isnan().any()
    expected = tpp_decode_attention_cpu(q, wide.k[0], wide.v[0], plan, head_dim**-0.5, variant=variant)
    assert torch.equal(out, expected), (out - expected).abs().max()
    assert_decode_matches(out, q, wide, tree, plan, head_dim**-0.5)
    q16 = q.bfloat16()
    out16 = tpp_decode_attention_cpu(q16, wide.k[0], wide.v[0], plan, head_dim**-0.5, variant=variant)
    assert out16.dtype == torch.bfloat16
    assert torch.equal(out16, tpp_decode_attention_cpu(q16.float(), wide.k[0], wide.v[0], plan, head_dim**-0.5,
                                                       variant=variant).bfloat16())


def test_glue_rejects_bad_tensors():
    """Bad input is a ValueError or TypeError naming it, when the step's plan is made (the plan
    tensor, its layout, its arrays against the pool) or at a layer's call (q, the pool, the
    window, the scratch)."""
    from chunk_llama.ops.cpu.attention import build
    from chunk_llama.step.decode_plan import DECODE_ARRAYS

    module = build()
    assert list(module.decode_layout()) == list(DECODE_ARRAYS)  # the glue reads the order Python writes
    pool, tree = make_tree([[1] * 50, [1] * 50 + [2]], chunk_size=16, num_kv_heads=1, head_dim=64)
    plan = build_decode_plan(tree, tree.seq_ids)
    scratch = torch.empty(10**5)

    def run(q, index=plan.index, layout=plan.layout, k=pool.k[0], scratch=scratch, chunks=1, window=0, isa="generic"):
        return run_planned(module, DECODE_PLAN, q, k, pool.v[0], index, layout, scratch, 0.125, window, isa, chunks)

    run(torch.randn(2, 1, 64))
    with pytest.raises(TypeError, match="q must be float32 or bfloat16"):
        run(torch.randn(2, 1, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"pool \[9, 1, 16, 64\] is not the pool the plan was checked against \[9, 1, 16, 32\]"):
        run(torch.randn(2, 1, 32))
    with pytest.raises(ValueError, match="max_blocks_per_item"):
        run(torch.randn(2, 1, 64), chunks=-1)
    with pytest.raises(ValueError, match="'sse9' is not in this build"):
        run(torch.randn(2, 1, 64), isa="sse9")
    with pytest.raises(TypeError, match="plan tensor must be a contiguous int64 CPU tensor"):
        run(torch.randn(2, 1, 64), index=plan.index.int())
    with pytest.raises(ValueError, match="layout has 16 entries"):
        run(torch.randn(2, 1, 64), layout=plan.layout[:-1])
    with pytest.raises(ValueError, match="the decode plan is for 2 sequences"):
        run(torch.randn(3, 1, 64))
    with pytest.raises(ValueError, match="plan array seq_pair_ptr .* is not inside the plan"):
        run(torch.randn(2, 1, 64), layout=plan.layout[:-1] + [plan.index.numel() - 1])
    with pytest.raises(ValueError, match="window must be 0 .none. or a positive int32"):
        run(torch.randn(2, 1, 64), window=-1)
    # segments outside the pool or their chunk: refused before any pointer is made from them
    row = plan.num_private.index(1)  # the sequence with a private segment
    offset = dict(zip(DECODE_ARRAYS, plan.layout[3:]))
    for name, at, value, message in [("shared_chunk_ids", 0, pool.capacity, "shared segment 0: chunk"),
                                     ("shared_len", 0, 17, "shared segment 0"),
                                     ("private_chunk_ids", row * plan.width, -1, "private segment 0")]:
        bad = plan.index.clone()
        bad[offset[name] + at] = value
        with pytest.raises(ValueError, match=message):
            run(torch.randn(2, 1, 64), index=bad)
    with pytest.raises(ValueError, match="rows of memory behind their last chunk"):
        run(torch.randn(2, 1, 64), k=pool.k[0].clone())
    with pytest.raises(ValueError, match="scratch"):
        run(torch.randn(2, 1, 64), scratch=torch.empty(3))


def test_a_stale_plan_is_refused_not_read():
    """A step's calls name the generation of the handle they were made with: once the handle
    is planned again (the next step), or its planning failed, they are refused; a pool other
    than the one the plan was checked against is refused; and the plan's arrays are copied
    when it is made, so writing the plan tensor afterwards cannot reach the kernel."""
    from chunk_llama.ops.cpu.attention import CpuDecode
    from chunk_llama.step import StaticBuffers

    pool, tree = make_tree([[1] * 50, [1] * 50 + [2]], chunk_size=16, num_kv_heads=1, head_dim=64)
    plan = build_decode_plan(tree, tree.seq_ids)
    decode = CpuDecode(StaticBuffers("cpu"), 2, 1, 64, 16, variant="generic")
    q = torch.randn(2, 2, 64)
    first = decode.plan(plan, pool.capacity)
    expected = first.run(q, pool.k[0], pool.v[0], 0.125)
    plan.index.fill_(-(1 << 40))  # the caller's tensor, written after planning: not what the kernel reads
    assert torch.equal(first.run(q, pool.k[0], pool.v[0], 0.125), expected)
    plan.index.copy_(build_decode_plan(tree, tree.seq_ids).index)

    second = decode.plan(plan, pool.capacity)  # the next step, on the same handle
    assert second.generation == first.generation + 1
    with pytest.raises(ValueError, match="plan is stale .generation 1; its handle holds 2"):
        first.run(q, pool.k[0], pool.v[0], 0.125)
    assert torch.equal(second.run(q, pool.k[0], pool.v[0], 0.125), expected)
    with pytest.raises(ValueError, match="layout has 16 entries"):
        decode._handle.make(DECODE_PLAN, plan.index, plan.layout[:-1], (2, 2, 1, 64, 16), pool.capacity,
                            decode.workspace.scratch, "generic")
    with pytest.raises(ValueError, match="stale .generation 2; its handle holds 3, not planned"):
        second.run(q, pool.k[0], pool.v[0], 0.125)  # (a failed planning leaves nothing to run)

    third = decode.plan(plan, pool.capacity)
    smaller, _ = make_tree([[1] * 20], chunk_size=16, num_kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match=rf"pool \[{smaller.capacity}, 1, 16, 64\] is not the pool the plan was "
                                         rf"checked against \[{pool.capacity}, 1, 16, 64\]"):
        third.run(q, smaller.k[0], smaller.v[0], 0.125)
    assert torch.equal(third.run(q, pool.k[0], pool.v[0], 0.125), expected)


@pytest.mark.parametrize("window", [0, 300])
def test_long_private_keys_run_in_parts(variant, window):
    """Phase 2 cuts a sequence's private keys into parts (128 keys, at most 16 parts: longer
    parts past 2,048 keys), merged in order: one sequence of 2,517 keys, one of 1,000 and one
    of 340 sharing a prefix of 300, and one of 129 (a last part of one key), with and without
    a sliding window."""
    from chunk_llama.ops import reference
    from chunk_llama.ops.cpu.attention import tpp_decode_attention_cpu

    rng = random.Random(window)
    prefix = [7] * 300
    tokens = [[rng.randrange(3, 90) for _ in range(2517)], prefix + [rng.randrange(3, 90) for _ in range(700)],
              prefix + [rng.randrange(3, 90) for _ in range(40)], [rng.randrange(3, 90) for _ in range(129)]]
    pool, tree = make_tree(tokens, chunk_size=64, num_kv_heads=3, head_dim=64)
    plan = build_decode_plan(tree, tree.seq_ids, group=3)
    q = torch.randn(plan.num_seqs, 9, 64, generator=torch.Generator().manual_seed(3))
    out = tpp_decode_attention_cpu(q, pool.k[0], pool.v[0], plan, 0.125, variant=variant, window=window)
    ref = reference.tpp_decode_attention(q, pool.k[0], pool.v[0], plan, 0.125, window=window)
    assert_kernel_close(out, ref, f"window {window} against the reference")


def test_a_sequences_attention_is_the_same_alone_or_in_a_batch(variant):
    """How phase 2 cuts a sequence's keys depends on the sequence only: its output row is
    bit for bit the same alone and beside other sequences (unrelated ones, so none of its
    keys becomes shared), at 1 part, at several, and at the 16 parts' cap."""
    from chunk_llama.ops.cpu.attention import tpp_decode_attention_cpu

    rng = random.Random(5)
    g = torch.Generator().manual_seed(10)
    for length in (100, 777, 2300):
        request = [rng.randrange(3, 90) for _ in range(length)]
        k, v = torch.randn(2, length, 64, generator=g), torch.randn(2, length, 64, generator=g)  # [kv heads, keys, D]
        q = torch.randn(4, 64, generator=g)
        others = [[90 + i] + [rng.randrange(3, 90) for _ in range(rng.choice([30, 400, 1500]))] for i in range(5)]
        rows = []
        for batch in ([request], others[:2] + [request] + others[2:]):
            pool, tree = make_tree(batch, chunk_size=32, num_kv_heads=2, head_dim=64)
            seq_id = batch.index(request)
            position = 0
            for chunk, start, count in tree.segments(seq_id):  # the request's K/V, the same in both pools
                pool.k[0][chunk, :, start:start + count] = k[:, position:position + count]
                pool.v[0][chunk, :, start:start + count] = v[:, position:position + count]
                position += count
            plan = build_decode_plan(tree, tree.seq_ids, group=2)
            queries = torch.randn(plan.num_seqs, 4, 64, generator=g)
            row = plan.seq_ids.index(seq_id)
            queries[row] = q
            rows.append(tpp_decode_attention_cpu(queries, pool.k[0], pool.v[0], plan, 0.125, variant=variant)[row])
        assert torch.equal(rows[0], rows[1]), length
