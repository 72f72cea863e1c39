"""Packed MXFP4 experts: the packed grouped matmul (native kernel and torch path) against
dequantize-then-matmul, model conversion, and the 4.25 bits per weight of packed storage."""

from __future__ import annotations

import functools

import pytest
import torch

from openk3.config import preset
from openk3.layers.mlp import situ_glu, swiglu
from openk3.layers.moe import Experts
from openk3.pretrained import build_model
from openk3.quant import mxfp4_cpu
from openk3.quant.mx import (
    E2M1_VALUES,
    dequantize_mxfp8,
    mxfp4_weight_from_packed,
    mxfp4_weight_to_packed,
    pack_mxfp4,
    quantize_mxfp8,
)
from openk3.quant.packed import (
    MXFP4Weight,
    PackedExperts,
    expert_storage,
    pack_experts,
    packed_routed_experts,
    packed_routed_experts_reference,
    unpack_experts,
)
from openk3.quant.qat import model_qat
from tests.conftest import assert_close

SITU = functools.partial(situ_glu, beta1=4.0, beta2=25.0)
native = pytest.mark.skipif(not mxfp4_cpu.available(), reason=f"no native kernel: {mxfp4_cpu.unavailable_reason()}")


def _random_packed(e: int, o: int, k: int, lo: int = 116, hi: int = 124) -> MXFP4Weight:
    """Random codes and scales (every code value; scales 2^-11..2^-4 keep outputs O(1), so the
    1e-6 tolerance is relative to fp32 rounding of O(1) sums) as an MXFP4Weight."""
    w = MXFP4Weight(e, o, k)
    w.weight_packed.copy_(pack_mxfp4(torch.randint(0, 16, (e, o, k), dtype=torch.uint8)))
    w.weight_scale.copy_(torch.randint(lo, hi, (e, o, k // 32), dtype=torch.uint8))
    return w


def _routing(n: int, e: int, k: int, hot: int | None = None):
    """Distinct experts per row; expert 1 never chosen; optionally one expert chosen by every row
    (so it gets more rows than the kernel's 8-token register tile)."""
    allowed = torch.tensor([i for i in range(e) if i != 1])
    idx = allowed[torch.rand(n, len(allowed)).argsort(-1)[:, :k]]
    if hot is not None:
        idx[:, 0] = hot
        idx[:, 1:] = torch.where(idx[:, 1:] == hot, (hot + 2) % e, idx[:, 1:])
    return idx, torch.rand(n, k)


def _mxfp8(t: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp8(*quantize_mxfp8(t))


def _explicit(x, idx, wts, w1, w3, w2, act, quant=None):
    """Per-token, per-slot float64 loop on the exactly dequantized weights (independent oracle)."""
    dense = [mxfp4_weight_from_packed(w.weight_packed, w.weight_scale).double() for w in (w1, w3, w2)]
    q = quant or (lambda t: t)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for n in range(x.shape[0]):
        xn = q(x[n:n + 1].float()).double()
        for j in range(idx.shape[1]):
            e = int(idx[n, j])
            h = act(xn @ dense[0][e].T, xn @ dense[1][e].T)
            out[n] += wts[n, j].double() * (q(h.float()).double() @ dense[2][e].T)[0]
    return out


IMPLS = [pytest.param("native", 2, marks=native, id="native-avx512"),
         pytest.param("native", 1, marks=native, id="native-avx2"),
         pytest.param("native", 0, marks=native, id="native-scalar"),
         pytest.param("torch", None, id="torch")]


@pytest.mark.parametrize("impl,simd", IMPLS)
@pytest.mark.parametrize("act", [SITU, swiglu], ids=["situ", "swiglu"])
def test_packed_path_equals_dequantize_then_matmul(impl, simd, act, monkeypatch):
    if simd is not None:
        if simd > mxfp4_cpu.simd_level():
            pytest.skip(f"CPU lacks SIMD level {simd}")
        monkeypatch.setattr(mxfp4_cpu, "grouped_gemm", functools.partial(mxfp4_cpu.grouped_gemm, simd=simd))
    e, f, l, n, k = 8, 96, 64, 29, 3
    w1, w3, w2 = _random_packed(e, f, l), _random_packed(e, f, l), _random_packed(e, l, f)
    x = torch.randn(n, l)
    idx, wts = _routing(n, e, k, hot=5)
    with torch.no_grad():
        got = packed_routed_experts(x, idx, wts, w1, w3, w2, act, impl=impl)
        ref = packed_routed_experts_reference(x, idx, wts, w1, w3, w2, act)
    assert got.dtype == torch.float32
    assert_close(got, ref, atol=1e-6, rtol=1e-6, what=f"{impl} vs dequantize-then-matmul")
    assert_close(got, _explicit(x, idx, wts, w1, w3, w2, act), atol=1e-5, rtol=1e-5, what="vs float64 loop")


@pytest.mark.parametrize("impl", [pytest.param("native", marks=native), "torch"])
def test_packed_path_with_mxfp8_inputs(impl):
    e, f, l, n, k = 6, 64, 32, 11, 2
    w1, w3, w2 = _random_packed(e, f, l), _random_packed(e, f, l), _random_packed(e, l, f)
    x, (idx, wts) = torch.randn(n, l) * 3, _routing(n, e, k)
    with torch.no_grad():
        got = packed_routed_experts(x, idx, wts, w1, w3, w2, SITU, input_quant=_mxfp8, impl=impl)
        ref = packed_routed_experts_reference(x, idx, wts, w1, w3, w2, SITU, input_quant=_mxfp8)
        plain = packed_routed_experts(x, idx, wts, w1, w3, w2, SITU, impl=impl)
    assert_close(got, ref, atol=1e-6, rtol=1e-6, what="packed + MXFP8 inputs")
    assert_close(got, _explicit(x, idx, wts, w1, w3, w2, SITU, _mxfp8), atol=1e-5, rtol=1e-5, what="float64")
    assert (got - plain).abs().max() > 1e-3  # the input fake-quant really acted


@native
def test_native_dequantize_is_bit_exact_on_every_code_and_scale():
    scales = torch.tensor([0, 1, 2, 100, 126, 127, 128, 200, 253, 254, 255], dtype=torch.uint8)
    codes = torch.arange(256, dtype=torch.uint8).repeat(len(scales), 1)  # every byte = every nibble pair
    sc = scales.unsqueeze(1).expand(-1, 16).contiguous()
    got = mxfp4_cpu.dequantize(codes.contiguous(), sc)
    want = mxfp4_weight_from_packed(codes, sc)
    assert torch.equal(got.isnan(), want.isnan()) and bool(got.isnan()[-1].all())
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))  # -0.0 kept too
    assert got[5, 0::2][:16].tolist() == [v for v in E2M1_VALUES]  # scale 2^0: the E2M1 table itself


@native
@pytest.mark.parametrize("simd", [0, 1, 2])
def test_native_gemm_nan_block_and_extreme_scales(simd):
    if simd > mxfp4_cpu.simd_level():
        pytest.skip(f"CPU lacks SIMD level {simd}")
    w = _random_packed(2, 4, 64)
    w.weight_scale[0, 1, 1] = 255  # NaN block: output row 1 of expert 0 is NaN
    w.weight_scale[0, 2] = 0       # 2^-127: subnormal weights
    w.weight_scale[1, 3, 0] = 140
    x, counts = torch.randn(5, 64), torch.tensor([3, 2])
    got = mxfp4_cpu.grouped_gemm(x, counts, w.weight_packed, w.weight_scale, simd=simd)
    dense = w.dequantize()
    ref = torch.cat([x[:3] @ dense[0].T, x[3:] @ dense[1].T])
    assert torch.equal(got.isnan(), ref.isnan()) and bool(got[:3, 1].isnan().all())
    ok = ~ref.isnan()
    assert_close(got[ok], ref[ok], atol=1e-6, rtol=1e-6, what="native gemm")


def test_impl_selection_and_errors():
    e, f, l = 4, 32, 32
    w1, w3, w2 = _random_packed(e, f, l), _random_packed(e, f, l), _random_packed(e, l, f)
    x, (idx, wts) = torch.randn(3, l, requires_grad=True), _routing(3, e, 2)
    with pytest.raises(ValueError, match="impl='native' does not apply"):
        packed_routed_experts(x, idx, wts, w1, w3, w2, swiglu, impl="native")  # autograd needs the torch path
    y = packed_routed_experts(x, idx, wts, w1, w3, w2, swiglu)  # automatic: torch path, differentiable in x
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    with pytest.raises(ValueError, match="impl='cuda'"):
        packed_routed_experts(x, idx, wts, w1, w3, w2, swiglu, impl="cuda")
    with pytest.raises(ValueError, match=r"x: expected \[N, L=32\]"):
        packed_routed_experts(torch.randn(3, 64), idx, wts, w1, w3, w2, swiglu)
    with pytest.raises(ValueError, match="are not"):
        packed_routed_experts(x, idx, wts, w1, w3, _random_packed(e, l, 64), swiglu)
    with pytest.raises(ValueError, match="in_features=48"):
        MXFP4Weight(2, 32, 48)
    with pytest.raises(ValueError, match="moe_intermediate_size=24"):
        PackedExperts.from_config(preset("k3-test-tiny"))


def _cfg():
    return preset("k3-test-tiny").replace(moe_intermediate_size=32)


def test_pack_experts_matches_fake_quant_model_and_unpacks_exactly():
    model = build_model(_cfg(), seed=2)
    ids = torch.randint(0, 512, (2, 7))
    model_qat(model, "mxfp4-weight-only")
    master = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}
    with torch.no_grad():
        want = model(ids).logits
    assert pack_experts(model) == 5
    assert not any(isinstance(m, Experts) for m in model.modules())
    with torch.no_grad():
        got = model(ids).logits
    assert_close(got, want, atol=1e-5, what="packed model vs fake-quant model")
    assert unpack_experts(model) == 5
    for n, p in model.named_parameters():
        if ".experts." in n:
            assert torch.equal(p, mxfp4_weight_from_packed(*mxfp4_weight_to_packed(master[n]))), n
    with torch.no_grad():
        assert_close(model(ids).logits, want, atol=1e-5, what="unpacked model")


def test_packed_storage_is_4_25_bits_per_weight():
    cfg = _cfg()
    model = build_model(cfg, seed=1)
    dense = expert_storage(model)
    assert dense["bits_per_weight"] == 32.0
    pack_experts(model)
    packed = expert_storage(model)
    e, f, l = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_latent_size
    assert packed["weights"] == dense["weights"] == 5 * 3 * e * f * l
    assert packed["bits_per_weight"] == 4.25  # 4 bits of E2M1 + 8 bits of E8M0 per 32 weights
    bufs = {n: b for n, b in model.named_buffers() if ".experts." in n}
    assert all(b.dtype == torch.uint8 for b in bufs.values())
    assert bufs["model.layers.1.block_sparse_moe.experts.w2.weight_packed"].shape == (e, l, f // 2)
    assert bufs["model.layers.1.block_sparse_moe.experts.w2.weight_scale"].shape == (e, l, f // 32)


@native
def test_native_grouped_gemm_rejects_negative_counts():
    with pytest.raises(ValueError, match="non-negative"):
        mxfp4_cpu.grouped_gemm(torch.randn(1, 64), torch.tensor([-1, 2]), torch.zeros(2, 4, 32, dtype=torch.uint8),
                               torch.full((2, 4, 2), 127, dtype=torch.uint8))
