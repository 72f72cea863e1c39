"""SiTU-GLU / SwiGLU activations and the gated MLP (architecture.md §8)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from openk3.config import K3Config, preset
from openk3.layers.mlp import MLP, glu_activation, situ_glu, swiglu
from openk3.layers.norm import rms_norm
from tests.conftest import assert_close, shared_path


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def test_situ_spec_test_vector():
    out = situ_glu(torch.tensor([-1.0]), torch.tensor([3.0]), 1.0, 1.0)
    expected = math.tanh(-1.0) * _sigmoid(-1.0) * math.tanh(3.0)
    assert abs(out.item() - expected) < 1e-7


def test_situ_closed_form_with_release_betas():
    g = torch.randn(200, dtype=torch.float64) * 10
    u = torch.randn(200, dtype=torch.float64) * 40
    expected = [4 * math.tanh(a / 4) * _sigmoid(a) * 25 * math.tanh(b / 25) for a, b in zip(g.tolist(), u.tolist())]
    assert_close(situ_glu(g, u, 4.0, 25.0), torch.tensor(expected, dtype=torch.float64), atol=1e-12, what="situ")


@pytest.mark.parametrize("b1,b2", [(4.0, 25.0), (1.0, 1.0), (0.5, 3.0)])
def test_situ_output_bounded_by_beta_product(b1, b2):
    g = torch.randn(10_000) * 1e3
    u = torch.randn(10_000) * 1e3
    out = situ_glu(g, u, b1, b2)
    assert out.abs().max().item() <= b1 * b2
    # The cap is reached, not just respected: large positive gate and up saturate at β₁β₂.
    sat = situ_glu(torch.tensor([1e4]), torch.tensor([-1e4]), b1, b2)
    assert abs(sat.item() + b1 * b2) < 1e-4 * b1 * b2


def test_situ_negative_gate_tail_goes_to_zero():
    out = situ_glu(torch.tensor([-40.0, -80.0]), torch.tensor([1e3, 1e3]), 4.0, 25.0)
    assert out.abs().max().item() < 1e-14


def test_situ_matches_swiglu_to_first_order_near_zero():
    g = torch.randn(1000, dtype=torch.float64)
    u = torch.randn(1000, dtype=torch.float64)
    rel = []
    for eps in (1e-1, 5e-2, 2.5e-2):
        a, b = g * eps, u * eps
        ref = swiglu(a, b)
        rel.append(((situ_glu(a, b, 1.0, 1.0) - ref).abs().max() / ref.abs().max()).item())
    # softcap(z) = z - z³/(3β²) + ...: the relative gap is O(eps²), so halving eps quarters it.
    assert rel[0] < 0.1
    for big, small in zip(rel, rel[1:]):
        assert 3.5 < big / small < 4.5


def test_situ_converges_to_swiglu_as_betas_grow():
    g = torch.randn(500, dtype=torch.float64) * 3
    u = torch.randn(500, dtype=torch.float64) * 3
    ref = swiglu(g, u)
    betas = (1.0, 10.0, 100.0, 1e4)
    errs = [(situ_glu(g, u, b, b) - ref).abs().max().item() for b in betas]
    assert all(a > b for a, b in zip(errs, errs[1:]))
    # Far from the cap the gap is O(1/β²).
    assert 0.5e4 < errs[2] / errs[3] < 2e4
    assert errs[-1] < 1e-4 * ref.abs().max().item()


def test_situ_gradient_survives_past_the_cap():
    # A hard clamp would give zero gradient here; the smooth cap does not.
    u = torch.tensor([100.0], requires_grad=True)
    situ_glu(torch.tensor([2.0]), u, 4.0, 25.0).sum().backward()
    assert u.grad.item() > 0


@pytest.mark.parametrize("fn", ["situ", "silu"])
def test_activation_is_evaluated_in_fp32_and_cast_back(fn):
    g = (torch.randn(4096) * 8).bfloat16()
    u = (torch.randn(4096) * 30).bfloat16()
    act = (lambda a, b: situ_glu(a, b, 4.0, 25.0)) if fn == "situ" else swiglu
    out = act(g, u)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, act(g.float(), u.float()).bfloat16())


def test_swiglu_closed_form():
    g = torch.randn(300, dtype=torch.float64)
    u = torch.randn(300, dtype=torch.float64)
    assert_close(swiglu(g, u), g / (1 + torch.exp(-g)) * u, atol=1e-14, what="swiglu")


@pytest.mark.parametrize("name", ["k3-test-tiny", "kimi-linear-tiny"])
def test_mlp_forward_matches_formula(name):
    cfg = preset(name)
    mlp = MLP(cfg, cfg.hidden_size, 40)
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        torch.nn.init.normal_(lin.weight, std=0.3)
    x = torch.randn(2, 5, cfg.hidden_size)
    wg, wu, wd = (m.weight.double() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    g, u = x.double() @ wg.T, x.double() @ wu.T
    if cfg.hidden_act == "situ":
        h = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    else:
        h = g * torch.sigmoid(g) * u
    assert_close(mlp(x), h @ wd.T, atol=1e-5, rtol=1e-5, what=f"{name} MLP")


def test_mlp_checkpoint_names_shapes_and_init():
    cfg = preset("k3-test-tiny")
    mlp = MLP(cfg, 64, 96)
    shapes = {k: tuple(v.shape) for k, v in mlp.state_dict().items()}
    assert shapes == {"gate_proj.weight": (96, 64), "up_proj.weight": (96, 64), "down_proj.weight": (64, 96)}
    std = torch.cat([p.flatten() for p in mlp.parameters()]).std().item()
    assert abs(std - cfg.initializer_range) < 0.1 * cfg.initializer_range


def test_mlp_rejects_bad_arguments():
    cfg = preset("k3-test-tiny")
    with pytest.raises(ValueError, match="intermediate_size"):
        MLP(cfg, 64, -1)
    bad = preset("k3-test-tiny")
    bad.hidden_act = "relu"
    with pytest.raises(ValueError, match="hidden_act"):
        glu_activation(bad)
    bad = preset("k3-test-tiny")
    bad.activation_situ_linear_beta = 0.0
    with pytest.raises(ValueError, match="activation_situ_linear_beta"):
        glu_activation(bad)


def test_dense_mlp_matches_reference_fixture():
    root = shared_path("fixtures", "k3-ref-tiny-a")
    cfg = K3Config.from_pretrained(root)
    weights = load_file(str(root / "model.safetensors"))
    ref = load_file(str(root / "reference_outputs.safetensors"))
    prefix = "language_model.model.layers.0."
    mlp = MLP(cfg, cfg.hidden_size, cfg.intermediate_size)
    mlp.load_state_dict({k[len(prefix + "mlp."):]: v for k, v in weights.items() if k.startswith(prefix + "mlp.")})
    norm_w = weights[prefix + "post_attention_layernorm.weight"]
    x = rms_norm(ref["short.hidden.layer0.ffn_in"], norm_w, cfg.rms_norm_eps)
    with torch.no_grad():
        assert_close(mlp(x), ref["short.hidden.layer0.ffn_out"], atol=1e-5, what="layer-0 dense MLP")


@pytest.mark.parametrize("b2", [25.0, None])
def test_situ_in_place_inference_form_equals_the_autograd_form(b2):
    # Without autograd situ_glu runs in place in one buffer; with inputs that need gradients it
    # runs the plain expression. Both compute the same values (to fp32 rounding), leave the
    # inputs unchanged, and the plain form still has its gradient.
    g = torch.randn(64, 96) * 6
    u = torch.randn(64, 96) * 30
    g0, u0 = g.clone(), u.clone()
    fast = situ_glu(g, u, 4.0, b2)
    assert torch.equal(g, g0) and torch.equal(u, u0)
    gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()
    plain = situ_glu(gr, ur, 4.0, b2)
    assert plain.requires_grad and not fast.requires_grad
    assert_close(fast, plain.detach(), atol=1e-6 * float(plain.abs().max()), what="in-place vs plain")
    plain.sum().backward()
    assert gr.grad is not None and torch.isfinite(gr.grad).all() and float(gr.grad.abs().max()) > 0
