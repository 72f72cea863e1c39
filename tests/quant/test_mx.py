"""openk3.quant.mx: MXFP4 / MXFP8 against an independent float64 OCP MX v1.0 oracle (always) and torchao's
``to_mx`` (test-only dependency, torchao==0.18.0; skipped when absent), pack layout, error handling, the straight-through estimator, the packed
linear reference. Spec: architecture.md §10, k3-release-notes.md §1.9."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from openk3.quant import mx
from tests.conftest import assert_close

FMT = {
    # element bit fields (exponent bits, mantissa bits, bias, number of finite non-negative codes), emax,
    # max magnitude, position of the sign bit in the code
    "mxfp4": dict(ebits=2, mbits=1, bias=1, ncodes=8, emax=2, max=6.0, sign=3),
    "mxfp8": dict(ebits=4, mbits=3, bias=7, ncodes=0x7F, emax=8, max=448.0, sign=7),  # 0x7F is E4M3FN NaN
}
MODES = ("floor", "rceil")


# --------------------------------------------------------------------------- float64 oracle


def _grid(fmt: str) -> torch.Tensor:
    """Non-negative finite element values in code order, decoded from the bit fields (not from mx.py)."""
    p = FMT[fmt]
    vals = []
    for c in range(p["ncodes"]):
        e, m = c >> p["mbits"], c & ((1 << p["mbits"]) - 1)
        frac = m / 2 ** p["mbits"]
        vals.append(frac * 2.0 ** (1 - p["bias"]) if e == 0 else (1 + frac) * 2.0 ** (e - p["bias"]))
    return torch.tensor(vals, dtype=torch.float64)


def oracle(x: torch.Tensor, fmt: str, mode: str, block: int = 32):
    """OCP MX v1.0 §6.3 in float64 along the last dim: (codes [*, N] int64, scale bytes [*, G] int64, values).

    FLOOR: e = floor(log2 amax) - emax; RCEIL: e = ceil(log2 fp32(amax / max)); e clamped to [-127, 127];
    elements RNE onto the grid (ties to the even code), saturated; non-finite blocks -> byte 255, codes 0.
    """
    p, grid = FMT[fmt], _grid(fmt)
    xb = x.double().reshape(*x.shape[:-1], -1, block)
    amax = xb.abs().amax(-1)
    finite = torch.isfinite(amax)
    a = torch.where(finite, amax, torch.ones_like(amax))
    if mode == "floor":
        e = torch.floor(torch.log2(a)) - p["emax"]
    else:
        e = torch.ceil(torch.log2((a.float() / p["max"]).double()))  # the descale is an fp32 quotient
    e = e.clamp(-127, 127)  # log2(0) = -inf lands on -127
    scale_byte = torch.where(finite, e + 127, torch.full_like(e, 255)).long()
    v = xb / torch.pow(2.0, e).unsqueeze(-1)
    mag = v.abs().clamp(max=p["max"])
    hi = torch.searchsorted(grid, mag).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    idx = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    sign = torch.signbit(v)
    codes = torch.where(finite.unsqueeze(-1), idx | (sign.long() << p["sign"]), torch.zeros_like(idx))
    vals = torch.where(sign, -grid[idx], grid[idx]) * torch.pow(2.0, e).unsqueeze(-1)
    vals = torch.where(finite.unsqueeze(-1), vals, torch.full_like(vals, math.nan))
    return codes.reshape(x.shape), scale_byte, vals.reshape(x.shape)


def ours(x: torch.Tensor, fmt: str, mode: str):
    """(codes int64, scale bytes int64, dequantized fp32) from openk3.quant.mx."""
    if fmt == "mxfp4":
        c, s = mx.quantize_mxfp4(x, scale_mode=mode)
        return c.long(), s.long(), mx.dequantize_mxfp4(c, s)
    e, s = mx.quantize_mxfp8(x, scale_mode=mode)
    return e.view(torch.uint8).long(), s.long(), mx.dequantize_mxfp8(e, s)


# --------------------------------------------------------------------------- test tensors


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float64).float()


@functools.lru_cache(maxsize=None)
def adversarial() -> torch.Tensor:
    """[R, 32] fp32, one block per row: zeros, every power-of-two block max (subnormal to 2^127), maxima
    just below / at / above 6*2^e, 8*2^e and 448*2^e, exact rounding ties, subnormal blocks, NaN / Inf."""
    g = torch.Generator().manual_seed(1)
    rows = [torch.zeros(32), -torch.zeros(32)]

    def body(scale: float) -> torch.Tensor:
        return ((torch.rand(32, generator=g, dtype=torch.float64) * 2 - 1) * scale).float()

    for k in range(-149, 128):
        r = body(2.0**k)
        r[k % 32] = (-1) ** k * 2.0**k
        rows.append(r)
    up, down = torch.tensor(math.inf), torch.tensor(-math.inf)
    for e in range(-135, 126):
        for m in (6.0, 8.0, 448.0, 7.0):
            top = m * 2.0**e
            if top > 3.0e38 or top < 2.0**-149:
                continue
            t = _f32(top)
            for edge in (torch.nextafter(t, up), t, torch.nextafter(t, down)):
                r = body(top)
                r[(e + int(m)) % 32] = -edge if e % 2 else edge
                rows.append(r)
    for fmt in FMT:  # every midpoint of the element grid, both signs, with the block max pinning X = 2^j
        grid = _grid(fmt)
        mids = ((grid[1:] + grid[:-1]) / 2).tolist()
        for j in (-130, -20, 0, 7, 100):
            for start in range(0, len(mids), 31):
                chunk = mids[start:start + 31]
                r = torch.zeros(32, dtype=torch.float64)
                r[0] = FMT[fmt]["max"]
                r[1:1 + len(chunk)] = torch.tensor(chunk) * torch.tensor([(-1) ** i for i in range(len(chunk))])
                rows.append((r * 2.0**j).float())
    sub = torch.randint(1, 2**23, (4, 32), generator=g).double() * 2.0**-149  # subnormal fp32 values
    rows += list(sub.float() * torch.tensor([1.0, -1.0]).repeat(16))
    mixed = sub[0].float().clone()
    mixed[3] = 1.0
    rows.append(mixed)
    for bad in ([math.nan], [math.inf], [-math.inf], [math.nan, math.inf], [math.inf, -math.inf]):
        r = body(1.0)
        r[: len(bad)] = torch.tensor(bad)
        rows.append(r)
    return torch.stack(rows)


@functools.lru_cache(maxsize=None)
def random_cases() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(2)
    heavy = torch.randn(32, 256, generator=g) * torch.exp(4 * torch.randn(32, 256, generator=g))
    return torch.randn(64, 256, generator=g), heavy, torch.randn(8, 3, 64, generator=g) * 1e-3


@functools.lru_cache(maxsize=None)
def ours_on_cases(fmt: str, mode: str) -> tuple:
    """(x, ours(x)) for every test tensor, shared by the oracle and torchao tests (inputs are not mutated)."""
    return tuple((x, ours(x, fmt, mode)) for x in (adversarial(), *random_cases()))


# --------------------------------------------------------------------------- oracle parity


@pytest.mark.parametrize("fmt", list(FMT))
@pytest.mark.parametrize("mode", MODES)
def test_matches_float64_oracle(fmt, mode):
    for x, (c, s, v) in ours_on_cases(fmt, mode):
        oc, os_, ov = oracle(x, fmt, mode)
        assert torch.equal(s, os_), f"{fmt}/{mode}: scales differ in {(s != os_).sum().item()} blocks"
        assert torch.equal(c, oc), f"{fmt}/{mode}: codes differ in {(c != oc).sum().item()} elements"
        torch.testing.assert_close(v, ov.float(), rtol=0, atol=0, equal_nan=True)


def test_documented_special_cases():
    x = adversarial()
    c, s = mx.quantize_mxfp4(x)
    assert s[0].item() == 0 and s[1].item() == 0 and c[0].eq(0).all() and c[1].eq(8).all()  # +0 / -0 blocks
    assert (s[-5:] == 255).all() and (c[-5:] == 0).all()  # NaN / Inf blocks -> NaN scale, zero codes
    assert torch.isnan(mx.dequantize_mxfp4(c[-5:], s[-5:])).all()
    # FLOOR clips a block max in [6, 8) * 2^e to 6 * 2^e; RCEIL moves to the next scale instead
    w = torch.zeros(1, 32)
    w[0, 0] = 7.5
    assert mx.dequantize_mxfp4(*mx.quantize_mxfp4(w))[0, 0].item() == 6.0
    assert mx.dequantize_mxfp4(*mx.quantize_mxfp4(w, scale_mode="rceil"))[0, 0].item() == 8.0


def test_code_assignment_matches_compressed_tensors_convention():
    """code = magnitude index in (0, .5, 1, 1.5, 2, 3, 4, 6) + 8 * sign; a max of 6 makes X = 1."""
    vals = torch.tensor(mx.E2M1_VALUES * 2).reshape(1, 32)
    c, s = mx.quantize_mxfp4(vals)
    assert s.tolist() == [[127]]
    assert c[0, :16].tolist() == list(range(16))
    assert torch.equal(mx.dequantize_mxfp4(c, s), vals)


def test_axis_and_bf16():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 40, generator=g)
    for q in (mx.quantize_mxfp4, mx.quantize_mxfp8):
        c0, s0 = q(x, axis=0)
        c1, s1 = q(x.T.contiguous())
        assert s0.shape == (2, 40) and torch.equal(s0, s1.T)
        assert torch.equal(c0.view(torch.uint8), c1.view(torch.uint8).T)
    xb = x.bfloat16()
    for fmt in FMT:
        for mode in MODES:
            c, s, _ = ours(xb.T.contiguous(), fmt, mode)
            oc, os_, _ = oracle(xb.float().T.contiguous(), fmt, mode)
            assert torch.equal(s, os_) and torch.equal(c, oc)


# --------------------------------------------------------------------------- torchao parity


def _torchao(x: torch.Tensor, fmt: str, mode: str):
    mxt = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    cfg = pytest.importorskip("torchao.prototype.mx_formats.config")
    elem = torch.float4_e2m1fn_x2 if fmt == "mxfp4" else torch.float8_e4m3fn
    s, d = mxt.to_mx(x.contiguous(), elem, 32, getattr(cfg.ScaleCalculationMode, mode.upper()))
    deq = mxt.to_dtype(d, s, elem, 32, torch.float32)
    codes = mx.unpack_mxfp4(d.view(torch.uint8)) if fmt == "mxfp4" else d.view(torch.uint8)
    return codes.long(), s.view(torch.uint8).long(), deq, d


def _torchao_deviations(x: torch.Tensor, scales: torch.Tensor, fmt: str, mode: str):
    """Blocks where torchao 0.18 eager departs from the spec, predicted from the input alone (mx.py docstring)."""
    amax = x.float().reshape(*x.shape[:-1], -1, 32).abs().amax(-1)
    inf_block = torch.isinf(amax)  # finite scale + saturated element in torchao, NaN block here
    tiny = (scales == 0) & (amax > 0)  # torchao divides by 2^-126 (FLOOR) or by 1 (RCEIL) instead of 2^-127
    log2_rounded = torch.zeros_like(tiny)
    if mode == "rceil":
        d = amax / FMT[fmt]["max"]
        lg = torch.log2(d)
        # log2 of a d just above 2^k rounds to exactly k in fp32, so ceil stays at k (exact answer k + 1)
        log2_rounded = torch.isfinite(d) & (d > 0) & (lg == lg.round()) & (d > torch.exp2(lg))
    return inf_block, tiny, log2_rounded


@pytest.mark.parametrize("fmt", list(FMT))
@pytest.mark.parametrize("mode", MODES)
def test_matches_torchao(fmt, mode):
    for x, (c, s, v) in ours_on_cases(fmt, mode):
        tc, ts, tv, _ = _torchao(x, fmt, mode)
        inf_block, tiny, log2_rounded = _torchao_deviations(x, s, fmt, mode)
        same_scale = ~inf_block & ~log2_rounded
        assert torch.equal(s[same_scale], ts[same_scale]), f"{fmt}/{mode}: E8M0 scales differ from torchao"
        assert torch.equal(ts[log2_rounded], s[log2_rounded] - 1)  # the documented fp32-log2 rounding
        same_elems = same_scale & ~tiny & (s != 255)
        blk = lambda t: t.reshape(*t.shape[:-1], -1, 32)  # noqa: E731
        assert torch.equal(blk(c)[same_elems], blk(tc)[same_elems]), f"{fmt}/{mode}: element codes differ"
        torch.testing.assert_close(blk(v)[same_elems], blk(tv)[same_elems], rtol=0, atol=0)
        nan_block = torch.isnan(x.float().reshape(*x.shape[:-1], -1, 32)).any(-1)
        assert (ts[nan_block] == 255).all() and torch.isnan(blk(tv)[nan_block]).all()
        if x.shape[-1] == 32:  # the adversarial set must exercise each documented deviation, yet mostly agree
            assert inf_block.any() and tiny.any() and (mode == "floor" or log2_rounded.any())
            assert same_elems.float().mean() > 0.7, "too few adversarial blocks compared against torchao"
        else:  # ordinary data never hits a deviation: every block is compared
            assert same_elems.all()


def test_pack_bytes_match_torchao():
    x = random_cases()[0]
    *_, data = _torchao(x, "mxfp4", "floor")
    codes, _ = mx.quantize_mxfp4(x)
    assert torch.equal(mx.pack_mxfp4(codes), data.view(torch.uint8))


# --------------------------------------------------------------------------- pack layout and errors


def test_pack_unpack_roundtrip_and_nibble_order():
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(mx.pack_mxfp4(mx.unpack_mxfp4(every_byte)), every_byte)
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    packed = mx.pack_mxfp4(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(mx.unpack_mxfp4(packed), codes)
    assert mx.pack_mxfp4(torch.tensor([[1, 2]], dtype=torch.uint8)).item() == 0x21  # element 0 in the low nibble


def test_rejects_bad_input():
    with pytest.raises(ValueError, match=r"dim 1 has size 48.*block=32"):
        mx.quantize_mxfp4(torch.randn(4, 48))
    with pytest.raises(ValueError, match=r"dim 0 has size 40"):
        mx.quantize_mxfp8(torch.randn(40, 32), axis=0)
    with pytest.raises(ValueError, match="dim 1 has size 33"):
        mx.fake_quant_mxfp4(torch.randn(2, 33))
    with pytest.raises(ValueError, match="dim 1 has size 16"):
        mx.fake_quant_mxfp8(torch.randn(2, 16))
    with pytest.raises(ValueError, match="scale_mode"):
        mx.quantize_mxfp4(torch.randn(2, 32), scale_mode="ceil")
    with pytest.raises(ValueError, match="block"):
        mx.quantize_mxfp4(torch.randn(2, 32), block=0)
    with pytest.raises(ValueError, match="float32/bfloat16"):
        mx.quantize_mxfp4(torch.ones(2, 32, dtype=torch.int32))
    c, s = mx.quantize_mxfp4(torch.randn(2, 64))
    with pytest.raises(ValueError, match="scales shape"):
        mx.dequantize_mxfp4(c, s[:, :1])
    with pytest.raises(ValueError, match="0..15"):
        mx.dequantize_mxfp4(c | 16, s)
    with pytest.raises(ValueError, match="even size"):
        mx.pack_mxfp4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        mx.pack_mxfp4(torch.full((2, 2), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        mx.unpack_mxfp4(torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="x last dim 32 != K = 64"):
        mx.mxfp4_linear_reference(torch.randn(3, 32), *mx.mxfp4_weight_to_packed(torch.randn(4, 64)))


# --------------------------------------------------------------------------- QAT and the packed reference


@pytest.mark.parametrize("fake, quant, deq", [
    (mx.fake_quant_mxfp4, mx.quantize_mxfp4, mx.dequantize_mxfp4),
    (mx.fake_quant_mxfp8, mx.quantize_mxfp8, mx.dequantize_mxfp8),
])
def test_fake_quant_forward_and_straight_through_gradient(fake, quant, deq):
    w = torch.randn(16, 64, requires_grad=True)
    master = w.detach().clone()
    out = fake(w)
    assert out.dtype == torch.float32 and torch.equal(out.detach(), deq(*quant(master)))
    grad = torch.randn(16, 64)
    out.backward(grad)
    assert torch.equal(w.grad, grad) and torch.equal(w.detach(), master)
    assert not torch.equal(out.detach(), master)  # it does quantize
    xb = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    yb = fake(xb, axis=-1, scale_mode="rceil")
    assert yb.dtype == torch.bfloat16
    yb.sum().backward()
    assert torch.equal(xb.grad, torch.ones_like(xb))


def test_mxfp4_linear_reference_matches_dequantized_matmul():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 24, 96, generator=g)  # stacked experts [E, O, K]
    packed, scale = mx.mxfp4_weight_to_packed(w)
    assert packed.shape == (3, 24, 48) and scale.shape == (3, 24, 3)
    assert packed.dtype == torch.uint8 and scale.dtype == torch.uint8
    _, _, w_ref = oracle(w, "mxfp4", "floor")
    assert torch.equal(mx.mxfp4_weight_from_packed(packed, scale), w_ref.float())
    x, bias = torch.randn(5, 7, 96, generator=g), torch.randn(24, generator=g)
    y = mx.mxfp4_linear_reference(x, packed[1], scale[1], bias)
    assert y.shape == (5, 7, 24) and y.dtype == torch.float32
    assert_close(y, x.double() @ w_ref[1].T + bias.double(), atol=1e-4, rtol=1e-5, what="mxfp4 linear")
