"""Batch invariance: a greedy request's logits are bit for bit those of its lone run, whatever
else is in its batch (sequences sharing its prefix or not), with its prefix cached (by a
prefill or by decode steps of an earlier request), with its prompt prefilled in pieces, with
another chunk size, with one thread instead of torch's, on every CPU kernel variant this CPU
runs, with float32 weights and with GGUF blocks (a tiny Llama of head dim 64, so the CPU kernels run).

What makes it hold (docs/ARCHITECTURE.md, "Batch invariance"): the linear layers run one
arithmetic per output for every row count (`ops/cpu/linear.py`, `csrc/cpu/linear.h`,
`quant_linear.h`), and every attention path (decode's two phases, prefill's context items
and tiles) computes a query's attention in the same blocks of keys at fixed positions,
folded in order (`csrc/cpu/blocks.h`), so no number depends on how the work was cut.
"""

from __future__ import annotations

import os

import pytest
import torch
from gguf_files import write_gguf
from helpers import tiny_llama
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, LlamaConfig

from chunk_llama import ChunkLlamaEngine
from chunk_llama.gguf.load import load_gguf_model
from chunk_llama.gguf.modules import GGUFLinear
from chunk_llama.ops.cpu import isa
from chunk_llama.ops.cpu.attention import build

VARIANTS = [v for v in isa.host_variants() if v in isa.compiled_variants()] if isa.host_arch() == "x86_64" else []
NEW_TOKENS = 8
CONFIG = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, eos_token_id=None)
SCENARIOS = ("split_prefill", "cached_prefix", "cached_from_decode", "batch_shared_prefix", "batch",
             "other_chunk_size", "one_thread")


@pytest.fixture(scope="module", params=["float32", "gguf_q4_1"])
def model(request, tmp_path_factory):
    if request.param == "float32":
        return tiny_llama(head_dim=64, num_heads=4, num_kv_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    sizes = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    write_gguf(path, AutoModelForCausalLM.from_config(LlamaConfig(**sizes)).float(), "llama", "Q4_1")
    folder, name = os.path.split(path)
    loaded, kept = load_gguf_model(path, AutoConfig.from_pretrained(folder, gguf_file=name))
    assert loaded is not None and isinstance(loaded.model.layers[0].mlp.down_proj, GGUFLinear), kept
    return loaded


@pytest.fixture(params=VARIANTS or [pytest.param(None, marks=pytest.mark.skip(reason="no x86-64 CPU kernel here"))])
def variant(request, monkeypatch):
    if build() is None:
        pytest.skip("the CPU kernel did not build here")
    monkeypatch.setenv(isa.ENV, request.param)
    return request.param


def prompts():
    """The request (300 tokens), unrelated prompts, and prompts sharing its first 200 tokens."""
    g = torch.Generator().manual_seed(0)
    request = torch.randint(6, 96, (300,), generator=g).tolist()
    others = [torch.randint(6, 96, (int(n),), generator=g).tolist() for n in (40, 90, 150, 20, 200)]
    sharing = [request[:200] + torch.randint(6, 96, (30,), generator=g).tolist() for _ in range(3)]
    return request, others, sharing


def engine(model, **kwargs):
    return ChunkLlamaEngine(model, **{"max_batch_size": 16, "chunk_size": 64, "kv_cache_bytes": 16 << 20, **kwargs})


def generated_after(model, prefix: list[int]) -> list[int]:
    return engine(model).generate([prefix], CONFIG)[0].token_ids


def run(model, scenario: str):
    """(the request's tokens, its output's token ids and logits [NEW_TOKENS, vocab]) in
    `scenario` ("alone", "alone_from_decode" or a SCENARIOS name)."""
    request, others, sharing = prompts()
    if scenario in ("alone_from_decode", "cached_from_decode"):
        # a prompt whose positions 250 .. 257 are what the model generated after its first 250
        request = request[:250] + generated_after(model, request[:250]) + request[258:]
    if scenario in ("alone", "alone_from_decode"):
        out = engine(model).generate([request], CONFIG)[0]
    elif scenario == "split_prefill":
        out = engine(model, max_prefill_tokens=64).generate([request], CONFIG)[0]
    elif scenario == "cached_prefix":
        warm = engine(model)
        warm.generate([request[:250]], CONFIG)
        out = warm.generate([request], CONFIG)[0]
        assert out.num_cached_tokens >= 250  # the prefix came from the cache
    elif scenario == "cached_from_decode":
        warm = engine(model)  # its K/V of positions 250 .. 256 come from decode steps
        assert warm.generate([request[:250]], CONFIG)[0].token_ids == request[250:258]
        out = warm.generate([request], CONFIG)[0]
        assert out.num_cached_tokens >= 257
    elif scenario == "batch_shared_prefix":
        out = engine(model).generate([request, *sharing], CONFIG)[0]
    elif scenario == "batch":
        out = engine(model).generate([request, *others], CONFIG)[0]
    elif scenario == "other_chunk_size":
        out = engine(model, chunk_size=16).generate([request], CONFIG)[0]
    else:  # the kernels split their work over torch's threads: one thread does it all
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            out = engine(model).generate([request], CONFIG)[0]
        finally:
            torch.set_num_threads(threads)
    return request, out.token_ids, out.logits


def test_small_linear_rows_do_not_change_each_other(variant):
    """The building block of an invariant linear path: a row's result is the same whatever other
    rows are computed with it, 1 to 700 of them."""
    module = build()
    g = torch.Generator().manual_seed(1)
    weight, x = torch.randn(384, 256, generator=g) * 0.05, torch.randn(700, 256, generator=g)
    alone = module.small_linear(x[:1].contiguous(), weight, None, isa=variant)
    for rows in (2, 5, 16, 64, 128, 700):
        together = module.small_linear(x[:rows].contiguous(), weight, None, isa=variant)
        assert torch.equal(together[:1], alone), rows


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_greedy_logits_are_bitwise_those_of_the_lone_run(model, variant, scenario):
    request, tokens, logits = run(model, scenario)
    lone_request, lone_tokens, lone_logits = run(model, "alone_from_decode" if "decode" in scenario else "alone")
    assert request == lone_request and tokens == lone_tokens
    differ = (logits != lone_logits).any(dim=-1).nonzero().flatten().tolist()
    assert not differ, (f"{scenario} ({variant}): steps {differ} differ from the lone run, by up to "
                        f"{(logits - lone_logits).abs().max().item():.3g}")
