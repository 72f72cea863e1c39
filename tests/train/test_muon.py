"""Per-Head Muon, its AdamW side, parameter grouping, the LR schedule and QK-Clip."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from openk3.config import preset
from openk3.train.muon import Muon, qk_clip_, qk_clip_weights_, zeropower_newton_schulz
from openk3.train.optim import (build_optimizer, classify_parameter, cosine_scheduler, cosine_with_warmup, decay_steps,
                                wsd_with_warmup)
from tests.conftest import assert_close

A, B, C = 3.4445, -4.7750, 2.0315


def ns_reference(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Plain float64 quintic Newton-Schulz on the Frobenius-normalised matrix (no tricks)."""
    x = g.double() / g.double().norm()
    for _ in range(steps):
        if x.shape[0] <= x.shape[1]:
            gram = x @ x.T
            x = A * x + (B * gram + C * gram @ gram) @ x
        else:
            gram = x.T @ x
            x = A * x + x @ (B * gram + C * gram @ gram)
    return x


def muon_reference(w: torch.Tensor, grads: list[torch.Tensor], blocks, lr: float, wd: float, mu: float = 0.95):
    """Moonlight-form Muon (M = mu M + G, U = G + mu M), float64, over row blocks of w.

    ``blocks``: list of (row_indices, rows) per orthogonalised block of a 2-D weight.
    """
    w = w.double().clone()
    m = torch.zeros_like(w)
    for g in grads:
        g = g.double()
        m = mu * m + g
        u = g + mu * m
        w = w * (1 - lr * wd)
        for rows in blocks:
            o = ns_reference(u[rows])
            w[rows] -= lr * 0.2 * math.sqrt(max(o.shape)) * o
    return w


def test_newton_schulz_matches_reference_and_is_near_orthogonal():
    for shape in [(16, 64), (64, 16), (24, 96)]:
        g = torch.randn(*shape)
        o = zeropower_newton_schulz(g)
        assert_close(o, ns_reference(g), atol=2e-5, what=f"NS {shape}")
        # Quintic band of Keller's coefficients: converged singular values lie in ~[0.68, 1.14].
        sv = torch.linalg.svdvals(o.double())
        assert sv.min() > 0.6 and sv.max() < 1.2, (shape, sv.min().item(), sv.max().item())
    # Batched: each matrix is normalised by its own norm, so scaling one block changes nothing.
    gb = torch.randn(3, 8, 32)
    gb[1] *= 100.0
    ob = zeropower_newton_schulz(gb)
    for i in range(3):
        assert_close(ob[i], zeropower_newton_schulz(gb[i]), atol=1e-6, what=f"batch {i}")
    assert zeropower_newton_schulz(torch.zeros(4, 8)).abs().max() == 0
    with pytest.raises(ValueError, match="g: expected"):
        zeropower_newton_schulz(torch.randn(8))


def _single_param_step(grad: torch.Tensor, head_blocks) -> torch.Tensor:
    """The scaled orthogonalised update of one step (zero weights, lr 1, no decay)."""
    p = nn.Parameter(torch.zeros_like(grad))
    opt = Muon([{"params": [p], "head_blocks": head_blocks}], lr=1.0, weight_decay=0.0)
    p.grad = grad.clone()
    opt.step()
    return -p.detach()


def test_per_head_muon_is_newton_schulz_per_head_block():
    H, K, D = 4, 16, 48
    g = torch.randn(H * K, D)
    upd = _single_param_step(g, (H, (K,)))
    # One step from zero momentum: Nesterov input = (1 - mu) g + mu (1 - mu) g, a multiple of g.
    for h in range(H):
        rows = slice(h * K, (h + 1) * K)
        assert_close(upd[rows], 0.2 * math.sqrt(D) * zeropower_newton_schulz(g[rows]), atol=1e-6, what=f"head {h}")
    # Heads are independent: a 1000x larger gradient on one head changes no update.
    g2 = g.clone()
    g2[:K] *= 1000.0
    assert_close(_single_param_step(g2, (H, (K,))), upd, atol=1e-5, what="head-scale invariance")
    # ... unlike full-matrix Muon, where the big head dominates.
    full = _single_param_step(g2, None)
    assert full[K:].abs().mean() < 0.5 * upd[K:].abs().mean()


def test_kv_split_blocks_use_their_own_shape_for_the_rms_factor():
    H, Dn, Dv, C_ = 3, 16, 8, 12
    g = torch.randn(H * (Dn + Dv), C_)
    upd = _single_param_step(g, (H, (Dn, Dv)))
    for h in range(H):
        k_rows = slice(h * (Dn + Dv), h * (Dn + Dv) + Dn)
        v_rows = slice(h * (Dn + Dv) + Dn, (h + 1) * (Dn + Dv))
        assert_close(upd[k_rows], 0.2 * math.sqrt(max(Dn, C_)) * zeropower_newton_schulz(g[k_rows]), atol=1e-6)
        assert_close(upd[v_rows], 0.2 * math.sqrt(max(Dv, C_)) * zeropower_newton_schulz(g[v_rows]), atol=1e-6)
    with pytest.raises(ValueError, match="head_blocks"):
        Muon([{"params": [nn.Parameter(torch.randn(10, 4))], "head_blocks": (3, (4,))}])


def test_stacked_experts_are_orthogonalised_expert_by_expert():
    E, F, L = 3, 12, 20
    g = torch.randn(E, F, L)
    upd = _single_param_step(g, None)
    for e in range(E):
        assert_close(upd[e], 0.2 * math.sqrt(L) * zeropower_newton_schulz(g[e]), atol=1e-6, what=f"expert {e}")


def test_multi_step_per_head_matches_float64_moonlight_reference():
    H, K, D, lr, wd = 2, 8, 24, 0.05, 0.1
    w0 = torch.randn(H * K, D)
    grads = [torch.randn(H * K, D) for _ in range(4)]
    p = nn.Parameter(w0.clone())
    opt = Muon([{"params": [p], "head_blocks": (H, (K,))}], lr=lr, weight_decay=wd)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref = muon_reference(w0, grads, [slice(h * K, (h + 1) * K) for h in range(H)], lr, wd)
    assert_close(p.detach(), ref, atol=2e-6, what="per-head Muon vs float64 reference")


def test_full_matrix_muon_equals_torch_optim_muon():
    """Where defined to agree: 2-D matrices, bf16 Newton-Schulz, Moonlight RMS matching."""
    shapes = [(48, 32), (16, 80)]
    ours = [nn.Parameter(torch.randn(*s)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    o1 = Muon(ours, lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16)
    o2 = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                          adjust_lr_fn="match_rms_adamw")
    for _ in range(5):
        for a, b in zip(ours, theirs):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    for a, b in zip(ours, theirs):
        assert_close(a.detach(), b.detach(), atol=1e-6, what="Muon vs torch.optim.Muon")
        assert not torch.equal(a.detach(), torch.zeros_like(a))


def test_adamw_groups_equal_torch_adamw():
    ours = [nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(5, 3))]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    o1 = Muon([{"params": ours, "use_muon": False}], lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8)
    o2 = torch.optim.AdamW(theirs, lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(6):
        for a, b in zip(ours, theirs):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    for a, b in zip(ours, theirs):
        assert_close(a.detach(), b.detach(), atol=1e-6, what="AdamW side vs torch.optim.AdamW")


def test_build_optimizer_groups_the_real_model_by_name():
    from openk3.model import K3ForCausalLM

    cfg = preset("k3-test-tiny")
    model = K3ForCausalLM(cfg)
    opt = build_optimizer(model, cfg, lr=1e-3)
    where = {n: g for g in opt.param_groups for n in g["param_names"]}
    assert len(where) == sum(1 for p in model.parameters() if p.requires_grad)
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    expect = {
        "model.embed_tokens.weight": ("adamw", None),
        "lm_head.weight": ("adamw", None),
        "model.layers.0.self_attn.q_proj.weight": ("muon_kda_qkv", (H, (K,))),
        "model.layers.0.self_attn.v_proj.weight": ("muon_kda_qkv", (H, (K,))),
        "model.layers.0.self_attn.A_log": ("adamw", None),
        "model.layers.0.self_attn.dt_bias": ("adamw", None),
        "model.layers.0.self_attn.q_conv1d.weight": ("adamw", None),
        "model.layers.0.self_attn.o_proj.weight": ("muon", None),
        "model.layers.0.self_attention_res_proj.weight": ("adamw", None),
        "model.layers.0.input_layernorm.weight": ("adamw", None),
        "model.layers.1.block_sparse_moe.gate.weight": ("muon", None),
        "model.layers.1.block_sparse_moe.experts.w1": ("muon", None),
        "model.layers.3.self_attn.q_b_proj.weight": ("muon_mla_q", (cfg.num_attention_heads, (cfg.qk_head_dim,))),
        "model.layers.3.self_attn.q_a_proj.weight": ("muon", None),
        "model.layers.3.self_attn.kv_b_proj.weight":
            ("muon_mla_kv", (cfg.num_attention_heads, (cfg.qk_nope_head_dim, cfg.v_head_dim))),
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": ("muon", None),
    }
    for name, (group, blocks) in expect.items():
        assert where[name]["name"] == group, name
        assert where[name]["head_blocks"] == blocks, name
        assert where[name]["weight_decay"] == (0.0 if group == "adamw" else 0.1), name
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_classify_rejects_projection_that_does_not_match_config():
    cfg = preset("k3-test-tiny")
    with pytest.raises(ValueError, match="kv_b_proj"):
        classify_parameter("model.layers.3.self_attn.kv_b_proj.weight", torch.empty(10, 16), cfg)
    assert classify_parameter("model.layers.3.self_attn.kv_b_proj.weight", torch.empty(10, 16), cfg,
                              per_head=False) == ("muon", None)


def test_cosine_with_warmup():
    total, warmup, lo = 100, 10, 0.1
    f = [cosine_with_warmup(s, total, warmup, lo) for s in range(total + 5)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0) and f[10] == pytest.approx(1.0)
    assert f[55] == pytest.approx(lo + (1 - lo) * 0.5)  # half-way through the decay
    assert all(a >= b for a, b in zip(f[10:], f[11:])) and f[100] == f[104] == pytest.approx(lo)
    p = nn.Parameter(torch.zeros(3))
    opt = Muon([{"params": [p], "use_muon": False}], lr=2.0)
    sched = cosine_scheduler(opt, total, warmup, lo)
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * x for x in f[:12]])
    with pytest.raises(ValueError, match="warmup"):
        cosine_with_warmup(0, 10, 11)
    with pytest.raises(ValueError, match="min_ratio"):
        cosine_with_warmup(0, 10, 1, 1.5)


def test_wsd_with_warmup_exact_values():
    total, warmup, decay, lo = 100, 10, 20, 0.1
    f = [wsd_with_warmup(s, total, warmup, decay, lo) for s in range(total + 3)]
    assert f[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])  # linear warmup, as cosine's
    assert f[10:81] == [1.0] * 71  # stable: exactly the peak until the decay starts at step 80
    assert f[80] == 1.0 and f[90] == pytest.approx(lo + (1 - lo) * 0.5)  # half-way through the decay
    assert f[85] == pytest.approx(lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert all(a >= b for a, b in zip(f[80:], f[81:])) and f[100] == f[102] == pytest.approx(lo)
    # decay over the whole post-warmup span is the cosine schedule itself; decay 0 drops at the end
    assert [wsd_with_warmup(s, total, warmup, total - warmup, lo) for s in range(total)] == pytest.approx(
        [cosine_with_warmup(s, total, warmup, lo) for s in range(total)])
    assert wsd_with_warmup(99, total, warmup, 0, lo) == 1.0 and wsd_with_warmup(100, total, warmup, 0, lo) == lo
    assert decay_steps(2400, 24, 0.2) == 480 and decay_steps(100, 90, 0.5) == 10 and decay_steps(10, 1, 0.0) == 0
    with pytest.raises(ValueError, match="decay=91"):
        wsd_with_warmup(0, 100, 10, 91)
    with pytest.raises(ValueError, match="decay="):
        wsd_with_warmup(0, 100, 10, True)
    with pytest.raises(ValueError, match="warmup"):
        wsd_with_warmup(0, 10, 11, 0)
    with pytest.raises(ValueError, match="step=-1"):
        wsd_with_warmup(-1, 10, 1, 2)
    with pytest.raises(ValueError, match="decay_fraction=1.5"):
        decay_steps(10, 1, 1.5)


# ------------------------------------------------------------------------------- QK-Clip
class _Attn(nn.Module):
    def __init__(self, H, Dn, Dr, Dv, q_in, kv_lora, lora: bool):
        super().__init__()
        q = nn.Linear(q_in, H * (Dn + Dr), bias=False)
        if lora:
            self.q_b_proj = q
        else:
            self.q_proj = q
        self.kv_a_proj_with_mqa = nn.Linear(q_in, kv_lora + Dr, bias=False)
        self.kv_b_proj = nn.Linear(kv_lora, H * (Dn + Dv), bias=False)


class _Layer(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.self_attn = attn


def _max_logits(attn, cq, ckv, k_rope, H, Dn, Dr, Dv):
    """Per-head max causal logit q.k / sqrt(Dn+Dr), computed straight from the weights."""
    wq = (attn.q_b_proj if hasattr(attn, "q_b_proj") else attn.q_proj).weight.view(H, Dn + Dr, -1)
    wkv = attn.kv_b_proj.weight.view(H, Dn + Dv, -1)
    q = torch.einsum("hdc,tc->htd", wq.double(), cq.double())  # [H, T, Dn+Dr]
    k_nope = torch.einsum("hdc,tc->htd", wkv[:, :Dn].double(), ckv.double())
    k = torch.cat([k_nope, k_rope.double()[None].expand(H, -1, -1)], dim=-1)
    s = q @ k.mT / math.sqrt(Dn + Dr)
    T = cq.shape[0]
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    return s.amax(dim=(1, 2))


@pytest.mark.parametrize("lora", [True, False])
def test_qk_clip_caps_clipped_heads_at_tau_and_leaves_the_rest(lora):
    cfg = preset("k3-test-tiny" if lora else "k3-test-tiny-noqlora")
    H, Dn, Dr, Dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q_in = cfg.q_lora_rank if lora else cfg.hidden_size
    attn = _Attn(H, Dn, Dr, Dv, q_in, cfg.kv_lora_rank, lora)
    with torch.no_grad():
        for h, scale in enumerate([1.0, 3.0, 0.5, 6.0]):  # heads of very different logit size
            (attn.q_b_proj if lora else attn.q_proj).weight.view(H, Dn + Dr, -1)[h] *= scale
    model = nn.Module()
    model.layers = nn.ModuleList([_Layer(nn.Identity()), _Layer(attn)])
    T = 12
    cq, ckv, k_rope = torch.randn(T, q_in), torch.randn(T, cfg.kv_lora_rank), torch.randn(T, Dr)
    before = _max_logits(attn, cq, ckv, k_rope, H, Dn, Dr, Dv)
    tau = before.median().item()
    clipped = before > tau
    assert 0 < clipped.sum() < H
    kv_before = attn.kv_b_proj.weight.detach().clone()
    kv_a_before = attn.kv_a_proj_with_mqa.weight.detach().clone()
    gammas = qk_clip_(model, {1: before.float()}, tau, cfg)
    after = _max_logits(attn, cq, ckv, k_rope, H, Dn, Dr, Dv)
    assert_close(after[clipped], torch.full_like(after[clipped], tau), atol=0, rtol=1e-5, what="clipped heads")
    assert_close(after[~clipped], before[~clipped], atol=0, rtol=1e-12, what="untouched heads")
    assert_close(gammas[1][~clipped], torch.ones(int((~clipped).sum())), atol=0)
    v_rows = kv_before.view(H, Dn + Dv, -1)[:, Dn:]
    assert torch.equal(attn.kv_b_proj.weight.detach().view(H, Dn + Dv, -1)[:, Dn:], v_rows)
    assert torch.equal(attn.kv_a_proj_with_mqa.weight.detach(), kv_a_before)
    # Through a plain list of layers: heads now at or below tau are left alone.
    w_now = attn.kv_b_proj.weight.detach().clone()
    gammas = qk_clip_([_Layer(nn.Identity()), _Layer(attn)], {1: after.float().clamp(max=tau)}, tau, cfg)
    assert torch.equal(gammas[1], torch.ones(H)) and torch.equal(attn.kv_b_proj.weight.detach(), w_now)
    with pytest.raises(ValueError, match="layer 0 has no MLA"):
        qk_clip_(model, {0: before}, tau, cfg)


def test_qk_clip_weights_validates():
    with pytest.raises(ValueError, match="tau"):
        qk_clip_weights_(torch.zeros(8, 4), torch.zeros(8, 4), torch.ones(2), 0.0,
                         num_heads=2, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2)
    with pytest.raises(ValueError, match="non-finite"):
        qk_clip_weights_(torch.zeros(8, 4), torch.zeros(8, 4), torch.tensor([1.0, math.inf]), 1.0,
                         num_heads=2, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2)
    with pytest.raises(ValueError, match="q_weight"):
        qk_clip_weights_(torch.zeros(7, 4), torch.zeros(8, 4), torch.ones(2), 1.0,
                         num_heads=2, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2)


def test_lr_scales_split_groups_and_scale_every_update():
    """``lr_scales``: a prefix's parameters get their own groups at ``multiplier x lr``; with the
    same gradients, one Muon / AdamW step moves them by exactly that multiple of the unscaled
    optimizer's step (both halves' updates, weight decay included, are linear in the LR), and the
    schedule (``initial_lr x multiplier(step)``) keeps the ratio."""
    from openk3.model import K3ForCausalLM

    cfg = preset("k3-test-tiny")
    torch.manual_seed(0)
    a = K3ForCausalLM(cfg)
    b = K3ForCausalLM(cfg)
    b.load_state_dict(a.state_dict())
    plain = build_optimizer(a, cfg, lr=1e-2)
    scaled = build_optimizer(b, cfg, lr=1e-2, lr_scales={"model.layers.0.": 0.25, "lm_head.": 0.5})
    names = [g["name"] for g in scaled.param_groups]
    assert names == ["muon", "muon@0.25", "muon_kda_qkv", "muon_kda_qkv@0.25", "muon_mla_q", "muon_mla_kv",
                     "adamw", "adamw@0.25", "adamw@0.5"]
    lrs = {g["name"]: g["lr"] for g in scaled.param_groups}
    assert lrs["muon@0.25"] == pytest.approx(2.5e-3) and lrs["adamw@0.5"] == pytest.approx(5e-3)
    assert lrs["muon"] == lrs["adamw"] == 1e-2
    assert [n for g in scaled.param_groups if g["name"] == "adamw@0.5" for n in g["param_names"]] == ["lm_head.weight"]
    # the trainer's schedule: lr = initial_lr * multiplier
    for opt in (plain, scaled):
        for g in opt.param_groups:
            g.setdefault("initial_lr", g["lr"])
            g["lr"] = g["initial_lr"] * 0.5
    torch.manual_seed(1)
    grads = {n: torch.randn_like(p) for n, p in a.named_parameters()}
    for model in (a, b):
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
    before = {n: p.detach().clone() for n, p in a.named_parameters()}
    plain.step()
    scaled.step()
    pb = dict(b.named_parameters())
    for n, p in a.named_parameters():
        scale = 0.25 if n.startswith("model.layers.0.") else 0.5 if n.startswith("lm_head.") else 1.0
        assert_close((pb[n] - before[n]).detach(), scale * (p - before[n]).detach(), atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("scales, match", [
    ({"": 0}, r"lr_scales\[''\]=0: must be a finite number > 0"),
    ({"x.": float("inf")}, r"lr_scales\['x.'\]=inf"),
    ({"x.": True}, r"lr_scales\['x.'\]=True"),
])
def test_lr_scales_reject_bad_multipliers(scales, match):
    from openk3.model import K3ForCausalLM

    cfg = preset("k3-test-tiny")
    with pytest.raises(ValueError, match=match):
        build_optimizer(K3ForCausalLM(cfg), cfg, lr=1e-3, lr_scales=scales)
