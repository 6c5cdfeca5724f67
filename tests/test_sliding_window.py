"""Sliding-window layers: the reference and every CPU kernel variant this CPU runs, in
decode and prefill, against dense SDPA with a window mask (transformers' semantics: a
query sees the `window` latest positions, its own included), on trees whose shared
chunks lie before, across and inside the windows."""

import random

import pytest
import torch
import torch.nn.functional as F
from helpers import make_tree, random_token_lists
from test_cpu_kernel import _variant_params
from test_cpu_prefill import packed_step
from tolerances import assert_kernel_close

from chunk_llama.ops import reference
from chunk_llama.ops.reference import gather_dense
from chunk_llama.step import build_decode_plan


@pytest.fixture(params=["reference"] + _variant_params())
def backend(request):
    return request.param


def dense_windowed(q, k, v, q_start, window, scale):
    """q: [num_new, H, D] at positions q_start ..; k, v: [KV, length, D] -> [num_new, H, D]."""
    length = k.shape[1]
    key_pos = torch.arange(length)
    query_pos = torch.arange(q_start, q_start + q.shape[0])
    mask = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] > query_pos[:, None] - window)
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float()[None], v.float()[None],
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def decode(backend, q, pool, plan, scale, window):
    if backend == "reference":
        return reference.tpp_decode_attention(q, pool.k[0], pool.v[0], plan, scale, window)
    from chunk_llama.ops.cpu.attention import tpp_decode_attention_cpu

    return tpp_decode_attention_cpu(q, pool.k[0], pool.v[0], plan, scale, variant=backend, window=window)


def shared_prefix_tokens(rng, num_seqs, prefix_len, vocab=3):
    """A long prefix shared by all, then a random tree below it (some sequences end inside it)."""
    prefix = [7] * prefix_len
    return [prefix[: rng.choice([prefix_len, prefix_len, rng.randint(1, prefix_len)])] + t
            for t in random_token_lists(rng, num_seqs, 90, vocab=vocab)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 1), (256, 4)])
@pytest.mark.parametrize("chunk_size", [16, 48])
@pytest.mark.parametrize("window", [1, 37, 123])
def test_decode_against_dense_windowed_sdpa(backend, dtype, head_dim, group, chunk_size, window):
    rng = random.Random(window * 7 + chunk_size + head_dim)
    tokens = shared_prefix_tokens(rng, rng.choice([17, 37]), rng.choice([64, 200]))
    pool, tree = make_tree(tokens, chunk_size=chunk_size, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    plan = build_decode_plan(tree, tree.seq_ids, group=group)
    assert plan.num_shared > 0
    q = torch.randn(plan.num_seqs, 2 * group, head_dim, generator=torch.Generator().manual_seed(window)).to(dtype)
    scale = head_dim**-0.5
    out = decode(backend, q, pool, plan, scale, window)
    assert out.dtype == dtype and torch.isfinite(out).all()
    for row, seq_id in enumerate(plan.seq_ids):
        ids = tree.segments(seq_id)
        length = tree.seq_len(seq_id)
        k, v = gather_dense(pool.k[0], ids, length), gather_dense(pool.v[0], ids, length)
        dense = dense_windowed(q[row][None], k, v, length - 1, window, scale)[0]
        assert_kernel_close(out[row], dense, f"sequence {seq_id} (length {length})")


@pytest.mark.parametrize("max_chunks_per_item", [1, 3, 1000])
def test_decode_segments_before_across_and_inside_windows(backend, max_chunks_per_item):
    """Phase 1 merges runs of shared chunks per work item: with sequences of very
    different lengths under one run, a segment is wholly outside some rows' windows,
    across others' and inside the rest."""
    if backend == "reference" and max_chunks_per_item != 1:
        pytest.skip("the reference has no work items")
    from chunk_llama.ops.cpu.attention import tpp_decode_attention_cpu

    tokens = [[7] * 160 + [i] * (3 + 29 * i) for i in range(6)]  # lengths 166 .. 311
    pool, tree = make_tree(tokens, chunk_size=16, num_kv_heads=1, head_dim=64)
    plan = build_decode_plan(tree, tree.seq_ids, group=4)
    q = torch.randn(plan.num_seqs, 4, 64, generator=torch.Generator().manual_seed(3))
    for window in (1, 50, 100, 170, 400):
        if backend == "reference":
            out = reference.tpp_decode_attention(q, pool.k[0], pool.v[0], plan, 0.125, window)
        else:
            out = tpp_decode_attention_cpu(q, pool.k[0], pool.v[0], plan, 0.125, max_chunks_per_item, backend,
                                           window=window)
        for row, seq_id in enumerate(plan.seq_ids):
            length = tree.seq_len(seq_id)
            ids = tree.segments(seq_id)
            k, v = gather_dense(pool.k[0], ids, length), gather_dense(pool.v[0], ids, length)
            torch.testing.assert_close(out[row], dense_windowed(q[row][None], k, v, length - 1, window, 0.125)[0],
                                       atol=1e-5, rtol=1e-5, msg=f"window {window}, sequence {seq_id}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 2), (256, 4)])
@pytest.mark.parametrize("window", [1, 17, 123])
def test_prefill_against_dense_windowed_sdpa(backend, dtype, head_dim, group, window):
    rng = random.Random(window + head_dim)
    tokens = random_token_lists(rng, 5, 300, vocab=3)
    q_starts = [rng.choice([0, len(t) // 2, len(t) - 1, 16 * ((len(t) - 1) // 32)]) for t in tokens]
    pool, tree, plan, q, q_full = packed_step(tokens, q_starts, chunk_size=16, num_kv_heads=2, group=group,
                                              head_dim=head_dim, dtype=dtype)
    scale = head_dim**-0.5
    if backend == "reference":
        out = reference.packed_prefill_attention(q, pool.k[0], pool.v[0], plan, scale, window)
    else:
        from chunk_llama.ops.cpu.attention import prefill_attention_cpu

        out = prefill_attention_cpu(q, pool.k[0], pool.v[0], plan, scale, variant=backend, window=window)
    for s, (start, q_start, n) in enumerate(plan.segments):
        ids = tree.segments(s)
        k, v = gather_dense(pool.k[0], ids, len(tokens[s])), gather_dense(pool.v[0], ids, len(tokens[s]))
        dense = dense_windowed(q_full[s][q_start:], k, v, q_start, window, scale)
        # the reference's prefill is SDPA in the storage dtype, which rounds P for the P V product
        operand_scale = v.float().abs().max().item() if backend == "reference" else None
        assert_kernel_close(out[start : start + n], dense, f"sequence {s}", operand_scale)


def test_windows_are_checked():
    from chunk_llama.ops import check_window

    assert check_window(None) == 0 and check_window(5) == 5
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="sliding window"):
            check_window(bad)
