"""Model families beyond Llama: tiny random Qwen2, Qwen3, Mistral, Phi-3 and Gemma 3
models, with and without sliding-window layers, through the engine equal stock
`generate`; what the kernels cannot run is refused by name, before any weights are read."""

import copy
import json
import random

import pytest
import torch
import transformers
from families import COMMON, ENGINE_MODELS, model_type, tiny_model, uncovered_families
from transformers import GenerationConfig

from chunk_llama import ChunkLlamaEngine, load_model


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(6, 96) for _ in range(40)]
    return [system[: rng.randint(0, 40)] + [rng.randrange(6, 96) for _ in range(rng.randint(1, 25))]
            for _ in range(7)]


def test_every_family_has_tiny_models():
    assert uncovered_families() == {"ENGINE_MODELS": set(), "FUSED_MODELS": set()}


@pytest.mark.parametrize("family", list(ENGINE_MODELS))
def test_engine_equals_stock_generate(family):
    stock = tiny_model(ENGINE_MODELS, family)
    assert stock.config.model_type == model_type(family)
    if family.endswith("-windowed"):
        from chunk_llama.hf.support import sliding_window

        assert sliding_window(stock.config) is not None
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=3, chunk_size=16, kv_cache_bytes=1 << 23)
    config = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0,
                              output_logits=True)
    batch = prompts(seed=len(family))
    for prompt, out in zip(batch, engine.generate(batch, config)):  # joins and leaves: 7 requests, 3 at a time
        with torch.no_grad():
            ref = stock.generate(torch.tensor([prompt]), generation_config=config, return_dict_in_generate=True,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert out.token_ids == ref.sequences[0, len(prompt):].tolist()
        assert (out.logits - torch.stack([step[0] for step in ref.logits])).abs().max() <= 1e-4
    assert engine.stats["prefill_tokens_reused"] > 0
    head_dim = engine.cache.pool.head_dim
    assert engine.stats["attention_backend"].startswith("reference" if head_dim == 16 else "cpu"), head_dim


@pytest.mark.parametrize("config_name,kwargs,feature", [
    ("Gemma2Config", dict(), "attention logit softcapping"),
    ("DeepseekV3Config", dict(), "multi-head latent attention"),
    ("GPT2Config", dict(), "positions without RoPE"),
    ("BloomConfig", dict(), "attention interface"),
    ("T5Config", dict(), "encoder-decoder"),
])
def test_unsupported_features_are_refused_by_name(config_name, kwargs, feature):
    from chunk_llama.hf.support import check_supported

    with pytest.raises(ValueError, match=feature):
        check_supported(getattr(transformers, config_name)(**kwargs))


def test_a_window_the_layers_do_not_pass_is_refused():
    """Stock masks apply a window only where the layers pass it to the attention function
    (as the kernels do); a config that sets one where they do not is refused by name."""
    from chunk_llama.hf.support import check_supported

    config = transformers.LlamaConfig(sliding_window=32, max_position_embeddings=512)
    with pytest.raises(ValueError, match="llama: sliding-window attention .window 32. whose attention layers"):
        check_supported(config)
    check_supported(transformers.LlamaConfig(sliding_window=512, max_position_embeddings=512))  # never binds


def test_load_model_refuses_before_reading_weights(tmp_path):
    config = transformers.Gemma2Config(**COMMON, intermediate_size=128, hidden_size=64, num_attention_heads=4,
                                       num_key_value_heads=1,
                                       head_dim=16)
    config.save_pretrained(tmp_path)  # a config and no weights: reading them would fail otherwise
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gemma2"
    with pytest.raises(ValueError, match="gemma2: attention logit softcapping"):
        load_model(str(tmp_path))


def tiny_longrope_phi3(switch: int = 32):
    """Phi-3 with LongRoPE (Phi-3-mini-128k's, Phi-3.5's rope): its short factors up to
    `switch` tokens, its long ones past that, for every position."""
    half = 16  # head_dim 32
    torch.manual_seed(0)
    config = transformers.Phi3Config(
        vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, original_max_position_embeddings=switch,
        initializer_range=0.2, bos_token_id=1, eos_token_id=None, pad_token_id=0,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=switch,
                             short_factor=[1.0 + 0.1 * i for i in range(half)],
                             long_factor=[2.0 + 0.5 * i for i in range(half)]))
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_longrope_stays_within_its_short_factors_and_generate_runs_stock_past_them(caplog):
    """Past its switch a LongRoPE model turns every key by its long factors (stock generate
    recomputes its cache there), and transformers picks the factors from a batch's longest row:
    the engine keeps requests within the switch (max_model_len's default; more is refused by
    name), where each request's tokens are stock's alone and batched; the patched generate runs
    stock where a call would pass it."""
    import chunk_llama
    from chunk_llama.hf.support import rope_switch_length
    from chunk_llama.logs import forget_logged

    stock = tiny_longrope_phi3(switch=32)
    assert rope_switch_length(stock.config) == 32
    engine = ChunkLlamaEngine(copy.deepcopy(stock), chunk_size=16)
    assert engine.max_model_len == 32
    with pytest.raises(ValueError, match="exceeds 32, the length past which this model's LongRoPE"):
        ChunkLlamaEngine(copy.deepcopy(stock), chunk_size=16, max_model_len=64)
    generator = torch.Generator().manual_seed(1)
    short, other = (torch.randint(2, 257, (n,), generator=generator).tolist() for n in (20, 27))
    config = GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match="exceeds max_model_len=32"):
        engine.generate([short], GenerationConfig(max_new_tokens=13, do_sample=False, pad_token_id=0))

    def stock_tokens(prompt, n):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            return stock.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()

    alone, batched = engine.generate([short], config)[0], engine.generate([short, other], config)
    assert alone.token_ids == batched[0].token_ids == stock_tokens(short, 5)
    assert batched[1].token_ids == stock_tokens(other, 5)
    patched = chunk_llama.patch_model(copy.deepcopy(stock))
    forget_logged()
    with caplog.at_level("WARNING", logger="chunk_llama.hf.generate"), torch.no_grad():
        ids = torch.tensor([short])
        got = patched.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                               pad_token_id=0)[0, 20:].tolist()
    assert got == stock_tokens(short, 20)
    assert any("LongRoPE past 32 tokens" in r.getMessage() for r in caplog.records)
