"""Linear layers in chunk-llama's forwards (`ops/cpu/linear.py`): the CPU kernel's
`small_linear` for every row count (a row's result the same whatever rows come with it),
oneDNN beyond SMALL_ROWS rows only where CHUNK_LLAMA_LINEAR=onednn asks, float32 on x86
CPUs, each as close to the float64 result as `F.linear` is; `F.linear` itself everywhere
else."""

import copy
import logging
import platform

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_llama
from test_cpu_kernel import _variant_params

from chunk_llama import ChunkCache, ChunkLlamaEngine, patch_model
from chunk_llama.logs import forget_logged
from chunk_llama.ops.cpu import linear

X86 = platform.machine().lower() in ("x86_64", "amd64")
x86_only = pytest.mark.skipif(not X86, reason="chunk-llama's linear paths are used on x86-64 CPUs only")


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    monkeypatch.delenv(linear.ENV, raising=False)
    linear.onednn_unavailable_reason.cache_clear()
    forget_logged()
    yield
    linear.onednn_unavailable_reason.cache_clear()


def check_against_float64(out, x, weight, bias):
    """As close to the float64 result as F.linear (MKL) is: float32 rounding in another order."""
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    error = (out.double() - exact).abs().max().item()
    stock_error = (F.linear(x, weight, bias).double() - exact).abs().max().item()
    assert out.shape == exact.shape and error <= max(4 * stock_error, 1e-6 * x.shape[-1] ** 0.5)


def random_layer(rows, in_features, out_features, bias, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    return x, weight, torch.randn(out_features, generator=generator) if bias else None


@pytest.mark.parametrize("variant", _variant_params())
@pytest.mark.parametrize("rows", [1, 5, 17, 128])
@pytest.mark.parametrize("in_features,out_features", [(37, 1), (96, 49), (576, 130)])
@pytest.mark.parametrize("bias", [True, False])
def test_small_linear_every_variant(variant, rows, in_features, out_features, bias):
    """Odd sizes: tiles narrower than the register tile in rows and columns, and
    in_features that are not a multiple of the lanes."""
    from chunk_llama.ops.cpu.attention import build

    x, weight, b = random_layer(rows, in_features, out_features, bias, seed=rows)
    check_against_float64(build().small_linear(x, weight, b, variant), x, weight, b)


def test_small_linear_rejects_bad_tensors():
    from chunk_llama.ops.cpu.attention import build

    module = build()
    x, weight, b = random_layer(3, 8, 5, True)
    with pytest.raises(TypeError, match="float32 CPU tensors"):
        module.small_linear(x.double(), weight.double(), None, "generic")
    with pytest.raises(ValueError, match="weight \\[out, in\\]"):
        module.small_linear(x, weight.t().contiguous(), None, "generic")
    with pytest.raises(ValueError, match="bias must be a contiguous float32 CPU vector of 5"):
        module.small_linear(x, weight, b[:4], "generic")


@x86_only
@pytest.mark.parametrize("choice", ["auto", "onednn"])
@pytest.mark.parametrize("rows", [1, 129, 300])
def test_linear_takes_small_linear_for_every_row_count_unless_onednn_is_asked_for(rows, choice, monkeypatch):
    monkeypatch.setenv(linear.ENV, choice)
    assert linear.onednn_unavailable_reason() is None  # (its one-time check runs here)
    calls = []
    onednn = linear._onednn
    monkeypatch.setattr(linear, "_onednn", lambda *a: calls.append("onednn") or onednn(*a))
    x, weight, b = random_layer(rows, 576, 130, True)
    out = linear.linear(x.view(1, rows, 576), weight, b)
    check_against_float64(out[0], x, weight, b)
    assert calls == (["onednn"] if choice == "onednn" and rows > linear.SMALL_ROWS else [])
    assert linear.linear(x.bfloat16(), weight.bfloat16()).dtype == torch.bfloat16  # F.linear: oneDNN already


@x86_only
@pytest.mark.parametrize("variant", _variant_params())
@pytest.mark.parametrize("in_features", [37, 576, 1536])
def test_a_row_is_the_same_whatever_rows_come_with_it(variant, in_features):
    """Every row count runs the same arithmetic per output (whole tiles, narrower tiles, row
    blocks, in_features taken in parts): a row's result is bit for bit its result alone."""
    from chunk_llama.ops.cpu.attention import build

    module = build()
    x, weight, b = random_layer(700, in_features, 37, True, seed=3)
    together = module.small_linear(x, weight, b, variant)
    for row in (0, 1, 5, 129, 698, 699):
        alone = module.small_linear(x[row:row + 1].contiguous(), weight, b, variant)
        assert torch.equal(together[row:row + 1], alone), f"row {row} of 700 differs from the row alone"
    for rows in (3, 17, 260):  # and in batches of other sizes, starting elsewhere
        assert torch.equal(module.small_linear(x[7:7 + rows].contiguous(), weight, b, variant), together[7:7 + rows])


def test_a_weight_or_bias_the_kernels_cannot_read_goes_to_f_linear():
    """The kernels read raw float32 pointers: a bias of another dtype must reach F.linear, which
    says what is wrong, never the kernel, which would read past its end."""
    step_linear = linear.resolve(torch.float32, "cpu")
    x, weight, b = random_layer(3, 64, 40, True)
    check_against_float64(step_linear(x, weight, b), x, weight, b)
    with pytest.raises(RuntimeError, match="dtype"):
        step_linear(x, weight, b.bfloat16())


@x86_only
def test_only_forwards_on_a_chunk_cache_take_them(monkeypatch):
    stock = tiny_llama()
    patched = patch_model(copy.deepcopy(stock))
    assert linear.backend(torch.float32).startswith("small_linear:")
    calls = []
    run = linear._run  # what the step's linear function calls (resolved once per step)
    monkeypatch.setattr(linear, "_run", lambda *args: calls.append(1) or run(*args))
    ids = torch.randint(6, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # no ChunkCache: F.linear, bit for bit what stock computes
        assert torch.equal(patched(ids).logits, stock(ids).logits) and not calls
        out = patched(input_ids=ids, past_key_values=ChunkCache(patched)).logits
    assert len(calls) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    torch.testing.assert_close(out, stock(ids).logits, rtol=1e-4, atol=1e-4)
    engine = ChunkLlamaEngine(patched, max_batch_size=2, chunk_size=16)
    assert engine.stats["linear_backend"].startswith("small_linear:")


def test_the_user_keeps_f_linear(monkeypatch, caplog):
    monkeypatch.setenv(linear.ENV, "torch")
    x, weight, _ = random_layer(3, 8, 5, False)
    with caplog.at_level(logging.WARNING, logger="chunk_llama.ops.cpu.linear"):
        assert torch.equal(linear.linear(x, weight), F.linear(x, weight)) and linear.backend(torch.float32) == "torch"
    assert not caplog.records  # a choice, not a fallback
    monkeypatch.setenv(linear.ENV, "fast")
    with pytest.raises(ValueError, match="CHUNK_LLAMA_LINEAR must be one of auto, onednn, torch"):
        linear.backend(torch.float32)


@x86_only
def test_a_failing_onednn_leaves_many_rows_to_small_linear_and_says_why(monkeypatch, caplog):
    monkeypatch.setenv(linear.ENV, "onednn")

    def broken(*args):
        raise RuntimeError("no primitive")

    monkeypatch.setattr(linear, "_onednn", broken)
    from chunk_llama.ops.cpu.attention import build

    with caplog.at_level(logging.WARNING, logger="chunk_llama.ops.cpu.linear"):
        assert linear.backend(torch.float32) == f"small_linear:{linear.isa.selected_variant()}"
        x, weight, _ = random_layer(200, 8, 5, False)
        assert torch.equal(linear.linear(x, weight), build().small_linear(x, weight, None, linear.isa.selected_variant()))
    assert [r.getMessage() for r in caplog.records] == [
        "chunk-llama: float32 linear layers: many rows run small_linear, not oneDNN: oneDNN linear failed its "
        "check: no primitive"]
