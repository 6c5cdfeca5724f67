"""Grammar-constrained decoding in the engine (`engine/grammar.py`) and OpenAI's penalties
(`engine/penalties.py`), each against its definition: every constrained output parses and
validates, the processed scores are -inf exactly where an independent llguidance matcher
disallows a token, and the penalties subtract what OpenAI's formula says."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.hf
import llguidance.torch
import pytest
import torch
from helpers import stock_greedy, tiny_byte_llama, tiny_byte_tokenizer
from transformers import GenerationConfig

from chunk_llama import ChunkLlamaEngine, Grammar
from chunk_llama.engine import OpenAIPenaltiesLogitsProcessor
from chunk_llama.engine.grammar import JSON_OPTIONS

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "unit", "days", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine():
    tokenizer = tiny_byte_tokenizer()
    model = tiny_byte_llama(tokenizer)
    return ChunkLlamaEngine(model, tokenizer, max_batch_size=8, chunk_size=16, kv_cache_bytes=8 << 20)


def prompts(engine, count):
    return [engine.tokenizer(f"weather {i} in the city of {'ABCDEFGH'[i % 8]}")["input_ids"] for i in range(count)]


def test_json_schema_outputs_validate_greedy_and_sampled(engine):
    greedy = engine.generate(prompts(engine, 6), GenerationConfig(max_new_tokens=80, do_sample=False),
                             grammar=Grammar.json_schema(SCHEMA))
    sampled = engine.generate(prompts(engine, 3), GenerationConfig(max_new_tokens=80, do_sample=True, temperature=1.5,
                                                                   num_return_sequences=2, seed=3),
                              grammar={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}})
    for out in greedy + sampled:
        assert out.finish_reason == "stop" and out.token_ids[-1] == engine.tokenizer.eos_token_id, out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    objects = engine.generate(prompts(engine, 3), GenerationConfig(max_new_tokens=60, do_sample=True, seed=5),
                              grammar={"type": "json_object"})
    for out in objects:  # any object; may be cut by the length (then it is a prefix of one)
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.text.startswith("{")


def test_scores_are_masked_exactly_where_the_grammar_disallows(engine):
    """The processed scores equal the raw logits where llguidance (run here, independently)
    allows a token and are -inf elsewhere, at every step."""
    (prompt,) = prompts(engine, 1)
    (out,) = engine.generate([prompt], GenerationConfig(max_new_tokens=80, do_sample=False, output_scores=True,
                                                        output_logits=True, return_dict_in_generate=True),
                             grammar=Grammar.json_schema(SCHEMA))
    vocab = engine.model.config.vocab_size
    tokenizer = llguidance.hf.from_tokenizer(engine.tokenizer, vocab, eos_token=[engine.tokenizer.eos_token_id])
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults=JSON_OPTIONS))
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    for step, token in enumerate(out.token_ids):
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        allowed = torch.tensor([(int(mask[0, t // 32]) >> (t % 32)) & 1 for t in range(vocab)], dtype=torch.bool)
        assert 0 < allowed.sum() < vocab
        scores, logits = out.scores[step], out.logits[step].float()
        assert torch.equal(scores[allowed], logits[allowed])
        assert torch.isneginf(scores[~allowed]).all()
        assert token == int(torch.where(allowed, logits, float("-inf")).argmax())  # greedy over what is allowed
        assert matcher.consume_token(token)
    assert matcher.is_stopped() or matcher.is_accepting()


def test_lark_grammar_and_unconstrained_requests_in_one_batch(engine):
    """A Lark grammar (what eval --constrained uses), and requests without a grammar in the same
    batch keep stock generate's greedy tokens."""
    lark = 'start: "Action: " TOOL "[" ARG "]"\nTOOL: "Weather" | "Flights"\nARG: /[a-z]{1,5}/'
    batch = prompts(engine, 4)
    config = GenerationConfig(max_new_tokens=20, do_sample=False)
    ids = [engine.add_request(p, config, grammar=Grammar.lark(lark) if i % 2 else None) for i, p in enumerate(batch)]
    outputs = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.finished:
                outputs[delta.request_id] = delta.output
    for i, request_id in enumerate(ids):
        out = outputs[request_id]
        if i % 2:
            import re

            assert re.fullmatch(r"Action: (Weather|Flights)\[[a-z]{1,5}\]", out.text), out.text
        else:
            assert out.token_ids == stock_greedy(engine.model, batch[i], config)


def test_bad_grammars_are_refused(engine):
    config = GenerationConfig(max_new_tokens=4)
    with pytest.raises(ValueError, match="invalid lark grammar"):
        engine.add_request([5, 6], config, grammar=Grammar.lark("start: undefined_rule"))
    with pytest.raises(ValueError, match="json_object or json_schema"):
        engine.add_request([5, 6], config, grammar={"type": "yaml"})
    with pytest.raises(TypeError, match="Grammar or a response_format dict"):
        engine.add_request([5, 6], config, grammar="json")
    with pytest.raises(ValueError, match="invalid json schema grammar"):
        engine.add_request([5, 6], config, grammar=Grammar.json_schema({"type": "object", "minProperties": "x"}))
    assert not engine.has_unfinished_requests()


def test_openai_penalties_follow_the_definition():
    """mu[j] - c[j] * frequency - (c[j] > 0) * presence, c counting the completion only."""
    processor = OpenAIPenaltiesLogitsProcessor(frequency_penalty=0.5, presence_penalty=1.25)
    prompt = [7, 7, 3]
    scores = torch.randn(1, 10)
    assert torch.equal(processor(torch.tensor([prompt]), scores.clone()), scores)  # nothing generated yet
    generated = [4, 7, 4, 4, 9]
    expected = scores.clone()
    for j in range(10):
        c = generated.count(j)
        expected[0, j] = scores[0, j] - c * 0.5 - (1.25 if c > 0 else 0.0)
    assert torch.allclose(processor(torch.tensor([prompt + generated]), scores.clone()), expected)
    with pytest.raises(ValueError, match=r"\[-2, 2\]"):
        OpenAIPenaltiesLogitsProcessor(frequency_penalty=3)


def test_penalties_in_the_engine_equal_the_formula_on_the_raw_logits(engine):
    (prompt,) = prompts(engine, 1)
    processor = OpenAIPenaltiesLogitsProcessor(frequency_penalty=1.5, presence_penalty=0.5)
    (out,) = engine.generate([prompt], GenerationConfig(max_new_tokens=12, do_sample=False, output_scores=True,
                                                        output_logits=True, return_dict_in_generate=True),
                             logits_processor=[processor])
    for step in range(len(out.token_ids)):
        counts = torch.bincount(torch.tensor(out.token_ids[:step], dtype=torch.long), minlength=out.scores.shape[1])
        expected = out.logits[step].float() - counts * 1.5 - (counts > 0) * 0.5
        assert torch.allclose(out.scores[step], expected)
        assert out.token_ids[step] == int(expected.argmax())
