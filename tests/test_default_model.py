"""The real default model (SmolLM2-135M-Instruct): engine vs stock, and KV held."""

import json
import os

import pytest
import torch
from helpers import token_granular_chunks
from transformers import GenerationConfig

import chunk_llama
from chunk_llama import ChunkLlamaEngine
from chunk_llama.cli import DEFAULT_SYSTEM, main
from chunk_llama.hf.generate import stock_generate


@pytest.fixture(scope="module")
def default_model():
    model, tokenizer = chunk_llama.load_default_model(torch.float32)
    return model, tokenizer


def system_prompt(tokenizer, num_tokens):
    with open(DEFAULT_SYSTEM, encoding="utf-8") as f:
        ids = tokenizer(f.read())["input_ids"][:num_tokens]
    return tokenizer.decode(ids)


def test_default_model_geometry(default_model):
    config = default_model[0].config
    assert (config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers) == (9, 3, 30)
    assert config.hidden_size // config.num_attention_heads == 64 and config.vocab_size == 49152


def test_shared_system_prompt_greedy_equals_stock_and_kv_is_deduplicated(default_model):
    model, tokenizer = default_model
    system = system_prompt(tokenizer, 1000)
    questions = ["How many flights left BOS on 2022-01-02?", "What is the elevation of DEN?",
                 "Which carrier flew most from JFK?", "What was the delay of DL 10?"]
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    config = GenerationConfig(max_new_tokens=8, do_sample=False)
    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=8, chunk_size=64)
    outputs = engine.generate(chats, config)
    chunk_size = 64
    for out in outputs:
        prompt = out.prompt_token_ids
        assert len(prompt) > 1000
        with torch.no_grad():
            expected = stock_generate(model, torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()
        assert out.token_ids == expected
        assert out.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert all(o.finish_reason == "length" for o in outputs)
    # peak: the last decode step, every prompt plus its first 7 generated tokens cached
    cached = [o.prompt_token_ids + o.token_ids[:-1] for o in outputs]
    stats = engine.stats
    assert stats["peak_chunks_used"] == token_granular_chunks(cached, chunk_size)
    assert stats["peak_kv_bytes"] == stats["peak_chunks_used"] * stats["bytes_per_chunk"]
    one_copy_each = sum(-(-len(t) // chunk_size) for t in cached) * stats["bytes_per_chunk"]
    assert stats["peak_kv_bytes"] < 0.4 * one_copy_each
    assert stats["prefill_tokens_reused"] >= 3 * 960  # the system prompt was computed once


def test_cli_generate_writes_jsonl_and_summary(default_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(chunk_llama.loading, "load_model", lambda *a, **k: default_model)  # loaded once per module
    questions = tmp_path / "questions.txt"
    questions.write_text("How many flights left BOS?\nWhat is the elevation of DEN?\n")
    output = tmp_path / "out.jsonl"
    assert main(["generate", "--prompts", str(questions), "--max-new-tokens", "4", "--output", str(output)]) == 0
    lines = output.read_text().splitlines()
    assert len(lines) == 2 and '"finish_reason"' in lines[0]
    summary = capsys.readouterr().out
    assert "sharing ratio" in summary and "one copy per request" in summary
    assert os.path.exists(DEFAULT_SYSTEM)


def test_cli_generate_samples_reproducibly_with_a_seed(default_model, tmp_path, monkeypatch):
    """--temperature samples; --seed S makes request i draw as stock generate after
    torch.manual_seed(S + i): two runs write the same answers."""
    monkeypatch.setattr(chunk_llama.loading, "load_model", lambda *a, **k: default_model)
    questions = tmp_path / "questions.txt"
    questions.write_text("Name a city.\nName a river.\n")
    runs = []
    for run in range(2):
        output = tmp_path / f"out{run}.jsonl"
        assert main(["generate", "--prompts", str(questions), "--max-new-tokens", "6", "--temperature", "1.5",
                     "--top-p", "0.95", "--seed", "7", "--output", str(output)]) == 0
        runs.append([json.loads(line)["output"] for line in output.read_text().splitlines()])
    assert runs[0] == runs[1] and len(runs[0]) == 2


def test_streamed_text_adds_up_to_the_output_with_multibyte_characters(default_model):
    model, tokenizer = default_model
    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=4, chunk_size=64)
    chat = [{"role": "user", "content": "Répète exactement: «café, naïve, 東京, 😀» puis 'ok'."}]
    config = GenerationConfig(max_new_tokens=24, do_sample=False)
    pieces = list(engine.stream(chat, config))
    out = engine.generate([chat], config)[0]
    assert "".join(pieces) == out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert len(pieces) > 3 and any(ord(ch) > 127 for ch in out.text)


@pytest.mark.slow
def test_from_pretrained_and_pipeline_on_the_default_model(default_model):
    """The one-line form on the real model's GGUF file, and `pipeline` with batches of
    left-padded chats over one system prompt: the same text as stock."""
    import os.path

    from transformers import AutoModelForCausalLM, pipeline

    stock, tokenizer = default_model
    folder, name = os.path.split(chunk_llama.loading.default_model_path())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, attn_implementation="chunk_llama")
    system = {"role": "system", "content": system_prompt(tokenizer, 300)}
    chats = [[system, {"role": "user", "content": q}] for q in ("Delay of DL 10?", "Flights from BOS?",
                                                                "Elevation of DEN?", "Busiest carrier at JFK?")]
    tokenizer.padding_side = "left"
    settings = dict(batch_size=2, max_new_tokens=8, do_sample=False)
    ours = pipeline("text-generation", model=model, tokenizer=tokenizer)(chats, **settings)
    theirs = pipeline("text-generation", model=stock, tokenizer=tokenizer)(chats, **settings)
    assert ours == theirs
    tree = model.chunk_llama_cache.tree
    assert tree.num_revived > 0  # the second batch found the first batch's system prompt
