"""The C++/OpenMP CPU kernel vs the PyTorch reference and dense SDPA (built with ninja on first use)."""

import random

import pytest
import torch

from chunk_llama.kv import build_decode_plan
from chunk_llama.ops import decode_backend
from helpers import check_native_kernel, make_tree, random_token_lists

# bf16: storage rounding of K/V/Q is shared with the reference; the output is rounded once more
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def check(tokens, **case):
    return check_native_kernel(tokens, backend="cpu", tolerance=TOLERANCE, **case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("chunk_size", [16, 48, 64, 128])
def test_random_trees(dtype, head_dim, group, chunk_size):
    rng = random.Random(head_dim * 1000 + group * 10 + chunk_size)
    for trial in range(2):
        tokens = random_token_lists(rng, rng.choice([1, 17, 37]), rng.choice([37, 123, 300]), vocab=3)
        check(tokens, chunk_size=chunk_size, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, seed=trial)


@pytest.mark.parametrize("num_seqs", [1, 17, 37])
def test_everything_and_nothing_shared(num_seqs):
    plan = check([[7] * 300 + [i] for i in range(num_seqs)], chunk_size=32, num_kv_heads=3, group=3, head_dim=64,
                 dtype=torch.float32)
    assert plan.num_shared == (300 // 32 if num_seqs > 1 else 0)
    plan = check([[i] * 123 for i in range(num_seqs)], chunk_size=32, num_kv_heads=3, group=3, head_dim=64,
                 dtype=torch.float32)
    assert plan.num_shared == 0


def test_unsupported_shapes_and_forced_reference_use_the_reference(monkeypatch):
    pool, tree = make_tree([[1] * 50, [1] * 40 + [2]], chunk_size=40, num_kv_heads=1, head_dim=64)
    q = torch.randn(2, 2, 64)
    assert decode_backend(q, pool.k[0]) == "reference"  # 40 is not a multiple of 16
    pool, tree = make_tree([[1] * 50, [1] * 40 + [2]], chunk_size=48, num_kv_heads=1, head_dim=96)
    assert decode_backend(torch.randn(2, 2, 96), pool.k[0]) == "reference"  # head dim 96: no kernel
    pool, tree = make_tree([[1] * 50], chunk_size=64, num_kv_heads=1, head_dim=64)
    assert decode_backend(q[:1], pool.k[0]) == "cpu"
    monkeypatch.setenv("CHUNK_LLAMA_FORCE_REFERENCE", "1")
    assert decode_backend(q[:1], pool.k[0]) == "reference"


def test_glue_rejects_bad_tensors():
    from chunk_llama.ops.cpu import _module

    pool, tree = make_tree([[1] * 50, [1] * 50 + [2]], chunk_size=16, num_kv_heads=1, head_dim=64)
    plan = build_decode_plan(tree, tree.seq_ids)
    args = [plan.shared_chunk_ids, plan.shared_begin, plan.shared_end, plan.shared_depth, plan.private_chunk_ids,
            plan.num_shared_tokens, plan.seq_lens, plan.seq_pair_ptr, torch.empty(10**5)]
    with pytest.raises(RuntimeError, match="share a dtype"):
        _module().tpp_decode(torch.randn(2, 1, 64, dtype=torch.bfloat16), pool.k[0], pool.v[0], *args, 0.125, 1)
    with pytest.raises(RuntimeError, match="head_dim"):
        _module().tpp_decode(torch.randn(2, 1, 32), pool.k[0], pool.v[0], *args, 0.125, 1)
    with pytest.raises(RuntimeError, match="max_chunks_per_item"):
        _module().tpp_decode(torch.randn(2, 1, 64), pool.k[0], pool.v[0], *args, 0.125, 0)
    args[-1] = torch.empty(3)
    with pytest.raises(RuntimeError, match="scratch"):
        _module().tpp_decode(torch.randn(2, 1, 64), pool.k[0], pool.v[0], *args, 0.125, 1)


def branching_tokens(num_seqs: int) -> list[list[int]]:
    """A long run of chunks shared by all, then two branches with runs of their own
    (one deep enough to span several segments), then private tails."""
    root = [7] * 300
    return [root + [1 + i % 2] * (130 if i % 2 else 40) + [100 + i] * (i % 23) for i in range(num_seqs)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 1), (256, 2)])
@pytest.mark.parametrize("max_chunks_per_item", [1, 2, 5, 1000])
def test_segments_of_shared_runs(dtype, head_dim, group, max_chunks_per_item):
    """Phase 1 merges up to `max_chunks_per_item` chunks of a run per work item; 50
    sequences x group rows also split a run's rows across items (more than 128)."""
    from chunk_llama.ops import reference
    from chunk_llama.ops.cpu import tpp_decode_attention_cpu
    from helpers import assert_decode_matches

    pool, tree = make_tree(branching_tokens(50), chunk_size=16, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    plan = build_decode_plan(tree, tree.seq_ids, group=group)
    assert plan.num_shared > 20
    q = torch.randn(plan.num_seqs, 2 * group, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = tpp_decode_attention_cpu(q, pool.k[0], pool.v[0], plan, head_dim**-0.5, max_chunks_per_item)
    ref = reference.tpp_decode_attention(q, pool.k[0], pool.v[0], plan, head_dim**-0.5)
    assert_decode_matches(out, q, pool, tree, plan, head_dim**-0.5, TOLERANCE[dtype], reference_out=ref)


def test_portable_build_without_avx512(monkeypatch):
    """The kernel's plain-array vector path (CPUs without AVX-512) gives the same results."""
    from chunk_llama.ops import cpu

    portable = cpu.build(("-mno-avx512f",))
    if portable is None:
        pytest.fail("the portable CPU build failed")
    monkeypatch.setattr(cpu, "_module", lambda: portable)
    for dtype in (torch.float32, torch.bfloat16):
        check(branching_tokens(9), chunk_size=32, num_kv_heads=2, group=3, head_dim=64, dtype=dtype)
        check([[i] * 70 for i in range(5)], chunk_size=16, num_kv_heads=1, group=1, head_dim=128, dtype=dtype)
