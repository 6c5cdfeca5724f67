"""The tolerance rules of the suite, in one place, derived from the dtypes (not guessed on
one CPU), with failure messages that say where and by how much (Liger's
`assert_verbose_allclose` style).

- A kernel against its float32 oracle on the same inputs: in float32 the two differ by
  summation order only (FP32_ATOL); a half-precision output is the float32 result rounded
  once, so it lies within one unit in the last place (ulp) of the half dtype at the
  value's magnitude of the oracle's (rounded or not), plus that float32 difference.
- A model in half precision against stock transformers in the same dtype: both are
  judged against the truth, the same weights in float32. Ours may be no further from the
  truth than `STOCK_FACTOR` times stock's own half-precision error plus `STOCK_ULPS` ulps
  of the half dtype at the truth's scale in the worst element, and than
  `STOCK_MEAN_FACTOR` times stock's on average. Stock's own error differs by CPU (oneDNN
  picks other kernels on Intel than on AMD), so a fixed bound measured on one machine is
  not one; the ratio of the two errors is what carries over.
"""

from __future__ import annotations

import torch

FP32_ATOL = 1e-5
MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
# Ours against the float32 truth, next to stock's own half-precision error. Measured ratios
# (ours / stock, bf16 and fp16, tiny Llamas through the patched forward and the engine,
# scripts/half_precision_errors.py, docs/BENCHMARKS.md): worst element 0.74-1.51 (a handful
# of elements: noisy), mean 0.93-1.07. A softmax scale 5% off gives 2.2-2.8 in both.
STOCK_FACTOR = 2.0
STOCK_ULPS = 2.0
STOCK_MEAN_FACTOR = 1.5


def ulp(dtype: torch.dtype, magnitude: torch.Tensor | float) -> torch.Tensor:
    """The spacing of `dtype`'s values at each magnitude (normal numbers)."""
    magnitude = torch.as_tensor(magnitude, dtype=torch.float64).abs()
    tiny = torch.finfo(dtype).tiny
    exponent = torch.floor(torch.log2(magnitude.clamp_min(tiny)))
    return torch.pow(2.0, exponent - MANTISSA_BITS[dtype])


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float = 0.0, rtol: float = 0.0,
                 ulps: float = 0.0, dtype: torch.dtype | None = None, what: str = "") -> None:
    """|actual - expected| <= atol + rtol |expected| + ulps * ulp(dtype, max(|actual|, |expected|))
    elementwise (NaN never passes); the message names the worst element."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == e.shape, f"{what}: shapes differ, {tuple(a.shape)} vs {tuple(e.shape)}"
    bound = atol + rtol * e.abs()
    if ulps:
        bound = bound + ulps * ulp(dtype, torch.maximum(a.abs(), e.abs()))
    diff = (a - e).abs()
    bad = ~(diff <= bound)
    if bad.any():
        excess = torch.where(bad, diff - bound, torch.zeros_like(diff)).nan_to_num(float("inf"))
        worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements out of bounds; worst at {worst}: actual "
            f"{a[worst].item():.6g}, expected {e[worst].item():.6g}, |diff| {diff[worst].item():.3g} > bound "
            f"{bound[worst].item() if bound.ndim else float(bound):.3g} (atol {atol}, rtol {rtol}, {ulps} ulps of "
            f"{dtype})")


def assert_kernel_close(out: torch.Tensor, truth: torch.Tensor, what: str = "",
                        rounded_operand_scale: float | None = None) -> None:
    """A kernel's output (its dtype: float32, bfloat16 or float16) against a float32 oracle
    on the same inputs (the oracle rounded to the output dtype, or not).

    rounded_operand_scale: for tensor-core kernels that round the softmax weights P to the
    half dtype for the P V product (the CUDA kernels): the largest |V|. Rounding each weight
    moves O = sum p_i v_i by at most half an ulp of P's dtype relative to sum p_i |v_i| <=
    max |V|, so one more ulp at that scale bounds it.
    """
    half = out.dtype != torch.float32
    atol = FP32_ATOL
    if half and rounded_operand_scale is not None:
        atol += ulp(out.dtype, rounded_operand_scale).item()
    assert_close(out, truth, atol=atol, ulps=1.0 if half else 0.0, dtype=out.dtype, what=what)


def assert_no_worse_than_stock(ours: torch.Tensor, stock: torch.Tensor | tuple[torch.Tensor, ...],
                               truth: torch.Tensor, dtype: torch.dtype, *, factor: float = STOCK_FACTOR,
                               ulps: float = STOCK_ULPS, mean_factor: float = STOCK_MEAN_FACTOR,
                               what: str = "") -> None:
    """Ours and stock computed in `dtype`, `truth` the same weights in a wider one (float32 for
    half precision; float64 for float32, e.g. GGUF blocks against transformers' dequantized copy):
    ours' worst error to the truth at most `factor` times stock's own plus `ulps` ulps of
    `dtype` at the truth's scale (the largest |truth|), and ours' mean error at most
    `mean_factor` times stock's (averaged over many elements, it needs no rounding allowance).

    stock: one of stock's computations of the same logits, or several (its forward teacher-forced,
    its own decode steps, the op-by-op path a fused one replaces): each is as right as the others,
    and on a small model their float32 errors differ by 2-5x from one another in the worst element
    and by CPU (which element an early rounding sends furthest), so stock's error is the largest
    of theirs, the worst and the mean each."""
    stocks = tuple(s.detach().double().cpu() for s in (stock if isinstance(stock, tuple) else (stock,)))
    ours, truth = (x.detach().double().cpu() for x in (ours, truth))
    assert torch.isfinite(ours).all(), f"{what}: non-finite values"
    err_ours = (ours - truth).abs()
    err_stocks = [(s - truth).abs() for s in stocks]
    slack = ulps * ulp(dtype, truth.abs().max()).item()
    for name, mine, theirs, times, extra in (
            ("worst", err_ours.max(), max(e.max() for e in err_stocks), factor, slack),
            ("mean", err_ours.mean(), max(e.mean() for e in err_stocks), mean_factor, 0.0)):
        bound = times * theirs.item() + extra
        if not mine.item() <= bound:
            where = tuple(int(i) for i in torch.unravel_index(err_ours.argmax(), err_ours.shape))
            raise AssertionError(
                f"{what}: our {name} error to the float32 truth {mine.item():.4g} exceeds {times}x stock's "
                f"{theirs.item():.4g} + {extra:.3g} ({ulps if extra else 0} ulps of {dtype} at "
                f"{truth.abs().max().item():.3g}); our worst element "
                f"at {where}: ours {ours[where].item():.5g}, stock {stocks[0][where].item():.5g}, truth "
                f"{truth[where].item():.5g}")
