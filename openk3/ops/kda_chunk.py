"""Chunkwise KDA, CPU/eager fast path: same function as the reference, cheaper evaluation order.

Shape legend: B batch rows, T tokens, H heads, K key dim, V value dim, C chunk size,
NC number of chunks (ceil(T / C)), n sub-tiles per chunk (C / tile), L tile length.

Same function and signature as :func:`openk3.ops.kda_reference.kda_chunk` (which stays the readable
reference and the test oracle). What differs:

* :func:`decayed_scores` (the intra-chunk ``A_kk`` / ``A_qk``, most of the reference's cost) handles
  all sub-tiles of a chunk in one batched op per step, and, when every per-step log-decay is
  >= -:data:`MATMUL_GATE_BOUND` (always for K3's bounded gate), replaces the [L, L, K] pairwise
  decay tensor by one small matmul per tile (overflow-free, see its docstring); otherwise it uses
  the exact pairwise form with the same numerics as the reference;
* the state-independent stage (G, ``A_kk``, the triangular solve for W and U, ``A_qk``, decayed q
  and k) is computed per group of :data:`GROUP` chunks, then a sequential state pass (three small
  matmuls per chunk) reads the chunks with ``unbind`` (backward: one ``stack``) rather than slices
  (backward: a zero-filled full [B, H, T, *] tensor per chunk).

Source: architecture.md §3.4 (chunkwise form, numerics); fla ``chunk_kda`` (the same split into a
parallel intra-chunk stage and a sequential inter-chunk state pass).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops import kda_reference as _ref

TILE = _ref._TILE
# Chunks whose state-independent stage is computed together. On the exact (unbounded-gate) path the
# [.., L, L, K] pairwise tensors of a group must stay cache-sized: all 8 chunks of a 512-token row at
# once measured slower than one at a time; on the matmul path the group size made no clear difference.
GROUP = 1
# Largest per-step |log-decay| for which the in-tile matmul factorisation of decayed_scores is used
# (tile 16: exponents stay within +-40). K3's gate is bounded by gate_lower_bound = -5 so it always
# qualifies; the unbounded Kimi-Linear gate qualifies while its decays stay moderate.
MATMUL_GATE_BOUND = 5.0


def decayed_scores(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, strict: bool, tile: int = TILE,
                   bounded: bool = False) -> torch.Tensor:
    """``out[i, j] = sum_c a_i[c] exp(G_i[c] - G_j[c]) b_j[c]`` for j < i (j <= i unless strict), else 0.

    Args:
        a, b, G: [..., C, K] fp32; G non-increasing along C (cumulative log-decay).
        strict: exclude the diagonal. tile: sub-tile length L (C must be a multiple of it;
            otherwise the reference's loop is used).
        bounded: the caller guarantees every per-step log-decay is >= -:data:`MATMUL_GATE_BOUND`
            (see below); enables the in-tile matmul factorisation.
    Returns:
        [..., C, C].
    Numerics: as the reference, no exponent is ever positive. Inside a tile the pairwise
    differences are masked to -inf before ``exp``; a row of tile p (p >= 1) reaches every earlier
    column through the last position r of tile p-1: ``exp(G_i - G_r) * exp(G_r - G_j)``, both <= 0
    for j <= r (columns j > r are masked, their exponent replaced by 0 before ``exp``).
    With ``bounded``, the in-tile term also factors, through the tile's middle position m:
    ``(a_i e^{G_i - G_m}) . (b_j e^{G_m - G_j})``, one small matmul per tile instead of the
    [L, L, K] pairwise tensor; |G_x - G_m| <= (L/2) * bound = 40, so every factor lies in
    [e^-40, e^40] (fp32-normal, no overflow even for the masked j > i pairs, which are discarded).
    """
    C, K = G.shape[-2:]
    if C % tile or C <= tile:
        return _ref._decayed_scores(a, b, G, strict)
    n = C // tile
    lead = G.shape[:-2]
    Gt, at, bt = (t.reshape(*lead, n, tile, K) for t in (G, a, b))
    keep = torch.ones(tile, tile, dtype=torch.bool, device=G.device).tril(-1 if strict else 0)
    if bounded:
        mid = Gt[..., tile // 2 : tile // 2 + 1, :]  # [..., n, 1, K]
        a_m, b_m = at * (Gt - mid).exp(), bt * (mid - Gt).exp()
        diag = torch.where(keep, a_m @ b_m.transpose(-1, -2), torch.zeros((), device=G.device))
    else:
        diff = Gt[..., :, None, :] - Gt[..., None, :, :]  # [..., n, L, L, K]
        decay = torch.where(keep[:, :, None], diff, float("-inf")).exp()
        diag = (at[..., :, None, :] * decay * bt[..., None, :, :]).sum(-1)  # [..., n, L, L]
    # Block-diagonal placement: [..., n, L, n, L] with only the p == p' blocks non-zero.
    eye_n = torch.eye(n, dtype=G.dtype, device=G.device)
    out = (diag[..., :, :, None, :] * eye_n[:, None, :, None]).reshape(*lead, n, tile, C)

    ref = Gt[..., :-1, -1:, :]  # [..., n-1, 1, K]: last position of tiles 0..n-2
    a_hat = at[..., 1:, :, :] * (Gt[..., 1:, :, :] - ref).exp()  # [..., n-1, L, K]
    col = torch.arange(C, device=G.device)
    before = col[None, :] < (torch.arange(1, n, device=G.device) * tile)[:, None]  # [n-1, C]: j <= r_p
    expo = torch.where(before[:, :, None], ref - G[..., None, :, :], torch.zeros((), device=G.device))
    b_hat = b[..., None, :, :] * expo.exp()  # [..., n-1, C, K]
    cross = torch.where(before[:, None, :], a_hat @ b_hat.transpose(-1, -2), torch.zeros((), device=G.device))
    out = out + F.pad(cross, (0, 0, 0, 0, 1, 0))  # tile 0 has no earlier columns
    return out.reshape(*lead, C, C)


def _chunk_rows(q, k, v, g, beta, scale, initial_state, lengths, chunk_size=64, output_chunk_states=False):
    dtype = v.dtype
    q, k, v, g, beta, S, valid = _ref._prepare(q, k, v, g, beta, scale, initial_state, lengths, chunk_size)
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    NC = -(-T // C)
    if NC == 0:
        res = (_ref._finish(v.new_zeros(B, 0, H, V), valid, dtype), S)
        return res + ((S.new_zeros(B, 0, *S.shape[1:]),) if output_chunk_states else ())
    pad = NC * C - T
    # [B, H, NC, C, *]; padded tail positions are identity steps (g = 0, beta = 0, k = 0).
    q, k, v, g = (F.pad(t.transpose(1, 2), (0, 0, 0, pad)).reshape(B, H, NC, C, -1) for t in (q * scale, k, v, g))
    beta = F.pad(beta.transpose(1, 2), (0, pad)).reshape(B, H, NC, C, 1)

    eye = torch.eye(C, dtype=torch.float32, device=q.device)
    # One host sync per call; padding is g = 0, which never disqualifies.
    bounded = TILE <= 16 and bool(g.min() >= -MATMUL_GATE_BOUND)
    outs, snaps = [], []
    for qs, ks, vs, gs, bs in zip(*(t.split(GROUP, dim=2) for t in (q, k, v, g, beta))):
        # State-independent stage for a group of chunks at once ([B, H, n_chunks, C, *]).
        G = gs.cumsum(-2)  # in-chunk cumulative log-decay
        eG = G.exp()
        A_kk = bs * decayed_scores(ks, ks, G, strict=True, bounded=bounded)
        WU = torch.linalg.solve_triangular(eye + A_kk, bs * torch.cat([ks * eG, vs], dim=-1), upper=False,
                                           unitriangular=True)
        Wc, Uc = WU.split([K, V], dim=-1)
        A_qk = decayed_scores(qs, ks, G, strict=False, bounded=bounded)
        q_dec = qs * eG
        G_end = G[..., -1:, :]  # [B, H, n_chunks, 1, K]
        k_dec_t = (ks * (G_end - G).exp()).transpose(-1, -2)  # [B, H, n_chunks, K, C]
        end_decay = G_end.exp().transpose(-1, -2)  # [B, H, n_chunks, K, 1]
        # Sequential state pass.
        for Wi, Ui, Ai, qi, ki, di in zip(*(t.unbind(2) for t in (Wc, Uc, A_qk, q_dec, k_dec_t, end_decay))):
            v_new = Ui - Wi @ S  # pseudo-values
            outs.append(qi @ S + Ai @ v_new)
            S = di * S + ki @ v_new
            if output_chunk_states:
                snaps.append(S)
    o = torch.stack(outs, dim=2).reshape(B, H, NC * C, V)[:, :, :T].transpose(1, 2)
    res = (_ref._finish(o, valid, dtype), S)
    if output_chunk_states:
        res += (torch.stack(snaps, 1),)
    return res


def kda_chunk_batched(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64, output_chunk_states: bool = False,
):
    """Chunkwise-parallel KDA, state-independent work batched over chunks.

    Args, Returns, Raises: exactly as :func:`openk3.ops.kda_reference.kda_chunk` (same function up to
    fp32 rounding; tests/ops/test_kda_ops.py checks values and gradients against it).
    Source: architecture.md §3.4.
    """
    return _ref._dispatch_varlen(_chunk_rows, q, k, v, g, beta, scale, initial_state, lengths, cu_seqlens,
                                 chunk_size=chunk_size, output_chunk_states=output_chunk_states)
