"""openk3.ops.latent_tile_cpu: the fused attention tile kernel against float64 sums, and the blocked
latent attention with it against the tile loop and the dense reference."""

from __future__ import annotations

import pytest
import torch

from openk3.ops import latent_tile_cpu as L
from openk3.ops.attention import latent_attention_reference
from openk3.ops.latent_blocked import latent_attention_blocked

pytestmark = pytest.mark.skipif(not L.available(), reason=str(L.unavailable_reason()))


def _sums64(q, keys, values, n_full, heads):
    """acc, den in float64: row i sees keys j < n_full + i // heads + 1."""
    s = q.double() @ keys.double().T
    r, n = s.shape
    limit = n_full + torch.arange(r) // heads + 1
    visible = torch.arange(n)[None, :] < limit[:, None]
    p = torch.exp2(s).masked_fill(~visible, 0.0)
    return p @ values.double(), p.sum(1)


@pytest.mark.parametrize(
    "rows,heads,n_full,D,key_block",
    [
        (
            1024,
            4,
            700,
            48,
            64,
        ),  # the shipped model's tile shape, a history that is no block multiple
        (37, 1, 0, 48, 64),  # no history: the causal square only; 37 rows = 6 blocks of 6 + 1
        (30, 3, 5, 17, 32),  # odd score width, 3 heads
        (200, 4, 64, 48, 128),  # more than one row group (192 rows)
        (6, 2, 33, 8, 96),
    ],
)
def test_tile_matches_float64_sums(rows, heads, n_full, D, key_block):
    g = torch.Generator().manual_seed(rows + n_full)
    n = n_full + -(-rows // heads)
    q = 0.4 * torch.randn(rows, D, generator=g)
    keys = 0.4 * torch.randn(n, D, generator=g)
    values = torch.randn(n, 32, generator=g)
    acc, den = L.latent_tile(
        q, L.pack_keys(keys), L.pad_values(values), n_full, heads, key_block=key_block
    )
    want_acc, want_den = _sums64(q, keys, values, n_full, heads)
    torch.testing.assert_close(den.double(), want_den, rtol=2e-6, atol=0)
    # acc entries are signed sums: compare on the scale of the row's denominator
    err = (acc.double() - want_acc).abs() / want_den[:, None]
    assert float(err.max()) < 2e-6, float(err.max())


def test_keys_beyond_the_last_row_are_ignored():
    # packed keys longer than the tile needs (the cache holds later tokens): same sums
    g = torch.Generator().manual_seed(3)
    q = torch.randn(40, 48, generator=g) * 0.3
    keys = torch.randn(300, 48, generator=g) * 0.3
    values = torch.randn(300, 32, generator=g)
    a1, d1 = L.latent_tile(q, L.pack_keys(keys), L.pad_values(values), 90, 4)
    a2, d2 = L.latent_tile(q, L.pack_keys(keys[:100]), L.pad_values(values[:100]), 90, 4)
    assert torch.equal(a1, a2) and torch.equal(d1, d2)


def test_threads_give_the_same_result():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1000, 48, generator=g) * 0.3
    keys = torch.randn(600, 48, generator=g) * 0.3
    values = torch.randn(600, 32, generator=g)
    kp, vp = L.pack_keys(keys), L.pad_values(values)
    a1, d1 = L.latent_tile(q, kp, vp, 350, 4, threads=1)
    a4, d4 = L.latent_tile(q, kp, vp, 350, 4, threads=4)
    assert torch.equal(a1, a4) and torch.equal(d1, d4)


def test_non_finite_scores_give_nan():
    # the caller's finiteness check then takes its exact fallback
    q = torch.zeros(4, 48)
    keys = torch.zeros(8, 48)
    keys[2, 0] = float("inf")
    q[:, 0] = 1.0
    _, den = L.latent_tile(q, L.pack_keys(keys), L.pad_values(torch.ones(8, 32)), 4, 1)
    assert not bool(torch.isfinite(den).any())


def test_pack_layout():
    keys = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    kp = L.pack_keys(keys)
    assert kp.shape == (4, 3, 16)
    assert kp[1, 2, 5].item() == keys[21, 2].item()
    assert bool((kp[2, :, 8:] == 0).all()) and bool((kp[3] == 0).all())
    vp = L.pad_values(torch.ones(40, 32))
    assert vp.shape == (64, 32) and vp[40:].abs().sum().item() == 0


def test_bad_inputs():
    kp, vp = L.pack_keys(torch.zeros(32, 48)), L.pad_values(torch.zeros(32, 32))
    with pytest.raises(ValueError, match="contiguous float32"):
        L.latent_tile(torch.zeros(4, 48, dtype=torch.float64), kp, vp, 0, 4)
    with pytest.raises(ValueError, match="contiguous float32"):
        L.latent_tile(torch.zeros(4, 47), kp, vp, 0, 4)  # score width differs from the keys'
    with pytest.raises(ValueError, match="exceed"):
        L.latent_tile(torch.zeros(8, 48), kp, vp, 31, 4)  # row 4 would see key 32
    with pytest.raises(ValueError, match="key_block"):
        L.latent_tile(torch.zeros(4, 48), kp, vp, 0, 4, key_block=48)


@pytest.mark.parametrize("B,T,past", [(1, 300, 0), (2, 77, 513)])
def test_blocked_attention_with_the_kernel_matches_the_tile_loop_and_the_reference(B, T, past):
    g = torch.Generator().manual_seed(T)
    H, C, R = 4, 32, 16
    S = past + T + 3
    q_latent = torch.randn(B, T, H, C, generator=g)
    q_rope = torch.randn(B, T, H, R, generator=g)
    latent = torch.randn(B, S, C, generator=g) / C**0.5
    k_rope = torch.randn(B, S, R, generator=g)
    past_lengths = torch.tensor([past] * B)
    lengths = torch.tensor([T, T - 5][:B])
    kw = {"scale": (C + R) ** -0.5, "lengths": lengths, "query_tokens": 64}
    fused = latent_attention_blocked(
        q_latent, q_rope, latent, k_rope, past_lengths, fused=True, **kw
    )
    loop = latent_attention_blocked(
        q_latent, q_rope, latent, k_rope, past_lengths, fused=False, **kw
    )
    ref = latent_attention_reference(
        q_latent, q_rope, latent, k_rope, past_lengths, scale=kw["scale"], lengths=lengths
    )
    torch.testing.assert_close(fused, loop, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-6)
    assert bool((fused[1:, T - 5 :] == 0).all())  # padded queries stay zero


def test_fused_true_where_it_does_not_apply_raises():
    x = torch.zeros(1, 2, 1, 16)
    with pytest.raises(ValueError, match="C = 32"):
        latent_attention_blocked(
            x,
            torch.zeros(1, 2, 1, 4),
            torch.zeros(1, 2, 16),
            torch.zeros(1, 2, 4),
            torch.tensor([0]),
            scale=1.0,
            fused=True,
        )
