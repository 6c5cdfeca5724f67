"""Token-granular sharing through the engine: prompts whose common prefix ends at every
offset inside a chunk hold it once and equal stock `generate` (greedy tokens and
teacher-forced logits), whether they arrive together (splits of nodes the same forward
writes) or one after another (splits of committed and retained nodes)."""

import copy
import random

import pytest
import torch
from helpers import assert_tree_consistent, tiny_llama, token_granular_chunks
from transformers import GenerationConfig

from chunk_llama import ChunkLlamaEngine
from chunk_llama.step import builder as step_module

CHUNK = 16
CONFIG = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True)


def prompts_parting_at_every_offset(seed: int) -> list[list[int]]:
    """One prompt per offset 0 .. 15 of the third chunk: a common system prompt up to there,
    then tokens of its own (drawn from ids the system prompt never uses, so no prompt's own
    part matches another's)."""
    rng = random.Random(seed)
    system = [rng.randrange(6, 50) for _ in range(3 * CHUNK)]
    return [system[: 2 * CHUNK + offset] + [rng.randrange(50, 96) for _ in range(rng.randint(1, 20))]
            for offset in range(CHUNK)]


def stock_logits(stock, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        out = stock.generate(torch.tensor([prompt]), generation_config=CONFIG, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack([step[0] for step in out.logits])


def check_against_stock(stock, prompts, outputs) -> None:
    for prompt, out in zip(prompts, outputs):
        tokens, logits = stock_logits(stock, prompt)
        assert out.token_ids == tokens
        assert (out.logits - logits).abs().max() <= 1e-4


@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 16), (2, 64)])
def test_arriving_together(num_kv_heads, head_dim, monkeypatch):
    """One prefill step computes the common prefix once (the first prompt's) and the others'
    own tokens, which read its whole blocks of keys together (the prefill kernel's context
    phase, with head dim 64 the CPU kernel): prompts parting inside their third chunk behind a
    common lead of 64 tokens (one block)."""
    stock = tiny_llama(num_kv_heads=num_kv_heads, head_dim=head_dim, num_heads=4, init=0.1)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=16, chunk_size=CHUNK, kv_cache_bytes=1 << 23,
                              max_prefill_tokens=4096)
    plans = []
    build = step_module.build_prefill_plan
    monkeypatch.setattr(step_module, "build_prefill_plan", lambda *a, **k: plans.append(build(*a, **k)) or plans[-1])
    lead = [random.Random(head_dim).randrange(6, 50) for _ in range(64)]
    prompts = [lead + prompt for prompt in prompts_parting_at_every_offset(seed=head_dim)]
    outputs = engine.generate(prompts, CONFIG)
    check_against_stock(stock, prompts, outputs)
    arrays = plans[0].cpu()  # the CPU kernel's schedule of that step
    assert len(plans) == 1 and arrays.ctx_items.shape[0] > 0 and (arrays.ctx_end >= 64).sum() >= 8
    # every prefix held once: the chunks of the distinct prefixes, placed as the tree does
    cached = [o.prompt_token_ids + o.token_ids[:-1] for o in outputs]
    assert engine.stats["peak_chunks_used"] == token_granular_chunks(cached, CHUNK)
    assert engine.stats["prefill_tokens_computed"] == len(set(tuple(p[:n]) for p in prompts for n in
                                                            range(1, len(p) + 1)))
    assert_tree_consistent(engine.cache.tree)


@pytest.mark.parametrize("retain", [True, False])
def test_arriving_one_after_another(retain):
    """Each prompt comes once the previous one is decoding (or done, its nodes retained):
    it splits a node that a completed forward wrote, a live or a retained one."""
    stock = tiny_llama(init=0.1)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=4, chunk_size=CHUNK, kv_cache_bytes=1 << 23,
                              retain_prefixes=retain)
    prompts = prompts_parting_at_every_offset(seed=7)
    random.Random(3).shuffle(prompts)
    ids, outputs = [], {}
    for prompt in prompts:
        ids.append(engine.add_request(prompt, CONFIG))
        for _ in range(3):  # a few steps: the earlier requests decode, some finish
            outputs.update({d.request_id: d.output for d in engine.step() if d.finished})
        assert_tree_consistent(engine.cache.tree)
    while engine.has_unfinished_requests():
        outputs.update({d.request_id: d.output for d in engine.step() if d.finished})
    check_against_stock(stock, prompts, [outputs[i] for i in ids])
    if retain:  # later prompts found the common prefix cached, however much of a chunk it filled
        assert engine.stats["prefill_tokens_reused"] >= sum(2 * CHUNK for _ in prompts[1:])
