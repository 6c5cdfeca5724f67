"""`--gguf-activations` on whole layers and models: `float32` is the path the blocks ran before the
option existed, bit for bit (the float32 kernel, `quant_linear.h`, through quant_matmul's float32
branch, and the fused layer's float32 branch); `auto` picks an integer mode only where its error on the default model is
within the issue's bound against the float64 truth of the same dequantized weights (top-1 agreement with
float32 at least 99.5%, worst logit error no larger than stock bfloat16's), measured over the
shipped prompts as `scripts/gguf_activation_errors.py` measures it; the option reaches every
entry point."""

import os
import sys

import pytest
import torch
from test_quant_act import FORMATS, layer_case

from chunk_llama.gguf.modules import GGUFLinear, set_gguf_activations
from chunk_llama.ops.cpu import activations, isa
from chunk_llama.ops.cpu import quant_linear as ops
from chunk_llama.ops.cpu.attention import build
from chunk_llama.settings import EngineArgs

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
ALL_FORMATS = tuple(sorted(set(FORMATS) | {"F16", "BF16"}))


@pytest.mark.parametrize("ggml_type", ALL_FORMATS)
@pytest.mark.parametrize("rows", [1, 17, 123])
def test_float32_mode_is_the_previous_path_bit_for_bit(ggml_type, rows):
    """A GGUFLinear in float32 mode gives exactly what quant_matmul asked for float32 gives (the
    float32 kernel, which the option left unchanged), before and after a round trip through an
    integer mode."""
    x, blocks, bias = layer_case(ggml_type, rows, 37, 3 if ggml_type.endswith("_K") else 5, rows)
    weight, variant = torch.from_numpy(blocks), isa.selected_variant()
    ggml_id = ops.GGML_TYPES[ggml_type]
    before = build().quant_matmul_call(ggml_id, x.shape[1], variant, "float32")(x, weight, bias)
    layer = GGUFLinear(weight, ggml_type, x.shape[1], bias, activations="float32")
    assert layer.activations == "float32"
    assert torch.equal(layer(x), before), f"{ggml_type}, {rows} rows: the float32 mode changed the numbers"
    set_gguf_activations(torch.nn.Sequential(layer), "int8")
    set_gguf_activations(torch.nn.Sequential(layer), "float32")  # (back and forth: the same op again)
    assert torch.equal(layer(x), before)


@pytest.mark.slow
@pytest.mark.parametrize("mode", activations.INTEGER_MODES)
def test_switching_the_default_model_to_an_integer_mode_and_back_gives_float32s_numbers_again(mode):
    """set_gguf_activations re-describes what it changes (a fused layer's struct included): an
    integer mode changes the logits, float32 after it gives float32's again, bit for bit."""
    from chunk_llama.loading import load_model

    if activations.int8_variant() is None:
        pytest.skip("no CPU kernels")
    model, tokenizer = load_model(None, device="cpu", dtype=torch.float32, gguf_activations="float32")
    ids = tokenizer("The chunk pool holds every layer's keys and values.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        first = model(input_ids=ids).logits
        set_gguf_activations(model, mode)
        integer = model(input_ids=ids).logits
        set_gguf_activations(model, "float32")
        back = model(input_ids=ids).logits
    assert not torch.equal(integer, first), f"{mode} mode left the logits as float32's"
    assert torch.equal(back, first), f"float32 after {mode} is not float32's numbers"


@pytest.mark.slow
def test_auto_picks_an_integer_mode_only_where_its_error_is_within_the_bound(capsys, monkeypatch):
    """Teacher-forced over the shipped prompts (the tool manual and the first questions): the
    bound is a mode's top-1 agreeing with float32's on at least 99.5% of positions and its worst
    logit error against the float64 truth no larger than stock bfloat16's. int16 keeps it on the
    default model (its steps are int8's / 255, and int8 misses it), with float32 K/V and with
    the float16 K/V that `kv_dtype=auto` holds under it; `auto` picks no mode that misses it on
    this CPU."""
    if activations.int8_variant() is None:
        pytest.skip("no CPU kernels")
    sys.path.insert(0, SCRIPTS)
    try:
        import gguf_activation_errors as errors
    finally:
        sys.path.remove(SCRIPTS)
    scores, positions = errors.measure(None, num_questions=4, kv_dtypes=(torch.float16,))
    bf16, within = scores["stock bf16"], {}
    for mode in (*activations.INTEGER_MODES, "int16, float16 K/V"):
        agreement = scores[mode].same_top / scores[mode].count
        within[mode] = agreement >= 0.995 and scores[mode].worst <= bf16.worst
        with capsys.disabled():
            print(f"\n{mode} on the default model, {positions} positions: top-1 = float32's {agreement:.2%}, worst "
                  f"{scores[mode].worst:.4f} (stock bfloat16 {bf16.worst:.4f}): "
                  f"{'within' if within[mode] else 'outside'} the bound")
        assert scores[mode].worst > scores["float32"].worst  # (the mode is measured, not float32 again)
    assert scores["float32"].worst < 1e-3  # (float32 sits on the truth: the measure measures)
    assert within["int16"] and within["int16, float16 K/V"]
    assert scores["int16, float16 K/V"].worst > scores["int16"].worst  # (the K/V were rounded)
    monkeypatch.delenv(activations.ENV, raising=False)
    picked = activations.resolve("auto")
    assert picked == "float32" or within[picked], f"auto picks {picked} here, outside the bound"


def test_kv_dtype_auto_holds_float16_under_integer_activations_and_float32_under_float32():
    """`kv_dtype="auto"` on a GGUF model: float16 K/V (half the bytes a token) where its blocks
    multiply integer activations, whose error with them is within auto's bound (above); the
    model's float32 in `float32` mode, which stays the previous path bit for bit; an explicit
    `kv_dtype` wins either way."""
    from chunk_llama.engine import ChunkLlamaEngine
    from chunk_llama.loading import load_model

    if activations.int8_variant() is None:
        pytest.skip("no CPU kernels")
    model, tokenizer = load_model(None, device="cpu", dtype=torch.float32, gguf_activations="float32")
    pools = {}
    for mode, kv_dtype in (("int16", "auto"), ("float32", "auto"), ("int16", "float32"), ("int8", "auto")):
        engine = ChunkLlamaEngine(model, tokenizer, kv_cache_bytes=1 << 24, gguf_activations=mode, kv_dtype=kv_dtype)
        pools[mode, kv_dtype] = engine.cache.pool.dtype, engine.stats["bytes_per_chunk"]
        engine.close()
    assert pools["int16", "auto"][0] == pools["int8", "auto"][0] == torch.float16
    assert pools["float32", "auto"][0] == pools["int16", "float32"][0] == torch.float32
    assert pools["int16", "auto"][1] * 2 == pools["float32", "auto"][1]


def test_every_entry_point_takes_the_option_and_the_environment_sets_it(monkeypatch):
    """EngineArgs (generate, serve, eval) declares it once; its default leaves the choice to
    CHUNK_LLAMA_GGUF_ACTIVATIONS (then auto), as load_model and the engine do."""
    import argparse
    import inspect

    from chunk_llama.engine import ChunkLlamaEngine
    from chunk_llama.loading import load_model
    from chunk_llama.settings import add_arguments

    assert EngineArgs().gguf_activations is None
    assert inspect.signature(load_model).parameters["gguf_activations"].default is None
    assert inspect.signature(ChunkLlamaEngine).parameters["gguf_activations"].default is None
    monkeypatch.setenv(activations.ENV, "int8")
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineArgs)
    assert parser.parse_args([]).gguf_activations == "int8"
    assert parser.parse_args(["--gguf-activations", "float32"]).gguf_activations == "float32"
    assert parser.parse_args(["--gguf-activations", "int16"]).gguf_activations == "int16"
    choices = next(action.choices for action in parser._actions if action.dest == "gguf_activations")
    assert tuple(choices) == activations.CHOICES
    assert activations.resolve(EngineArgs().gguf_activations) == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--gguf-activations", "int4"])
