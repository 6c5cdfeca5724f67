"""The CUDA prefill (ops/cuda/prefill.py): the varlen packing of a step's contexts, checked
on any device against the reference with an SDPA oracle of the varlen kernel, and
PyTorch's FlashAttention-2 varlen kernel itself on a GPU (skipped without one)."""

import random

import pytest
import torch
from helpers import random_token_lists
from test_cpu_prefill import dense_causal, packed_step, q_starts_for
from tolerances import assert_kernel_close

from chunk_llama import ops
from chunk_llama.ops import reference
from chunk_llama.ops.cuda.prefill import flash_varlen, packed_prefill_attention_varlen, sdpa_varlen
from chunk_llama.ops.reference import gather_dense
from chunk_llama.step import build_prefill_plan
from chunk_llama.step.prefill_schedule import merged
from chunk_llama.step.varlen import build_varlen_context

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU and a CUDA build of torch")


def varlen_of(tree, plan, device, whole_chunks):
    paths = [[(id(n), n.chunk_id, n.start, len(n.tokens)) for n in tree.path(s)] for s in range(plan.num_seqs)]
    return build_varlen_context([merged(p) for p in paths], plan.segments, tree.chunk_size if whole_chunks else None,
                                device)


def check_varlen(tokens, q_starts, *, attend, device, window=0, packed=False, whole_chunks=False, **case):
    """whole_chunks: a tree that shares whole chunks only (as on CUDA), gathered chunk by chunk."""
    dtype, head_dim = case["dtype"], case["head_dim"]
    pool, tree, plan, q, q_full = packed_step(tokens, q_starts, packed=packed, token_granular=not whole_chunks,
                                              **case)
    pool.k, pool.v = [k.to(device) for k in pool.k], [v.to(device) for v in pool.v]
    ctx = varlen_of(tree, plan, device, whole_chunks)
    assert (ctx.kv_slot is None) == whole_chunks
    in_order = [start for start, _, _ in plan.segments] == [sum(n for *_, n in plan.segments[:s]) for s in
                                                            range(plan.num_seqs)]
    assert (ctx.q_rows is None) == in_order  # rows in sequence order need no gather
    scale = head_dim**-0.5
    operand_scale = pool.v[0].nan_to_num(0).abs().max().item()
    q = q.to(device)
    out = packed_prefill_attention_varlen(q, pool.k[0], pool.v[0], ctx, scale, window, attend=attend)
    want = reference.packed_prefill_attention(q, pool.k[0], pool.v[0], plan, scale, window)
    for s, (start, q_start, n) in enumerate(plan.segments):
        rows = slice(start, start + n)
        # the varlen kernel and the reference's SDPA both take P rounded to the half dtype
        assert_kernel_close(out[rows], want[rows].float(), f"sequence {s} against the reference", 2 * operand_scale)
        ids = tree.segments(s)
        k = gather_dense(pool.k[0], ids, len(tokens[s])).cpu()
        v = gather_dense(pool.v[0], ids, len(tokens[s])).cpu()
        dense = dense_causal(q_full[s], k, v, scale, window)[q_start:]
        assert_kernel_close(out[rows].cpu(), dense, f"sequence {s} against dense SDPA", operand_scale)


@pytest.mark.parametrize("whole_chunks", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("window", [0, 1, 37])
@pytest.mark.parametrize("group", [1, 3])
def test_varlen_packing_equals_the_reference(whole_chunks, packed, window, group):
    """Random trees (token-granular splits, prefixes ending inside chunks; or whole-chunk
    sharing, gathered by chunk), new tokens from 0, a chunk boundary, inside a chunk or the
    last token; rows shuffled with spare rows between sequences, or packed."""
    rng = random.Random(group * 10 + window)
    for trial in range(3):
        tokens = random_token_lists(rng, rng.choice([1, 5, 17]), rng.choice([37, 123]), vocab=3)
        q_starts = [q_starts_for(rng, len(t), 16) for t in tokens]
        check_varlen(tokens, q_starts, attend=sdpa_varlen, device="cpu", window=window, packed=packed, chunk_size=16,
                     whole_chunks=whole_chunks, num_kv_heads=2, group=group, head_dim=64, dtype=torch.float32,
                     seed=trial)


def step_kv(pool, tree, plan, num_rows):
    """The K and V of every query row as the layer would have computed them (what the pool
    holds at its positions): [num_rows, num_kv_heads, head_dim] each, spare rows zero."""
    k_rows = torch.zeros(num_rows, *pool.k[0].shape[1:2], pool.k[0].shape[3], dtype=pool.k[0].dtype)
    v_rows = torch.zeros_like(k_rows)
    for s, (start, q_start, n) in enumerate(plan.segments):
        length = q_start + n
        k_rows[start : start + n] = gather_dense(pool.k[0], tree.segments(s), length)[:, q_start:].transpose(0, 1)
        v_rows[start : start + n] = gather_dense(pool.v[0], tree.segments(s), length)[:, q_start:].transpose(0, 1)
    return k_rows, v_rows


@pytest.mark.parametrize("whole_chunks", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("window", [0, 37])
def test_fresh_prompts_read_the_layers_new_kv_not_the_pool(whole_chunks, packed, window):
    """Where no sequence has a cached position the keys are the step's own K/V, packed like
    the queries: with the pool poisoned (NaN) the result still equals the reference on the
    real pool. With one cached position anywhere the pool is read: new K/V poisoned, still equal."""
    rng = random.Random(window + packed)
    tokens = random_token_lists(rng, 7, 123, vocab=3)
    for q_starts in ([0] * len(tokens), [0] * (len(tokens) - 1) + [5]):
        pool, tree, plan, q, _ = packed_step(tokens, q_starts, packed=packed, token_granular=not whole_chunks,
                                             chunk_size=16, num_kv_heads=2, group=3, head_dim=64, dtype=torch.float32)
        ctx = varlen_of(tree, plan, "cpu", whole_chunks)
        assert ctx.fresh == (max(q_starts) == 0)
        new_kv = step_kv(pool, tree, plan, q.shape[0])
        want = reference.packed_prefill_attention(q, pool.k[0], pool.v[0], plan, 0.125, window)
        if ctx.fresh:
            k_cache, v_cache = torch.full_like(pool.k[0], float("nan")), torch.full_like(pool.v[0], float("nan"))
        else:
            k_cache, v_cache = pool.k[0], pool.v[0]
            new_kv = tuple(torch.full_like(x, float("nan")) for x in new_kv)
        out = packed_prefill_attention_varlen(q, k_cache, v_cache, ctx, 0.125, window, attend=sdpa_varlen,
                                              new_kv=new_kv)
        for start, _, n in plan.segments:
            torch.testing.assert_close(out[start : start + n], want[start : start + n], atol=1e-5, rtol=1e-5)


def test_a_context_shorter_than_its_new_tokens_is_refused():
    with pytest.raises(ValueError, match="fewer than"):
        build_varlen_context([[(0, 0, 10)]], [(0, 5, 6)], 16, "cpu")


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 4), (256, 4), (96, 1)])
@pytest.mark.parametrize("window", [0, 37, 700])
def test_flash_varlen_on_the_gpu(dtype, head_dim, group, window):
    rng = random.Random(head_dim + group + window)
    tokens = random_token_lists(rng, 17, 300, vocab=3) + [[1] * 1000 + [2] * 123]
    q_starts = [q_starts_for(rng, len(t), 64) for t in tokens]
    for packed, whole_chunks in ((False, False), (True, False), (False, True), (True, True)):
        check_varlen(tokens, q_starts, attend=flash_varlen, device="cuda", window=window, packed=packed, chunk_size=64,
                     whole_chunks=whole_chunks, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype)


@needs_gpu
def test_the_dispatch_runs_the_cuda_prefill_on_a_gpu_plan(caplog):
    rng = random.Random(5)
    tokens = random_token_lists(rng, 9, 200, vocab=3)
    pool, tree, plan, q, _ = packed_step(tokens, [0] * len(tokens), packed=True, chunk_size=64, num_kv_heads=3,
                                         group=3, head_dim=64, dtype=torch.bfloat16)
    k, v = pool.k[0].cuda(), pool.v[0].cuda()
    paths = [[(id(n), n.chunk_id, n.start, len(n.tokens)) for n in tree.path(s)] for s in range(len(tokens))]
    gpu_plan = build_prefill_plan(paths, plan.segments, 3, num_kv_heads=3, device="cuda", chunk_size=64)
    assert ops.prefill_backend(q.cuda(), k) == "cuda"
    out = ops.packed_prefill_attention(q.cuda(), k, v, gpu_plan, 0.125)
    want = reference.packed_prefill_attention(q.cuda(), k, v, gpu_plan, 0.125)
    # both round P to bf16 for the P V product: twice the largest |V| the sequences read (the
    # pool's unused slots are NaN here)
    operand_scale = 2 * max(reference.gather_dense(v, tree.segments(s), tree.seq_len(s)).abs().max().item()
                            for s in range(len(tokens)))
    assert_kernel_close(out, want.float(), "against the reference", operand_scale)
    # fresh prompts: the layer's new K/V are read, not the pool (poisoned here)
    assert gpu_plan.varlen().fresh
    new_kv = tuple(x.cuda() for x in step_kv(pool, tree, plan, q.shape[0]))
    out = ops.packed_prefill_attention(q.cuda(), torch.full_like(k, float("nan")), torch.full_like(v, float("nan")),
                                       gpu_plan, 0.125, new_kv=new_kv)
    assert_kernel_close(out, want.float(), "fresh prompts against the reference", operand_scale)
    with pytest.raises(ValueError, match="built for the CPU"):
        ops.packed_prefill_attention(q.cuda(), k, v, plan, 0.125)
