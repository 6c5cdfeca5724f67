"""The C++ packed prefill kernel (csrc/cpu/prefill.h), every variant this CPU runs, against
the PyTorch reference and dense causal SDPA over random trees and packed steps."""

import logging
import random

import pytest
import torch
import torch.nn.functional as F
from helpers import make_tree, random_token_lists, run_planned
from test_cpu_kernel import _variant_params, widened_pool
from tolerances import assert_kernel_close

from chunk_llama import ops
from chunk_llama.logs import forget_logged
from chunk_llama.ops import reference
from chunk_llama.ops.cpu.structs import PREFILL_PLAN
from chunk_llama.ops.dispatch import CacheBackends, Geometry
from chunk_llama.ops.reference import gather_dense
from chunk_llama.step import StaticBuffers, build_prefill_plan


@pytest.fixture(params=_variant_params())
def variant(request):
    return request.param


def q_starts_for(rng: random.Random, length: int, chunk_size: int) -> int:
    """0, a chunk boundary, inside a chunk, or the last token: where a step's new tokens begin."""
    boundary = chunk_size * rng.randint(0, (length - 1) // chunk_size)
    return rng.choice([0, boundary, min(length - 1, boundary + rng.randint(1, chunk_size - 1)), length - 1])


def packed_step(tokens, q_starts, *, chunk_size, num_kv_heads, group, head_dim, dtype, seed=0, packed=False,
                token_granular=True):
    """A tree of `tokens`, one packed step whose sequence s has new tokens from q_starts[s] on.
    Its query rows: the sequences in a shuffled order with a spare row between them, or
    `packed` in token order with none (as the engine packs them: sequences with a common
    prefix are neighbours and read it together in the context phase).
    Returns (pool, tree, plan, q, q_full) with q_full[s]: [len, num_heads, head_dim] queries
    of every position of sequence s (the step's are the last len - q_start)."""
    pool, tree = make_tree(tokens, chunk_size=chunk_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           dtype=dtype, seed=seed, token_granular=token_granular)
    generator = torch.Generator().manual_seed(seed + 1)
    q_full = [torch.randn(len(t), num_kv_heads * group, head_dim, generator=generator).to(dtype) for t in tokens]
    order = list(range(len(tokens)))
    if packed:
        order.sort(key=lambda s: tokens[s])
    else:
        random.Random(seed).shuffle(order)
    segments, row = [None] * len(tokens), 0
    for s in order:
        segments[s] = (row, q_starts[s], len(tokens[s]) - q_starts[s])
        row += segments[s][2] + (0 if packed else 1)
    paths = [[(id(n), n.chunk_id, n.start, len(n.tokens)) for n in tree.path(s)] for s in range(len(tokens))]
    plan = build_prefill_plan(paths, segments, group, num_q_tokens=row, num_kv_heads=num_kv_heads)
    q = torch.zeros(row, num_kv_heads * group, head_dim, dtype=dtype)  # [num_q_tokens, num_heads, head_dim]
    for s, (start, q_start, n) in enumerate(segments):
        q[start : start + n] = q_full[s][q_start:]
    return pool, tree, plan, q, q_full


def cpu_arrays(plan):
    """The CPU kernel's arrays of a prefill plan, as its `plan` step builds them."""
    return plan.cpu()


def dense_causal(q_full, k, v, scale, window=0):
    """Stock attention: causal SDPA over the whole sequence (with a sliding window's mask if
    `window`). q_full: [len, H, D]; k, v: [KV, len, D]."""
    length = q_full.shape[0]
    mask = None
    if window:
        position = torch.arange(length)
        mask = (position[None, :] <= position[:, None]) & (position[None, :] > position[:, None] - window)
    out = F.scaled_dot_product_attention(q_full.float().transpose(0, 1)[None], k.float()[None], v.float()[None],
                                         attn_mask=mask, is_causal=not window, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # [len, H, D]


def check_step(tokens, q_starts, variant, window=0, **case):
    from chunk_llama.ops.cpu.attention import prefill_attention_cpu

    dtype, head_dim = case["dtype"], case["head_dim"]
    pool, tree, plan, q, q_full = packed_step(tokens, q_starts, **case)
    scale = head_dim**-0.5
    out = prefill_attention_cpu(q, pool.k[0], pool.v[0], plan, scale, variant=variant, window=window)
    assert out.dtype == dtype and out.shape == q.shape
    ref = reference.packed_prefill_attention(q.float(), pool.k[0].float(), pool.v[0].float(), plan, scale, window)
    for s, (start, q_start, n) in enumerate(plan.segments):
        rows = slice(start, start + n)
        assert_kernel_close(out[rows], ref[rows], f"sequence {s} vs reference")
        length = len(tokens[s])
        k = gather_dense(pool.k[0], tree.segments(s), length)
        v = gather_dense(pool.v[0], tree.segments(s), length)
        dense = dense_causal(q_full[s], k, v, scale, window)[q_start:]
        assert_kernel_close(out[rows], dense, f"sequence {s} vs dense causal SDPA")
    return plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 3])
def test_random_trees(variant, dtype, head_dim, group):
    """Sequences branching off one another (shared chunk ids in one call), odd lengths,
    new tokens from 0, a chunk boundary, inside a chunk or only the last token."""
    rng = random.Random(head_dim * 100 + group * 10 + (dtype == torch.bfloat16))
    chunk_size = rng.choice([16, 48, 64])
    tokens = random_token_lists(rng, 4, 123, vocab=3) + [[1] * 17, [1] * 37, [2] * 123]
    q_starts = [q_starts_for(rng, len(t), chunk_size) for t in tokens]
    check_step(tokens, q_starts, variant, chunk_size=chunk_size, num_kv_heads=2, group=group, head_dim=head_dim,
               dtype=dtype, seed=group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (80, 2), (96, 3), (128, 1), (256, 2)])
@pytest.mark.parametrize("window", [0, 37])
def test_context_phase_reads_a_common_prefix_once_for_its_sequences(variant, dtype, head_dim, group, window):
    """Sequences packed next to each other that all see a common prefix whole read it in the
    context phase (several runs: prefixes ending inside chunks, branches, one sequence that
    writes part of the prefix in the same step, one whose new tokens start inside it);
    equal to the reference and dense causal SDPA."""
    rng = random.Random(head_dim + group + window)
    system = [rng.randrange(3) for _ in range(150)]
    tokens, q_starts = [], []
    for i in range(9):
        cut = [150, 150, 120, 97, 97, 40, 150, 150, 150][i]
        own = [3 + i] + [rng.randrange(3) for _ in range(rng.randint(0, 30))]
        tokens.append(system[:cut] + own)
        q_starts.append(cut if i != 6 else 80)  # sequence 6 computes positions 80 .. itself
    q_starts[0] = 0  # sequence 0 writes the whole prefix in this step
    plan = check_step(tokens, q_starts, variant, window, chunk_size=32, num_kv_heads=2, group=group,
                      head_dim=head_dim, dtype=dtype, packed=True)
    arrays = cpu_arrays(plan)
    assert arrays.ctx_items.shape[0] > 0 and arrays.num_partial_rows > 0
    ctx_end = arrays.ctx_end.tolist()
    assert ctx_end[0] == 0 and 0 < ctx_end[6] <= 80 and all(ctx_end[i] > 0 for i in (1, 2, 3, 4, 7, 8))


@pytest.mark.parametrize("window", [0, 100])
def test_a_narrower_group_goes_on_from_the_wider_groups_states(variant, window):
    """Four sequences sharing 140 tokens, two of them 270: the context phase folds blocks
    [0, 2) for all four, then blocks [2, 4) for the two from the states the first level left
    (a level each), and each tile goes on from its sequence's last state."""
    rng = random.Random(window)
    system = [rng.randrange(3) for _ in range(270)]
    tokens = [system[:140] + [3], system[:140] + [4, 5], system + [6], system + [7, 8]]
    plan = check_step(tokens, [len(t) - 1 - (i % 2) for i, t in enumerate(tokens)], variant, window, chunk_size=32,
                      num_kv_heads=2, group=3, head_dim=64, dtype=torch.float32, packed=True)
    arrays = cpu_arrays(plan)
    assert arrays.ctx_levels.tolist() == [0, 1, 2] and arrays.ctx_end.tolist() == [128, 128, 256, 256]
    (seq0, *level0), (seq1, *level1) = arrays.ctx_items[:, :3].tolist()  # (path's sequence, first, end block)
    assert level0 == [0, 2] and level1 == [2, 4] and seq1 in (2, 3)
    assert arrays.ctx_items[1, 6].item() == arrays.ctx_items[0, 5].item()  # started from level 0's states


def test_q_start_at_and_inside_chunk_boundaries(variant):
    """One sequence of each length 17, 37, 123 per new-token start around the boundaries
    (chunks of 16; the random trees cover 48 and 64)."""
    chunk_size = 16
    for length in (17, 37, 123):
        starts = sorted({s for s in (0, 1, chunk_size - 1, chunk_size, chunk_size + 1, 2 * chunk_size,
                                     length - 2, length - 1) if 0 <= s < length})
        tokens = [[7] * length for _ in starts]  # the same path: every call shares its chunk ids
        check_step(tokens, starts, variant, chunk_size=chunk_size, num_kv_heads=3, group=3, head_dim=64,
                   dtype=torch.float32, seed=length)


def test_tiles_split_long_prompts_mid_token(variant):
    """300 tokens x group 3 = 900 rows: tiles of 128 rows, most ending inside a token's group."""
    plan = check_step([[3] * 300, [3] * 200 + [4] * 50], [0, 130], variant, chunk_size=64, num_kv_heads=2, group=3,
                      head_dim=128, dtype=torch.float32)
    tiles = cpu_arrays(plan).tiles
    assert tiles.shape[0] == 8 + 3
    work = [(e - b) * (plan.segments[s][1] + (e - 1) // 3 + 1) for s, b, e in tiles.tolist()]
    assert work == sorted(work, reverse=True)


def test_variants_agree(variant):
    from chunk_llama.ops.cpu.attention import prefill_attention_cpu

    pool, _, plan, q, _ = packed_step([[1] * 99, [1] * 64 + [2] * 40], [0, 70], chunk_size=32, num_kv_heads=2,
                                      group=2, head_dim=64, dtype=torch.float32)
    base = prefill_attention_cpu(q, pool.k[0], pool.v[0], plan, 0.125, variant="generic")
    out = prefill_attention_cpu(q, pool.k[0], pool.v[0], plan, 0.125, variant=variant)
    rows = torch.cat([torch.arange(s, s + n) for s, _, n in plan.segments])
    assert (out[rows] - base[rows]).abs().max().item() <= 2e-6


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (96, 2), (256, 1)])
def test_float32_queries_over_a_16_bit_pool(variant, head_dim, group, pool_dtype):
    """As decode (test_cpu_kernel.py): float32 queries over a bfloat16 or float16 pool give bit
    for bit the output over the pool widened to float32 beforehand, in float32."""
    from chunk_llama.ops.cpu.attention import prefill_attention_cpu

    tokens = [[1] * 99, [1] * 64 + [2] * 40, [3] * 37]
    pool, _, plan, q, _ = packed_step(tokens, [0, 70, 17], chunk_size=32, num_kv_heads=2, group=group,
                                      head_dim=head_dim, dtype=pool_dtype, packed=True)
    q = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    wide = widened_pool(pool)
    out = prefill_attention_cpu(q, pool.k[0], pool.v[0], plan, head_dim**-0.5, variant=variant)
    expected = prefill_attention_cpu(q, wide.k[0], wide.v[0], plan, head_dim**-0.5, variant=variant)
    rows = torch.cat([torch.arange(s, s + n) for s, _, n in plan.segments])
    assert out.dtype == torch.float32 and not out[rows].isnan().any()
    assert torch.equal(out[rows], expected[rows]), (out[rows] - expected[rows]).abs().max()
    ref = reference.packed_prefill_attention(q, wide.k[0], wide.v[0], plan, head_dim**-0.5)
    assert_kernel_close(out[rows], ref[rows], "against the reference")


def test_dispatch_runs_the_kernel_and_logs_fallbacks_once(monkeypatch, caplog):
    forget_logged()
    pool, _, plan, q, _ = packed_step([[1] * 40], [5], chunk_size=16, num_kv_heads=1, group=2, head_dim=64,
                                      dtype=torch.float32)
    assert ops.prefill_backend(q, pool.k[0]) == "cpu"
    pool72, _, plan72, q72, _ = packed_step([[1] * 40], [5], chunk_size=16, num_kv_heads=1, group=2, head_dim=72,
                                            dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="chunk_llama.ops"):
        for _ in range(2):
            out = ops.packed_prefill_attention(q72, pool72.k[0], pool72.v[0], plan72, 0.1)
        ref = reference.packed_prefill_attention(q72, pool72.k[0], pool72.v[0], plan72, 0.1)
        torch.testing.assert_close(out[:35], ref[:35])
        monkeypatch.setenv("CHUNK_LLAMA_FORCE_REFERENCE", "1")
        assert ops.prefill_backend(q, pool.k[0]) == "reference"
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "prefill attention runs the PyTorch reference" in messages[0] and "not 72" in messages[0]
    assert "CHUNK_LLAMA_FORCE_REFERENCE" in messages[1]


def test_glue_rejects_bad_plans():
    from chunk_llama.ops.cpu.attention import build
    from chunk_llama.step.prefill_plan import PREFILL_ARRAYS, PackedArrays

    module = build()
    assert list(module.prefill_layout()) == list(PREFILL_ARRAYS)  # the glue reads the order Python writes
    # both read the 140 common tokens' two whole blocks (128) in the context phase, then the
    # rest: 12 tokens of the prefix and 1 and 17 tokens of their own
    pool, _, plan, q, _ = packed_step([[1] * 140 + [3], [1] * 140 + [2] * 20], [140, 143], chunk_size=16,
                                      num_kv_heads=1, group=2, head_dim=64, dtype=torch.float32, packed=True)
    arrays = cpu_arrays(plan)
    scratch = torch.empty(10**6)

    def run(window=0, num_partial_rows=arrays.num_partial_rows, **change):
        values = {name: getattr(arrays, name).flatten().tolist() for name in PREFILL_ARRAYS}
        values.update({name: value.flatten().tolist() for name, value in change.items()})
        counts = [len(values["token_start"]), arrays.layout[1], q.shape[0], len(values["tiles"]) // 3,
                  len(values["ctx_items"]) // 7, len(values["ctx_levels"]) - 1, num_partial_rows]
        bad = PackedArrays(values, counts, {}, torch.device("cpu"), None, "")
        return run_planned(module, PREFILL_PLAN, q, pool.k[0], pool.v[0], bad.index, bad.layout, scratch, 0.125,
                           window, "generic")

    run()
    with pytest.raises(ValueError, match="at most 128 rows"):
        run(tiles=torch.tensor([[0, 0, 129]]))
    with pytest.raises(ValueError, match="at most 128 rows"):
        run(tiles=torch.tensor([[0, 0, 4]]))  # past the sequence's 1 token x 2 heads
    with pytest.raises(ValueError, match="not inside the pool"):
        run(seg_chunk=arrays.seg_chunk + 1000)
    with pytest.raises(ValueError, match="not inside the pool"):
        run(seg_start=arrays.seg_start + 8)  # a whole chunk's run from slot 8 ends past the chunk
    with pytest.raises(ValueError, match="not inside the pool"):  # a run of 24 keys in a chunk of 16
        run(seg_pos=torch.where(arrays.seg_pos == 32, 1 << 62, arrays.seg_pos))
    with pytest.raises(ValueError, match="must start at position 0"):
        run(seg_pos=arrays.seg_pos + 1)
    with pytest.raises(ValueError, match="outside q"):
        run(token_start=arrays.token_start + 30)
    with pytest.raises(ValueError, match="window must be 0 .none. or a positive int32"):
        run(window=-5)
    # the context phase: its items, levels and partial rows are checked like the rest (one
    # item: 18 rows of states, one per token)
    assert arrays.num_partial_rows == 18 and arrays.ctx_items.shape[0] == 1 and arrays.ctx_end.tolist() == [128, 128]
    with pytest.raises(ValueError, match="context item 0 is not a run of blocks"):
        run(ctx_items=arrays.ctx_items + torch.tensor([0, 5, 0, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="context item 0: blocks up to 7 reach past"):
        run(ctx_items=arrays.ctx_items + torch.tensor([0, 0, 5, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="partial rows"):
        run(num_partial_rows=17)
    with pytest.raises(ValueError, match="partial rows"):  # the states it starts from, past the partials
        run(ctx_items=torch.tensor([[*arrays.ctx_items[0, :6].tolist(), 1]]))
    with pytest.raises(ValueError, match="ctx_levels must run from 0 to the 1 context items"):
        run(ctx_levels=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="context end 50 is past its first new token at 140 or not a multiple of 64"):
        run(ctx_end=arrays.ctx_end.clone().fill_(50))
    with pytest.raises(ValueError, match="must have one context state"):
        run(ctx_end=torch.tensor([128, 0]))
    # the plan tensor itself: its type, its layout, and arrays past its end
    def run_plan(index, layout, scratch=scratch):
        return run_planned(module, PREFILL_PLAN, q, pool.k[0], pool.v[0], index, layout, scratch, 0.125, 0, "generic")

    with pytest.raises(TypeError, match="plan tensor must be a contiguous int64 CPU tensor"):
        run_plan(arrays.index.int(), arrays.layout)
    with pytest.raises(ValueError, match="layout has 20 entries"):
        run_plan(arrays.index, arrays.layout[:-1])
    with pytest.raises(ValueError, match="plan array seq_ctx_offset .* is not inside the plan"):
        run_plan(arrays.index[:-1], arrays.layout)
    with pytest.raises(ValueError, match="scratch"):
        run_plan(arrays.index, arrays.layout, torch.empty(3))


def test_step_builder_makes_one_plan_per_forward():
    from chunk_llama.step import StepBuilder

    pool, tree = make_tree([[1] * 50, [1] * 40 + [2] * 10], chunk_size=16, num_kv_heads=1, head_dim=64)
    buffers = StaticBuffers("cpu")
    backends = CacheBackends(Geometry(torch.device("cpu"), torch.float32, 3, 1, 64, 16, torch.float32), buffers)
    step = StepBuilder(tree, 3, backends, buffers).prefill([(0, 0, 10, 40, 50), (1, 40, 32, 18, 50)], 58)
    plan = step.prefill
    assert plan.segments == [(0, 10, 40), (40, 32, 18)]
    arrays = cpu_arrays(plan)
    assert cpu_arrays(plan) is arrays  # built once per step, whatever number of layers reads it
    for s in (0, 1):
        runs = tree.segments(s)
        assert [(c, st) for c, st, _ in runs] == list(zip(arrays.seg_chunk[s].tolist(),
                                                          arrays.seg_start[s].tolist()))[: len(runs)]
        assert arrays.seg_pos[s, : len(runs)].tolist() == [sum(n for *_, n in runs[:i]) for i in range(len(runs))]
    assert arrays.seg_chunk[0, :3].tolist() == arrays.seg_chunk[1, :3].tolist()  # the 40 common tokens, shared
    assert arrays.tiles.tolist() == [[0, 0, 120], [1, 0, 54]]
    assert arrays.token_pos.tolist() == list(range(10, 50)) + list(range(32, 50))
    assert arrays.ctx_items.numel() == 0  # sequence 0 computes tokens 10 .. of the common prefix
    assert not step.is_decode
