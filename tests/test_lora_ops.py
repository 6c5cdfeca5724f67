"""The segmented LoRA op (`ops/lora.py`) against its float64 oracle: odd row counts, ranks and
widths, segments that leave base rows between them, one adapter of several factors
(PEFT's active adapters combined), float32 and 16-bit outputs; and a row's delta bit for bit
the same whatever rows come with it, through the step's linear function (batch invariance)."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close

from chunk_llama.ops.cpu import linear as linear_ops
from chunk_llama.ops.lora import LoraFactors, LoraRows, add_lora_deltas, reference_lora_delta


class Adapter:
    """The interface `LoraRows` segments hold: factors by module key."""

    def __init__(self, factors):
        self._factors = factors

    def factors(self, key):
        return self._factors.get(key, ())


U = 2.0 ** -24  # float32's unit roundoff


def float32_bound(x, base, adapter_factors) -> torch.Tensor:
    """A bound on float32's error in base + sum s (x A^T) B^T, from the classic dot-product
    bound |fl(a.b) - a.b| <= gamma_n |a|.|b| (gamma_n = n u / (1 - n u)) for both products,
    the scaling and the additions each rounding once more."""
    def gamma(n):
        return n * U / (1 - n * U)

    x = x.double().abs()
    total = torch.zeros_like(base, dtype=torch.float64)
    magnitude = base.double().abs()
    for f in adapter_factors:
        a, b = f.a.double().abs(), f.b.double().abs()
        t = x @ a.T  # |x| |A|^T bounds |x A^T|
        product = t @ b.T * abs(f.scaling)
        total += (gamma(a.shape[1]) * t @ b.T + gamma(b.shape[1]) * t @ b.T) * abs(f.scaling) + 2 * U * product
        magnitude += product
    return total + 2 * U * magnitude * len(adapter_factors)


def factors(rank, in_features, out_features, seed, scaling=0.5):
    g = torch.Generator().manual_seed(seed)
    return LoraFactors(torch.randn(rank, in_features, generator=g) * 0.3,
                       torch.randn(out_features, rank, generator=g) * 0.3, scaling)


@pytest.mark.parametrize("rows, in_features, out_features, ranks", [
    (17, 37, 29, (4, 7)), (37, 64, 96, (16, 32)), (5, 576, 192, (8, 1)), (64, 33, 130, (5, 3))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_segments_add_each_adapters_delta_to_its_rows_only(rows, in_features, out_features, ranks, dtype):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    base = torch.randn(rows, out_features, generator=g).to(dtype)
    first = Adapter({"q": (factors(ranks[0], in_features, out_features, 1),)})
    # two factors on one module: PEFT's active adapters summed
    second = Adapter({"q": (factors(ranks[1], in_features, out_features, 2, scaling=2.0),
                            factors(ranks[0], in_features, out_features, 3, scaling=0.25)),
                      "k": (factors(ranks[1], in_features, 7, 4),)})
    cut = [0, rows // 5, rows // 2, rows // 2 + 1, rows]
    lora = LoraRows.from_runs([(cut[0], cut[1], first), (cut[1], cut[2], None), (cut[2], cut[3], second),
                               (cut[3], cut[4], first)], rows)
    assert [(s, e) for s, e, _ in lora.segments] == [(cut[0], cut[1]), (cut[2], cut[3]), (cut[3], cut[4])]
    out = add_lora_deltas(base.clone(), x, lora, "q")
    expected = base.double().clone()
    for start, end, adapter in lora.segments:
        expected[start:end] += reference_lora_delta(x[start:end], adapter.factors("q"))
    # float32's rounding (derived bound); a 16-bit output is the float32 sum rounded once more
    bound = torch.zeros_like(expected)
    for start, end, adapter in lora.segments:
        bound[start:end] = float32_bound(x[start:end], base[start:end], adapter.factors("q"))
    assert_close(out, expected, atol=bound, ulps=1.0 if dtype != torch.float32 else 0.0,
                 dtype=dtype, what=f"{dtype} rows {rows}")
    assert out.dtype is dtype
    torch.testing.assert_close(out[cut[1]:cut[2]], base[cut[1]:cut[2]], rtol=0, atol=0)  # base rows untouched
    # a module the adapters do not target: nothing added
    assert torch.equal(add_lora_deltas(base.clone(), x, lora, "v"), base)


def test_rows_that_do_not_fit_the_step_are_refused():
    lora = LoraRows.from_runs([(0, 3, Adapter({"q": (factors(4, 8, 8, 0),)}))], 4)
    with pytest.raises(ValueError, match="4 rows but the layer was given 3 inputs"):
        add_lora_deltas(torch.zeros(3, 8), torch.zeros(3, 8), lora, "q")


def test_a_rows_delta_does_not_depend_on_the_rows_beside_it():
    """Through the step's linear function (`small_linear` on x86), a row's delta is bit for bit
    the one it gets alone, in a group of any size."""
    fn = linear_ops.resolve(torch.float32, "cpu")
    if fn is None:
        pytest.skip("F.linear runs here (no batch-invariant linear path)")
    adapter = Adapter({"q": (factors(16, 576, 192, 5),)})
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 576, generator=g)
    base = torch.randn(40, 192, generator=g)
    together = add_lora_deltas(base.clone(), x, LoraRows.from_runs([(0, 40, adapter)], 40), "q", fn)
    for row in (0, 17, 39):
        alone = add_lora_deltas(base[row:row + 1].clone(), x[row:row + 1],
                                LoraRows.from_runs([(0, 1, adapter)], 1), "q", fn)
        assert torch.equal(alone[0], together[row]), row
    shifted = add_lora_deltas(base[3:].clone(), x[3:], LoraRows.from_runs([(0, 37, adapter)], 37), "q", fn)
    assert torch.equal(shifted, together[3:])
    # and the sum is the oracle's, to float32's rounding
    expected = base.double() + reference_lora_delta(x, adapter.factors("q"))
    assert_close(together, expected, atol=float32_bound(x, base, adapter.factors("q")), what="small_linear")
