"""openk3.ops.attention: full causal form (SDPA and reference) and the absorbed latent form,
each against naive per-query loops written here from the definitions (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from openk3.ops.attention import (
    causal_attention,
    causal_attention_reference,
    get_attention_backend,
    latent_attention,
)
from openk3.ops.backends import use_backend
from tests.conftest import assert_close

BACKENDS = ("sdpa", "reference")


def _native_params():
    from openk3.ops import exp2_cpu

    on = pytest.param(
        True,
        id="native",
        marks=pytest.mark.skipif(not exp2_cpu.available(), reason=str(exp2_cpu.unavailable_reason())),
    )
    return [pytest.param(False, id="torch"), on]


# The blocked latent attention runs each tile's exp2 and row sum in torch or in the native kernel.
NATIVE = _native_params()


def naive_attention(q, k, v, scale, visible):
    """Per (b, h, i): softmax over the keys j with visible(b, i, j); zeros if none. float64.

    Also returns the per-head max logit over visible pairs."""
    B, H, T, _ = q.shape
    out = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    best = torch.full((H,), -math.inf, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                js = [j for j in range(k.shape[2]) if visible(b, i, j)]
                if not js:
                    continue
                logit = torch.stack([q[b, h, i].double() @ k[b, h, j].double() for j in js]) * scale
                best[h] = max(best[h], logit.max())
                p = torch.softmax(logit, 0)
                out[b, h, i] = sum(p[n] * v[b, h, j].double() for n, j in enumerate(js))
    return out, best


def _qkv(B=2, H=3, T=7, K=6, V=5):
    return torch.randn(B, H, T, K), torch.randn(B, H, T, K), torch.randn(B, H, T, V)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_matches_naive_with_padding(backend):
    q, k, v = _qkv()
    lengths = torch.tensor([7, 4])
    ml = torch.full((3,), -math.inf)
    out = causal_attention(q, k, v, scale=0.3, lengths=lengths, max_logits_out=ml, backend=backend)
    want, best = naive_attention(q, k, v, 0.3, lambda b, i, j: j <= i and i < lengths[b])
    assert_close(out, want, atol=1e-5, what="causal attention, padded rows")
    assert bool((out[1, :, 4:] == 0).all()), "padded query positions must be zero"
    assert_close(ml, best, atol=1e-5, what="max logits")


@pytest.mark.parametrize("backend", BACKENDS)
def test_cu_seqlens_packed_equals_separate_documents(backend):
    H, K, V = 2, 4, 3
    cu = torch.tensor([0, 3, 3, 8, 11])  # includes an empty document
    T = int(cu[-1])
    q, k, v = torch.randn(1, H, T, K), torch.randn(1, H, T, K), torch.randn(1, H, T, V)
    ml = torch.full((H,), -math.inf)
    packed = causal_attention(q, k, v, scale=0.5, cu_seqlens=cu, max_logits_out=ml, backend=backend)
    best = torch.full((H,), -math.inf)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if e == s:
            continue
        ml_doc = torch.full((H,), -math.inf)
        sep = causal_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], scale=0.5, max_logits_out=ml_doc, backend=backend)
        assert_close(packed[:, :, s:e], sep, atol=1e-6, what=f"document [{s}, {e})")
        best = torch.maximum(best, ml_doc)
    assert_close(ml, best, atol=1e-6, what="packed max logits")
    seg = torch.searchsorted(cu[1:], torch.arange(T), right=True)
    want, _ = naive_attention(q, k, v, 0.5, lambda b, i, j: j <= i and seg[i] == seg[j])
    assert_close(packed, want, atol=1e-5, what="block-diagonal causal vs naive")


def test_sdpa_equals_reference_and_override():
    q, k, v = _qkv(T=33)
    a = causal_attention(q, k, v, scale=0.2, backend="sdpa")
    b = causal_attention_reference(q, k, v, scale=0.2)
    assert_close(a, b, atol=1e-6, what="sdpa vs reference")
    assert get_attention_backend() == "sdpa"
    with use_backend("attention", "reference"):
        assert get_attention_backend() == "reference"
    assert get_attention_backend() == "sdpa"


def test_max_logits_is_running_max_and_chunked(monkeypatch):
    import openk3.ops.attention as attn

    monkeypatch.setattr(attn, "_MAX_LOGIT_CHUNK", 4)  # several query blocks
    q, k, v = _qkv(T=11)
    _, best = naive_attention(q, k, v, 0.7, lambda b, i, j: j <= i)
    ml = torch.tensor([-math.inf, 1e9, -math.inf])  # the second head's larger value must survive
    causal_attention(q, k, v, scale=0.7, max_logits_out=ml, backend="sdpa")
    assert ml[1] == 1e9
    assert_close(ml[[0, 2]], best[[0, 2]], atol=1e-5, what="chunked max logits")


def test_full_bad_inputs():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backend"):
        causal_attention(q, k, v, scale=1.0, backend="flash9")
    with pytest.raises(ValueError, match="lengths"):
        causal_attention(q, k, v, scale=1.0, lengths=torch.tensor([8, 1]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_attention(q, k, v, scale=1.0, cu_seqlens=torch.tensor([0, 7]))  # B = 2
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_attention(q[:1], k[:1], v[:1], scale=1.0, cu_seqlens=torch.tensor([0, 5]))  # does not end at T
    with pytest.raises(ValueError, match="q, k, v"):
        causal_attention(q, k[:, :, :3], v, scale=1.0)
    with pytest.raises(ValueError, match="max_logits_out"):
        causal_attention(q, k, v, scale=1.0, max_logits_out=torch.zeros(5))


def test_latent_attention_matches_naive():
    B, T, H, C, R, S = 3, 4, 2, 5, 3, 12
    ql, qr = torch.randn(B, T, H, C), torch.randn(B, T, H, R)
    lat, kr = torch.randn(B, S, C), torch.randn(B, S, R)
    past, lengths = torch.tensor([0, 5, 8]), torch.tensor([4, 1, 3])
    ml = torch.full((H,), -math.inf)
    out = latent_attention(ql, qr, lat, kr, past, scale=0.4, lengths=lengths, max_logits_out=ml)
    # Expressed as ordinary attention: key = [latent | k_rope], value = latent.
    q = torch.cat([ql, qr], -1).transpose(1, 2)
    k = torch.cat([lat, kr], -1)[:, None].expand(B, H, S, C + R)
    v = lat[:, None].expand(B, H, S, C)
    want, best = naive_attention(q, k, v, 0.4, lambda b, t, j: t < lengths[b] and j < past[b] + t + 1)
    assert_close(out, want.transpose(1, 2), atol=1e-5, what="latent attention")
    assert_close(ml, best, atol=1e-5, what="latent max logits")
    assert bool((out[1, 1:] == 0).all()) and bool((out[2, 3:] == 0).all()), "padded queries must be zero"


def test_latent_attention_ignores_stale_cache_entries():
    B, T, H, C, R, S = 1, 2, 2, 4, 2, 8
    ql, qr = torch.randn(B, T, H, C), torch.randn(B, T, H, R)
    lat, kr = torch.randn(B, S, C), torch.randn(B, S, R)
    past = torch.tensor([3])
    a = latent_attention(ql, qr, lat, kr, past, scale=1.0)
    lat2, kr2 = lat.clone(), kr.clone()
    lat2[:, 5:], kr2[:, 5:] = 1e4, -1e4  # beyond past + T: never visible
    b = latent_attention(ql, qr, lat2, kr2, past, scale=1.0)
    assert torch.equal(a, b)


def test_latent_attention_overflow_and_shapes():
    ql, qr = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 2)
    lat, kr = torch.randn(1, 5, 4), torch.randn(1, 5, 2)
    with pytest.raises(ValueError, match="exceed"):
        latent_attention(ql, qr, lat, kr, torch.tensor([3]), scale=1.0)
    with pytest.raises(ValueError, match="past_lengths"):
        latent_attention(ql, qr, lat, kr, torch.tensor([0, 0]), scale=1.0)
    with pytest.raises(ValueError, match="q_latent"):
        latent_attention(ql, qr[..., :1], lat, kr, torch.tensor([0]), scale=1.0)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("tiles", [(256, 512), (3, 4), (1, 1), (2, 7)], ids=lambda t: f"q{t[0]}k{t[1]}")
def test_blocked_latent_attention_matches_naive(tiles, native):
    # Several query and key tiles, partial tiles, rows with different histories, a padded row and
    # an empty one; the tiled online softmax equals the definition.
    from openk3.ops.latent_blocked import latent_attention_blocked

    g = torch.Generator().manual_seed(5)
    B, T, H, C, R, S = 4, 9, 3, 6, 2, 40
    ql, qr = torch.randn(B, T, H, C, generator=g), torch.randn(B, T, H, R, generator=g)
    lat, kr = torch.randn(B, S, C, generator=g), torch.randn(B, S, R, generator=g)
    past, lengths = torch.tensor([0, 13, 30, 4]), torch.tensor([9, 9, 5, 0])
    out = latent_attention_blocked(ql, qr, lat, kr, past, scale=0.6, lengths=lengths, query_tokens=tiles[0],
                                   key_block=tiles[1], native=native)
    q = torch.cat([ql, qr], -1).transpose(1, 2)
    k = torch.cat([lat, kr], -1)[:, None].expand(B, H, S, C + R)
    v = lat[:, None].expand(B, H, S, C)
    want, _ = naive_attention(q, k, v, 0.6, lambda b, t, j: t < lengths[b] and j < past[b] + t + 1)
    assert_close(out, want.transpose(1, 2), atol=2e-6, what="blocked latent attention")
    assert bool((out[2, 5:] == 0).all()) and bool((out[3] == 0).all()), "padded queries must be zero"
    dense = latent_attention(ql, qr, lat, kr, past, scale=0.6, lengths=lengths, backend="reference")
    assert_close(out, dense, atol=2e-6, what="blocked vs dense")


@pytest.mark.parametrize("native", NATIVE)
def test_blocked_latent_attention_moves_its_offset_exactly(native):
    # Logits of hundreds: the first key (the initial offset) scores far below later keys, so the
    # running offset must move (tile maxima beyond the margin) without overflow or lost precision.
    from openk3.ops.latent_blocked import latent_attention_blocked

    g = torch.Generator().manual_seed(6)
    B, T, H, C, R, S = 1, 6, 2, 8, 4, 50
    ql, qr = torch.randn(B, T, H, C, generator=g), torch.randn(B, T, H, R, generator=g)
    lat, kr = torch.randn(B, S, C, generator=g), torch.randn(B, S, R, generator=g)
    lat[0, 0] = -ql[0, :, 0].mean(0) * 4  # key 0 scores low for every query
    lat[0, 30] = ql[0, :, 0].mean(0) * 6  # a sharp peak late in the history
    past = torch.tensor([44])
    out = latent_attention_blocked(ql, qr, lat, kr, past, scale=20.0, query_tokens=2, key_block=8, native=native)
    q = torch.cat([ql, qr], -1).transpose(1, 2)
    k = torch.cat([lat, kr], -1)[:, None].expand(B, H, S, C + R)
    v = lat[:, None].expand(B, H, S, C)
    want, best = naive_attention(q, k, v, 20.0, lambda b, t, j: j < past[b] + t + 1)
    assert float(best.max()) > 100  # the case this test is about
    assert torch.isfinite(out).all()
    # Logits of ~300 carry fp32 rounding of ~1e-5 into the exponent: the dense fp32 form errs as much.
    dense = latent_attention(ql, qr, lat, kr, past, scale=20.0, backend="reference")
    ref_err = float((dense.double() - want.transpose(1, 2)).abs().max())
    assert_close(out, want.transpose(1, 2), atol=max(4 * ref_err, 1e-6), what="blocked latent attention, large logits")


@pytest.mark.parametrize("native", NATIVE)
def test_blocked_latent_attention_offset_free_and_fixed_offset_tiles(monkeypatch, native):
    # Query tiles of one call take different forms: small logits run offset-free (the score product
    # C + R wide), logits of hundreds the fixed offset (C + R + 1 wide, a ones column); both equal
    # the definition.
    from openk3.ops import latent_blocked

    widths = []
    real = latent_blocked._tile_fixed
    monkeypatch.setattr(latent_blocked, "_tile_fixed", lambda qx, *a: widths.append(qx.shape[1]) or real(qx, *a))
    g = torch.Generator().manual_seed(7)
    B, T, H, C, R, S = 1, 4, 2, 8, 4, 30
    ql, qr = torch.randn(B, T, H, C, generator=g), torch.randn(B, T, H, R, generator=g)
    ql[:, 2:], qr[:, 2:] = ql[:, 2:] * 60, qr[:, 2:] * 60  # tokens 2-3: logits of hundreds
    lat, kr = torch.randn(B, S, C, generator=g), torch.randn(B, S, R, generator=g)
    past = torch.tensor([20])
    out = latent_blocked.latent_attention_blocked(ql, qr, lat, kr, past, scale=0.5, query_tokens=2, key_block=8,
                                                  native=native)
    assert sorted(set(widths)) == [C + R, C + R + 1], widths
    q = torch.cat([ql, qr], -1).transpose(1, 2)
    k = torch.cat([lat, kr], -1)[:, None].expand(B, H, S, C + R)
    v = lat[:, None].expand(B, H, S, C)
    want, best = naive_attention(q, k, v, 0.5, lambda b, t, j: j < past[b] + t + 1)
    assert float(best.max()) > 100
    dense = latent_attention(ql, qr, lat, kr, past, scale=0.5, backend="reference")
    ref_err = float((dense.double() - want.transpose(1, 2)).abs().max())
    assert_close(out, want.transpose(1, 2), atol=max(4 * ref_err, 2e-6), what="blocked latent attention, mixed tiles")


@pytest.mark.parametrize("native", NATIVE)
def test_blocked_latent_attention_recovers_when_every_logit_underflows(native):
    # Every visible logit near -200: the offset-free form's exp2 underflows to 0 for every key, the
    # denominator check sends the tile to the running-offset form, which gives the softmax.
    from openk3.ops.latent_blocked import latent_attention_blocked

    g = torch.Generator().manual_seed(8)
    B, T, H, C, R, S = 1, 3, 2, 8, 4, 24
    base = torch.randn(C + R, generator=g)
    keys = base + 0.05 * torch.randn(S, C + R, generator=g)
    lat, kr = keys[None, :, :C].clone(), keys[None, :, C:].clone()
    q = -base * (200 / float(base @ base)) + 0.05 * torch.randn(B, T, H, C + R, generator=g)
    ql, qr = q[..., :C].contiguous(), q[..., C:].contiguous()
    past = torch.tensor([S - T])
    out = latent_attention_blocked(ql, qr, lat, kr, past, scale=1.0, query_tokens=2, key_block=8, native=native)
    qq = torch.cat([ql, qr], -1).transpose(1, 2)
    k = torch.cat([lat, kr], -1)[:, None].expand(B, H, S, C + R)
    v = lat[:, None].expand(B, H, S, C)
    want, best = naive_attention(qq, k, v, 1.0, lambda b, t, j: j < past[b] + t + 1)
    assert float(best.max()) < -150  # the case this test is about
    assert_close(out, want.transpose(1, 2), atol=2e-5, what="blocked latent attention, underflowing logits")


def test_column_extrema_match_amax_amin():
    from openk3.ops.latent_blocked import _column_extrema

    g = torch.Generator().manual_seed(9)
    for S in (1, 15, 16, 17, 100):
        keys = torch.randn(S, 7, generator=g)
        hi, lo = _column_extrema(keys)
        assert torch.equal(hi, keys.amax(0)) and torch.equal(lo, keys.amin(0)), S


@pytest.mark.parametrize("native", NATIVE)
def test_blocked_latent_attention_never_reads_past_the_visible_prefix(native):
    from openk3.ops.latent_blocked import latent_attention_blocked

    ql, qr = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 2)
    lat, kr = torch.randn(2, 10, 4), torch.randn(2, 10, 2)
    past = torch.tensor([2, 5])
    a = latent_attention_blocked(ql, qr, lat, kr, past, scale=1.0, key_block=2, native=native)
    lat[0, 5:], kr[1, 8:] = float("nan"), float("inf")  # beyond past + T of each row
    b = latent_attention_blocked(ql, qr, lat, kr, past, scale=1.0, key_block=2, native=native)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="exceed"):
        latent_attention_blocked(ql, qr, lat, kr, torch.tensor([8, 0]), scale=1.0)


@pytest.mark.parametrize("native", NATIVE)
def test_blocked_latent_attention_equals_the_reference_at_model_widths(native):
    # The shipped model's widths (H 4, C 32, R 16), default tiles, histories of 0 to ~1.5 tiles of
    # keys, lengths off the 256-token tile grid and a padded row: fp32 agreement with the dense form.
    from openk3.ops.attention import latent_attention_reference
    from openk3.ops.latent_blocked import latent_attention_blocked

    g = torch.Generator().manual_seed(10)
    B, T, H, C, R = 4, 300, 4, 32, 16
    past, lengths = torch.tensor([0, 1, 257, 390]), torch.tensor([300, 299, 130, 0])
    S = int((past + T).max())
    ql, qr = 0.8 * torch.randn(B, T, H, C, generator=g), 0.8 * torch.randn(B, T, H, R, generator=g)
    lat, kr = 0.7 * torch.randn(B, S, C, generator=g), torch.randn(B, S, R, generator=g)
    out = latent_attention_blocked(ql, qr, lat, kr, past, scale=48**-0.5, lengths=lengths, native=native)
    want = latent_attention_reference(ql, qr, lat, kr, past, scale=48**-0.5, lengths=lengths)
    assert_close(out, want, atol=1e-5, what="blocked vs reference latent attention")
    assert bool((out[2, 130:] == 0).all()) and bool((out[3] == 0).all()), "padded queries must be zero"
