"""KDA ops: chunked == recurrent == an independent float64 token recurrence; gates; short conv.

Shape legend: B batch, T tokens, H heads, K key dim, V value dim, C channels, W conv kernel.
Spec: architecture.md §3.2 (equations), §3.4 (chunkwise form), §3.5 (decode); release notes §1.4.
"""

from __future__ import annotations

import math

import pytest
import torch

from openk3.ops import kda_chunk as kc
from openk3.ops import kda_reference as ref
from openk3.ops.backends import use_backend
from openk3.ops.kda import kda
from openk3.ops.short_conv import _ShiftConv, short_conv, short_conv_reference, short_conv_step
from tests.conftest import assert_close

H, K, V = 3, 8, 6
SCALE = K ** -0.5


# ----------------------------------------------------------------------------- independent oracles
def naive_kda64(q, k, v, g, beta, scale, S0=None):
    """Float64 §3.2 token recurrence with explicit matrices, one row at a time:
    S_t = (I - b k k^T) Diag(exp(g)) S_{t-1} + b k v^T,  o_t = S_t^T (q scale)."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    B, T, Hh, Kk = q.shape
    S = torch.zeros(B, Hh, Kk, v.shape[-1], dtype=torch.float64) if S0 is None else S0.double().clone()
    eye = torch.eye(Kk, dtype=torch.float64)
    o = torch.zeros(B, T, Hh, v.shape[-1], dtype=torch.float64)
    for t in range(T):
        kt, bt = k[:, t], beta[:, t, :, None, None]
        transition = eye - bt * (kt[..., :, None] @ kt[..., None, :])
        S = transition @ torch.diag_embed(g[:, t].exp()) @ S + bt * (kt[..., :, None] @ v[:, t][..., None, :])
        o[:, t] = (S.transpose(-1, -2) @ (q[:, t] * scale)[..., None])[..., 0]
    return o, S


def unit(x):
    return x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()


def make_inputs(B, T, g_kind="bounded"):
    q, k = unit(torch.randn(B, T, H, K)), unit(torch.randn(B, T, H, K))
    v = torch.randn(B, T, H, V)
    if g_kind == "bounded":  # the K3 range (-5, 0), spread over the whole range
        g = -5 * torch.sigmoid(2 * torch.randn(B, T, H, K))
    elif g_kind == "floor":  # every step at g_min: cumulative -320 over a chunk
        g = torch.full((B, T, H, K), -5.0)
    else:  # Kimi-Linear softplus gate: unbounded, some channels decay by e^-60 per step
        g = -torch.rand(B, T, H, K) * torch.tensor([0.0, 0.01, 1.0, 60.0]).repeat(K // 4)
    beta = torch.sigmoid(torch.randn(B, T, H))
    return q, k, v, g, beta


# ----------------------------------------------------------------------------- chunk vs recurrent
@pytest.mark.parametrize("T", [1, 63, 64, 65, 130])
def test_chunk_recurrent_naive_agree(T):
    q, k, v, g, beta = make_inputs(2, T)
    S0 = 0.5 * torch.randn(2, H, K, V)
    o64, s64 = naive_kda64(q, k, v, g, beta, SCALE, S0)
    o_r, s_r = ref.kda_recurrent(q, k, v, g, beta, SCALE, S0)
    o_c, s_c = ref.kda_chunk(q, k, v, g, beta, SCALE, S0)
    assert s_r.dtype == s_c.dtype == torch.float32
    assert_close(o_c, o_r, atol=1e-5, what="chunk vs recurrent output")
    assert_close(s_c, s_r, atol=1e-5, what="chunk vs recurrent state")
    for name, o, s in (("recurrent", o_r, s_r), ("chunk", o_c, s_c)):
        assert_close(o, o64, atol=1e-5, what=f"{name} vs float64 output")
        assert_close(s, s64, atol=1e-5, what=f"{name} vs float64 state")


@pytest.mark.parametrize("g_kind", ["floor", "softplus"])
def test_strong_decay_does_not_overflow(g_kind):
    q, k, v, g, beta = make_inputs(1, 130, g_kind)
    o64, s64 = naive_kda64(q, k, v, g, beta, SCALE)
    o_c, s_c = ref.kda_chunk(q, k, v, g, beta, SCALE)
    o_r, s_r = ref.kda_recurrent(q, k, v, g, beta, SCALE)
    assert_close(o_c, o64, atol=1e-5, what="chunk output")
    assert_close(s_c, s64, atol=1e-5, what="chunk state")
    assert_close(o_c, o_r, atol=1e-5, what="chunk vs recurrent")


@pytest.mark.parametrize("chunk_size", [16, 40, 64])
def test_chunk_size_does_not_change_result(chunk_size):
    q, k, v, g, beta = make_inputs(1, 100)
    o_r, s_r = ref.kda_recurrent(q, k, v, g, beta, SCALE)
    o_c, s_c = ref.kda_chunk(q, k, v, g, beta, SCALE, chunk_size=chunk_size)
    assert_close(o_c, o_r, atol=1e-5, what=f"chunk_size={chunk_size}")
    assert_close(s_c, s_r, atol=1e-5, what=f"state chunk_size={chunk_size}")


@pytest.mark.parametrize("fn", [ref.kda_chunk, kc.kda_chunk_batched, ref.kda_recurrent])
def test_padded_rows_equal_rows_alone(fn):
    T, lengths = 70, torch.tensor([70, 33, 0])
    q, k, v, g, beta = make_inputs(3, T)
    S0 = torch.randn(3, H, K, V)
    for b, L in enumerate(lengths.tolist()):  # garbage in the padding must not leak anywhere
        v[b, L:] = float("nan")
        g[b, L:] = float("nan")
    o, s = fn(q, k, v, g, beta, SCALE, S0, lengths)
    for b, L in enumerate(lengths.tolist()):
        o64, s64 = naive_kda64(q[b:b + 1, :L], k[b:b + 1, :L], v[b:b + 1, :L], g[b:b + 1, :L], beta[b:b + 1, :L],
                               SCALE, S0[b:b + 1])
        assert_close(o[b:b + 1, :L], o64, atol=1e-5, what=f"row {b} output")
        assert_close(s[b:b + 1], s64, atol=1e-5, what=f"row {b} state")
        assert torch.all(o[b, L:] == 0), "padded outputs must be zero"
    assert torch.equal(s[2], S0[2]), "a row with no valid token keeps its state"


@pytest.mark.parametrize("fn", [ref.kda_chunk, kc.kda_chunk_batched, ref.kda_recurrent])
def test_cu_seqlens_equals_documents_alone(fn):
    doc_lengths = [5, 64, 0, 70]
    cu = torch.tensor([0] + list(torch.tensor(doc_lengths).cumsum(0).tolist()))
    q, k, v, g, beta = make_inputs(1, int(cu[-1]))
    S0 = torch.randn(len(doc_lengths), H, K, V)
    o, s = fn(q, k, v, g, beta, SCALE, S0, cu_seqlens=cu)
    assert o.shape == (1, int(cu[-1]), H, V) and s.shape == (len(doc_lengths), H, K, V)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_n, s_n = ref.kda_recurrent(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], SCALE, S0[n:n + 1])
        assert_close(o[:, a:b], o_n, atol=1e-5, what=f"document {n} output")
        assert_close(s[n:n + 1], s_n, atol=1e-5, what=f"document {n} state")


def test_chunk_states_are_recurrent_states_at_boundaries():
    T, C, lengths = 150, 64, torch.tensor([150, 100])
    q, k, v, g, beta = make_inputs(2, T)
    S0 = torch.randn(2, H, K, V)
    _, final, states = ref.kda_chunk(q, k, v, g, beta, SCALE, S0, lengths, chunk_size=C, output_chunk_states=True)
    _, _, states_r = ref.kda_recurrent(q, k, v, g, beta, SCALE, S0, lengths, chunk_size=C, output_chunk_states=True)
    assert states.shape == (2, 3, H, K, V)
    assert_close(states, states_r, atol=1e-5, what="chunk states, chunk vs recurrent")
    assert torch.equal(states[:, -1], final)
    for b, L in enumerate(lengths.tolist()):
        for i in range(3):
            end = min((i + 1) * C, L)
            sl = slice(0, end)
            _, s = naive_kda64(q[b:b + 1, sl], k[b:b + 1, sl], v[b:b + 1, sl], g[b:b + 1, sl], beta[b:b + 1, sl],
                               SCALE, S0[b:b + 1])
            assert_close(states[b:b + 1, i], s, atol=1e-5, what=f"row {b} state after {end} tokens")


def test_chunk_gradients_equal_recurrent_gradients():
    q, k, v, g, beta = make_inputs(1, 70)
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta)]
    weight = torch.randn(1, 70, H, V)
    grads = []
    for fn in (ref.kda_chunk, ref.kda_recurrent):
        o, s = fn(*inputs, SCALE, lengths=torch.tensor([60]))
        grads.append(torch.autograd.grad((o * weight).sum() + s.sum(), inputs))
    for name, a, b in zip(("q", "k", "v", "g", "beta"), *grads):
        assert_close(a, b, atol=5e-5, what=f"d/d{name}")


def test_dispatch_modes_match_references():
    q, k, v, g, beta = make_inputs(2, 20)
    S0 = torch.randn(2, H, K, V)
    for mode, fn in (("chunk", kc.kda_chunk_batched), ("recurrent", ref.kda_recurrent)):  # the defaults
        o, s = kda(q, k, v, g, beta, SCALE, S0, mode=mode)
        o_ref, s_ref = fn(q, k, v, g, beta, SCALE, S0)
        assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    with use_backend("kda", "reference"):
        assert torch.equal(kda(q, k, v, g, beta, SCALE, S0)[0], ref.kda_chunk(q, k, v, g, beta, SCALE, S0)[0])
    with pytest.raises(ValueError, match="mode"):
        kda(q, k, v, g, beta, SCALE, mode="parallel")
    with pytest.raises(ValueError, match="backend"):
        kda(q, k, v, g, beta, SCALE, backend="nope")
    with pytest.raises(ValueError, match="backend"):
        with use_backend("kda", "nope"):
            pass


def test_backend_from_the_environment(monkeypatch):
    q, k, v, g, beta = make_inputs(1, 20)
    monkeypatch.setenv("OPENK3_KDA_BACKEND", "reference")
    assert torch.equal(kda(q, k, v, g, beta, SCALE)[0], ref.kda_chunk(q, k, v, g, beta, SCALE)[0])
    with use_backend("kda", "batched"):  # the in-process override wins over the environment
        assert torch.equal(kda(q, k, v, g, beta, SCALE)[0], kc.kda_chunk_batched(q, k, v, g, beta, SCALE)[0])
    monkeypatch.setenv("OPENK3_KDA_BACKEND", "fla")
    with pytest.raises(ValueError, match="OPENK3_KDA_BACKEND='fla'"):
        kda(q, k, v, g, beta, SCALE)


@pytest.mark.parametrize("g_kind, chunk_size", [
    ("bounded", 64),  # in-tile matmul factorisation
    ("floor", 64),  # every step exactly at the bound -5: still the matmul path, cumulative -320
    ("softplus", 64),  # decays of e^-60 per step: the exact pairwise path
    ("bounded", 40),  # chunk not a multiple of the tile: the reference's tile loop
    ("bounded", 16),  # one tile per chunk
])
def test_batched_chunk_equals_reference_values_states_gradients(g_kind, chunk_size):
    """kda_chunk_batched == kda_chunk (reference): outputs, final and per-chunk states, and the
    gradients of every input incl. the initial state, with padded rows; plus the float64 oracle."""
    T, lengths = 150, torch.tensor([150, 97])
    q, k, v, g, beta = make_inputs(2, T, g_kind)
    S0 = 0.5 * torch.randn(2, H, K, V)
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta, S0)]
    w_o, w_s = torch.randn(2, T, H, V), torch.randn(2, H, K, V)
    results = []
    for fn in (kc.kda_chunk_batched, ref.kda_chunk):
        o, s, states = fn(*inputs[:5], SCALE, inputs[5], lengths, chunk_size=chunk_size, output_chunk_states=True)
        grads = torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), inputs)
        results.append((o, s, states, grads))
    (o, s, states, grads), (o_ref, s_ref, states_ref, grads_ref) = results
    assert_close(o, o_ref, atol=1e-5, what="output")
    assert_close(s, s_ref, atol=1e-5, what="final state")
    assert_close(states, states_ref, atol=1e-5, what="chunk states")
    for name, a, b in zip(("q", "k", "v", "g", "beta", "S0"), grads, grads_ref):
        assert_close(a, b, atol=5e-5, rtol=1e-5, what=f"d/d{name}")
    o64, s64 = naive_kda64(q[:1], k[:1], v[:1], g[:1], beta[:1], SCALE, S0[:1])
    assert_close(o[:1], o64, atol=1e-5, what="row 0 vs float64 output")
    assert_close(s[:1], s64, atol=1e-5, what="row 0 vs float64 state")


@pytest.mark.parametrize("strict", [True, False])
def test_decayed_scores_pairwise_equals_closed_form(strict):
    """The batched pairwise scores (unbounded gates) == a float64 closed form, with decays of up
    to e^-60 per step and at the K3 bound."""
    a, b = torch.randn(2, 64, K), torch.randn(2, 64, K)
    for g in (torch.full((2, 64, K), -kc.MATMUL_GATE_BOUND), -60 * torch.rand(2, 64, K)):
        G = g.cumsum(-2)
        got = kc.decayed_scores(a, b, G, strict)
        diff = (G.double()[:, :, None, :] - G.double()[:, None, :, :]).clamp(max=0)
        want = (a.double()[:, :, None, :] * diff.exp() * b.double()[:, None, :, :]).sum(-1)
        want = want * torch.ones(64, 64, dtype=torch.bool).tril(-1 if strict else 0)
        assert torch.isfinite(got).all()
        assert_close(got, want, atol=1e-5, rtol=1e-5, what="pairwise")


@pytest.mark.parametrize("g_kind", ["bounded", "floor"])
def test_sub_chunk_scores_equal_closed_form(g_kind):
    """_intra_bounded's middle-position factorisation: A_qk and A_kk == float64 closed forms, finite
    at the bound (every step -5, exponents reaching +-40)."""
    B, T = 2, 4 * kc.SUB
    q, k, v, g, beta = make_inputs(B, T, g_kind)
    shape = lambda t: t.transpose(1, 2).reshape(B, H, T // kc.SUB, kc.SUB, -1)  # noqa: E731
    q, k, v, g, b = shape(q), shape(k), shape(v), shape(g), shape(beta[..., None])
    W, U, A_qk, Q, Kt, D = kc._intra_bounded(q, k, v, g, b)
    G = g.double().cumsum(-2)
    pair = (G[..., :, None, :] - G[..., None, :, :]).clamp(max=0).exp()  # [.., i, j, K]
    tril = torch.ones(kc.SUB, kc.SUB, dtype=torch.bool)
    want_qk = (q.double()[..., :, None, :] * pair * k.double()[..., None, :, :]).sum(-1) * tril.tril()
    want_kk = (k.double()[..., :, None, :] * pair * k.double()[..., None, :, :]).sum(-1) * tril.tril(-1)
    want_kk = want_kk * b.double()
    assert all(torch.isfinite(t).all() for t in (W, U, A_qk, Q, Kt, D))
    assert_close(A_qk, want_qk, atol=1e-5, rtol=1e-5, what="A_qk")
    eye = torch.eye(kc.SUB, dtype=torch.float64)
    want_u = torch.linalg.solve(eye + want_kk, b.double() * v.double())
    assert_close(U, want_u, atol=1e-4, rtol=1e-5, what="U = (I + A_kk)^-1 beta v")


@pytest.mark.parametrize("C", [1, 2, 16, 64])
def test_unit_lower_inverse_equals_the_inverse(C):
    """The blocked inverse of I + A (A strictly lower) == float64 torch.linalg.inv; its upper
    triangle and diagonal are never read; a C that is not a power of two is refused."""
    g = torch.Generator().manual_seed(C)
    A = torch.randn(3, 2, C, C, generator=g, dtype=torch.float64).tril(-1) * 0.5
    want = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A)
    noisy = A + torch.randn(3, 2, C, C, generator=g, dtype=torch.float64).triu()  # ignored entries
    got = kc.unit_lower_inverse(noisy)
    # float64: what is left is rounding, amplified by the inverse's growth at C = 64
    assert_close(got, want, atol=1e-10 * float(want.abs().max()), rtol=1e-10, what="unit lower inverse")
    assert bool((got.triu(1) == 0).all()) and bool((got.diagonal(dim1=-2, dim2=-1) == 1).all())
    with pytest.raises(ValueError, match="power of two"):
        kc.unit_lower_inverse(torch.zeros(2, 12, 12))


def test_invalid_arguments_raise():
    q, k, v, g, beta = make_inputs(2, 10)
    with pytest.raises(ValueError, match="beta"):
        ref.kda_chunk(q, k, v, g, beta[..., :1], SCALE)
    with pytest.raises(ValueError, match="g"):
        ref.kda_recurrent(q, k, v, g[..., :2], beta, SCALE)
    with pytest.raises(ValueError, match="initial_state"):
        ref.kda_chunk(q, k, v, g, beta, SCALE, torch.zeros(2, H, V, K + 1))
    with pytest.raises(ValueError, match="lengths"):
        ref.kda_chunk(q, k, v, g, beta, SCALE, lengths=torch.tensor([3, 11]))
    with pytest.raises(ValueError, match="scale"):
        ref.kda_chunk(q, k, v, g, beta, -1.0)
    with pytest.raises(ValueError, match="batch dim must be 1"):
        ref.kda_chunk(q, k, v, g, beta, SCALE, cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        ref.kda_chunk(q[:1], k[:1], v[:1], g[:1], beta[:1], SCALE, cu_seqlens=torch.tensor([0, 4, 3, 10]))
    with pytest.raises(ValueError, match="mutually exclusive"):
        ref.kda_chunk(q[:1], k[:1], v[:1], g[:1], beta[:1], SCALE, lengths=torch.tensor([10]),
                      cu_seqlens=torch.tensor([0, 10]))


# ----------------------------------------------------------------------------- gates and L2 norm
def test_lower_bound_gate_closed_form_and_range():
    z = torch.randn(5, H, K)  # moderate logits: fp32 sigmoid does not saturate, so the range is strict
    A_log, dt_bias = 0.3 * torch.randn(H), torch.randn(H * K)
    g = ref.kda_gate_lower_bound(z, A_log, dt_bias, -5.0)
    A, zb = A_log.double().exp()[:, None], z.double() + dt_bias.double().view(H, K)
    expected = -5.0 / (1.0 + torch.exp(-A * zb))
    assert g.dtype == torch.float32
    assert_close(g, expected, atol=1e-6, what="lower-bound gate")
    assert bool(((g > -5) & (g < 0)).all())
    g_ext = ref.kda_gate_lower_bound(torch.tensor([-1e4, 1e4]).view(1, 1, 2).expand(1, H, 2), A_log,
                                     torch.zeros(H, 2), -5.0)
    assert bool(((g_ext >= -5) & (g_ext <= 0)).all()) and torch.isfinite(g_ext).all()


def test_softplus_gate_closed_form():
    z = 4 * torch.randn(5, H, K)
    A_log, dt_bias = torch.randn(H), torch.randn(H, K)
    g = ref.kda_gate_softplus(z, A_log, dt_bias)
    zb = z.double() + dt_bias.double()
    expected = -A_log.double().exp()[:, None] * torch.log1p(torch.exp(zb))
    assert_close(g, expected, atol=1e-5, rtol=1e-6, what="softplus gate")
    big = ref.kda_gate_softplus(torch.full((1, H, K), 200.0), torch.zeros(H), torch.zeros(H * K))
    assert_close(big, torch.full((1, H, K), -200.0), atol=1e-4, what="softplus large input")


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_A_log_is_per_head(gate):
    fn = (lambda z, a, d: ref.kda_gate_lower_bound(z, a, d, -5.0)) if gate == "lower_bound" else ref.kda_gate_softplus
    z, dt_bias, A_log = torch.randn(4, H, K), torch.randn(H * K), torch.zeros(H)
    A2 = A_log.clone()
    A2[1] = 1.0
    g1, g2 = fn(z, A_log, dt_bias), fn(z, A2, dt_bias)
    changed = (g1 != g2).any(dim=(0, 2))
    assert changed.tolist() == [False, True, False]
    with pytest.raises(ValueError, match="A_log"):
        fn(z, torch.zeros(H * K), dt_bias)
    with pytest.raises(ValueError, match="dt_bias"):
        fn(z, A_log, torch.zeros(H * K + 1))
    with pytest.raises(ValueError, match="lower_bound"):
        ref.kda_gate_lower_bound(z, A_log, dt_bias, 0.5)


def test_l2_normalize_closed_form():
    x = torch.randn(4, H, K, dtype=torch.float64)
    y = ref.l2_normalize(x)
    assert y.dtype == torch.float32
    assert_close(y, x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6), atol=1e-6, what="l2 normalize")
    assert torch.equal(ref.l2_normalize(torch.zeros(2, K)), torch.zeros(2, K))


# ----------------------------------------------------------------------------- short conv
def conv_by_formula(x, w, tail):
    """out_t[c] = sum_j w[c, j] x_{t-W+1+j}[c], history before t=0 taken from tail."""
    B, T, C = x.shape
    W = w.shape[-1]
    stream = torch.cat([tail.double().transpose(1, 2), x.double()], dim=1)  # [B, W-1+T, C]
    out = torch.zeros(B, T, C, dtype=torch.float64)
    for t in range(T):
        for j in range(W):
            out[:, t] += w[:, j].double() * stream[:, t + j]
    return out


def test_short_conv_matches_formula_and_pieces():
    B, T, C, W = 2, 11, 5, 4
    x, w, tail = torch.randn(B, T, C), torch.randn(C, 1, W), torch.randn(B, C, W - 1)
    y, new_tail = short_conv(x, w, tail)
    assert_close(y, conv_by_formula(x, w[:, 0], tail), atol=1e-5, what="conv formula")
    assert torch.equal(new_tail, x[:, -(W - 1):].transpose(1, 2))
    y0, _ = short_conv(x, w)
    assert_close(y0, conv_by_formula(x, w[:, 0], torch.zeros(B, C, W - 1)), atol=1e-5, what="zero tail")
    y_silu, _ = short_conv(x, w[:, 0], tail, activation="silu")  # [C, W] weights accepted too
    assert_close(y_silu, torch.nn.functional.silu(y), atol=1e-6, what="silu")
    # In pieces, carrying the tail (including pieces shorter than W-1) == in one go.
    outs, t_ = [], tail
    for a, b in ((0, 2), (2, 3), (3, 9), (9, 11)):
        o, t_ = short_conv(x[:, a:b], w, t_)
        outs.append(o)
    assert_close(torch.cat(outs, 1), y, atol=1e-6, what="pieces")
    assert torch.equal(t_, new_tail)


def test_short_conv_step_equals_full():
    B, T, C, W = 3, 9, 4, 4
    x, w, tail = torch.randn(B, T, C), torch.randn(C, 1, W), torch.randn(B, C, W - 1)
    y, final_tail = short_conv(x, w, tail, activation="silu")
    t_ = tail
    for t in range(T):
        y_t, t_ = short_conv_step(x[:, t], w, t_, activation="silu")
        assert_close(y_t, y[:, t], atol=1e-6, what=f"step {t}")
    assert torch.equal(t_, final_tail)
    _, kept = short_conv_step(x[:, 0], w, tail, valid=torch.tensor([True, False, True]))
    assert torch.equal(kept[1], tail[1]) and torch.equal(kept[0, :, -1], x[0, 0])


def test_short_conv_tail_respects_lengths():
    B, T, C, W = 3, 6, 2, 4
    x, w, tail = torch.randn(B, T, C), torch.randn(C, 1, W), torch.randn(B, C, W - 1)
    lengths = torch.tensor([6, 2, 0])
    y, new_tail = short_conv(x, w, tail, lengths)
    for b, L in enumerate(lengths.tolist()):
        y_b, t_b = short_conv(x[b:b + 1, :L], w, tail[b:b + 1])
        assert_close(y[b:b + 1, :L], y_b, atol=1e-6, what=f"row {b} output")
        assert torch.equal(new_tail[b:b + 1], t_b)
    assert torch.equal(new_tail[1], torch.cat([tail[1, :, 2:], x[1, :2].T], dim=1))
    assert torch.equal(new_tail[2], tail[2])
    with pytest.raises(ValueError, match="lengths"):
        short_conv(x, w, tail, torch.tensor([7, 0, 0]))
    with pytest.raises(ValueError, match="tail"):
        short_conv(x, w, tail[..., :2])
    with pytest.raises(ValueError, match="weight"):
        short_conv(x, torch.randn(C + 1, 1, W))
    with pytest.raises(ValueError, match="activation"):
        short_conv(x, w, activation="gelu")
    assert math.isfinite(float(y.sum()))


# ----------------------------------------------------------------------------- short conv fast path
@pytest.mark.parametrize("B, T, C, W, with_tail, lengths, activation", [
    (2, 11, 5, 4, True, None, "silu"),
    (2, 11, 5, 4, False, None, None),
    (3, 7, 4, 4, True, [7, 2, 0], "silu"),  # padding, a row shorter than W-1, an empty row
    (2, 9, 3, 4, False, [9, 4], None),
    (2, 2, 3, 4, True, None, None),  # T < W-1: the new tail keeps part of the old one
    (2, 0, 3, 4, True, None, "silu"),  # no tokens
    (2, 6, 3, 1, True, None, "silu"),  # W = 1: no history at all
    (1, 5, 6, 3, True, [3], "silu"),
])
def test_short_conv_fast_path_equals_conv1d_reference(B, T, C, W, with_tail, lengths, activation):
    """The shifted multiply-add fast path == the F.conv1d reference: outputs, new tail (exactly)
    and the gradients of x, weight and tail (through both outputs)."""
    x = torch.randn(B, T, C, requires_grad=True)
    w = torch.randn(C, 1, W, requires_grad=True)
    tail = torch.randn(B, C, W - 1, requires_grad=True) if with_tail else None
    lens = None if lengths is None else torch.tensor(lengths)
    gy, g_tail = torch.randn(B, T, C), torch.randn(B, C, W - 1)
    if lens is not None:  # padded outputs are unspecified: give them no gradient
        gy = gy * (torch.arange(T)[None, :] < lens[:, None])[..., None]
    leaves = [t for t in (x, w, tail) if t is not None]
    results = []
    for fn in (short_conv, short_conv_reference):
        y, new_tail = fn(x, w, tail, lens, activation)
        grads = torch.autograd.grad((y * gy).sum() + (new_tail * g_tail).sum(), leaves, allow_unused=True)
        results.append((y, new_tail, [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]))
    (y, new_tail, grads), (y_ref, tail_ref, grads_ref) = results
    if lens is not None:
        valid = (torch.arange(T)[None, :] < lens[:, None])[..., None]
        y, y_ref = y * valid, y_ref * valid
    assert y.shape == y_ref.shape == (B, T, C) and y.dtype == torch.float32
    assert_close(y, y_ref, atol=1e-5, what="output")
    assert torch.equal(new_tail, tail_ref)
    for name, g, g_ref in zip(("x", "weight", "tail"), grads, grads_ref):
        assert_close(g, g_ref, atol=2e-5, rtol=1e-5, what=f"grad {name}")


def test_short_conv_fast_backward_gradcheck():
    """The hand-written backward (incl. the fused SiLU) against float64 finite differences."""
    B, T, C, W = 2, 6, 3, 4
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    tail = torch.randn(B, W - 1, C, dtype=torch.float64, requires_grad=True)
    wt = torch.randn(W, C, dtype=torch.float64, requires_grad=True)
    for silu in (False, True):
        assert torch.autograd.gradcheck(lambda a, b, c: _ShiftConv.apply(a, b, c, silu), (x, tail, wt))
        assert torch.autograd.gradcheck(lambda a, c: _ShiftConv.apply(a, None, c, silu), (x, wt))


def test_short_conv_fast_path_low_precision_input():
    """bf16 input: fp32 math, result and tail cast back (matches the reference up to one bf16 ulp)."""
    B, T, C, W = 2, 10, 8, 4
    x, w, tail = torch.randn(B, T, C).bfloat16(), torch.randn(C, 1, W), torch.randn(B, C, W - 1).bfloat16()
    y, new_tail = short_conv(x, w, tail, activation="silu")
    y_ref, tail_ref = short_conv_reference(x, w, tail, activation="silu")
    assert y.dtype == new_tail.dtype == torch.bfloat16
    assert_close(y.float(), y_ref.float(), atol=1e-2, rtol=1e-2, what="bf16 output")
    assert torch.equal(new_tail, tail_ref)



@pytest.mark.parametrize("beta", [0.5, 0.99])
def test_repeated_keys_keep_full_precision(beta):
    """Identical keys with beta near 1 and no decay (a run of repeated tokens): A_kk is as large
    as it gets; the fast form must still match the float64 recurrence to fp32 precision."""
    T = 48
    k = unit(torch.randn(1, 1, H, K)).expand(1, T, H, K).contiguous()
    q, v = unit(torch.randn(1, T, H, K)), torch.randn(1, T, H, V)
    g, b = torch.zeros(1, T, H, K), torch.full((1, T, H), beta)
    o, s = kc.kda_chunk_batched(q, k, v, g, b, SCALE)
    o64, s64 = naive_kda64(q, k, v, g, b, SCALE, torch.zeros(1, H, K, V))
    assert_close(o, o64, atol=2e-6, rtol=1e-5, what="output, repeated keys")
    assert_close(s, s64, atol=2e-6, rtol=1e-5, what="state, repeated keys")
