"""RMSNorm / GatedRMSNorm: the in-place form used without autograd equals the plain expression
bit for bit, leaves its inputs alone, and the plain form keeps its gradients."""

from __future__ import annotations

import pytest
import torch

from openk3.layers.norm import GatedRMSNorm, rms_norm


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_without_autograd_equals_the_autograd_form(with_weight):
    x = torch.randn(3, 50, 64) * 4
    w = torch.randn(64) if with_weight else None
    x0 = x.clone()
    fast = rms_norm(x, w, 1e-5)
    assert torch.equal(x, x0)
    xr = x.clone().requires_grad_()
    plain = rms_norm(xr, w, 1e-5)
    assert plain.requires_grad and not fast.requires_grad
    assert torch.equal(fast, plain.detach())
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * (1 if w is None else w)
    assert (fast - expected).abs().max() < 1e-5
    plain.square().sum().backward()
    assert xr.grad is not None and float(xr.grad.abs().max()) > 0


def test_gated_rms_norm_without_autograd_equals_the_autograd_form():
    norm = GatedRMSNorm(32)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    x = torch.randn(2, 7, 4, 32)
    gate = torch.randn(2, 7, 4, 32)
    x0, g0 = x.clone(), gate.clone()
    with torch.no_grad():
        fast = norm(x, gate)
    assert torch.equal(x, x0) and torch.equal(gate, g0)
    plain = norm(x, gate)  # weight requires grad: the plain expression
    assert plain.requires_grad
    assert torch.equal(fast, plain.detach())
    assert (fast - rms_norm(x, norm.weight.detach(), norm.eps) * torch.sigmoid(gate)).abs().max() < 1e-6
