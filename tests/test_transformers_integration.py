"""chunk-llama as transformers' own: `attn_implementation="chunk_llama"`, padded batches,
`pipeline`, caches across `generate` calls, generation modes a ChunkCache cannot run,
accelerate's offload, PEFT adapters and torchao weights, each against stock on the same
weights."""

import copy
import logging

import pytest
import torch
from helpers import tiny_bpe_tokenizer, tiny_llama
from transformers import AutoModelForCausalLM, GenerationConfig, pipeline

import chunk_llama
from chunk_llama import ChunkCache, ChunkLlamaEngine
from chunk_llama.hf import is_patched
from chunk_llama.logs import forget_logged

GREEDY = GenerationConfig(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama (head dim 64: the CPU kernels run) saved as a model folder, and the stock model."""
    stock = tiny_llama(num_heads=4, num_kv_heads=2, head_dim=64, eos=None)
    folder = tmp_path_factory.mktemp("tiny")
    stock.save_pretrained(folder)
    return folder, stock


def shared_batch(seed=0, pad_rows=(2,), pad=7):
    """Three rows of 30 columns over a common 20-token prefix; a row in `pad_rows` is that
    prefix and 10 - pad tokens of its own, left-padded with `pad` columns (as a tokenizer
    pads prompts of different lengths)."""
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(6, 96, (20,), generator=generator)
    ids = torch.cat([prefix.repeat(3, 1), torch.randint(6, 96, (3, 10), generator=generator)], dim=1)
    mask = torch.ones_like(ids)
    for row in pad_rows:
        ids[row] = torch.cat([torch.zeros(pad, dtype=ids.dtype), ids[row, : 30 - pad]])
        mask[row, :pad] = 0
    return ids, mask


def test_one_line_from_pretrained_shares_the_batch_prefix(saved):
    folder, stock = saved
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="chunk_llama")
    assert is_patched(model) and model.config._attn_implementation == "chunk_llama"
    ids, mask = shared_batch()
    with torch.no_grad():
        want = stock.generate(ids, attention_mask=mask, generation_config=GREEDY)
        got = model.generate(ids, attention_mask=mask, generation_config=GREEDY)
    assert torch.equal(got, want)
    tree = model.chunk_llama_cache.tree
    held = sum(len(node.tokens) for node in tree.nodes())  # K/V held: each distinct prefix once
    assert tree.num_seqs == 3 and held == sum(tree.seq_len(s) for s in tree.seq_ids) - 2 * 20
    assert model(ids).logits.shape == (3, 30, 96)  # a plain forward: stock SDPA


def test_left_padding_equals_stock_and_right_padding_is_refused(saved):
    _, stock = saved
    model = chunk_llama.patch_model(copy.deepcopy(stock))
    ids, mask = shared_batch(seed=1, pad_rows=(0, 2), pad=11)
    with torch.no_grad():
        want = stock.generate(ids, attention_mask=mask, generation_config=GREEDY)
        got = model.generate(ids, attention_mask=mask, generation_config=GREEDY, past_key_values=ChunkCache(model))
    assert torch.equal(got, want)
    right = torch.ones_like(mask)
    right[1, -3:] = 0
    with pytest.raises(ValueError, match="left-padded batches only"):
        model.generate(ids, attention_mask=right, generation_config=GREEDY, past_key_values=ChunkCache(model))


def test_a_cache_across_generate_calls_is_a_prefix_cache(saved):
    """The second call is a new batch, never the first one's continuation; with retention
    it finds the first call's chunks."""
    _, stock = saved
    model = chunk_llama.patch_model(copy.deepcopy(stock))
    cache = ChunkCache(model, retain_prefixes=True)
    first, mask = shared_batch(seed=2, pad_rows=())
    second = first.clone()
    second[:, 25:] = torch.randint(6, 96, (3, 5), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        for ids in (first, second, first[:1]):
            want = stock.generate(ids, generation_config=GREEDY)
            assert torch.equal(model.generate(ids, generation_config=GREEDY, past_key_values=cache), want)
    assert cache.tree.num_revived > 0  # later calls matched the earlier calls' chunks
    cache.reset()
    assert cache.pool.num_used == 0 and cache.get_seq_length() == 0 and not cache.is_croppable


def test_modes_a_chunk_cache_cannot_run(saved, caplog):
    """Beam search on a ChunkCache is refused before any forward; without one it runs stock."""
    _, stock = saved
    model = chunk_llama.patch_model(copy.deepcopy(stock))
    calls = []
    model.model.register_forward_hook(lambda *args: calls.append(1))
    ids, mask = shared_batch(seed=3)
    beams = dict(num_beams=2, max_new_tokens=4, pad_token_id=0)
    with pytest.raises(ValueError, match="beam search .* cannot run on a ChunkCache"):
        model.generate(ids, attention_mask=mask, past_key_values=ChunkCache(model), **beams)
    assert not calls
    with caplog.at_level(logging.WARNING, logger="chunk_llama.hf.generate"), torch.no_grad():
        got = model.generate(ids, attention_mask=mask, **beams)
        want = stock.generate(ids, attention_mask=mask, **beams)
    assert torch.equal(got, want)
    assert any("beam search" in r.getMessage() and "runs stock" in r.getMessage() for r in caplog.records)



@pytest.mark.parametrize("settings", [dict(use_cache=False), dict(cache_implementation="static"),
                                      dict(cache_implementation="dynamic"), "config: use_cache=False"])
def test_generate_without_a_cache_or_with_its_own_runs_stock(saved, settings, caplog):
    """`use_cache=False` (each step feeds the whole sequence) and a `cache_implementation`
    (generate makes that cache itself), in the call or in the model's generation config as
    some checkpoints ship it: stock's tokens, run stock and said so, not the prefix cache."""
    _, stock = saved
    model = chunk_llama.patch_model(copy.deepcopy(stock))
    reference = copy.deepcopy(stock)
    if settings == "config: use_cache=False":
        model.generation_config.use_cache = reference.generation_config.use_cache = False
        settings = {}
    ids = torch.tensor([[5, 17, 33, 80, 60, 20, 9, 41]])
    forget_logged()
    with caplog.at_level(logging.WARNING, logger="chunk_llama.hf.generate"), torch.no_grad():
        got = model.generate(ids, generation_config=GREEDY, **settings)
        want = reference.generate(ids, generation_config=GREEDY, **settings)
    assert torch.equal(got, want), f"{settings}: {got[0, 8:].tolist()} against stock's {want[0, 8:].tolist()}"
    assert any("runs stock" in r.getMessage() for r in caplog.records)


def test_pipeline_with_batches(saved):
    folder, stock = saved
    tokenizer = tiny_bpe_tokenizer()
    tokenizer.padding_side = "left"
    prompts = ["the quick brown fox jumps over", "the quick brown fox then", "stop here then go", "the lazy dog"]
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="chunk_llama")
    settings = dict(batch_size=2, max_new_tokens=8, do_sample=False)
    ours = pipeline("text-generation", model=model, tokenizer=tokenizer)(prompts, **settings)
    theirs = pipeline("text-generation", model=stock, tokenizer=tokenizer)(prompts, **settings)
    assert ours == theirs
    assert model.chunk_llama_cache.tree.num_revived + model.chunk_llama_cache.tree.num_retained > 0


def test_accelerate_offload_computes_what_the_offloaded_stock_model_does(saved, tmp_path):
    """Layer 1 offloaded to disk: accelerate's hook brings its weights in; the patch leaves
    the hooked layers' forward to it."""
    folder, _ = saved
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    load = lambda name, **kw: AutoModelForCausalLM.from_pretrained(  # noqa: E731
        folder, device_map=device_map, offload_folder=tmp_path / name, **kw)
    stock = load("stock")
    assert stock.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # offloaded
    ids, mask = shared_batch(seed=4)
    with torch.no_grad():
        want = stock.generate(ids, attention_mask=mask, generation_config=GREEDY)
        for model in (chunk_llama.patch_model(load("patched")), load("one-line", attn_implementation="chunk_llama")):
            assert torch.equal(model(ids).logits, stock(ids).logits)  # no cache: stock, hooks kept
            assert torch.equal(model.generate(ids, attention_mask=mask, generation_config=GREEDY), want)
            assert model.chunk_llama_cache.pool.device.type == "cpu"


def test_kv_of_each_layer_sits_on_that_layers_device(saved):
    """The placement of a model split over devices, on the CPU: a layer whose weights are
    on `meta` gets its K/V there (the forward of such a model needs real devices)."""
    from chunk_llama.hf.support import layer_devices

    _, stock = saved
    model = copy.deepcopy(stock)
    model.model.layers[1].to("meta")
    assert layer_devices(model, 2) == [torch.device("cpu"), torch.device("meta")]
    cache = ChunkCache(model, kv_cache_bytes=1 << 22)
    assert [k.device.type for k in cache.pool.k] == ["cpu", "meta"] and cache.pool.v[1].device.type == "meta"
    # a step's tensors, plan and backend for the other device: made once, when the step is built
    cache.add_sequence(0, list(range(6, 40)))
    cache.begin_prefill([0], [0])
    step = cache.step
    assert list(step.devices) == [torch.device("meta")]
    there = step.on(torch.device("meta"))
    assert there is step.on(torch.device("meta")) and there.writes.chunk.device.type == "meta"
    assert there.prefill.device.type == "meta" and there.prefill.segments == step.prefill.segments
    assert there.attention.backend == "reference" and not there.devices
    cache.end_step(completed=False)


def test_peft_adapters_on_off_on_each_equal_stock(saved):
    """A random LoRA on q/k/v: the prefix cache never serves K/V computed under the other
    state (the engine keeps its prefixes between the calls)."""
    peft = pytest.importorskip("peft")

    _, base = saved
    torch.manual_seed(0)
    stock = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False))
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=4, chunk_size=16, kv_cache_bytes=1 << 22)
    ids, _ = shared_batch(seed=5, pad_rows=())
    prompts = ids.tolist()
    outputs = {}
    for state in ("on", "off", "on"):
        for model in (stock, engine.model):
            layers = model.base_model
            (layers.enable_adapter_layers if state == "on" else layers.disable_adapter_layers)()
        with torch.no_grad():
            want = [stock.generate(torch.tensor([p]), generation_config=GREEDY)[0, len(p):].tolist() for p in prompts]
        got = [out.token_ids for out in engine.generate(prompts, GREEDY)]
        assert got == want, state
        outputs.setdefault(state, want)
    assert outputs["on"] != outputs["off"]  # the adapter changes the answers (else the test could not fail)
    assert engine.stats["prefill_tokens_reused"] > 0  # the prefix cache served within each state


def test_torchao_int8_weights_run_their_own_linear(saved):
    """Weight-only int8 (a tensor subclass in a plain nn.Linear): the engine leaves those
    layers to torchao and matches the quantized model under stock generate."""
    torchao = pytest.importorskip("torchao.quantization")
    config = torchao.Int8WeightOnlyConfig() if hasattr(torchao, "Int8WeightOnlyConfig") else torchao.int8_weight_only()
    _, base = saved
    stock = copy.deepcopy(base)
    torchao.quantize_(stock, config)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=4, chunk_size=16, kv_cache_bytes=1 << 22)
    prompts = shared_batch(seed=6, pad_rows=())[0].tolist()
    with torch.no_grad():
        want = [stock.generate(torch.tensor([p]), generation_config=GREEDY)[0, len(p):].tolist() for p in prompts]
    assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == want


def test_torchao_int4_weights_run_their_own_linear(saved):
    """Weight-only int4 in torchao's CPU layout (Int4OpaqueTensor: tinygemm's
    _weight_int4pack_mm_for_cpu), groups of 32: the engine leaves those layers to torchao
    and matches the quantized model under stock generate."""
    pytest.importorskip("torchao.quantization")
    workflow = pytest.importorskip("torchao.prototype.quantization.int4.inference_workflow",
                                   reason="this torchao has no CPU int4 weight-only layout")
    from torchao.quantization import quantize_

    _, base = saved
    stock = copy.deepcopy(base)
    quantize_(stock, workflow.PrototypeInt4WeightOnlyConfig(group_size=32))
    assert type(stock.model.layers[0].self_attn.q_proj.weight).__name__ == "Int4OpaqueTensor"
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=4, chunk_size=16, kv_cache_bytes=1 << 22)
    prompts = shared_batch(seed=8, pad_rows=())[0].tolist()
    with torch.no_grad():
        want = [stock.generate(torch.tensor([p]), generation_config=GREEDY)[0, len(p):].tolist() for p in prompts]
        float_answers = [base.generate(torch.tensor([p]), generation_config=GREEDY)[0, len(p):].tolist()
                         for p in prompts]
    assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == want
    assert want != float_answers  # the int4 weights change the answers (else the test could not tell)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_model_split_over_two_gpus_keeps_each_layers_kv_there(saved):
    folder, _ = saved
    split = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
             "model.rotary_emb": 1, "lm_head": 1}
    model = AutoModelForCausalLM.from_pretrained(folder, device_map=split, dtype=torch.bfloat16,
                                                 attn_implementation="chunk_llama")
    stock = AutoModelForCausalLM.from_pretrained(folder, device_map=split, dtype=torch.bfloat16)
    ids, mask = shared_batch(seed=7)
    with torch.no_grad():
        got = model.generate(ids.cuda(0), attention_mask=mask.cuda(0), generation_config=GREEDY)
        want = stock.generate(ids.cuda(0), attention_mask=mask.cuda(0), generation_config=GREEDY)
    assert [k.device.index for k in model.chunk_llama_cache.pool.k] == [0, 1]
    assert torch.equal(got.cpu(), want.cpu())
