"""Vectorised routed-expert dispatch vs the loop-over-experts reference."""

from __future__ import annotations

import functools

import pytest
import torch

from openk3.layers.mlp import situ_glu, swiglu
from openk3.ops import grouped_mm as gm
from openk3.ops.backends import use_backend
from openk3.ops.grouped_mm import routed_experts, routed_experts_reference
from tests.conftest import assert_close

SITU = functools.partial(situ_glu, beta1=4.0, beta2=25.0)


def _problem(n=37, e=8, k=3, l=32, f=24, dtype=torch.float32, skip=(3, 6), requires_grad=False):
    """Random routing with distinct experts per row that never picks the experts in ``skip``."""
    allowed = torch.tensor([i for i in range(e) if i not in skip])
    pick = torch.rand(n, len(allowed)).argsort(-1)[:, :k]
    idx = allowed[pick]
    weight = torch.rand(n, k)
    x = torch.randn(n, l, dtype=dtype)
    w1 = torch.randn(e, f, l, dtype=dtype) * 0.3
    w3 = torch.randn(e, f, l, dtype=dtype) * 0.6
    w2 = torch.randn(e, l, f, dtype=dtype) * 0.1
    tensors = [x, weight, w1, w3, w2]
    for t in tensors:
        t.requires_grad_(requires_grad)
    return x, idx, weight, w1, w3, w2


@pytest.mark.parametrize("backend", ["grouped_mm", "bmm"])
@pytest.mark.parametrize("act", [SITU, swiglu], ids=["situ", "swiglu"])
def test_dispatch_matches_loop_reference(backend, act):
    x, idx, w, w1, w3, w2 = _problem()
    out = routed_experts(x, idx, w, w1, w3, w2, act, backend=backend)
    ref = routed_experts_reference(x, idx, w, w1, w3, w2, act)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert_close(out, ref, atol=1e-5, rtol=1e-5, what=f"{backend} vs loop")


@pytest.mark.parametrize("n", [1, 3, 40], ids=lambda n: f"N={n}")
def test_static_form_matches_loop_reference_in_both_regimes(n):
    """N·k < E gathers the chosen experts' weights; N·k >= E runs every expert densely."""
    x, idx, w, w1, w3, w2 = _problem(n=n, e=8, k=2)
    out = routed_experts(x, idx, w, w1, w3, w2, SITU, backend="static")
    ref = routed_experts_reference(x, idx, w, w1, w3, w2, SITU)
    assert_close(out, ref, atol=1e-5, rtol=1e-5, what=f"static vs loop, N={n}")


def test_reference_matches_float64_per_token_sum():
    x, idx, w, w1, w3, w2 = _problem(n=11, dtype=torch.float64)
    ref = routed_experts_reference(x, idx, w, w1, w3, w2, SITU)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            acc += w[t, j].double() * (w2[e] @ SITU(w1[e] @ x[t], w3[e] @ x[t]))
        rows.append(acc)
    assert_close(ref, torch.stack(rows), atol=1e-12, what="loop reference")


@pytest.mark.parametrize("backend", ["grouped_mm", "bmm"])
def test_dispatch_gradients_match_reference(backend):
    x, idx, w, w1, w3, w2 = _problem(requires_grad=True)
    leaves = (x, w, w1, w3, w2)
    probe = torch.randn(x.shape)
    grads = torch.autograd.grad((routed_experts(x, idx, w, w1, w3, w2, SITU, backend=backend) * probe).sum(), leaves)
    ref = torch.autograd.grad((routed_experts_reference(x, idx, w, w1, w3, w2, SITU) * probe).sum(), leaves)
    for name, g, r in zip(("x", "weight", "w1", "w3", "w2"), grads, ref):
        assert_close(g, r, atol=1e-5, rtol=1e-5, what=f"{backend} grad {name}")
    # Experts nobody chose get exactly zero gradient.
    for g in grads[2:]:
        assert g[3].abs().max() == 0 and g[6].abs().max() == 0


def test_unaligned_and_float64_fall_back_to_bmm():
    x, idx, w, w1, w3, w2 = _problem(l=7, f=5)
    assert gm._select_backend(x, w1, None) == "bmm"
    assert_close(
        routed_experts(x, idx, w, w1, w3, w2, swiglu),
        routed_experts_reference(x, idx, w, w1, w3, w2, swiglu),
        atol=1e-5, rtol=1e-5, what="unaligned",
    )
    with pytest.raises(ValueError, match="grouped_mm"):
        routed_experts(x, idx, w, w1, w3, w2, swiglu, backend="grouped_mm")
    x64, idx, w, w1, w3, w2 = _problem(dtype=torch.float64)
    assert gm._select_backend(x64, w1, None) == "bmm"
    out = routed_experts(x64, idx, w, w1, w3, w2, SITU)
    assert out.dtype == torch.float64
    assert_close(out, routed_experts_reference(x64, idx, w, w1, w3, w2, SITU), atol=1e-12, what="float64 bmm")


def test_aligned_fp32_on_cpu_uses_grouped_mm():
    x, _, _, w1, _, _ = _problem()
    expected = "grouped_mm" if hasattr(torch, "_grouped_mm") else "bmm"
    assert gm._select_backend(x, w1, None) == expected


def test_repeated_expert_in_a_row_and_single_expert_models():
    x, idx, w, w1, w3, w2 = _problem(n=9, e=4, k=2, skip=())
    idx[:, 1] = idx[:, 0]  # same expert twice: both slots count
    for backend in ("grouped_mm", "bmm", "static"):
        out = routed_experts(x, idx, w, w1, w3, w2, SITU, backend=backend)
        assert_close(out, routed_experts_reference(x, idx, w, w1, w3, w2, SITU), atol=1e-5, rtol=1e-5, what=backend)
    x, idx, w, w1, w3, w2 = _problem(n=5, e=1, k=1, skip=())
    for backend in ("grouped_mm", "bmm", "static"):
        out = routed_experts(x, idx, w, w1, w3, w2, SITU, backend=backend)
        assert_close(out, routed_experts_reference(x, idx, w, w1, w3, w2, SITU), atol=1e-5, rtol=1e-5, what="E=1")


@pytest.mark.parametrize("backend", ["grouped_mm", "bmm", "static", "loop"])
def test_zero_tokens(backend):
    x, idx, w, w1, w3, w2 = _problem(n=0)
    out = routed_experts(x, idx, w, w1, w3, w2, SITU, backend=backend)
    assert out.shape == (0, 32) and out.dtype == torch.float32


def test_bf16_inputs_accumulate_in_fp32():
    x, idx, w, w1, w3, w2 = _problem()
    ref = routed_experts_reference(x, idx, w, w1, w3, w2, SITU)
    out = routed_experts(x.bfloat16(), idx, w, w1.bfloat16(), w3.bfloat16(), w2.bfloat16(), SITU)
    assert out.dtype == torch.float32
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 2e-2


def test_dispatch_is_deterministic():
    x, idx, w, w1, w3, w2 = _problem()
    a = routed_experts(x, idx, w, w1, w3, w2, SITU)
    assert torch.equal(a, routed_experts(x, idx, w, w1, w3, w2, SITU))


def test_force_backend_context_manager(monkeypatch):
    x, idx, w, w1, w3, w2 = _problem(n=6)
    calls = []
    real = gm.routed_experts_reference
    monkeypatch.setattr(gm, "routed_experts_reference", lambda *a: calls.append(1) or real(*a))
    with use_backend("grouped_mm", "loop"):
        gm.routed_experts(x, idx, w, w1, w3, w2, SITU)
    assert calls == [1]
    gm.routed_experts(x, idx, w, w1, w3, w2, SITU)
    assert calls == [1], "the override must end with the block"
    with pytest.raises(ValueError, match="backend"):
        with use_backend("grouped_mm", "cutlass"):
            pass


def test_bad_inputs_raise():
    x, idx, w, w1, w3, w2 = _problem()
    with pytest.raises(ValueError, match="w2"):
        routed_experts(x, idx, w, w1, w3, w2.transpose(1, 2), SITU)
    with pytest.raises(ValueError, match="topk_weight"):
        routed_experts(x, idx, w[:, :1], w1, w3, w2, SITU)
    with pytest.raises(ValueError, match="x"):
        routed_experts(x[:, :16], idx, w, w1, w3, w2, SITU)
    with pytest.raises(ValueError, match="backend"):
        routed_experts(x, idx, w, w1, w3, w2, SITU, backend="triton")
    bad = idx.clone()
    bad[0, 0] = 8
    with pytest.raises((IndexError, RuntimeError)):
        routed_experts(x, bad, w, w1, w3, w2, SITU)
