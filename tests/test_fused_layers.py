"""The fused decoder layer (`hf/fused/layers.py`, `csrc/cpu/layer.cpp`): a decode step of a
Llama, Mistral, Qwen2, Qwen3, Gemma 3 or Phi-3 layer in one call is as close to the float64 truth
as the op-by-op path is (float32 weights and GGUF blocks, biases, q/k norms, Gemma's
sandwich norms and GELU, sliding windows, GQA, odd sizes, rows in the plan's order or not)
and gives stock's greedy tokens; what it does not compute (a hook inside the layer, a replaced
weight, autograd) runs op by op, and bad input to the C function is a
ValueError naming it."""

import copy
import logging
import random

import pytest
import torch
from families import FUSED_MODELS, tiny_model
from helpers import make_tree
from test_quant_linear import gguf_py_decoded, random_blocks
from tolerances import assert_no_worse_than_stock
from transformers import GenerationConfig

from chunk_llama import ChunkCache, ChunkLlamaEngine, patch_model
from chunk_llama.gguf.modules import GGUFLinear, set_gguf_activations
from chunk_llama.hf.fused import layers as fused_layers
from chunk_llama.hf.fused import per_step
from chunk_llama.hf.fused import stack as fused_stack
from chunk_llama.logs import forget_logged
from chunk_llama.ops.cpu import isa
from chunk_llama.ops.cpu.attention import CpuDecode, build
from chunk_llama.ops.cpu.planned import CpuPlanned, DecoderStack
from chunk_llama.ops.cpu.structs import DecoderLayer, Weight
from chunk_llama.step import StaticBuffers, build_decode_plan

pytestmark = pytest.mark.skipif(build() is None or isa.host_arch() != "x86_64",
                                reason="the fused layer runs with the CPU kernels' linear path (x86-64)")

GREEDY = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True)


def tiny(family: str) -> torch.nn.Module:
    model = tiny_model(FUSED_MODELS, family)
    with torch.no_grad():  # norms of their own (initialized equal, a norm read for another would pass)
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.2)
    return model


def prompts(seed: int) -> list[list[int]]:
    """Two system prompts (17 and 37 tokens), interleaved, each with its own question."""
    rng = random.Random(seed)
    systems = [[rng.randrange(6, 96) for _ in range(n)] for n in (17, 37)]
    return [systems[i % 2] + [rng.randrange(6, 96) for _ in range(rng.randint(1, 9))] for i in range(5)]


@pytest.fixture(autouse=True)
def fresh_logs():
    """Each reason is logged once per process: tests that count the lines start afresh (a test
    elsewhere may have logged the same reason first)."""
    forget_logged()


@pytest.fixture
def fused_calls(monkeypatch):
    """Spies on the C calls: [(rows, whether the plan reorders them, the layer's K pool address)] per
    fused layer, whether it ran in its own call or in its stack's (`stack_calls` counts those)."""
    calls = []
    layer_call, stack_call = CpuPlanned.decoder_layer, CpuPlanned.decoder_stack

    def spy(self, layer, hidden, cos, sin, k_cache, v_cache, scale, window, *lora):
        calls.append((hidden.shape[0], self.reordered, k_cache.data_ptr()))
        return layer_call(self, layer, hidden, cos, sin, k_cache, v_cache, scale, window, *lora)

    def stack_spy(self, stack, hidden, cos, sin, lora=None):
        calls.extend((hidden.shape[0], self.reordered, kv.k_cache.data_ptr()) for kv in stack.kvs)
        stack_calls.append(stack.num_layers)
        return stack_call(self, stack, hidden, cos, sin, lora)

    stack_calls = []
    monkeypatch.setattr(CpuPlanned, "decoder_layer", spy)
    monkeypatch.setattr(CpuPlanned, "decoder_stack", stack_spy)
    monkeypatch.setattr(CpuPlanned, "stack_calls", stack_calls, raising=False)
    return calls


def truth_logits(model: torch.nn.Module, prompt: list[int], new_tokens: list[int]) -> torch.Tensor:
    """The float64 model's logits for each new token, teacher-forced: [len(new_tokens), vocab]."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + new_tokens[:-1]])).logits[0]
    return logits[len(prompt) - 1:]


def engine_outputs(model, batch, monkeypatch, fused: bool, kv_dtype: str = "auto"):
    monkeypatch.setenv(fused_layers.ENV, "1" if fused else "0")
    engine = ChunkLlamaEngine(model, max_batch_size=3, chunk_size=16, kv_cache_bytes=1 << 23, kv_dtype=kv_dtype)
    try:
        return engine.generate(batch, GREEDY)
    finally:
        engine.close()


def check_fused_against_op_by_op(stock, truth_model, batch, monkeypatch, fused_calls, what, kv_dtype="auto",
                                 near_ties: bool = False):
    """The fused engine's greedy tokens equal the op-by-op engine's, and its decode steps' logits are no
    further from the float64 truth than the op-by-op path's or stock's float32 forward.

    near_ties: under integer activations a float32 rounding apart can round an activation to the next
    integer code, which moves logits by about the mode's own error; where the two paths' tokens part
    there, the op-by-op path's margin between the two tokens must be within its own error to the truth
    at that step (either token is right to the mode's accuracy), and the logits are compared up to it."""
    op_by_op = engine_outputs(copy.deepcopy(stock), batch, monkeypatch, fused=False, kv_dtype=kv_dtype)
    assert not fused_calls
    fused = engine_outputs(copy.deepcopy(stock), batch, monkeypatch, fused=True, kv_dtype=kv_dtype)
    num_layers = stock.config.num_hidden_layers
    # every decode step of every layer fused: 7 requests x 7 decode steps, 3 at a time
    assert len(fused_calls) >= num_layers * (GREEDY.max_new_tokens - 1) * len(batch) / 3, fused_calls
    lengths = []  # per request: how many of its logits follow the same tokens on both paths
    for i, (ours, theirs) in enumerate(zip(fused, op_by_op)):
        same = next((j for j, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)) if a != b), None)
        if same is not None:
            assert near_ties, f"{what}: request {i}: tokens {ours.token_ids} against {theirs.token_ids}"
            row = theirs.logits[same].double()
            truth_row = truth_logits(truth_model, batch[i], theirs.token_ids)[same]
            margin = (row[theirs.token_ids[same]] - row[ours.token_ids[same]]).item()
            error = (row - truth_row).abs().max().item()
            assert margin <= error, (f"{what}: request {i} parts at step {same} by a margin of {margin:.4g}, "
                                     f"above the op-by-op path's own error there ({error:.4g})")
        lengths.append(len(ours.token_ids) if same is None else same + 1)
    # the first token comes from the prefill (not fused): the decode steps' logits, all requests
    # together (a worst element over many is a steadier measure of the two paths' rounding)
    truth = torch.cat([truth_logits(truth_model, prompt, out.token_ids)[1:n]
                       for prompt, out, n in zip(batch, fused, lengths)])
    # held to the op-by-op path's error and to stock's own (the float32 model teacher-forced): on this tiny
    # model either may be the smaller, by CPU (tolerances.py)
    stock32 = copy.deepcopy(truth_model).float()
    stock = torch.cat([truth_logits(stock32, prompt, out.token_ids)[1:n]
                       for prompt, out, n in zip(batch, fused, lengths)])
    assert_no_worse_than_stock(torch.cat([out.logits[1:n] for out, n in zip(fused, lengths)]),
                               (torch.cat([out.logits[1:n] for out, n in zip(op_by_op, lengths)]), stock), truth,
                               torch.float32, what=what)
    return fused


@pytest.mark.parametrize("family", list(FUSED_MODELS))
def test_fused_layers_compute_what_the_op_by_op_path_does(family, monkeypatch, fused_calls):
    stock = tiny(family)
    batch = prompts(seed=len(family))
    fused = check_fused_against_op_by_op(stock, copy.deepcopy(stock).double(), batch, monkeypatch, fused_calls,
                                         family)
    for prompt, out in zip(batch, fused):
        with torch.no_grad():
            want = stock.generate(torch.tensor([prompt]), generation_config=GREEDY, return_dict_in_generate=True,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert out.token_ids == want.sequences[0, len(prompt):].tolist()


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "phi3"])
def test_fused_layers_write_a_16_bit_pool_as_the_op_by_op_path(family, kv_dtype, monkeypatch, fused_calls):
    """kv_dtype=bfloat16 or float16 under float32 layers: the fused layer rounds the new K/V to
    the pool as torch's copy does on the op-by-op path (to nearest even), and both read them
    widened: the same tokens, logits as close to the truth; the rounding shows against a
    float32 pool."""
    stock = tiny(family)
    batch = prompts(seed=len(family) + 1)
    fused = check_fused_against_op_by_op(stock, copy.deepcopy(stock).double(), batch, monkeypatch, fused_calls,
                                         family, kv_dtype=kv_dtype)
    wide = engine_outputs(copy.deepcopy(stock), batch, monkeypatch, fused=True)
    assert any(not torch.equal(a.logits, b.logits) for a, b in zip(fused, wide)), f"{kv_dtype} K/V changed nothing"


GGUF_FORMATS = {  # family -> (the projections' GGML formats, sizes in whole K-quant super-blocks of 256)
    "llama": ({"q_proj": "Q4_1", "k_proj": "Q8_0", "v_proj": "Q6_K", "o_proj": "Q4_1", "gate_proj": "Q5_K",
               "up_proj": "Q4_0", "down_proj": "Q8_0"},
              dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)),
    # row ranges of fused blocks: q/k/v of one Q8_0 tensor, gate/up of one Q5_K
    "phi3": ({"qkv_proj": "Q8_0", "o_proj": "Q4_1", "gate_up_proj": "Q5_K", "down_proj": "Q6_K"},
             dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)),
}


def gguf_model(family: str):
    """A tiny model of `family` whose projections are GGUF blocks (GGUF_FORMATS, random
    blocks), and the float64 model of their decoded weights."""
    formats, sizes = GGUF_FORMATS[family]
    model = tiny_model(FUSED_MODELS, family, **sizes)
    truth_model = copy.deepcopy(model).double()
    for (layer, ours), theirs in zip(enumerate(model.model.layers), truth_model.model.layers):
        for owner in ("self_attn", "mlp"):
            for name, module in list(getattr(ours, owner).named_children()):
                if name not in formats:
                    continue
                blocks = random_blocks(formats[name], module.out_features, module.in_features, seed=layer)
                bias = None if module.bias is None else module.bias.detach().clone()
                setattr(getattr(ours, owner), name, GGUFLinear(torch.from_numpy(blocks), formats[name],
                                                                module.in_features, bias))
                with torch.no_grad():
                    getattr(getattr(theirs, owner), name).weight.copy_(gguf_py_decoded(blocks, formats[name]))
    return model, truth_model


@pytest.mark.parametrize("family", list(GGUF_FORMATS))
def test_gguf_block_layers_fuse(family, monkeypatch, fused_calls):
    model, truth_model = gguf_model(family)
    check_fused_against_op_by_op(model, truth_model, prompts(seed=3), monkeypatch, fused_calls,
                                 f"{family} GGUF blocks")


@pytest.mark.parametrize("mode", ["int8", "int16"])
@pytest.mark.parametrize("family", list(GGUF_FORMATS))
def test_gguf_block_layers_fuse_on_integer_activations(family, mode, monkeypatch, fused_calls):
    """--gguf-activations int8 / int16: the fused layer multiplies with the same integer kernel as
    the op-by-op GGUFLinear (`layer.cpp`'s integer branch), so the two paths agree but where a float32
    rounding apart sends an activation to the next integer code (`near_ties`)."""
    if build().int8_variant(isa.selected_variant()) is None:
        pytest.skip("no integer kernel")
    model, truth_model = gguf_model(family)
    assert set_gguf_activations(model, mode) == mode
    check_fused_against_op_by_op(model, truth_model, prompts(seed=3), monkeypatch, fused_calls,
                                 f"{family} GGUF blocks, {mode} activations", near_ties=True)


def test_where_float32_layers_run_f_linear_they_stay_op_by_op(monkeypatch, fused_calls):
    """CHUNK_LLAMA_LINEAR=torch (as on CPUs other than x86-64): float32 projections keep
    F.linear, GGUF blocks (the same kernel either way) still fuse."""
    monkeypatch.setenv("CHUNK_LLAMA_LINEAR", "torch")
    batch = prompts(seed=4)[:3]
    for model, fuses in ((tiny("llama"), False), (gguf_model("llama")[0], True)):
        fused_calls.clear()
        engine = ChunkLlamaEngine(copy.deepcopy(model), max_batch_size=3, chunk_size=16, kv_cache_bytes=1 << 23)
        outputs = engine.generate(batch, GREEDY)
        engine.close()
        assert bool(fused_calls) is fuses
        for prompt, out in zip(batch, outputs):
            with torch.no_grad():
                want = model.generate(torch.tensor([prompt]), generation_config=GREEDY, return_dict_in_generate=True)
            assert out.token_ids == want.sequences[0, len(prompt):].tolist()


def test_forwards_with_autograd_on_stay_op_by_op(fused_calls):
    """The C function records no graph: a decode forward with grad enabled runs op by op."""
    patched = patch_model(tiny("llama"))
    prompt = torch.tensor([prompts(seed=2)[0]])
    for grad in (True, False):
        fused_calls.clear()
        cache = ChunkCache(patched, chunk_size=16, kv_cache_bytes=1 << 22)
        with torch.set_grad_enabled(grad):
            patched(input_ids=prompt, past_key_values=cache)  # the prompt (the name 5.23 and 5.24 take)
            patched(input_ids=torch.tensor([[7]]), past_key_values=cache)  # one decode step
        assert bool(fused_calls) is not grad


def test_rows_out_of_the_plans_order(monkeypatch, fused_calls):
    """Stock generate on a patched model: its rows interleave two system prompts, the plan
    groups them, so the fused call reorders q and its attention."""
    stock = tiny("llama")
    batch = [p[:18] for p in prompts(seed=11)[:4]]  # equal lengths: no padding
    patched = patch_model(copy.deepcopy(stock))
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        got = patched.generate(torch.tensor(batch), generation_config=config)
        want = stock.generate(torch.tensor(batch), generation_config=config)
    assert any(reordered for _, reordered, _ in fused_calls), fused_calls
    assert torch.equal(got, want)


def test_a_layer_it_does_not_describe_runs_op_by_op(monkeypatch, fused_calls, caplog):
    """A hook inside layer 0, then a replaced weight: each is seen at the next call (the hook
    runs, the new weight is used), logged once; a PeftModel's LoRA layers fuse in the engine's
    steps (the adapter's deltas added in the call) and give stock PEFT's tokens."""
    stock = tiny("llama")
    batch = prompts(seed=5)[:3]
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=3, chunk_size=16, kv_cache_bytes=1 << 23,
                              retain_prefixes=False)
    model = engine.model
    seen = []
    handle = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *args: seen.append(1))
    with caplog.at_level(logging.WARNING, logger=fused_layers.__name__):
        engine.generate(batch, GREEDY)
    assert len(seen) >= GREEDY.max_new_tokens  # the prefill, then every decode step ran the hook
    pools = [k.data_ptr() for k in engine.cache.pool.k]
    assert fused_calls and {pool for _, _, pool in fused_calls} == {pools[1]}  # layer 1 still fused
    assert caplog.text.count("a hook runs inside it") == 1
    handle.remove()

    fused_calls.clear()
    for m in (stock, model):  # a new parameter object: the layer is described again, with it
        with torch.no_grad():
            m.model.layers[1].mlp.down_proj.weight = torch.nn.Parameter(m.model.layers[1].mlp.down_proj.weight * 1.5)
    outputs = engine.generate(batch, GREEDY)
    assert {pool for _, _, pool in fused_calls} == set(pools)  # the hook's removal seen too
    for prompt, out in zip(batch, outputs):
        with torch.no_grad():
            want = stock.generate(torch.tensor([prompt]), generation_config=GREEDY, return_dict_in_generate=True)
        assert out.token_ids == want.sequences[0, len(prompt):].tolist()
    engine.close()

    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False)
    stock_lora = peft.get_peft_model(copy.deepcopy(stock), lora)
    engine_lora = ChunkLlamaEngine(copy.deepcopy(stock_lora), max_batch_size=3, chunk_size=16,
                                   kv_cache_bytes=1 << 23)
    fused_calls.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=fused_layers.__name__):
        outputs = engine_lora.generate(batch, GREEDY)
    # (the engine adds the PeftModel's active adapter per row, in the fused calls: PEFT's LoRA
    # layer in place of q_proj is read as its base layer, its factors as the adapter's)
    assert fused_calls and "runs op by op" not in caplog.text, caplog.text
    for prompt, out in zip(batch, outputs):
        with torch.no_grad():
            want = stock_lora.generate(input_ids=torch.tensor([prompt]), generation_config=GREEDY,
                                       return_dict_in_generate=True)
        assert out.token_ids == want.sequences[0, len(prompt):].tolist()
    engine_lora.close()


def test_a_partial_rotary_embedding_runs_op_by_op(monkeypatch, fused_calls, caplog):
    """Phi-4-mini's partial_rotary_factor (part of each head turned): the C function turns
    whole heads, so such layers stay op by op, said once, and the tokens are stock's."""
    stock = tiny_model(FUSED_MODELS, "phi3", partial_rotary_factor=0.5)
    batch = prompts(seed=7)[:2]
    with caplog.at_level(logging.WARNING, logger=fused_layers.__name__):
        outputs = engine_outputs(copy.deepcopy(stock), batch, monkeypatch, fused=True)
    assert not fused_calls and caplog.text.count("turns part of each head only") == 1, caplog.text
    for prompt, out in zip(batch, outputs):
        with torch.no_grad():
            want = stock.generate(torch.tensor([prompt]), generation_config=GREEDY, return_dict_in_generate=True,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert out.token_ids == want.sequences[0, len(prompt):].tolist()


def test_weights_moved_in_place_are_read_where_they_are_now(fused_calls):
    """`model.half().float()` keeps every Parameter object but gives each new memory
    (`param.data = ...`): the layers are described again, not read at the old addresses."""
    stock = tiny("llama")
    batch = prompts(seed=9)[:3]
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=3, chunk_size=16, kv_cache_bytes=1 << 23,
                              retain_prefixes=False)
    engine.generate(batch, GREEDY)  # described at the first addresses
    parameters = list(engine.model.parameters())
    for model in (stock, engine.model):
        model.half().float()
    assert [p is q for p, q in zip(parameters, engine.model.parameters())] == [True] * len(parameters)
    fused_calls.clear()
    outputs = engine.generate(batch, GREEDY)
    assert fused_calls
    for prompt, out in zip(batch, outputs):
        with torch.no_grad():
            want = stock.generate(torch.tensor([prompt]), generation_config=GREEDY, return_dict_in_generate=True)
        assert out.token_ids == want.sequences[0, len(prompt):].tolist()
    engine.close()


def test_bad_input_to_the_c_function_is_a_value_error():
    """Weights whose sizes do not fit the layer, a layer of other heads than the plan's, and a
    write outside the pool are named before any pointer is made from them (the write when the
    step's plan is made, the layer at its call)."""
    hidden, heads, head_dim, inter, chunk = 64, 2, 32, 96, 16
    weights = {name: torch.zeros(out, inp) for name, out, inp in (
        ("q", heads * head_dim, hidden), ("k", head_dim, hidden), ("v", head_dim, hidden),
        ("o", hidden, heads * head_dim), ("gate", inter, hidden), ("up", inter, hidden), ("down", hidden, inter))}
    norm = torch.ones(hidden)

    def layer(num_heads=heads, **changed):
        described = {name: Weight(w.data_ptr(), None, 0, w.shape[0], w.shape[1], w.numel() * 4)
                     for name, w in weights.items()}
        described.update(changed)
        return DecoderLayer(hidden_size=hidden, num_heads=num_heads, num_kv_heads=1, head_dim=head_dim,
                            intermediate_size=inter, input_norm=norm.data_ptr(), mlp_norm=norm.data_ptr(),
                            norm_eps=1e-6, **described)

    pool, tree = make_tree([[1] * 20], chunk_size=chunk, num_kv_heads=1, head_dim=head_dim)
    plan = build_decode_plan(tree, tree.seq_ids)
    decode = CpuDecode(StaticBuffers("cpu"), heads, 1, head_dim, chunk)
    slot = (torch.tensor([0]), torch.tensor([1]), torch.tensor([4]))  # token 0 to slot 4 of chunk 1
    planned = decode.plan(plan, pool.capacity, slot)
    x, cos = torch.zeros(1, hidden), torch.ones(1, head_dim)

    def call(described):
        with pytest.raises(ValueError) as error:
            planned.decoder_layer(described, x, cos, cos, pool.k[0], pool.v[0], 1.0, 0)
        return str(error.value)

    wrong = weights["up"][:-1]
    assert "up_proj is [95, 64], the layer needs [96, 64]" in call(
        layer(up=Weight(wrong.data_ptr(), None, 0, inter - 1, hidden, wrong.numel() * 4)))
    assert "q_proj holds 100 bytes" in call(layer(q=Weight(weights["q"].data_ptr(), None, 3, heads * head_dim,
                                                             hidden, 100)))
    assert "are not the plan's 2, 1 of 32" in call(layer(num_heads=4))
    with pytest.raises(ValueError, match="is not inside 1 rows and the pool of 3 chunks"):
        decode.plan(plan, pool.capacity, (slot[0], torch.tensor([pool.capacity]), slot[2]))  # the guard chunk
    with pytest.raises(ValueError, match="is not inside 1 rows"):
        decode.plan(plan, pool.capacity, (torch.tensor([1]), slot[1], slot[2]))  # a token of no row

    # the stack: each layer's pool and window checked before any layer runs
    good, bad = (decode._kvs.get(pool.k[0], pool.v[0], 1.0, window) for window in (0, -3))
    with pytest.raises(ValueError, match="one pool per layer, got 2 layers and 1 pools"):
        DecoderStack([layer(), layer()], [good])
    planned = decode.plan(plan, pool.capacity, slot)
    k_before = pool.k.clone()
    with pytest.raises(ValueError, match="window must be 0 .none. or a positive int32, got -3"):
        planned.decoder_stack(DecoderStack([layer(), layer()], [good, bad]), x, [cos, cos], [cos, cos])
    assert torch.equal(pool.k.nan_to_num(), k_before.nan_to_num())  # (nothing written: no layer ran)
    # each layer's tables checked (most families give every layer the same two, checked once)
    for tables in ([cos, torch.ones(2, head_dim)], [cos, cos.double()]):
        with pytest.raises((ValueError, TypeError), match="cos and sin"):
            planned.decoder_stack(DecoderStack([layer(), layer()], [good, good]), x, [cos, cos], tables)
    assert torch.equal(pool.k.nan_to_num(), k_before.nan_to_num())


# fused_stack.STACK_MODELS' families (Gemma 3: a rotary embedding and a window per layer type;
# Qwen2 windowed: a window per layer)
STACKED = ["llama", "qwen2", "qwen2-windowed", "mistral-windowed", "qwen3", "phi3", "gemma3_text"]


@pytest.mark.parametrize("family", [*STACKED, "llama-gguf"])
def test_a_stack_in_one_call_computes_what_its_layers_do(family, monkeypatch, fused_calls):
    """The plain-loop stacks run all their layers in one call per decode step, bit for bit
    what one call per layer gives, each layer with its own rotary embedding and window."""
    model = gguf_model("llama")[0] if family == "llama-gguf" else tiny(family)
    batch = prompts(seed=9)[:3]
    outputs = {}
    for stacked in ("0", "1"):
        monkeypatch.setenv(fused_stack.ENV, stacked)
        CpuPlanned.stack_calls.clear()
        outputs[stacked] = engine_outputs(copy.deepcopy(model), batch, monkeypatch, fused=True)
        expected = stacked == "1"
        calls = CpuPlanned.stack_calls
        assert bool(calls) is expected and all(n == model.config.num_hidden_layers for n in calls), calls
    for ours, theirs in zip(outputs["1"], outputs["0"]):
        assert ours.token_ids == theirs.token_ids and torch.equal(ours.logits, theirs.logits), family


def test_a_hooked_layer_keeps_a_call_per_layer(monkeypatch, fused_calls):
    """A hook on a decoder layer would see the stack's output: such a model runs one call per
    layer, and the hook sees every decode step."""
    model = tiny("llama")
    seen = []
    model.model.layers[1].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    engine = ChunkLlamaEngine(model, max_batch_size=3, chunk_size=16, kv_cache_bytes=1 << 23)
    outputs = engine.generate(prompts(seed=2)[:2], GREEDY)
    engine.close()
    assert not CpuPlanned.stack_calls and fused_calls
    assert len(seen) >= GREEDY.max_new_tokens
    monkeypatch.setenv(fused_stack.ENV, "0")
    engine = ChunkLlamaEngine(tiny("llama"), max_batch_size=3, chunk_size=16, kv_cache_bytes=1 << 23)
    assert [o.token_ids for o in engine.generate(prompts(seed=2)[:2], GREEDY)] == [o.token_ids for o in outputs]
    engine.close()


def test_a_layer_given_another_input_than_the_stacks_output_fails_the_step():
    """Once the stack ran, a later layer passes its output on only if that is what it is
    given: another loop than the one assumed fails loudly instead of computing on."""
    model = patch_model(tiny("llama"))
    layer = model.model.layers[1]
    stack, index = layer._chunk_llama_stack
    assert index == 1 and stack.layers() == list(model.model.layers)

    class Step:  # what _forward reads of a decode step whose stack ran
        decode = object()

    output = torch.zeros(1, 1, 96)
    per_step.of(Step).stack_output = (stack, output)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(fused_layers, "current_step", lambda: Step)
    try:
        assert layer(output) is output
        with pytest.raises(RuntimeError, match="another input than the fused stack"):
            layer(torch.zeros(1, 1, 96))
    finally:
        monkeypatch.undo()


def test_a_stacked_decode_step_ends_by_prefetching_what_the_next_ones_checks_read(monkeypatch, fused_calls):
    """After the LM head (the step's last weights), a step whose stack ran in one call asks the
    caches for every object the next step's checks read (`Stack.warm`): each layer's module and
    tensor dicts, its tensors with their TensorImpls and storages; once per such step."""
    from chunk_llama.ops.cpu.binding import CpuLibrary
    made, calls = [], []
    make = CpuLibrary.prefetch_call

    def spy(self, addresses):
        made.append(list(addresses))
        prefetch = make(self, addresses)
        return lambda: (calls.append(len(made)), prefetch())

    monkeypatch.setattr(CpuLibrary, "prefetch_call", spy)
    model = gguf_model("llama")[0]
    engine = ChunkLlamaEngine(model, max_batch_size=3, chunk_size=16, kv_cache_bytes=1 << 23)
    engine.generate(prompts(seed=4)[:2], GREEDY)
    engine.close()
    assert len(calls) == len(CpuPlanned.stack_calls) > 0
    assert len(made) == 1, "the addresses are gathered once while the layers' descriptions hold"
    addresses = set(made[0])
    for i, layer in enumerate(model.model.layers):
        q = layer.self_attn.q_proj
        tensor = next(t for t in (*q._parameters.values(), *q._buffers.values()) if t is not None)
        wanted = {id(layer._modules), id(q._buffers), id(tensor), tensor._cdata, tensor.untyped_storage()._cdata}
        assert wanted <= addresses, f"layer {i}: {wanted - addresses} not prefetched"


def test_prefetching_an_address_that_holds_nothing_is_harmless():
    """Prefetches never fault: a stale address (its object gone), 0 or an unmapped one reads
    nothing; the addresses must be ints."""
    library = build()
    gone = id(object())
    library.prefetch_call([gone, 0, 8, 2**47 - 4096, 2**64 - 64, id(library)])()
    library.prefetch_call([])()
    with pytest.raises(TypeError, match="ints"):
        library.prefetch_call([1.5])
