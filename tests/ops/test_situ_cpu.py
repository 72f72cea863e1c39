"""openk3.ops.situ_cpu: the native SiTU-GLU kernel against the torch form in float64."""

from __future__ import annotations

import math

import pytest
import torch

from openk3.layers import mlp
from openk3.layers.mlp import situ_glu
from openk3.ops import situ_cpu

pytestmark = pytest.mark.skipif(not situ_cpu.available(), reason=str(situ_cpu.unavailable_reason()))


@pytest.mark.parametrize("b2", [25.0, None])
@pytest.mark.parametrize("shape", [(1,), (15,), (16,), (17,), (33, 5), (4096, 64), (2, 700, 384)])
def test_matches_the_float64_form(shape, b2):
    g = torch.Generator().manual_seed(math.prod(shape))
    gate, up = 6 * torch.randn(shape, generator=g), 30 * torch.randn(shape, generator=g)
    want = situ_glu(gate.double(), up.double(), 4.0, b2)
    got = situ_cpu.situ_glu(gate, up, 4.0, b2)
    torch_err = float((situ_glu(gate, up, 4.0, b2).double() - want).abs().max())
    err = float((got.double() - want).abs().max())
    assert got.dtype == torch.float32 and got.shape == gate.shape
    # as accurate as the eager fp32 form (within 2x of its error, ~2e-7 of the scale)
    assert err <= max(2 * torch_err, 3e-7 * float(want.abs().max())), (err, torch_err)


def test_tanh_branch_is_accurate_across_its_switch_point():
    # gate = 1e6 makes tanh(g/b1) sigma(g) exactly 1, so out / (b1 b2) = tanh(u / b2)
    t = torch.linspace(-12.0, 12.0, 480_001)
    out = situ_cpu.situ_glu(torch.full_like(t, 1e6), 25 * t, 4.0, 25.0).double() / 100
    want = torch.tanh(t.double())
    rel = (out - want).abs() / want.abs().clamp_min(1e-30)
    assert float(rel.max()) < 5e-7
    assert float(out.abs().max()) <= 1.0


def test_special_values():
    x = torch.tensor([0.0, 1e-30, -1e-8, 50.0, -50.0, -100.0, 1e30, -1e30])
    x = torch.cat([x, torch.tensor([float("inf"), float("-inf"), float("nan")])])
    for b2 in (25.0, None):
        up = torch.full_like(x, 3.0)
        got, want = situ_cpu.situ_glu(x, up, 4.0, b2), situ_glu(x.double(), up.double(), 4.0, b2)
        assert torch.isnan(got[-1]) and torch.isnan(want[-1])
        # element-wise to a few ulp, also where sigma(g) is tiny (g = -50: ~2e-22); below
        # 2^-126 the fp32 result flushes to zero
        assert torch.allclose(got[:-1].double(), want[:-1], rtol=3e-7, atol=2.0**-126)
    # NaN in the up branch stays NaN; saturation reaches the cap exactly
    nan_up = situ_cpu.situ_glu(torch.tensor([1.0]), torch.tensor([float("nan")]), 4.0, 25.0)
    assert torch.isnan(nan_up).all()
    sat = situ_cpu.situ_glu(torch.tensor([1e4]), torch.tensor([-1e4]), 4.0, 25.0)
    assert sat.item() == -100.0


def test_situ_glu_dispatches_only_without_autograd(monkeypatch):
    calls = []
    real = situ_cpu.situ_glu
    monkeypatch.setattr(situ_cpu, "situ_glu", lambda *a: calls.append(1) or real(*a))
    gate, up = torch.randn(8, 64), torch.randn(8, 64)
    mlp.situ_glu(gate, up, 4.0, 25.0)
    assert calls == [1]
    out = mlp.situ_glu(gate.clone().requires_grad_(), up, 4.0, 25.0)  # autograd: the torch form
    assert calls == [1] and out.requires_grad
    mlp.situ_glu(gate.double(), up.double(), 4.0, 25.0)  # float64: the torch form
    mlp.situ_glu(gate.t(), up.t(), 4.0, 25.0)  # non-contiguous: the torch form
    assert calls == [1]


def test_bad_input_is_refused():
    gate = torch.randn(4, 8)
    with pytest.raises(ValueError, match="contiguous fp32"):
        situ_cpu.situ_glu(gate.double(), gate.double(), 4.0, 25.0)
    with pytest.raises(ValueError, match="contiguous fp32"):
        situ_cpu.situ_glu(gate, torch.randn(4, 9), 4.0, 25.0)
    with pytest.raises(ValueError, match="betas must be positive"):
        situ_cpu.situ_glu(gate, gate, 0.0, 25.0)
    with pytest.raises(ValueError, match="betas must be positive"):
        situ_cpu.situ_glu(gate, gate, 4.0, -1.0)
