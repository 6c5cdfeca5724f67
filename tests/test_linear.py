"""Linear layers in chunk-llama's forwards: oneDNN for float32 on x86 CPUs (`ops/linear.py`),
equal to `F.linear` to float32 rounding; `F.linear` itself everywhere else."""

import copy
import logging
import platform

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_llama

from chunk_llama import ChunkCache, ChunkLlamaEngine, patch_model
from chunk_llama.ops import linear

X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    monkeypatch.delenv(linear.ENV, raising=False)
    linear.onednn_unavailable_reason.cache_clear()
    linear._log_once.cache_clear()
    yield
    linear.onednn_unavailable_reason.cache_clear()


@pytest.mark.skipif(not X86, reason="oneDNN linear layers are used on x86-64 CPUs only")
@pytest.mark.parametrize("rows", [1, 17, 123])
@pytest.mark.parametrize("in_features,out_features", [(37, 64), (576, 1536), (96, 49)])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_equals_f_linear(rows, in_features, out_features, bias):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    assert linear.use_onednn(x, weight)
    # as close to the float64 result as F.linear (MKL) is: float32 rounding, in another order
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    error = (linear.linear(x, weight, b).double() - exact).abs().max().item()
    stock_error = (F.linear(x, weight, b).double() - exact).abs().max().item()
    assert error <= max(4 * stock_error, 1e-6 * in_features**0.5)
    assert not linear.use_onednn(x.bfloat16(), weight.bfloat16())  # torch's bfloat16 matmul is oneDNN already


@pytest.mark.skipif(not X86, reason="oneDNN linear layers are used on x86-64 CPUs only")
def test_only_forwards_on_a_chunk_cache_use_onednn(monkeypatch):
    stock = tiny_llama()
    patched = patch_model(copy.deepcopy(stock))
    assert linear.backend(torch.float32) == "onednn"  # (its one-time check runs here)
    calls = []
    onednn = linear._onednn
    monkeypatch.setattr(linear, "_onednn", lambda *a: calls.append(a[1].shape) or onednn(*a))
    ids = torch.randint(6, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # no ChunkCache: F.linear, bit for bit what stock computes
        assert torch.equal(patched(ids).logits, stock(ids).logits) and not calls
        out = patched(input_ids=ids, past_key_values=ChunkCache(patched)).logits
    assert len(calls) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    torch.testing.assert_close(out, stock(ids).logits, rtol=1e-4, atol=1e-4)
    engine = ChunkLlamaEngine(patched, max_batch_size=2, chunk_size=16)
    assert engine.stats["linear_backend"] == "onednn"


def test_the_user_keeps_f_linear(monkeypatch, caplog):
    monkeypatch.setenv(linear.ENV, "torch")
    x, weight = torch.randn(3, 8), torch.randn(5, 8)
    with caplog.at_level(logging.WARNING, logger="chunk_llama.ops.linear"):
        assert not linear.use_onednn(x, weight) and linear.backend(torch.float32) == "torch"
    assert not caplog.records  # a choice, not a fallback
    monkeypatch.setenv(linear.ENV, "fast")
    linear.onednn_unavailable_reason.cache_clear()
    with pytest.raises(ValueError, match="CHUNK_LLAMA_LINEAR must be auto, onednn or torch"):
        linear.backend(torch.float32)


@pytest.mark.skipif(not X86, reason="oneDNN linear layers are used on x86-64 CPUs only")
def test_a_failing_onednn_falls_back_to_f_linear_and_says_why(monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("no primitive")

    monkeypatch.setattr(linear, "_onednn", broken)
    with caplog.at_level(logging.WARNING, logger="chunk_llama.ops.linear"):
        assert linear.backend(torch.float32) == "torch" and linear.backend(torch.float32) == "torch"
        x, weight = torch.randn(3, 8), torch.randn(5, 8)
        assert torch.equal(linear.linear(x, weight), F.linear(x, weight))
    assert [r.getMessage() for r in caplog.records] == [
        "chunk-llama: float32 linear layers run F.linear (MKL), not oneDNN: oneDNN linear failed its check: no primitive"]
