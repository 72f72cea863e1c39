"""QAT on routed experts: forward equals explicit MXFP4/MXFP8 fake-quant, gradients are straight
through into the fp32 master weights, the switch, and a short SGD run that learns as well as fp32."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from openk3.config import preset
from openk3.layers.mlp import situ_glu
from openk3.layers.moe import Experts, LatentMoE
from openk3.layers.norm import RMSNorm
from openk3.ops.backends import use_backend
from openk3.pretrained import build_model
from openk3.quant.mx import dequantize_mxfp4, dequantize_mxfp8, quantize_mxfp4, quantize_mxfp8
from openk3.quant.qat import SCHEMES, QuantScheme, RoutedExperts, model_qat, qat_scheme, resolve_scheme
from tests.conftest import assert_close


def _cfg():
    """k3-test-tiny with an MX-compatible expert width (its F = 24 is not a multiple of 32)."""
    return preset("k3-test-tiny").replace(moe_intermediate_size=32)


def _experts(e=6, f=64, l=32) -> Experts:
    ex = Experts(_cfg().replace(n_routed_experts=e, moe_intermediate_size=f, routed_expert_hidden_size=l))
    with torch.no_grad():
        for w in (ex.w1, ex.w3, ex.w2):
            w.normal_(0.0, 0.2)
    return ex


def _dq4(w):  # explicit MXFP4 round trip along the last dim (the GEMM's K)
    return dequantize_mxfp4(*quantize_mxfp4(w.detach()))


def _dq8(x):
    return dequantize_mxfp8(*quantize_mxfp8(x.detach()))


def _ste(x, q):  # straight-through written independently of the library: value q(x), gradient 1
    return x + (q(x) - x).detach()


def _oracle(z, idx, wts, w1, w3, w2, act, inputs: bool):
    """Per-token / per-slot loop with explicitly fake-quantized weights and inputs."""
    qi = (lambda t: _ste(t, _dq8)) if inputs else (lambda t: t)
    rows = []
    for n in range(z.shape[0]):
        zn = qi(z[n:n + 1])
        acc = 0.0
        for j in range(idx.shape[1]):
            e = int(idx[n, j])
            h = act(zn @ w1[e].T, zn @ w3[e].T)
            acc = acc + wts[n, j] * (qi(h) @ w2[e].T)
        rows.append(acc)
    return torch.cat(rows)


@pytest.mark.parametrize("backend", ["grouped_mm", "bmm", "loop"])
@pytest.mark.parametrize("scheme", ["mxfp4", "mxfp4-weight-only"])
def test_qat_forward_equals_explicit_fake_quant(backend, scheme):
    ex = _experts()
    model_qat(nn.ModuleList([ex]), scheme)
    assert ex.qat is SCHEMES[scheme]
    n, k = 13, 2
    z = torch.randn(n, 32) * 2
    idx = torch.rand(n, 6).argsort(-1)[:, :k]
    wts = torch.rand(n, k)
    with use_backend("grouped_mm", backend):
        got = ex(z, idx, wts)
    want = _oracle(z, idx, wts, _dq4(ex.w1), _dq4(ex.w3), _dq4(ex.w2), ex.act, scheme == "mxfp4")
    assert_close(got, want, atol=1e-5, rtol=1e-5, what=f"QAT {scheme} forward ({backend})")
    ex.qat = None
    plain = ex(z, idx, wts)
    assert (plain - got).abs().max() > 1e-3  # fake-quant changes the result (the test can fail)


def test_qat_gradients_are_straight_through():
    ex = _experts()
    model_qat(nn.ModuleList([ex]), "mxfp4")
    n, k = 9, 3
    z = torch.randn(n, 32, requires_grad=True)
    idx = torch.rand(n, 6).argsort(-1)[:, :k]
    wts = torch.rand(n, k, requires_grad=True)
    g_out = torch.randn(n, 32)
    (ex(z, idx, wts) * g_out).sum().backward()
    # oracle: fake-quantized weights as leaves; inputs through an independent STE
    leaves = [_dq4(w).requires_grad_(True) for w in (ex.w1, ex.w3, ex.w2)]
    z2 = z.detach().clone().requires_grad_(True)
    wts2 = wts.detach().clone().requires_grad_(True)
    (_oracle(z2, idx, wts2, *leaves, ex.act, True) * g_out).sum().backward()
    for name, master, leaf in zip(("w1", "w3", "w2"), (ex.w1, ex.w3, ex.w2), leaves):
        assert master.dtype == torch.float32
        assert_close(master.grad, leaf.grad, atol=1e-5, rtol=1e-5, what=f"d loss / d {name} (STE)")
    assert_close(z.grad, z2.grad, atol=1e-5, rtol=1e-5, what="d loss / d z (STE through MXFP8)")
    assert_close(wts.grad, wts2.grad, atol=1e-5, rtol=1e-5, what="d loss / d routing weights")


def test_model_qat_switch_keeps_master_weights_and_state_dict():
    model = build_model(_cfg(), seed=4)
    ids = torch.randint(0, 512, (1, 6))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        off = model(ids).logits
    assert qat_scheme(model) is None
    assert model_qat(model, "mxfp4") == 5  # the MoE layers of k3-test-tiny
    assert qat_scheme(model) is SCHEMES["mxfp4"]
    assert "qat=mxfp4" in repr(model.model.layers[1].block_sparse_moe.experts)
    with torch.no_grad():
        on = model(ids).logits
    assert (on - off).abs().max() > 1e-4
    sd = model.state_dict()
    assert sd.keys() == before.keys() and all(torch.equal(sd[k], before[k]) for k in sd)
    assert model_qat(model, None) == 5 and qat_scheme(model) is None
    with torch.no_grad():
        assert torch.equal(model(ids).logits, off)
    model.model.layers[1].block_sparse_moe.experts.qat = SCHEMES["mxfp4"]
    with pytest.raises(ValueError, match="different QAT schemes"):
        qat_scheme(model)


def test_routed_experts_are_found_by_protocol_not_class():
    """Dense and packed experts are RoutedExperts (model_qat switches both); a module with a
    ``qat`` slot and ``w1`` but no ``w2`` / ``w3`` is not one and is left alone."""
    from openk3.quant.packed import PackedExperts

    dense = _experts()
    packed = PackedExperts.from_experts(dense)
    assert isinstance(dense, RoutedExperts) and isinstance(packed, RoutedExperts)

    class HalfExperts(nn.Module):
        qat = None

        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.zeros(2, 32, 32))

    half = HalfExperts()
    assert not isinstance(half, RoutedExperts)
    assert model_qat(nn.ModuleList([dense, packed, half]), "mxfp4") == 2
    assert dense.qat is packed.qat is SCHEMES["mxfp4"] and half.qat is None


def test_qat_errors_and_scheme_resolution():
    with pytest.raises(ValueError, match=r"moe_intermediate_size=24 is not a multiple of 32"):
        model_qat(build_model(preset("k3-test-tiny")), "mxfp4")
    with pytest.raises(ValueError, match="quantization='int4'"):
        resolve_scheme("int4")
    assert resolve_scheme(None) is None and resolve_scheme("none") is None and resolve_scheme("off") is None
    assert resolve_scheme("mxfp4") is SCHEMES["mxfp4"]
    with pytest.raises(ValueError, match="scale_mode='ceil'"):
        QuantScheme("x", scale_mode="ceil")
    rceil = QuantScheme("mxfp4-rceil", scale_mode="rceil")
    w = torch.tensor([[7.0] + [0.5] * 31])  # FLOOR clips 7 to 6; RCEIL picks the larger scale
    assert SCHEMES["mxfp4"].fake_quant_weight(w)[0, 0] == 6.0
    assert rceil.fake_quant_weight(w)[0, 0] == 8.0


class _TinyMoELM(nn.Module):
    """Embedding -> RMSNorm -> LatentMoE (residual) -> RMSNorm -> LM head: the smallest network in
    which every routed-expert GEMM is on the training path (the full tiny model is too slow to train
    in a unit test on two shared CPU cores)."""

    def __init__(self, cfg, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, cfg.hidden_size)
        nn.init.normal_(self.embed.weight, std=1.0)
        self.norm1, self.norm2 = RMSNorm(cfg.hidden_size, 1e-6), RMSNorm(cfg.hidden_size, 1e-6)
        self.moe = LatentMoE(cfg, 1)
        self.head = nn.Linear(cfg.hidden_size, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.moe(self.norm1(h))
        return self.head(self.norm2(h))


def _train(qat: str | None, steps: int = 40) -> list[float]:
    torch.manual_seed(11)
    cfg = _cfg().replace(initializer_range=0.1, hidden_size=64, moe_intermediate_size=64, routed_expert_hidden_size=64)
    net = _TinyMoELM(cfg, vocab=64)
    model_qat(net, qat)
    data = torch.Generator().manual_seed(5)
    perm = torch.randperm(64, generator=data)
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for _ in range(steps):
        # synthetic next-token task: y = perm[x] with prob. 0.6, else uniform noise, so the loss has a
        # floor of ~2.2 nats (entropy of the label noise) and the two runs are compared away from 0
        x = torch.randint(0, 64, (8, 16), generator=data)
        noise = torch.rand(x.shape, generator=data) < 0.4
        y = torch.where(noise, torch.randint(0, 64, x.shape, generator=data), perm[x])
        loss = nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.dtype == torch.float32 for p in net.parameters())  # fp32 masters throughout
    return losses


def test_short_sgd_run_with_qat_learns_like_fp32():
    base, qat = _train(None), _train("mxfp4")
    first, end_base, end_qat = base[0], sum(base[-5:]) / 5, sum(qat[-5:]) / 5
    assert end_base < 0.65 * first and end_qat < 0.65 * first  # both really learned (ln 64 -> ~2.4)
    assert abs(end_qat - end_base) <= 0.05 * end_base, (end_base, end_qat)
    assert base != qat  # QAT was really on
