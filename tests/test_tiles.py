"""Tiled GGML blocks (`ops/cpu/tiles.py`, kTiled in `csrc/cpu/quant_params.h`): the layout goes
there and back bit for bit; the integer kernel reads tiles as it reads rows, bit for bit, on
every variant, format, mode and row count; tiles are refused where rows are read; a model tiles
its integer blocks (a tied embedding and LM head sharing one tiled tensor) and goes back to rows
for float32, computing the same numbers either way, fused layers included."""

import os
import subprocess
import sys

import pytest
import torch
from test_quant_act import FORMATS, MODES, int8_call, int8_variants, layer_case
from test_quant_linear import random_blocks
from transformers import GenerationConfig

from chunk_llama.engine import ChunkLlamaEngine
from chunk_llama.gguf.modules import GGUFEmbedding, GGUFLinear, set_gguf_activations
from chunk_llama.loading import load_model
from chunk_llama.ops.cpu import isa, tiles
from chunk_llama.ops.cpu import quant_linear as ops
from chunk_llama.ops.cpu.attention import build

pytestmark = pytest.mark.skipif(build() is None, reason="tiles are read by the CPU kernels")


def _width(ggml_type: str) -> int:
    return 2 * 256 if ggml_type.endswith("_K") else 5 * 32


@pytest.mark.parametrize("ggml_type", FORMATS)
def test_tiles_go_there_and_back_and_give_any_row(ggml_type):
    """The C routine and the torch reference write the same layout; any row reads back."""
    blocks = torch.from_numpy(random_blocks(ggml_type, 48, _width(ggml_type), seed=3))
    tiled = tiles.tile(blocks, ggml_type)
    assert tiled.shape == blocks.shape and not torch.equal(tiled, blocks)
    assert torch.equal(tiled, tiles.reference_tile(blocks, ggml_type))  # (the library's, torch's)
    assert torch.equal(tiles.untile(tiled, ggml_type), blocks)
    assert torch.equal(tiles.reference_untile(tiled, ggml_type), blocks)
    ids = torch.tensor([0, 47, 16, 15, 31, 5, 5])
    assert torch.equal(tiles.take_rows(tiled, ggml_type, ids), blocks[ids])
    assert torch.equal(tiles.reference_take_rows(tiled, ggml_type, ids), blocks[ids])
    assert tiles.take_rows(tiled, ggml_type, ids[:0]).shape == (0, blocks.shape[1])
    for bad in (48, -1):
        with pytest.raises(ValueError, match=f"row {bad} is not one of the 48"):
            tiles.take_rows(tiled, ggml_type, torch.tensor([3, bad]))
    # a slice of whole tiles is the tiled slice
    assert torch.equal(tiles.tile(blocks[16:48], ggml_type), tiled[16:48])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", int8_variants())
@pytest.mark.parametrize("ggml_type", FORMATS)
def test_the_kernel_reads_tiles_as_it_reads_rows(variant, ggml_type, mode):
    """80 rows: AVX-512's items of 32 end on a single tile; every row count of a decode step and
    of the many-row tile."""
    x, blocks, bias = layer_case(ggml_type, 40, 80, 2 if ggml_type.endswith("_K") else 5, 7)
    rows, tiled = torch.from_numpy(blocks), tiles.tile(torch.from_numpy(blocks), ggml_type)
    from_rows = int8_call(ggml_type, x.shape[1], variant, mode)
    from_tiles = build().quant_matmul_call(ops.GGML_TYPES[ggml_type] | tiles.TILED, x.shape[1], variant, mode)
    for count in (1, 2, 3, 4, 5, 17, 40):
        expected = from_rows(x[:count].contiguous(), rows, bias)
        got = from_tiles(x[:count].contiguous(), tiled, bias)
        assert torch.equal(got, expected), f"{ggml_type} ({variant}, {mode}), {count} rows: " \
            f"{(got - expected).abs().max().item():.3g} from the rows' result"


def test_tiles_are_refused_where_rows_are_read():
    blocks = tiles.tile(torch.from_numpy(random_blocks("Q4_K", 32, 256)), "Q4_K")
    tiled_type, variant = ops.GGML_TYPES["Q4_K"] | tiles.TILED, isa.selected_variant()
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="only integer activations read tiles"):
        build().quant_matmul_call(tiled_type, 256, variant, "float32")(x, blocks, None)
    with pytest.raises(ValueError, match="only integer activations read tiles"):
        build().dequantize(blocks, tiled_type, 256, variant)
    with pytest.raises(ValueError, match="whole number of tiles of 16"):
        build().quant_matmul_call(tiled_type, 256, variant, "int16")(x, blocks[:24], None)
    with pytest.raises(ValueError, match="integer activations only"):
        ops.QuantLinear(ops.GGML_TYPES["Q4_K"], 256, "float32", tiled=True)
    with pytest.raises(ValueError, match="not whole tiles"):
        tiles.tile(torch.zeros(24, 144, dtype=torch.uint8), "Q4_K")
    with pytest.raises(ValueError, match="not whole tiles"):
        tiles.tile(torch.zeros(32, 128, dtype=torch.uint8), "BF16")


class _Tied(torch.nn.Module):
    """An embedding and an LM head on one tensor of blocks, and a layer too narrow to tile."""

    def __init__(self):
        super().__init__()
        blocks = torch.from_numpy(random_blocks("Q8_0", 48, 64, seed=1))
        self.embed = GGUFEmbedding(blocks, "Q8_0", 64)
        self.head = GGUFLinear(blocks, "Q8_0", 64)
        self.odd = GGUFLinear(torch.from_numpy(random_blocks("Q4_0", 37, 64, seed=2)), "Q4_0", 64)

    def forward(self, ids):
        hidden = self.embed(ids)
        return self.head(hidden), self.odd(hidden)


@pytest.mark.parametrize("mode", MODES)
def test_a_model_tiles_its_integer_blocks_once_for_a_tied_pair_and_back(mode):
    model, ids = _Tied(), torch.tensor([[0, 47, 16, 3]])
    rows = model.head.blocks.clone()
    float32_out = model(ids)
    assert set_gguf_activations(model, mode) == mode
    assert model.head.tiled and model.embed.tiled and not model.odd.tiled
    assert model.head.blocks is model.embed.blocks and not torch.equal(model.head.blocks, rows)
    tiled_out = model(ids)
    weight = model.head.weight  # (decoded from rows)
    assert torch.equal(weight, ops.dequantize(rows, ops.GGML_TYPES["Q8_0"], 64))
    assert torch.equal(model.state_dict()["head.weight"], weight)
    # the same numbers as the integer kernel on rows
    hidden = model.embed(ids)
    assert torch.equal(hidden[0], ops.dequantize(rows, ops.GGML_TYPES["Q8_0"], 64)[ids[0]])
    on_rows = ops.QuantLinear(ops.GGML_TYPES["Q8_0"], 64, mode)(hidden, rows, None)
    assert torch.equal(tiled_out[0], on_rows)
    assert set_gguf_activations(model, "float32") == "float32"
    assert not model.head.tiled and not model.embed.tiled and model.head.blocks is model.embed.blocks
    assert torch.equal(model.head.blocks, rows)
    assert all(torch.equal(a, b) for a, b in zip(model(ids), float32_out))
    # one module alone back to float32 reads rows again (its tied embedding keeps the tiles)
    set_gguf_activations(model, mode)
    model.head.set_activations("float32")
    assert not model.head.tiled and model.embed.tiled and torch.equal(model.head(hidden), float32_out[0])


SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "synthetic_gguf.py")


def test_a_tiled_model_generates_what_it_generates_on_rows(tmp_path, monkeypatch):
    """The engine's fused layers on a K-quant model: logits and greedy tokens on tiles equal those
    on rows, bit for bit, in int16."""
    path = str(tmp_path / "tiny.gguf")
    subprocess.run([sys.executable, SCRIPT, "--out", path, "--layers", "2", "--hidden", "256", "--ffn", "512",
                    "--heads", "4", "--kv-heads", "2", "--head-dim", "64"], check=True, capture_output=True)
    model, tokenizer = load_model(path, gguf_activations="int16")
    kept = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert kept and all(m.tiled for m in kept)
    engine = ChunkLlamaEngine(model, tokenizer)
    prompts = [[1, 5, 9, 33, 200, 17, 4], [1, 5, 9, 33, 8]]
    config = {"max_new_tokens": 6, "do_sample": False, "output_logits": True}
    on_tiles = engine.generate(prompts, GenerationConfig(**config))
    monkeypatch.setattr(tiles, "tileable", lambda *args: False)
    set_gguf_activations(model, "int16")
    assert not any(m.tiled for m in kept)
    on_rows = engine.generate(prompts, GenerationConfig(**config))
    for a, b in zip(on_tiles, on_rows):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.logits, b.logits)
