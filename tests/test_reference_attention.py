"""Two-phase partition attention vs dense SDPA on each sequence's own K/V."""

import random

import pytest
import torch
from helpers import assert_decode_matches, dense_decode_reference, make_tree, random_token_lists
from tolerances import assert_kernel_close

from chunk_llama.ops.reference import gather_dense, prefill_attention, tpp_decode_attention
from chunk_llama.step import build_decode_plan


def check_against_dense(pool, tree, num_heads, head_dim, dtype, seed=0):
    plan = build_decode_plan(tree, tree.seq_ids)
    q = torch.randn(plan.num_seqs, num_heads, head_dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
    scale = head_dim**-0.5
    out = tpp_decode_attention(q, pool.k[0], pool.v[0], plan, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert_decode_matches(out, q, pool, tree, plan, scale)
    return plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_random_trees(dtype, head_dim, group, chunk_size):
    rng = random.Random(hash((head_dim, group, chunk_size)) % 1000)
    num_kv_heads = 2
    for trial in range(3):
        tokens = random_token_lists(rng, rng.choice([1, 5, 17]), rng.choice([37, 123, 300]), vocab=3)
        pool, tree = make_tree(
            tokens, chunk_size=chunk_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, seed=trial
        )
        check_against_dense(pool, tree, num_kv_heads * group, head_dim, dtype, seed=trial)


@pytest.mark.parametrize("num_seqs", [1, 17, 37])
def test_everything_shared_and_nothing_shared(num_seqs):
    shared = [[7] * 123 + [i] for i in range(num_seqs)]  # one long common prefix
    pool, tree = make_tree(shared, chunk_size=16, num_kv_heads=3, head_dim=64)
    plan = check_against_dense(pool, tree, 9, 64, torch.float32)
    if num_seqs > 1:
        # the 11 common tokens past the 7 full chunks are shared too
        assert plan.num_shared == -(-123 // 16) and plan.max_rows_per_shared == num_seqs
    distinct = [[i, *range(5 + i)] for i in range(num_seqs)]
    pool, tree = make_tree(distinct, chunk_size=16, num_kv_heads=3, head_dim=64)
    plan = check_against_dense(pool, tree, 9, 64, torch.float32)
    assert plan.num_shared == 0


def test_sequences_ending_on_a_shared_chunk_boundary():
    # sequence 0 ends exactly where sequence 1 continues: all of 0 is in shared chunks
    pool, tree = make_tree([[1] * 32, [1] * 32 + [2, 3]], chunk_size=16, num_kv_heads=1, head_dim=64)
    plan = check_against_dense(pool, tree, 4, 64, torch.float32)
    assert plan.num_shared == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_start,num_new", [(0, 17), (37, 1), (40, 23)])
def test_prefill_attention_is_causal_with_offset(dtype, q_start, num_new):
    pool, tree = make_tree([list(range(q_start + num_new))], chunk_size=16, num_kv_heads=2, head_dim=64, dtype=dtype)
    q = torch.randn(num_new, 6, 64).to(dtype)
    k = gather_dense(pool.k[0], tree.segments(0), q_start + num_new)
    v = gather_dense(pool.v[0], tree.segments(0), q_start + num_new)
    out = prefill_attention(q, k, v, q_start, 0.125)
    for i in range(num_new):
        expected = dense_decode_reference(q[i], k[:, : q_start + i + 1], v[:, : q_start + i + 1], 0.125)
        # SDPA in the storage dtype rounds P for the P V product: the largest |V| bounds it
        assert_kernel_close(out[i], expected, f"query {i}", v.float().abs().max().item())


def test_uninitialised_slots_never_leak_into_the_output():
    """The pool is torch.empty: slots past a sequence's end may hold NaN."""
    tokens = [[1] * 40 + [2] * 7, [1] * 40 + [3] * 30, [5] * 9]
    pool, tree = make_tree(tokens, chunk_size=16, num_kv_heads=2, head_dim=64)
    valid_k, valid_v = pool.k.clone(), pool.v.clone()
    pool.k.fill_(float("nan"))
    pool.v.fill_(float("nan"))
    for node in tree.nodes():
        slots = slice(node.start, node.end)
        pool.k[:, node.chunk_id, :, slots] = valid_k[:, node.chunk_id, :, slots]
        pool.v[:, node.chunk_id, :, slots] = valid_v[:, node.chunk_id, :, slots]
    plan = check_against_dense(pool, tree, 6, 64, torch.float32)
    assert plan.private_chunk_ids.shape[1] > 1  # padding entries point at chunk 0 too
