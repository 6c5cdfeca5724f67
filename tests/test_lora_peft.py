"""A PEFT `PeftModel` handed to the engine as it is: its adapters by their PEFT names in one
batch, what it computes as it stands for a request naming none, and the two ways the
one-adapter mode gave wrong text (each against stock PEFT `generate`, greedy, float32):
- an adapter deleted and loaded again under the same name with other weights: the engine
  served K/V of the old weights (their tensors' version counters started again);
- a model that ran in an engine, then wrapped with PEFT: the engine's decode forward passed
  the cache on under the name the model's own forward takes, not the one PEFT's passes on,
  so the layers wrote no K/V.
And `attn_implementation="chunk_llama"` with PEFT (stock `generate` on the patched model),
the same reload included."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_llama
from lora_adapters import SPECS, make_adapter, stock_answer, stock_peft
from transformers import AutoModelForCausalLM, GenerationConfig

from chunk_llama import ChunkLlamaEngine

peft = pytest.importorskip("peft")
NEW = 6
GREEDY = GenerationConfig(max_new_tokens=NEW, do_sample=False)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """(base, {name: folder}): "c", "a" and a second "a" of other weights."""
    base = tiny_llama(head_dim=64, num_heads=4, num_kv_heads=2, max_position_embeddings=1024, eos=None)
    root = tmp_path_factory.mktemp("peft-adapters")
    folders = {"a": make_adapter(base, str(root / "a"), seed=1, **SPECS["b"]),
               "a2": make_adapter(base, str(root / "a2"), seed=2, **SPECS["b"]),
               "c": make_adapter(base, str(root / "c"), seed=3, **SPECS["c"])}
    return base, folders


def prompts():
    g = torch.Generator().manual_seed(0)
    system = torch.randint(6, 96, (40,), generator=g).tolist()
    return [system + torch.randint(6, 96, (n,), generator=g).tolist() for n in (5, 9)]


def stock(base, folder) -> list[list[int]]:
    model = stock_peft(base, folder)
    return [stock_answer(model, p, NEW)[0] for p in prompts()]


def engine_on(model) -> ChunkLlamaEngine:
    return ChunkLlamaEngine(model, max_batch_size=8, chunk_size=16, kv_cache_bytes=8 << 20)


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_a_peft_models_adapters_by_name_in_one_batch_and_after_a_reload_under_the_same_name(adapters):
    base, folders = adapters
    model = peft.PeftModel.from_pretrained(copy.deepcopy(base), folders["c"], adapter_name="c")
    model.load_adapter(folders["a"], adapter_name="a")
    engine = engine_on(model)
    assert engine.adapter_names() == ["c", "a"]
    want = {name: stock(base, folders[name]) for name in ("c", "a", "a2")} | {None: stock(base, None)}
    # as it stands: PEFT's active adapter ("c", then "a"), as the one-adapter mode answered
    assert tokens(engine.generate(prompts(), GREEDY)) == want["c"]
    model.set_adapter("a")
    assert tokens(engine.generate(prompts(), GREEDY)) == want["a"]
    # "a" deleted and loaded again under its name with other weights
    model.delete_adapter("a")
    model.load_adapter(folders["a2"], adapter_name="a")
    model.set_adapter("a")
    outputs = engine.generate(prompts(), GREEDY)
    assert tokens(outputs) == want["a2"]
    assert outputs[0].num_cached_tokens == 0  # nothing of the old "a" was found
    # each adapter by its name, and the base with its adapters disabled, in one batch
    names = ["c", "a", None, "c"]
    both = prompts() * 2
    with model.disable_adapter():
        outputs = engine.generate(both, GREEDY, adapter=names)
    assert tokens(outputs) == [want["c"][0], want["a2"][1], want[None][0], want["c"][1]]
    with pytest.raises(ValueError, match="unknown adapter 'b'; known adapters: c, a"):
        engine.generate(prompts(), GREEDY, adapter="b")


def test_a_model_that_ran_in_an_engine_then_wrapped_with_peft(adapters):
    base, folders = adapters
    model = copy.deepcopy(base)
    engine = engine_on(model)
    assert tokens(engine.generate(prompts(), GREEDY)) == stock(base, None)
    engine.close()
    wrapped = peft.PeftModel.from_pretrained(model, folders["a"])
    assert tokens(engine_on(wrapped).generate(prompts(), GREEDY)) == stock(base, folders["a"])


def test_attn_implementation_chunk_llama_with_peft_and_a_reload(adapters, tmp_path):
    base, folders = adapters
    base.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="chunk_llama").eval()
    model = peft.PeftModel.from_pretrained(model, folders["a"], adapter_name="a")

    def generate():
        with torch.no_grad():
            return [model.generate(input_ids=torch.tensor([p]), generation_config=GREEDY)[0, len(p):].tolist()
                    for p in prompts()]

    assert generate() == stock(base, folders["a"])
    model.delete_adapter("a")
    model.load_adapter(folders["a2"], adapter_name="a")
    model.set_adapter("a")
    assert generate() == stock(base, folders["a2"])
