"""Weights kept in GGML blocks (`ops/cpu/quant_linear.py`, `csrc/cpu/quant.h`): every format
decodes as gguf-py decodes it (what transformers loads a GGUF file with; bit for bit on
x86), in every variant,
on random bytes (so every bit pattern of the packed weights and scales); the linear layer
on the blocks is the float64 product with the decoded weight to float32 rounding, on odd
shapes; bad input is a ValueError or TypeError naming it."""

import logging

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from test_cpu_kernel import _variant_params
from test_linear import check_against_float64

from chunk_llama.logs import forget_logged
from chunk_llama.ops.cpu import isa
from chunk_llama.ops.cpu import quant_linear as ops
from chunk_llama.ops.cpu.attention import build
from chunk_llama.ops.cpu.linear import SMALL_ROWS

FORMATS = tuple(ops.GGML_TYPES)
# Where each format's fp16 scales sit in a block (the rest are packed weights, scales and
# minimums of any value): set to finite halves, one of them subnormal.
HALF_SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(ggml_type: str, num_rows: int, in_features: int, seed: int = 0) -> np.ndarray:
    """[num_rows, row_bytes] uint8: random blocks of the format."""
    block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    rng = np.random.default_rng(seed)
    if ggml_type in ("BF16", "F16"):  # every sign and mantissa, exponents 2^-15 .. 2^0 (no infinity or NaN)
        mantissa_bits, bias = (7, 127) if ggml_type == "BF16" else (10, 15)
        bits = rng.integers(0, 1 << 16, (num_rows, in_features), dtype=np.uint16)
        sign_mantissa = bits & np.uint16(0x8000 | ((1 << mantissa_bits) - 1))
        exponent = ((bits >> mantissa_bits) % 16 + (bias - 15)).astype(np.uint16)
        bits = sign_mantissa | (exponent << np.uint16(mantissa_bits))
        bits.flat[0] = 0x0001  # a subnormal
        return bits.view(np.uint8).reshape(num_rows, -1)
    blocks = rng.integers(0, 256, (num_rows, in_features // block_elems, block_bytes), dtype=np.uint8)
    for offset in HALF_SCALES[ggml_type]:
        halves = rng.uniform(-0.05, 0.05, blocks.shape[:2]).astype(np.float16)
        halves.flat[0] = np.float16(3e-6)  # subnormal in fp16
        blocks[..., offset:offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(num_rows, -1)


def gguf_py_decoded(blocks: np.ndarray, ggml_type: str) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType[ggml_type]).copy())


def block_width(ggml_type: str) -> int:
    """The row width's step: a block, or for BF16 (blocks of one) the kernel's group of 32."""
    return max(GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]][0], 32)


@pytest.mark.parametrize("variant", _variant_params())
@pytest.mark.parametrize("ggml_type", FORMATS)
def test_every_format_decodes_as_gguf_py(variant, ggml_type):
    in_features = 3 * block_width(ggml_type)
    blocks = random_blocks(ggml_type, 37, in_features, seed=ops.GGML_TYPES[ggml_type])
    truth = gguf_py_decoded(blocks, ggml_type)
    decoded = build().dequantize(torch.from_numpy(blocks), ops.GGML_TYPES[ggml_type], in_features, variant)
    error = (decoded - truth).abs().max().item()
    if isa.host_arch() == "x86_64":  # bit for bit: no multiply-add fused (quant.h's rounded)
        assert torch.equal(decoded, truth), f"{ggml_type} ({variant}) decodes {error:.3g} from gguf-py"
    else:  # aarch64's baseline has FMA, which the generic lanes' compiler may fuse into: 1 ulp
        assert error <= 2 ** -22 * truth.abs().max().item(), f"{ggml_type} ({variant}) decodes {error:.3g} from gguf-py"


@pytest.mark.parametrize("variant", _variant_params())
def test_every_half_decodes_as_numpy(variant):
    """All 65,536 halves as F16 weights (the generic lanes convert them with the scalar
    fp16_to_float that K-quant scales use there): exactly numpy's floats, subnormals and
    infinities included; NaNs stay NaNs (the hardware's conversion quiets a signalling one)."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    blocks = torch.from_numpy(halves.view(np.uint8).reshape(2048, 64).copy())
    decoded = build().dequantize(blocks, ops.GGML_TYPES["F16"], 32, variant).reshape(-1)
    truth = torch.from_numpy(halves.view(np.float16).astype(np.float32))
    nan = truth.isnan()
    wrong = ((decoded.view(torch.int32) != truth.view(torch.int32)) & ~nan | (nan & ~decoded.isnan())).nonzero()[:, 0]
    assert wrong.numel() == 0, f"{wrong.numel()} halves differ, the first {hex(int(halves[wrong[0]]))}"


@pytest.mark.parametrize("variant", _variant_params())
@pytest.mark.parametrize("ggml_type", FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 17, 133])
@pytest.mark.parametrize("out_features", [1, 7, 37])
def test_linear_on_blocks_every_variant(variant, ggml_type, rows, out_features):
    """Tiles narrower than the register tile in rows and columns; the kernel itself at every
    row count (the layer sends many rows to oneDNN instead, tested below)."""
    in_features = (5 if block_width(ggml_type) == 32 else 2) * block_width(ggml_type)
    blocks = random_blocks(ggml_type, out_features, in_features, seed=rows)
    weight = gguf_py_decoded(blocks, ggml_type)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if rows % 2 else None
    call = build().quant_matmul_call(ops.GGML_TYPES[ggml_type], in_features, variant, "float32")
    check_against_float64(call(x, torch.from_numpy(blocks), bias), x, weight, bias)


@pytest.mark.parametrize("variant", _variant_params())
@pytest.mark.parametrize("ggml_type", FORMATS)
def test_a_row_is_the_same_whatever_rows_come_with_it(variant, ggml_type):
    """A decode step's few rows decode the blocks in registers, more rows go through a buffer
    of the decoded groups, a block of rows at a time, rows wider than the kernel's split taken
    in parts: the same arithmetic in the same order, so each row's outputs are bit for bit the
    same alone, in a small batch or in a large one (batch invariance)."""
    for width, num_rows in ((3 * block_width(ggml_type), 11), (-(-800 // block_width(ggml_type)) * block_width(ggml_type), 400)):
        blocks = torch.from_numpy(random_blocks(ggml_type, 37, width, seed=7))  # 9 tiles of 4, and 1
        x = torch.randn(num_rows, width, generator=torch.Generator().manual_seed(7))
        bias = torch.randn(37, generator=torch.Generator().manual_seed(8))
        call = build().quant_matmul_call(ops.GGML_TYPES[ggml_type], width, variant, "float32")
        together = call(x, blocks, bias)
        for start, stop in [(0, 1), (1, 2), (4, 5), (10, 11), (2, 4), (5, 8), (num_rows - 3, num_rows)]:
            alone = call(x[start:stop].contiguous(), blocks, bias)
            assert torch.equal(alone, together[start:stop]), \
                f"{ggml_type} ({variant}, {width} wide): rows {start}..{stop} alone differ from the {num_rows}-row " \
                f"call by {(alone - together[start:stop]).abs().max().item():.3g}"


@pytest.mark.parametrize("rows", [1, SMALL_ROWS, SMALL_ROWS + 45])
def test_the_layer_on_few_and_many_rows(rows):
    """Every row count through the kernel (CHUNK_LLAMA_LINEAR=onednn: beyond SMALL_ROWS through
    the decoded weight and oneDNN, tested in test_linear's choice); a 3-d input keeps its
    leading dimensions."""
    blocks = random_blocks("Q4_K", 70, 512, seed=rows)
    weight = gguf_py_decoded(blocks, "Q4_K")
    x = torch.randn(1, rows, 512, generator=torch.Generator().manual_seed(1))
    out = ops.QuantLinear(ops.GGML_TYPES["Q4_K"], 512)(x, torch.from_numpy(blocks), None)
    assert out.shape == (1, rows, 70)
    check_against_float64(out[0], x[0], weight, None)


def test_an_input_of_another_dtype_multiplies_the_decoded_weight(caplog):
    blocks = random_blocks("Q8_0", 9, 64)
    x = torch.randn(3, 64).bfloat16()
    forget_logged()
    with caplog.at_level(logging.WARNING, logger="chunk_llama.ops.cpu.quant_linear"):
        out = ops.QuantLinear(ops.GGML_TYPES["Q8_0"], 64)(x, torch.from_numpy(blocks), None)
    expected = torch.nn.functional.linear(x, gguf_py_decoded(blocks, "Q8_0").bfloat16())
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert "bfloat16 input" in caplog.text


def test_kernels_forced_off_after_loading_decode_with_gguf_py(monkeypatch, caplog):
    """CHUNK_LLAMA_FORCE_REFERENCE set once the blocks are kept (the kernels' library is then
    None): the layers and the embedding decode with gguf-py and multiply with F.linear, on
    few rows and many, said once."""
    from chunk_llama.gguf.modules import GGUFEmbedding, GGUFLinear

    blocks = torch.from_numpy(random_blocks("Q4_1", 70, 128))
    weight = gguf_py_decoded(blocks.numpy(), "Q4_1")
    layer, embedding = GGUFLinear(blocks, "Q4_1", 128), GGUFEmbedding(blocks, "Q4_1", 128)
    assert repr(embedding) == "GGUFEmbedding(70, 128, ggml_type=Q4_1)"
    monkeypatch.setenv("CHUNK_LLAMA_FORCE_REFERENCE", "1")
    assert build() is None
    forget_logged()
    with caplog.at_level(logging.WARNING, logger="chunk_llama.ops.cpu.quant_linear"):
        for rows in (1, SMALL_ROWS + 5):
            x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
            assert torch.equal(layer(x), torch.nn.functional.linear(x, weight))
        ids = torch.tensor([[3, 69, 0]])
        assert torch.equal(embedding(ids), weight[ids])
    assert caplog.text.count("decoded by gguf-py") == 1


def test_a_bias_of_another_dtype_is_never_read_as_float32():
    blocks = random_blocks("Q4_0", 9, 64)
    x, bias = torch.randn(3, 64), torch.randn(9).bfloat16()
    out = ops.QuantLinear(ops.GGML_TYPES["Q4_0"], 64)(x, torch.from_numpy(blocks), bias)
    expected = torch.nn.functional.linear(x, gguf_py_decoded(blocks, "Q4_0"), bias.float())
    torch.testing.assert_close(out, expected)


def test_bad_blocks_are_refused_with_the_reason():
    library = build()
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="GGML type 10 is not one the kernels decode"):
        library.quant_matmul_call(10, 64, "generic", "float32")(x, torch.zeros(3, 128, dtype=torch.uint8), None)
    with pytest.raises(ValueError, match="not a whole number of blocks of 256"):
        library.quant_row_bytes(ops.GGML_TYPES["Q6_K"], 300)
    with pytest.raises(ValueError, match="holds 72 bytes, not 3 rows of 36"):  # a row of 64 Q4_0 weights is 36 bytes
        library.quant_matmul_call(ops.GGML_TYPES["Q4_0"], 64, "generic", "float32")(
            x, torch.zeros(3, 24, dtype=torch.uint8), None)
    with pytest.raises(ValueError, match="do not fit"):
        library.quant_matmul_call(ops.GGML_TYPES["Q4_0"], 64, "generic", "float32")(
            torch.randn(2, 32), torch.zeros(3, 36, dtype=torch.uint8), None)
    with pytest.raises(TypeError, match="uint8"):
        library.dequantize(torch.zeros(3, 36), ops.GGML_TYPES["Q4_0"], 64, "generic")
