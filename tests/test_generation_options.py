"""Every generation option `generate` supports gives, per request, exactly what stock
`generate` gives on that request alone: greedy, and seeded sampling after
`torch.manual_seed(seed)`; the model's own `generation_config` is merged in; what
cannot run per request raises a ValueError naming the option."""

import copy
import random

import pytest
import torch
from helpers import tiny_bpe_tokenizer, tiny_llama, tiny_tokenizer
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation import WatermarkingConfig

from chunk_llama import ChunkLlamaEngine
from chunk_llama.eval.parity import trim_at_eos
from chunk_llama.hf.generate import stock_generate

BASE = dict(max_new_tokens=10, pad_token_id=0)


def make_prompts(seed=0, num=3):
    rng = random.Random(seed)
    shared = [rng.randrange(6, 96) for _ in range(21)]
    return [shared + [rng.randrange(6, 96) for _ in range(rng.randint(1, 15))] for _ in range(num)]


def stock_samples(model, prompt, config, seed=None, **kwargs) -> list[list[int]]:
    """Stock `generate` on this prompt alone: each returned sequence's new tokens, cut after EOS."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = stock_generate(model, torch.tensor([prompt]), generation_config=config,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kwargs)
    eos = config.eos_token_id if config.eos_token_id is not None else model.generation_config.eos_token_id
    return [trim_at_eos(row[len(prompt):].tolist(), eos) for row in out]


def engine_samples(engine, prompts, config, **kwargs) -> list[list[list[int]]]:
    by_request: dict[int, list[list[int]]] = {}
    for out in engine.generate(prompts, config, **kwargs):
        by_request.setdefault(out.request_id, []).append(out.token_ids)
    return list(by_request.values())


def assert_equal_to_stock(engine, stock, prompts, config, seed=None, **kwargs):
    expected = [stock_samples(stock, p, config, seed, **kwargs) for p in prompts]
    assert engine_samples(engine, prompts, config, **kwargs) == expected


@pytest.fixture(scope="module")
def models():
    stock = tiny_llama(eos=5)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), tiny_tokenizer(), max_batch_size=8, chunk_size=16,
                              kv_cache_bytes=1 << 22)
    greedy = stock_samples(stock, make_prompts()[0], GenerationConfig(do_sample=False, eos_token_id=None, **BASE))[0]
    return stock, engine, greedy


def greedy_options(t):
    """One option each; `t` is stock's unconstrained greedy output of the first prompt,
    so that each option changes it."""
    return {
        "repetition_penalty": dict(repetition_penalty=1.8),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
        "encoder_repetition_penalty": dict(encoder_repetition_penalty=1.8),
        "encoder_no_repeat_ngram_size": dict(encoder_no_repeat_ngram_size=1),
        "bad_words_ids": dict(bad_words_ids=[[t[1]], [t[3], t[4]]]),
        "suppress_tokens": dict(suppress_tokens=[t[2]]),
        "begin_suppress_tokens": dict(begin_suppress_tokens=[t[0]]),
        "sequence_bias": dict(sequence_bias={(t[1],): -20.0, (t[2], t[3]): 15.0}),
        "min_new_tokens": dict(min_new_tokens=6, eos_token_id=t[2]),
        "min_length": dict(min_length=30, eos_token_id=t[2]),
        "eos_token_id": dict(eos_token_id=[t[4], 90]),
        "forced_bos_token_id": dict(forced_bos_token_id=7),
        "forced_eos_token_id": dict(forced_eos_token_id=9),
        "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(2, 1.6), eos_token_id=t[6]),
        "renormalize_logits": dict(renormalize_logits=True, repetition_penalty=1.3),
        "remove_invalid_values": dict(remove_invalid_values=True),
        "max_length_instead_of_max_new_tokens": dict(max_new_tokens=None, max_length=40),
        "watermarking": dict(watermarking_config=WatermarkingConfig(bias=6.0)),
        "guidance_scale": dict(guidance_scale=1.5),
    }


@pytest.mark.parametrize("name", list(greedy_options(list(range(10)))))
def test_greedy_option_equals_stock(models, name):
    stock, engine, greedy = models
    options = {**BASE, **greedy_options(greedy)[name]}
    config = GenerationConfig(do_sample=False, **options)
    prompts = make_prompts() + [[7]]  # forced_bos_token_id acts on a one-token input only
    assert_equal_to_stock(engine, stock, prompts, config)
    if name != "remove_invalid_values":  # no inf or NaN here to remove: the one option that changes nothing
        unconstrained = GenerationConfig(do_sample=False, eos_token_id=None, **BASE)
        assert engine_samples(engine, prompts, config) != engine_samples(engine, prompts, unconstrained)


SAMPLING = {
    "plain": dict(),
    "temperature": dict(temperature=0.6),
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.7),
    "min_p": dict(min_p=0.2),
    "typical_p": dict(typical_p=0.8),
    "epsilon_cutoff": dict(epsilon_cutoff=0.02),
    "eta_cutoff": dict(eta_cutoff=0.02),
    "top_h": dict(top_h=0.6),
    "combined": dict(temperature=0.8, top_k=30, top_p=0.9, repetition_penalty=1.2, no_repeat_ngram_size=3),
    "num_return_sequences": dict(num_return_sequences=3, eos_token_id=[11, 12, 13, 14, 15, 16, 17, 18]),
}


@pytest.mark.parametrize("name", list(SAMPLING))
def test_seeded_sampling_option_equals_stock(models, name):
    stock, engine, _ = models
    config = GenerationConfig(do_sample=True, seed=1234, **{**BASE, "top_k": 0, **SAMPLING[name]})
    for prompt in make_prompts(seed=3):
        assert engine_samples(engine, [prompt], config) == [stock_samples(stock, prompt, config, seed=1234)]
    # and with other requests running beside it, submitted first
    others = [engine.add_request(p, GenerationConfig(do_sample=True, max_new_tokens=7)) for p in make_prompts(seed=4)]
    assert engine_samples(engine, make_prompts(seed=3), config) == [
        stock_samples(stock, p, config, seed=1234) for p in make_prompts(seed=3)
    ]
    while engine.has_unfinished_requests():
        engine.step()
    assert len(others) == 3


def test_samples_that_finish_early_keep_drawing_like_stock(models):
    stock, engine, _ = models
    config = GenerationConfig(do_sample=True, seed=5, num_return_sequences=4, eos_token_id=list(range(6, 30)), **BASE)
    got = engine_samples(engine, make_prompts(seed=7), config)
    expected = [stock_samples(stock, p, config, seed=5) for p in make_prompts(seed=7)]
    assert got == expected
    lengths = {len(s) for samples in got for s in samples}
    assert len(lengths) > 1  # some samples finished before others: the case this test is about


class BanNextOfLast(LogitsProcessor):
    """A user's processor: never the token right after the last one."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[torch.arange(scores.shape[0]), (input_ids[:, -1] + 1) % scores.shape[-1]] = -float("inf")
        return scores


class StopAfterEven(StoppingCriteria):
    """A user's criterion: stop once two even tokens came in a row."""

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -1] % 2 == 0) & (input_ids[:, -2] % 2 == 0)


def test_user_processor_and_stopping_criteria_equal_stock(models):
    stock, engine, _ = models
    config = GenerationConfig(do_sample=False, eos_token_id=None, **BASE)
    kwargs = dict(logits_processor=LogitsProcessorList([BanNextOfLast()]),
                  stopping_criteria=StoppingCriteriaList([StopAfterEven()]))
    prompts = make_prompts(seed=9, num=4)
    expected = [stock_samples(stock, p, config, **kwargs) for p in prompts]
    assert engine_samples(engine, prompts, config, **kwargs) == expected
    assert any(len(e[0]) < 10 for e in expected)  # the criterion stopped someone


def test_stop_strings_equal_stock(models):
    stock, _, greedy = models
    tokenizer = tiny_bpe_tokenizer()
    engine = ChunkLlamaEngine(copy.deepcopy(stock), tokenizer, max_batch_size=8, chunk_size=16, kv_cache_bytes=1 << 22)
    prompt = make_prompts()[0]
    for stop in (tokenizer.decode(greedy[3:5]), tokenizer.decode(greedy[4:5])[-2:]):  # across tokens, inside one
        config = GenerationConfig(do_sample=False, eos_token_id=None, stop_strings=[stop], **BASE)
        expected = stock_samples(stock, prompt, config, tokenizer=tokenizer)
        assert engine_samples(engine, [prompt], config) == [expected] and len(expected[0]) < 10


def test_the_models_generation_config_is_merged_in(models):
    stock, _, _ = models
    stock = copy.deepcopy(stock)
    stock.generation_config.repetition_penalty = 3.0
    stock.generation_config.no_repeat_ngram_size = 2
    stock.generation_config.eos_token_id = None
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=8, chunk_size=16, kv_cache_bytes=1 << 22)
    prompts = make_prompts(seed=11)
    assert_equal_to_stock(engine, stock, prompts, GenerationConfig(max_new_tokens=8, pad_token_id=0))
    # no config at all: the model's, with transformers' default length (20 new tokens)
    expected = [stock_samples(stock, p, GenerationConfig(pad_token_id=0)) for p in prompts]
    with pytest.warns(UserWarning, match="max_length"):
        got = engine.generate(prompts)
    assert [[o.token_ids] for o in got] == expected and all(len(o.token_ids) == 20 for o in got)


def test_scores_and_logits_are_returned_like_generate(models):
    stock, engine, _ = models
    config = GenerationConfig(do_sample=False, eos_token_id=None, output_scores=True, output_logits=True,
                              return_dict_in_generate=True, repetition_penalty=1.5, **BASE)
    prompt = make_prompts()[1]
    out = engine.generate([prompt], config)[0]
    with torch.no_grad():
        ref = stock.generate(torch.tensor([prompt]), generation_config=config,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert out.token_ids == ref.sequences[0, len(prompt):].tolist()
    assert torch.allclose(out.scores, torch.cat(ref.scores), atol=1e-4)
    assert torch.allclose(out.logits, torch.cat(ref.logits), atol=1e-4)


@pytest.mark.parametrize("options, match", [
    (dict(num_beams=2), "beam search"),
    (dict(num_beams=3, do_sample=True), "beam sampling"),
    (dict(do_sample=False, num_return_sequences=2), "num_return_sequences"),
    (dict(penalty_alpha=0.6, top_k=4), "contrastive search"),
    (dict(prompt_lookup_num_tokens=3), "assisted generation"),
    (dict(dola_layers="low"), "DoLa"),
    (dict(force_words_ids=[[7]], num_beams=2), "constrained beam search"),
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    (dict(output_hidden_states=True, return_dict_in_generate=True), "output_hidden_states"),
    (dict(token_healing=True), "token_healing"),
    (dict(seed=1.5, do_sample=True), "seed must be an int"),
    (dict(num_return_sequences=9, do_sample=True), "exceeds max_batch_size"),
])
def test_what_cannot_run_per_request_is_refused_by_name(models, options, match):
    _, engine, _ = models
    with pytest.raises((ValueError, TypeError), match=match):
        engine.add_request(make_prompts()[0], GenerationConfig(**{**BASE, **options}))
    assert not engine.has_unfinished_requests()
