"""GGUF blocks on integer activations (`--gguf-activations int8|int16`: `csrc/cpu/quant_act.h`,
`ops/cpu/activations.py`): in both modes the kernel computes its NumPy oracle
(`ops/cpu/int8_reference.py`) to float32 rounding in every variant, on odd shapes and random blocks; it keeps the error bound
of the activations' rounding against the exact product; each row's result does not depend on
the rows beside it; the variants with FMA agree bit for bit; the option resolves as documented."""

import logging

import numpy as np
import pytest
import torch
from test_cpu_kernel import _variant_params
from test_quant_linear import random_blocks

from chunk_llama.gguf.modules import GGUFLinear, set_gguf_activations
from chunk_llama.logs import forget_logged
from chunk_llama.ops.cpu import activations, int8_reference, isa
from chunk_llama.ops.cpu import quant_linear as ops
from chunk_llama.ops.cpu.attention import build

FORMATS = tuple(sorted(activations.INT8_TYPES))
MODES = activations.INTEGER_MODES


def int8_call(ggml_type: str, in_features: int, variant: str, mode: str = "int8"):
    return build().quant_matmul_call(ops.GGML_TYPES[ggml_type], in_features, variant, mode)


def int8_variants():
    """The variants whose integer kernel this CPU runs (AVX-512's needs VNNI)."""
    return [p for p in _variant_params() if not p.marks and build().int8_variant(p.values[0]) == p.values[0]] or \
        [pytest.param(None, marks=pytest.mark.skip(reason="no int8 kernel runs here"))]


def layer_case(ggml_type: str, rows: int, out_features: int, blocks_per_row: int, seed: int):
    width = blocks_per_row * (256 if ggml_type.endswith("_K") else 32)
    blocks = random_blocks(ggml_type, out_features, width, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator) * torch.rand(rows, width, generator=generator) ** 4
    bias = torch.randn(out_features, generator=generator) if rows % 2 else None
    return x, blocks, bias


def float32_slack(x: torch.Tensor, blocks: np.ndarray, ggml_type: str) -> torch.Tensor:
    """The float32 rounding of the kernel's per-group chain: a few units of 2^-24 per group
    times the magnitudes it adds (|x| |w| summed)."""
    weight = int8_reference._dequantized(blocks, ggml_type).double()
    groups = x.shape[1] // 32
    return 4 * (groups + 2) * 2.0 ** -24 * (x.double().abs() @ weight.abs().T) + 1e-30


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", int8_variants())
@pytest.mark.parametrize("ggml_type", FORMATS)
@pytest.mark.parametrize("rows,out_features", [(1, 37), (5, 7), (11, 37), (17, 1), (133, 37)])
def test_int8_kernel_computes_its_oracle(variant, ggml_type, rows, out_features, mode):
    """Tiles narrower than the register tile in rows and columns (an item of 32 columns, 37 of
    them: a last item of 5); the oracle takes the codes the kernel takes, so only float32
    rounding differs."""
    x, blocks, bias = layer_case(ggml_type, rows, out_features, 3 if ggml_type.endswith("_K") else 5, rows)
    out = int8_call(ggml_type, x.shape[1], variant, mode)(x, torch.from_numpy(blocks), bias)
    expected, _ = int8_reference.int8_linear(x, blocks, ggml_type, bias, mode)
    error = (out.double() - expected).abs()
    slack = float32_slack(x, blocks, ggml_type) + (0 if bias is None else 2.0 ** -23 * bias.double().abs())
    assert (error <= slack).all(), f"{ggml_type} ({variant}, {mode}): {error.max().item():.3g} from the oracle"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", int8_variants())
@pytest.mark.parametrize("ggml_type", FORMATS)
def test_the_activations_rounding_is_the_only_error(variant, ggml_type, mode):
    """Against the exact product with x (float64 on the dequantized weights): within half a
    step of each group's codes times its weights' distance from the group's offset."""
    x, blocks, bias = layer_case(ggml_type, 9, 37, 2 if ggml_type.endswith("_K") else 9, 11)
    out = int8_call(ggml_type, x.shape[1], variant, mode)(x, torch.from_numpy(blocks), bias)
    weight = int8_reference._dequantized(blocks, ggml_type).double()
    exact = x.double() @ weight.T + (0 if bias is None else bias.double())
    _, bound = int8_reference.int8_linear(x, blocks, ggml_type, bias, mode)
    error = (out.double() - exact).abs()
    assert (error <= bound + float32_slack(x, blocks, ggml_type)).all(), \
        f"{ggml_type} ({variant}, {mode}): error {error.max().item():.3g}, bound {bound.max().item():.3g}"
    assert error.max() > 0  # (x is not all multiples of its groups' steps: the test can fail)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", int8_variants())
@pytest.mark.parametrize("ggml_type", FORMATS)
def test_a_row_is_the_same_whatever_rows_come_with_it(variant, ggml_type, mode):
    """Batch invariance within the mode: every row count runs the same tile on the same decoded
    item, a last tile of fewer rows alike, and a step's rows in registers (up to 16 on AVX-512,
    4 at a time) the same operations."""
    x, blocks, bias = layer_case(ggml_type, 130, 37, 2 if ggml_type.endswith("_K") else 9, 3)
    call, weight = int8_call(ggml_type, x.shape[1], variant, mode), torch.from_numpy(blocks)
    together = call(x, weight, bias)
    for start, stop in [(0, 1), (1, 2), (4, 5), (2, 4), (5, 8), (0, 8), (9, 21), (10, 26), (40, 57), (127, 130),
                        (3, 100)]:
        alone = call(x[start:stop].contiguous(), weight, bias)
        assert torch.equal(alone, together[start:stop]), f"{ggml_type} ({variant}, {mode}): rows {start}..{stop}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ggml_type", FORMATS)
def test_the_fma_variants_agree_bit_for_bit(ggml_type, mode):
    """The codes, the integer sums and the order of the float32 operations are the same on every
    instruction set: AVX2's kernel gives AVX-512's numbers (the portable lanes do not fuse their
    multiply-adds, so they may differ there)."""
    runs = [v for v in ("avx512", "avx2") if v in isa.host_variants() and build().int8_variant(v) == v]
    if len(runs) < 2:
        pytest.skip(f"this CPU runs the int8 kernel of {runs or 'no FMA variant'} only")
    x, blocks, bias = layer_case(ggml_type, 19, 37, 2 if ggml_type.endswith("_K") else 9, 5)
    outs = [int8_call(ggml_type, x.shape[1], v, mode)(x, torch.from_numpy(blocks), bias) for v in runs]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("mode", MODES)
def test_formats_without_integer_codes_are_refused(mode):
    call = build().quant_matmul_call(ops.GGML_TYPES["BF16"], 64, isa.selected_variant(), mode)
    with pytest.raises(ValueError, match="no integer codes"):
        call(torch.randn(2, 64), torch.zeros(3, 128, dtype=torch.uint8), None)


def test_the_option_resolves_from_the_argument_then_the_environment(monkeypatch):
    monkeypatch.setenv(activations.ENV, "int16")
    assert activations.resolve() == "int16" and activations.resolve("float32") == "float32"
    monkeypatch.setenv(activations.ENV, "bfloat15")
    with pytest.raises(ValueError, match=activations.ENV):
        activations.resolve()
    with pytest.raises(ValueError, match="gguf_activations"):
        activations.resolve("int4")
    monkeypatch.delenv(activations.ENV)
    runs = activations.int8_variant()
    assert activations.resolve() == (activations.AUTO.get(runs, "float32") if runs == isa.selected_variant()
                                     else "float32")


@pytest.mark.parametrize("mode", MODES)
def test_a_module_switches_its_activations_and_keeps_16_bit_blocks_in_float32(mode):
    x, blocks, bias = layer_case("Q4_K", 3, 37, 2, 9)
    layer = GGUFLinear(torch.from_numpy(blocks), "Q4_K", x.shape[1], bias)
    half = GGUFLinear(torch.zeros(4, 128, dtype=torch.uint8), "BF16", 64)
    model = torch.nn.Sequential(layer, half)
    float32_out = layer(x[None])[0]
    assert set_gguf_activations(model, mode) == mode
    assert layer.activations == mode and half.activations == "float32"
    expected, _ = int8_reference.int8_linear(x, blocks, "Q4_K", bias, mode)
    slack = float32_slack(x, blocks, "Q4_K") + 2.0 ** -23 * bias.double().abs()
    assert ((layer(x[None])[0].double() - expected).abs() <= slack).all()
    set_gguf_activations(model, "float32")
    assert torch.equal(layer(x[None])[0], float32_out)


def _auto_on(variant, monkeypatch, caplog) -> tuple[str, str]:
    """What `auto` resolves to with `variant` selected, and what it logs."""
    monkeypatch.setenv(isa.ENV, variant)
    monkeypatch.delenv(activations.ENV)
    forget_logged()
    with caplog.at_level(logging.INFO, logger="chunk_llama.ops.cpu.activations"):
        return activations.resolve("auto"), caplog.text


def test_auto_logs_why_it_keeps_float32_on_a_variant_not_measured(monkeypatch, caplog):
    mode, logged = _auto_on("generic", monkeypatch, caplog)
    assert mode == "float32" and "auto keeps float32" in logged


@pytest.mark.parametrize("variant", ["avx2", "avx512"])
def test_auto_picks_int16_on_the_x86_kernels_and_says_so(variant, monkeypatch, caplog):
    """Where it was measured faster than float32 in prefill and batched decode, as fast at one
    row, and within the error bound (ops/cpu/activations.py)."""
    if variant not in isa.host_variants() or build().int8_variant(variant) != variant:
        pytest.skip(f"this CPU does not run the {variant} variant's integer kernel")
    mode, logged = _auto_on(variant, monkeypatch, caplog)
    assert mode == "int16" and f"auto picks int16 on the {variant} kernel" in logged
