"""A bfloat16 model on the CPU (`--dtype bfloat16`): its decoder layers fuse (`hf/fused/layers.py`:
the weights read as they are, as BF16 blocks, the norms' weights and biases widened once, the
hidden states widened at the call and rounded back after it) and its other linear layers run
the quantized kernel on the weight as it is (`ops/cpu/linear.py`); judged, as every half-precision
result, by the float64 truth of the same weights next to stock transformers' bfloat16 error."""

import copy
import logging

import pytest
import torch
from families import FUSED_MODELS, tiny_model
from test_fused_layers import GREEDY, fresh_logs, fused_calls, prompts, truth_logits  # noqa: F401
from tolerances import assert_no_worse_than_stock, ulp

from chunk_llama import ChunkLlamaEngine
from chunk_llama.hf.fused import layers as fused_layers
from chunk_llama.ops.cpu import isa, linear
from chunk_llama.ops.cpu.attention import build
from chunk_llama.ops.cpu.quant_linear import GGML_TYPES

pytestmark = pytest.mark.skipif(build() is None or isa.host_arch() != "x86_64",
                                reason="the fused layer and the 16-bit linear path run with the CPU kernels (x86-64)")

# widths in whole groups of 32 (the kernel reads 16-bit weights in groups of 32; other widths
# run op by op, as test_a_width_off_the_groups_runs_op_by_op checks)
WIDTHS = {"llama": dict(intermediate_size=128), "qwen2": dict(intermediate_size=64),
          "gemma3_text": dict(intermediate_size=128), "phi3": dict(intermediate_size=128)}


def tiny_bf16(family: str, **overrides) -> torch.nn.Module:
    model = tiny_model(FUSED_MODELS, family, **{**WIDTHS.get(family, {}), **overrides})
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or "bias" in name:  # norms and biases of their own, read widened
                parameter.add_(torch.randn_like(parameter) * 0.2)
    return model.to(torch.bfloat16)


def generate(model, batch, monkeypatch, fused: bool = True):
    monkeypatch.setenv(fused_layers.ENV, "1" if fused else "0")
    engine = ChunkLlamaEngine(model, max_batch_size=3, chunk_size=16, kv_cache_bytes=1 << 23)
    try:
        return engine.generate(batch, GREEDY), engine.stats
    finally:
        engine.close()


@pytest.mark.parametrize("family", list(WIDTHS))
def test_a_bfloat16_models_decode_layers_fuse_no_further_from_the_truth_than_stock(family, monkeypatch,
                                                                                 fused_calls):
    model = tiny_bf16(family)
    truth_model = copy.deepcopy(model).double()
    batch = prompts(seed=len(family) + 7)
    outputs, stats = generate(copy.deepcopy(model), batch, monkeypatch)
    assert stats["linear_backend"].startswith("half_blocks:"), stats["linear_backend"]
    num_layers = model.config.num_hidden_layers
    assert len(fused_calls) >= num_layers * (GREEDY.max_new_tokens - 1) * len(batch) / 3, fused_calls
    ours, stock, truth = [], [], []
    for prompt, out in zip(batch, outputs):
        sequence = torch.tensor([prompt + out.token_ids[:-1]])
        with torch.no_grad():
            stock.append(model(input_ids=sequence).logits[0, len(prompt):].double())  # the decode steps' positions
        truth.append(truth_logits(truth_model, prompt, out.token_ids)[1:])
        ours.append(out.logits[1:].double())
    assert_no_worse_than_stock(torch.cat(ours), torch.cat(stock), torch.cat(truth), torch.bfloat16, what=family)


def test_a_width_off_the_groups_runs_op_by_op(monkeypatch, fused_calls, caplog):
    model = tiny_bf16("llama", intermediate_size=123)
    with caplog.at_level(logging.WARNING, logger="chunk_llama.hf.fused.layers"):
        generate(model, prompts(seed=3)[:2], monkeypatch)
    assert not fused_calls
    assert "down_proj: its bfloat16 weight is 123 wide, not whole groups of 32" in caplog.text


def test_a_norm_weight_changed_in_place_is_read_again(monkeypatch, fused_calls):
    """The C call reads float32 copies of a bfloat16 model's norm weights: a change in place
    (torch counts it in the tensor's version) makes the layer be described again."""
    def change(model):
        with torch.no_grad():
            for layer in model.model.layers:
                layer.input_layernorm.weight.mul_(-1.5)
                layer.mlp.down_proj.bias.mul_(3.0)
        return model

    model = tiny_bf16("llama")
    batch = prompts(seed=5)[:2]
    before, _ = generate(model, batch, monkeypatch)
    changed, _ = generate(change(model), batch, monkeypatch)
    fresh, _ = generate(change(tiny_bf16("llama")), batch, monkeypatch)  # described from the new values
    assert fused_calls
    for a, b, c in zip(before, changed, fresh):
        assert torch.equal(b.logits, c.logits) and not torch.equal(a.logits, b.logits)


@pytest.mark.parametrize("native", [True, False])
def test_a_long_bfloat16_prefill_fuses_only_where_onednn_is_not_native(native, monkeypatch, fused_calls, caplog):
    """Beyond SMALL_ROWS tokens a bfloat16 prefill runs op by op where oneDNN multiplies bfloat16
    natively (its linear layers then go to oneDNN), and fused elsewhere."""
    monkeypatch.setattr(isa, "native_half_gemm", lambda dtype: native)
    model = tiny_bf16("llama")
    prompt = [(7 * i) % 90 + 6 for i in range(linear.SMALL_ROWS + 20)]
    with caplog.at_level(logging.INFO, logger="chunk_llama.hf.fused.layers"):
        outputs, _ = generate(copy.deepcopy(model), [prompt], monkeypatch)
    prefill_calls = [rows for rows, _, _ in fused_calls if rows == len(prompt)]
    assert len(prefill_calls) == (0 if native else model.config.num_hidden_layers), fused_calls
    assert ("runs op by op: oneDNN multiplies it natively here" in caplog.text) == native
    assert len(outputs[0].token_ids) == GREEDY.max_new_tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 17, linear.SMALL_ROWS + 9])
@pytest.mark.parametrize("native", [True, False])
def test_the_16_bit_linear_path_rounds_the_float32_sum_once(dtype, rows, native, monkeypatch):
    monkeypatch.setattr(isa, "native_half_gemm", lambda dtype: native)
    assert linear.HALF_BLOCKS[dtype] == GGML_TYPES[{torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]]
    generator = torch.Generator().manual_seed(rows)
    x, weight, bias = (torch.randn(*shape, generator=generator).to(dtype) for shape in ((rows, 96), (37, 96), (37,)))
    step_linear = linear.resolve(dtype, "cpu")
    out = step_linear(x.view(1, rows, 96), weight, bias)
    assert out.dtype is dtype and out.shape == (1, rows, 37)
    if native and rows > linear.SMALL_ROWS:  # oneDNN's, as F.linear computes it (in its own rounding)
        assert torch.equal(out, torch.nn.functional.linear(x.view(1, rows, 96), weight, bias))
    else:  # the kernel's float32 sum of the exact products (error at most n eps sum |x w|), rounded once
        truth = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
        magnitude = torch.nn.functional.linear(x.double().abs(), weight.double().abs(), bias.double().abs())
        bound = 97 * 2.0 ** -24 * magnitude + ulp(dtype, torch.maximum(out[0].double().abs(), truth.abs()))
        error = (out[0].double() - truth).abs()
        assert (error <= bound).all(), f"{dtype}, {rows} rows: {(error - bound).max().item():.3g} over the bound"
    assert linear.backend(dtype) == f"half_blocks:{isa.selected_variant()}" + (" + onednn" if native else "")
    odd = torch.randn(5, 37, generator=generator).to(dtype)  # 37 wide: not whole groups, F.linear's
    assert torch.equal(step_linear(x[:, :37], odd, None), torch.nn.functional.linear(x[:, :37], odd))
    wide = weight.float()  # a float32 layer in a 16-bit step (a cache made for another dtype): F.linear's
    assert torch.equal(step_linear(x.float(), wide, None), torch.nn.functional.linear(x.float(), wide))
