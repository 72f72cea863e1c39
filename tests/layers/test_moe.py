"""Router and LatentMoE against per-token float64 implementations of architecture.md §6.1."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from openk3.config import K3Config, preset
from openk3.layers.moe import Experts, LatentMoE, Router, RouterOutput, select_topk
from openk3.layers.norm import rms_norm
from openk3.ops.backends import use_backend
from tests.conftest import assert_close, shared_path

# ----------------------------------------------------------------------------- reference


def _act(cfg: K3Config, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if cfg.hidden_act == "silu":
        return g * torch.sigmoid(g) * u
    b1, b2 = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * b2 * torch.tanh(u / b2)


def _naive_grouped_topk(biased: list[float], k: int, n_group: int, topk_group: int) -> list[int]:
    """DeepSeek-V3 noaux_tc choice for one token: groups by top-2 sum, then top-k inside them."""
    per = len(biased) // n_group
    group_score = [sum(sorted(biased[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
    kept = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
    eligible = [e for g in kept for e in range(g * per, (g + 1) * per)]
    return sorted(eligible, key=lambda e: -biased[e])[:k]


def _naive_moe(cfg: K3Config, p: dict[str, torch.Tensor], x: torch.Tensor, forced=None):
    """One token at a time, straight from the spec. p: float64 state dict of LatentMoE (stacked
    expert names); x: [N, D] float64. Returns (y [N, D], chosen experts per token, in pick order)."""
    k = cfg.num_experts_per_tok
    n_group, topk_group = cfg.n_group, cfg.topk_group
    bias = p["gate.e_score_correction_bias"]
    outs, chosen = [], []
    for t in range(x.shape[0]):
        xt = x[t]
        s = torch.sigmoid(p["gate.weight"] @ xt)
        if forced is None:
            pick = _naive_grouped_topk((s + bias).tolist(), k, n_group, topk_group)
        else:
            pick = [int(e) for e in forced[t]]
        w = s[pick]
        if cfg.norm_topk_prob and k > 1:
            w = w / w.sum()
        w = w * cfg.routed_scaling_factor
        z = p["routed_expert_down_proj.weight"] @ xt if cfg.routed_expert_hidden_size else xt
        u = sum(w[j] * (p["experts.w2"][e] @ _act(cfg, p["experts.w1"][e] @ z, p["experts.w3"][e] @ z))
                for j, e in enumerate(pick))
        if "routed_expert_norm.weight" in p:
            u = u / torch.sqrt(u.pow(2).mean() + cfg.rms_norm_eps) * p["routed_expert_norm.weight"]
        y = p["routed_expert_up_proj.weight"] @ u if cfg.routed_expert_hidden_size else u
        if "shared_experts.gate_proj.weight" in p:
            h = _act(cfg, p["shared_experts.gate_proj.weight"] @ xt, p["shared_experts.up_proj.weight"] @ xt)
            y = y + p["shared_experts.down_proj.weight"] @ h
        outs.append(y)
        chosen.append(pick)
    return torch.stack(outs), chosen


VARIANTS = {
    "k3": lambda: preset("k3-test-tiny"),
    "k3-no-shared": lambda: preset("k3-test-tiny").replace(n_shared_experts=0),
    "k3-no-norm": lambda: preset("k3-test-tiny").replace(latent_moe_use_norm=False),
    "kimi-linear": lambda: preset("kimi-linear-tiny"),
    "kimi-linear-grouped": lambda: preset("kimi-linear-tiny").replace(n_group=4, topk_group=2),
}


def _moe(cfg: K3Config) -> LatentMoE:
    """A LatentMoE with weights drawn at the fixture's scales (so SiTU caps and routing gaps are
    exercised) and a non-zero selection bias."""
    m = LatentMoE(cfg, layer_idx=1)
    std = {"gate.weight": 0.3, "experts.w1": 0.3, "experts.w3": 0.6, "experts.w2": 0.1,
           "routed_expert_down_proj.weight": 0.3, "routed_expert_up_proj.weight": 0.15,
           "shared_experts.gate_proj.weight": 0.25, "shared_experts.up_proj.weight": 0.5,
           "shared_experts.down_proj.weight": 0.05}
    with torch.no_grad():
        for name, t in m.state_dict(keep_vars=True).items():
            if name == "gate.e_score_correction_bias":
                t.normal_(0.0, 0.3)
            elif name == "routed_expert_norm.weight":
                t.normal_(1.0, 0.1)
            else:
                t.normal_(0.0, std[name])
    return m


def _min_routing_gap(m: LatentMoE, x: torch.Tensor) -> float:
    biased = torch.sigmoid(x.double() @ m.gate.weight.double().T) + m.gate.e_score_correction_bias.double()
    top = biased.topk(m.gate.top_k + 1, dim=-1).values
    return (top[:, -2] - top[:, -1]).min().item()


# ----------------------------------------------------------------------------- router


def _router(cfg: K3Config, std: float = 0.3) -> Router:
    r = Router(cfg)
    torch.nn.init.normal_(r.weight, std=std)
    return r


def test_router_output_types_and_scores():
    cfg = preset("k3-test-tiny")
    r = _router(cfg)
    x = torch.randn(13, cfg.hidden_size).bfloat16()
    out = r(x)
    assert isinstance(out, RouterOutput)
    assert out.topk_idx.shape == (13, 2) and out.topk_idx.dtype == torch.int64
    assert out.topk_weight.dtype == torch.float32 and out.scores.dtype == torch.float32
    assert out.scores.shape == (13, cfg.n_routed_experts)
    assert_close(out.scores, torch.sigmoid(x.double() @ r.weight.double().T), atol=1e-6, what="scores")
    biased = out.scores + r.e_score_correction_bias
    chosen = biased.gather(1, out.topk_idx)
    assert bool((chosen[:, :-1] >= chosen[:, 1:]).all()), "ids are ordered by biased score"


def test_bias_changes_selection_but_not_weights():
    cfg = preset("k3-test-tiny")
    r = _router(cfg)
    x = torch.randn(40, cfg.hidden_size)
    plain = r(x)
    r.e_score_correction_bias[5] = 10.0
    biased = r(x)
    assert bool((biased.topk_idx == 5).any(-1).all()), "a large bias forces expert 5 into every top-k"
    assert not torch.equal(plain.topk_idx, biased.topk_idx)
    assert torch.equal(plain.scores, biased.scores)
    raw = biased.scores.gather(1, biased.topk_idx)  # unbiased scores of the chosen experts
    assert_close(biased.topk_weight, raw / raw.sum(-1, keepdim=True), atol=1e-7, what="weights")


@pytest.mark.parametrize("name", ["k3-test-tiny", "kimi-linear-tiny"])
def test_renormalisation_and_scaling(name):
    cfg = preset(name)
    x = torch.randn(25, cfg.hidden_size)
    out = _router(cfg)(x)
    s = torch.full((25,), cfg.routed_scaling_factor)
    assert_close(out.topk_weight.sum(-1), s, atol=1e-6, what="sum of weights")
    r = _router(cfg.replace(norm_topk_prob=False))
    out = r(x)
    assert_close(out.topk_weight, out.scores.gather(1, out.topk_idx) * cfg.routed_scaling_factor,
                 atol=1e-7, what="no renormalisation")
    # k = 1: the official gate renormalises only for k > 1, keeping the raw score.
    r = _router(cfg.replace(num_experts_per_tok=1))
    out = r(x)
    assert_close(out.topk_weight[:, 0], out.scores.max(-1).values * cfg.routed_scaling_factor,
                 atol=1e-7, what="k=1")


@pytest.mark.parametrize("e,n_group,topk_group,k", [(16, 4, 2, 3), (16, 4, 1, 4), (12, 3, 2, 5), (8, 8, 3, 2)])
def test_grouped_topk_matches_naive(e, n_group, topk_group, k):
    # Negative values included: masked experts must never win, whatever the sign of the scores.
    biased = torch.rand(64, e) - 0.6
    got = select_topk(biased, k, n_group, topk_group)
    for t in range(biased.shape[0]):
        assert got[t].tolist() == _naive_grouped_topk(biased[t].tolist(), k, n_group, topk_group)


def test_grouped_router_uses_groups():
    cfg = preset("kimi-linear-tiny").replace(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3)
    r = _router(cfg)
    r.e_score_correction_bias.normal_(0.0, 0.3)
    x = torch.randn(30, cfg.hidden_size)
    out = r(x)
    biased = (out.scores + r.e_score_correction_bias).tolist()
    for t in range(30):
        assert out.topk_idx[t].tolist() == _naive_grouped_topk(biased[t], 3, 4, 2)
    # use_grouped_topk=false does not turn the groups off: the official gates never read it (they group
    # whenever num_expert_group > topk_group), and neither does openk3.
    d = cfg.to_dict()
    d["use_grouped_topk"] = False
    same = Router(K3Config.from_dict(d))
    same.load_state_dict(r.state_dict())
    assert torch.equal(same(x).topk_idx, out.topk_idx)
    assert not torch.equal(out.topk_idx, select_topk(torch.tensor(biased), 3))  # the groups did matter


def test_k_equals_e_and_ties():
    idx = select_topk(torch.rand(7, 8), 8)
    assert torch.equal(idx.sort(-1).values, torch.arange(8).expand(7, 8))
    tied = select_topk(torch.zeros(5, 8), 3)
    assert all(len(set(row)) == 3 and all(0 <= e < 8 for e in row) for row in tied.tolist())
    cfg = preset("k3-test-tiny").replace(num_experts_per_tok=8)
    r = Router(cfg)
    torch.nn.init.zeros_(r.weight)  # every score is exactly 0.5: a full tie
    out = r(torch.randn(4, cfg.hidden_size))
    assert torch.equal(out.topk_idx.sort(-1).values, torch.arange(8).expand(4, 8))
    assert_close(out.topk_weight, torch.full((4, 8), 1 / 8), atol=1e-7, what="tied weights")


def test_router_errors():
    cfg = preset("k3-test-tiny")
    with pytest.raises(ValueError, match="k=3"):
        select_topk(torch.zeros(2, 8), 3, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="n_group"):
        select_topk(torch.zeros(2, 8), 2, n_group=3, topk_group=1)
    r = Router(cfg)
    with pytest.raises(ValueError, match="force_topk_idx"):
        r(torch.randn(3, 64), force_topk_idx=torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="force_topk_idx"):
        r(torch.randn(3, 64), force_topk_idx=torch.full((3, 2), 8))
    with pytest.raises(ValueError, match=r"x: expected \[N, D=64\]"):
        r(torch.randn(3, 32))


# ----------------------------------------------------------------------------- LatentMoE


def test_structure_and_checkpoint_names():
    k3 = LatentMoE(preset("k3-test-tiny"), 1)
    names = {k: tuple(v.shape) for k, v in k3.state_dict().items()}
    assert names == {
        "gate.weight": (8, 64), "gate.e_score_correction_bias": (8,),
        "experts.w1": (8, 24, 32), "experts.w3": (8, 24, 32), "experts.w2": (8, 32, 24),
        "routed_expert_down_proj.weight": (32, 64), "routed_expert_norm.weight": (32,),
        "routed_expert_up_proj.weight": (64, 32),
        "shared_experts.gate_proj.weight": (48, 64), "shared_experts.up_proj.weight": (48, 64),
        "shared_experts.down_proj.weight": (64, 48),
    }
    kl = LatentMoE(preset("kimi-linear-tiny"), 1)
    assert set(kl.state_dict()) == {
        "gate.weight", "gate.e_score_correction_bias", "experts.w1", "experts.w3", "experts.w2",
        "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight", "shared_experts.down_proj.weight",
    }
    assert kl.experts.w1.shape == (8, 24, 64)
    no_shared = LatentMoE(preset("k3-test-tiny").replace(n_shared_experts=None), 1)
    assert "shared_experts" not in dict(no_shared.named_children())
    # num_shared_experts=0: the reference's zero-width shared MLP (zero-size tensors, adds nothing)
    zero = LatentMoE(preset("k3-test-tiny").replace(n_shared_experts=0), 1)
    assert tuple(zero.shared_experts.gate_proj.weight.shape) == (0, 64)
    assert tuple(zero.shared_experts.down_proj.weight.shape) == (64, 0)


def test_init():
    cfg = preset("k3-test-tiny").replace(n_routed_experts=64, num_experts_per_tok=4)
    m = LatentMoE(cfg, 1)
    assert m.gate.weight.dtype == torch.float32 and m.gate.e_score_correction_bias.dtype == torch.float32
    assert not m.gate.e_score_correction_bias.requires_grad
    assert torch.equal(m.gate.e_score_correction_bias, torch.zeros(64))
    assert torch.equal(m.routed_expert_norm.weight.detach(), torch.ones(32))
    for t in (m.gate.weight, m.experts.w1, m.experts.w2, m.experts.w3,
              m.routed_expert_down_proj.weight, m.routed_expert_up_proj.weight):
        assert abs(t.std().item() - cfg.initializer_range) < 0.15 * cfg.initializer_range
        assert abs(t.mean().item()) < 0.15 * cfg.initializer_range


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_matches_naive_float64(variant):
    cfg = VARIANTS[variant]()
    m = _moe(cfg)
    x = torch.randn(3, 7, cfg.hidden_size)  # 21 tokens
    assert _min_routing_gap(m, x.reshape(-1, cfg.hidden_size)) > 1e-4, "test draw has a routing near-tie"
    sink: list = []
    with torch.no_grad():
        y = m(x, routing_sink=sink)
    p = {k: v.double() for k, v in m.state_dict().items()}
    ref, chosen = _naive_moe(cfg, p, x.reshape(-1, cfg.hidden_size).double())
    assert y.shape == x.shape and y.dtype == torch.float32
    assert_close(y.reshape(-1, cfg.hidden_size), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5, what=variant)
    assert len(sink) == 1 and sink[0].topk_idx.tolist() == chosen
    # [N, D] input gives the same result as [B, T, D].
    with torch.no_grad():
        assert torch.equal(m(x.reshape(-1, cfg.hidden_size)), y.reshape(-1, cfg.hidden_size))


def test_forced_routing_matches_naive():
    cfg = VARIANTS["k3"]()
    m = _moe(cfg)
    x = torch.randn(9, cfg.hidden_size)
    forced = torch.stack([torch.randperm(8)[:2] for _ in range(9)])
    forced[:, 0] = 7  # everyone uses expert 7; most other experts get nobody
    sink: list = []
    with torch.no_grad():
        y = m(x, routing_sink=sink, force_topk_idx=forced)
    ref, _ = _naive_moe(cfg, {k: v.double() for k, v in m.state_dict().items()}, x.double(), forced=forced)
    assert torch.equal(sink[0].topk_idx, forced)
    assert_close(y, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5, what="forced routing")


@pytest.mark.parametrize("variant", ["k3", "kimi-linear"])
def test_gradients_match_naive_float64(variant):
    cfg = VARIANTS[variant]()
    m = _moe(cfg)
    x = torch.randn(2, 4, cfg.hidden_size, requires_grad=True)
    probe = torch.randn(2, 4, cfg.hidden_size)
    (m(x) * probe).sum().backward()
    params = {k: v.detach().double().requires_grad_(v.requires_grad) for k, v in m.state_dict(keep_vars=True).items()}
    x64 = x.detach().double().requires_grad_(True)
    ref, _ = _naive_moe(cfg, params, x64.reshape(-1, cfg.hidden_size))
    (ref * probe.reshape(-1, cfg.hidden_size).double()).sum().backward()
    named = dict(m.named_parameters())
    assert set(named) == {k for k, v in params.items() if v.requires_grad}
    for name, param in named.items():
        expected = params[name].grad
        assert param.grad is not None and expected.abs().max() > 0, f"no gradient reaches {name}"
        assert_close(param.grad, expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-4, what=f"grad {name}")
    assert_close(x.grad, x64.grad, atol=1e-5 * x64.grad.abs().max().item(), rtol=1e-4, what="grad x")


def test_backends_agree_inside_the_module():
    cfg = VARIANTS["k3"]()
    m = _moe(cfg)
    x = torch.randn(31, cfg.hidden_size)
    with torch.no_grad():
        fast = m(x)
        with use_backend("grouped_mm", "loop"):
            slow = m(x)
        with use_backend("grouped_mm", "bmm"):
            padded = m(x)
    assert_close(fast, slow, atol=1e-5, rtol=1e-5, what="auto vs loop")
    assert_close(padded, slow, atol=1e-5, rtol=1e-5, what="bmm vs loop")


def test_bf16_module_keeps_fp32_routing():
    cfg = VARIANTS["k3"]()
    m = _moe(cfg).bfloat16()
    sink: list = []
    y = m(torch.randn(2, 5, cfg.hidden_size).bfloat16(), routing_sink=sink)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    assert sink[0].scores.dtype == torch.float32 and sink[0].topk_weight.dtype == torch.float32


def test_experts_module_checks_widths():
    ex = Experts(preset("k3-test-tiny"))
    with pytest.raises(ValueError, match="width"):
        ex(torch.randn(4, 64), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2))


# ----------------------------------------------------------------------------- reference fixture


def test_moe_layers_match_reference_fixture():
    """Every MoE layer of k3-ref-tiny-a: same experts chosen, same weights, same block output."""
    root = shared_path("fixtures", "k3-ref-tiny-a")
    cfg = K3Config.from_pretrained(root)
    weights = load_file(str(root / "model.safetensors"))
    ref = load_file(str(root / "reference_outputs.safetensors"))
    layers = [i for i, t in enumerate(cfg.mlp_layer_types) if t == "sparse"]
    assert layers == [1, 2, 3, 4, 5, 6]
    for layer in layers:
        prefix = f"language_model.model.layers.{layer}.block_sparse_moe."
        state = {k[len(prefix):]: v for k, v in weights.items()
                 if k.startswith(prefix) and not k[len(prefix):].startswith("experts.")}
        for w in ("w1", "w2", "w3"):
            state[f"experts.{w}"] = torch.stack(
                [weights[f"{prefix}experts.{e}.{w}.weight"] for e in range(cfg.n_routed_experts)]
            )
        m = LatentMoE(cfg, layer)
        m.load_state_dict(state)
        x = rms_norm(
            ref[f"short.hidden.layer{layer}.ffn_in"],
            weights[f"language_model.model.layers.{layer}.post_attention_layernorm.weight"],
            cfg.rms_norm_eps,
        )
        sink: list = []
        with torch.no_grad():
            y = m(x, routing_sink=sink)
        idx, perm = sink[0].topk_idx.sort(-1)
        assert torch.equal(idx, ref[f"short.hidden.layer{layer}.router.topk_idx"]), f"layer {layer} routing"
        assert_close(sink[0].topk_weight.gather(1, perm), ref[f"short.hidden.layer{layer}.router.topk_weight"],
                     atol=1e-6, what=f"layer {layer} routing weights")
        expected = ref[f"short.hidden.layer{layer}.ffn_out"]
        assert_close(y, expected, atol=1e-5 * max(1.0, expected.abs().max().item()), what=f"layer {layer} output")


def test_routing_weights_sum_is_irrelevant_after_latent_norm():
    """Why K3 sets routed_scaling_factor=1 (architecture.md §6.1): the latent RMSNorm removes the
    routed branch's scale, so scaling the weights changes the output only through eps."""
    base = VARIANTS["k3"]().replace(n_shared_experts=0)
    m1 = _moe(base)
    m2 = LatentMoE(base.replace(routed_scaling_factor=3.0), 1)
    m2.load_state_dict(m1.state_dict())
    x = torch.randn(10, base.hidden_size)
    with torch.no_grad():
        assert_close(m2(x), m1(x), atol=1e-4 * m1(x).abs().max().item(), what="scale invariance")
    assert math.isclose(m2.gate.routed_scaling_factor, 3.0)
