"""CUDA kernels vs the PyTorch reference and dense SDPA (skipped without a GPU)."""

import copy
import random

import pytest
import torch
from helpers import check_native_kernel, make_tree, random_token_lists, tiny_llama
from tolerances import assert_kernel_close

from chunk_llama import ChunkCache, patch_model
from chunk_llama.hf.generate import stock_generate
from chunk_llama.logs import forget_logged
from chunk_llama.ops import tpp_decode_attention
from chunk_llama.step import build_decode_plan

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU and a CUDA build of torch"),
]


def run_case(tokens, **case):
    return check_native_kernel(tokens, backend="cuda", device="cuda", **case)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("chunk_size", [32, 64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8, 12])
def test_random_trees(dtype, head_dim, chunk_size, group):
    rng = random.Random(head_dim * 1000 + chunk_size * 10 + group)
    for trial in range(2):
        tokens = random_token_lists(rng, rng.choice([1, 17, 37]), rng.choice([123, 300]), vocab=3)
        run_case(tokens, chunk_size=chunk_size, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, seed=trial)


@pytest.mark.parametrize("num_seqs", [1, 17, 37, 96])
def test_everything_and_nothing_shared(num_seqs):
    shared = [[7] * 1000 + [i, i] for i in range(num_seqs)]
    plan = run_case(shared, chunk_size=64, num_kv_heads=4, group=8, head_dim=128, dtype=torch.float16)
    if num_seqs > 1:
        assert plan.num_shared == 1000 // 64  # whole chunks only on CUDA
    distinct = [[i] * 300 for i in range(num_seqs)]
    plan = run_case(distinct, chunk_size=64, num_kv_heads=4, group=8, head_dim=128, dtype=torch.float16)
    assert plan.num_shared == 0


@pytest.mark.parametrize("group", [1, 3, 12])
def test_few_long_sequences_split_the_private_tail(group):
    # 1-3 sequences of 5,000 private tokens: the sequence-first phase is split across blocks
    tokens = [[s] * 5000 for s in range(3)] + [[9] * 2000 + [1] * 3000, [9] * 2000 + [2] * 3000]  # last two share
    run_case(tokens[:1], chunk_size=64, num_kv_heads=2, group=group, head_dim=128, dtype=torch.float16)
    run_case(tokens, chunk_size=64, num_kv_heads=2, group=group, head_dim=64, dtype=torch.bfloat16)


def test_incremental_plan_updates_on_the_gpu():
    pool, tree = make_tree([[1] * 100 + [2], [1] * 100 + [3] * 60, [5] * 10], chunk_size=32, num_kv_heads=3,
                           head_dim=64, dtype=torch.float16, device="cuda", spare_chunks=12, token_granular=False)
    plan = build_decode_plan(tree, [0, 1, 2], device="cuda", group=3)
    for _ in range(70):
        tree.append([0, 1, 2], [9, 9, 9])
        events = tree.take_node_events()
        if events:
            plan.add_private_nodes(events)
        plan.advance()
    assert plan.aligned and plan.cuda_index is not None
    pool.k.normal_()  # the appended tokens' K/V (the pool starts uninitialised)
    pool.v.normal_()
    fresh = build_decode_plan(tree, [0, 1, 2], device="cuda", group=3)
    q = torch.randn(3, 9, 64, device="cuda", dtype=torch.float16)
    got = tpp_decode_attention(q, pool.k[0], pool.v[0], plan, 0.125)
    want = tpp_decode_attention(q, pool.k[0], pool.v[0], fresh, 0.125)
    assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_patched_model_on_gpu_matches_stock_logits(dtype):
    """A model with the default model's attention geometry (9 query, 3 KV heads, head dim 64)."""
    stock = tiny_llama(num_heads=9, num_kv_heads=3, head_dim=64, init=0.05).to("cuda", dtype)
    patched = patch_model(copy.deepcopy(stock))
    rng = random.Random(0)
    system = [rng.randrange(6, 96) for _ in range(150)]
    seqs = [system + [rng.randrange(6, 96) for _ in range(n)] for n in (3, 40, 17, 1)]
    full = [s + [rng.randrange(6, 96) for _ in range(24)] for s in seqs]
    with torch.no_grad():
        expected = [stock(input_ids=torch.tensor([f], device="cuda")).logits[0].float() for f in full]
    cache = ChunkCache(patched, chunk_size=64, kv_cache_bytes=1 << 26)
    starts = [cache.add_sequence(i, s) for i, s in enumerate(seqs)]
    input_ids, position_ids, last = cache.begin_prefill(list(range(len(seqs))), starts)
    tol = 3e-2 if dtype == torch.float16 else 1.5e-1
    with torch.no_grad():
        logits = patched(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, logits_to_keep=last).logits[0]
        for i, s in enumerate(seqs):
            assert (logits[i].float() - expected[i][len(s) - 1]).abs().max() <= tol
        for step in range(24):
            order = cache.begin_decode({i: full[i][len(seqs[i]) + step] for i in range(len(seqs))})
            ids = torch.tensor([[full[i][len(seqs[i]) + step]] for i in order], device="cuda")
            pos = torch.tensor([[len(seqs[i]) + step] for i in order], device="cuda")
            out = patched(input_ids=ids, position_ids=pos, past_key_values=cache).logits[:, -1].float()
            for row, i in enumerate(order):
                assert (out[row] - expected[i][len(seqs[i]) + step]).abs().max() <= tol
    assert cache.num_plan_updates > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (256, 4)])
@pytest.mark.parametrize("window", [1, 37, 123, 700])
def test_sliding_windows_against_the_reference(dtype, head_dim, group, window):
    """Shared chunks before, across and inside the windows; long private tails split."""
    from test_sliding_window import dense_windowed

    from chunk_llama.ops import reference
    from chunk_llama.ops.reference import gather_dense

    tokens = [[7] * 320 + [i] * (3 + 97 * i) for i in range(6)] + [[8] * 2000]
    pool, tree = make_tree(tokens, chunk_size=64, num_kv_heads=2, head_dim=head_dim, dtype=dtype, device="cuda",
                           token_granular=False)
    plan = build_decode_plan(tree, tree.seq_ids, device="cuda", group=group)
    q = torch.randn(plan.num_seqs, 2 * group, head_dim, generator=torch.Generator().manual_seed(window)).to("cuda", dtype)
    out = tpp_decode_attention(q, pool.k[0], pool.v[0], plan, head_dim**-0.5, window)
    ref = reference.tpp_decode_attention(q, pool.k[0], pool.v[0], plan, head_dim**-0.5, window)
    dense_kv = {s: (gather_dense(pool.k[0], tree.segments(s), tree.seq_len(s)),
                    gather_dense(pool.v[0], tree.segments(s), tree.seq_len(s))) for s in plan.seq_ids}
    # tensor cores take P rounded to the half dtype: the largest |V| the sequences read (the
    # pool's unused slots hold whatever memory held, NaN included)
    operand_scale = max(v.abs().max().item() for _, v in dense_kv.values())
    assert_kernel_close(out, ref.float(), "against the reference", operand_scale)
    for row, seq_id in enumerate(plan.seq_ids):
        length = tree.seq_len(seq_id)
        k, v = dense_kv[seq_id]
        dense = dense_windowed(q[row][None].cpu(), k.cpu(), v.cpu(), length - 1, window, head_dim**-0.5)[0]
        assert_kernel_close(out[row].cpu(), dense, f"sequence {seq_id}", operand_scale)


def test_a_plan_split_inside_a_chunk_runs_the_reference_and_says_so(caplog):
    """The CUDA kernels take whole-chunk plans; a token-granular tree's plan (built by hand
    here: the CUDA cache shares by whole chunks) runs the reference, logged once."""
    from chunk_llama.ops import reference

    pool, tree = make_tree([[1] * 40 + [2], [1] * 37 + [3]], chunk_size=32, num_kv_heads=2, head_dim=64,
                           dtype=torch.float16, device="cuda")
    plan = build_decode_plan(tree, tree.seq_ids, device="cuda", group=2)
    assert not plan.aligned and plan.cuda_index is None
    q = torch.randn(2, 4, 64, device="cuda", dtype=torch.float16)
    forget_logged()
    with caplog.at_level("WARNING", logger="chunk_llama.ops"):
        out = tpp_decode_attention(q, pool.k[0], pool.v[0], plan, 0.125)
    assert "whole-chunk segments only" in caplog.text
    torch.testing.assert_close(out, reference.tpp_decode_attention(q, pool.k[0], pool.v[0], plan, 0.125))


def stock_greedy_on(model, prompt: list[int], config) -> list[int]:
    with torch.no_grad():
        out = stock_generate(model, torch.tensor([prompt], device="cuda"), generation_config=config,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"),
                             return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist()


def teacher_forced_logits(model, prompt: list[int], new: list[int]) -> torch.Tensor:
    """[len(new), vocab] float32 logits of `model` predicting each of `new` after `prompt`."""
    with torch.no_grad():
        ids = torch.tensor([prompt + new[:-1]], device="cuda")
        return model(input_ids=ids).logits[0, len(prompt) - 1:].float()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (4, 1, 256)])
@pytest.mark.parametrize("max_prefill_tokens", [1024, 23])
def test_engine_greedy_equals_stock_on_the_gpu(dtype, num_heads, num_kv_heads, head_dim, max_prefill_tokens):
    """The whole engine on a GPU (prefill through FlashAttention varlen over the pool, decode
    through the two-phase kernels, chunked prefill splitting prompts mid-chunk, requests
    joining and leaving): its logits are as close to the float32 model's as stock's
    half-precision forward is, its greedy tokens are float32's up to that rounding, and in
    float16 most requests equal stock `generate` token for token (a half-precision near-tie
    may send two correct kernels different ways)."""
    from transformers import GenerationConfig

    from chunk_llama import ChunkLlamaEngine
    from chunk_llama.ops import prefill_backend

    stock = tiny_llama(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, init=0.2, eos=None,
                       num_layers=3).to("cuda", dtype)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=5, chunk_size=64, kv_cache_bytes=1 << 26,
                              max_prefill_tokens=max_prefill_tokens)
    assert engine.stats["attention_backend"] == "cuda"
    rng = random.Random(num_heads + head_dim)
    system = [rng.randrange(6, 96) for _ in range(150)]
    prompts = [system[: rng.choice([150, 130, 64])] + [rng.randrange(6, 96) for _ in range(rng.randint(1, 40))]
               for _ in range(9)] + [[rng.randrange(6, 96) for _ in range(300)]]
    config = GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0,
                              output_logits=True)
    outputs = engine.generate(prompts, config)
    exact_model = copy.deepcopy(stock).float()  # the same weights, float32: the truth both are held to
    num_equal = 0
    for prompt, out in zip(prompts, outputs):
        # along the engine's own tokens: its logits and stock's, each against float32
        truth = teacher_forced_logits(exact_model, prompt, out.token_ids)
        stock_error = (teacher_forced_logits(stock, prompt, out.token_ids) - truth).abs().max().item()
        engine_error = (out.logits.to(truth.device).float() - truth).abs().max().item()
        assert engine_error <= 2 * stock_error + 1e-2, (engine_error, stock_error)
        # greedy: each token is float32's argmax, or within the engine's own rounding of it
        chosen = truth.gather(1, torch.tensor(out.token_ids, device="cuda")[:, None])[:, 0]
        assert (truth.max(dim=1).values - chosen).max().item() <= 2 * engine_error + 1e-2
        num_equal += out.token_ids == stock_greedy_on(stock, prompt, config)
    if dtype == torch.float16:  # bf16's 8-bit mantissa parts greedy paths too often to count (the CPU kernels' too)
        assert num_equal >= len(prompts) // 2, f"only {num_equal}/{len(prompts)} requests equal stock token for token"
    assert engine.stats["prefill_tokens_reused"] > 0
    assert prefill_backend(torch.empty(1, num_heads, head_dim, device="cuda", dtype=dtype),
                           engine.cache.pool.k[0]) == "cuda"
