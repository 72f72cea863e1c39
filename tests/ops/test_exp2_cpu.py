"""openk3.ops.exp2_cpu: the native exp2 + row-sum kernel against torch (float64 for the values)."""

from __future__ import annotations

import pytest
import torch

from openk3.ops import exp2_cpu

pytestmark = pytest.mark.skipif(not exp2_cpu.available(), reason=str(exp2_cpu.unavailable_reason()))


def test_exp2_is_as_accurate_as_torch_over_the_fp32_range():
    x = torch.linspace(-150.0, 100.0, 200_003)
    y, den = x.clone()[None], torch.empty(1)
    exp2_cpu.exp2_rowsum_(y, den)
    want = torch.exp2(x.double())
    normal = want > 2.0**-126
    rel = ((y[0].double() - want).abs() / want)[normal]
    torch_rel = ((torch.exp2(x).double() - want).abs() / want)[normal]
    assert float(rel.max()) <= max(1.5 * float(torch_rel.max()), 1.2e-7), float(rel.max())
    # below 2^-126: gradual underflow, off by at most one subnormal step
    assert float((y[0].double() - want)[~normal].abs().max()) <= 2.0**-149
    assert float(den[0]) == pytest.approx(float(want.sum()), rel=1e-6)


def test_special_values():
    x = torch.tensor([[float("nan"), float("-inf"), float("inf"), 200.0, -200.0, 0.0, 1.0, -1.0]])
    den = torch.empty(1)
    exp2_cpu.exp2_rowsum_(x, den)
    assert torch.isnan(x[0, 0]) and torch.isnan(den[0])
    assert x[0, 1:].tolist() == [0.0, float("inf"), float("inf"), 0.0, 1.0, 2.0, 0.5]


@pytest.mark.parametrize("cols", [1, 15, 16, 17, 31, 32, 33, 256, 300])
def test_rows_sum_like_torch(cols):
    g = torch.Generator().manual_seed(cols)
    x = 4 * torch.randn(37, cols, generator=g)
    y, den = x.clone(), torch.empty(37)
    exp2_cpu.exp2_rowsum_(y, den)
    want = torch.exp2(x.double())
    torch.testing.assert_close(y.double(), want, rtol=2e-7, atol=0)
    torch.testing.assert_close(den.double(), want.sum(1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("heads,n", [(1, 5), (4, 64), (3, 17), (4, 256)])
def test_diagonal_tile_is_causal(heads, n):
    # rows token-major, heads rows per token: row t*heads+h sees keys 0..t, the rest must be 0
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n * heads, n, generator=g)
    y, den = x.clone(), torch.empty(n * heads)
    exp2_cpu.exp2_rowsum_(y, den, heads=heads, diagonal=True)
    masked = torch.arange(n).repeat_interleave(heads)[:, None] < torch.arange(n)[None]
    want = torch.exp2(x.double()).masked_fill(masked, 0.0)
    torch.testing.assert_close(y.double(), want, rtol=2e-7, atol=0)
    assert bool((y[masked] == 0).all())
    torch.testing.assert_close(den.double(), want.sum(1), rtol=1e-6, atol=0)


def test_threads_give_the_same_result():
    x = torch.randn(1024, 256)
    a, b = x.clone(), x.clone()
    da, db = torch.empty(1024), torch.empty(1024)
    exp2_cpu.exp2_rowsum_(a, da, threads=1)
    exp2_cpu.exp2_rowsum_(b, db, threads=4)
    assert torch.equal(a, b) and torch.equal(da, db)


def test_bad_inputs():
    with pytest.raises(ValueError, match="float32"):
        exp2_cpu.exp2_rowsum_(torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2))
    with pytest.raises(ValueError, match="contiguous"):
        exp2_cpu.exp2_rowsum_(torch.zeros(3, 2).T, torch.zeros(2))
    with pytest.raises(ValueError, match="\\[r\\]"):
        exp2_cpu.exp2_rowsum_(torch.zeros(2, 3), torch.zeros(3))
    with pytest.raises(ValueError, match="diagonal"):
        exp2_cpu.exp2_rowsum_(torch.zeros(9, 2), torch.zeros(9), heads=4, diagonal=True)
