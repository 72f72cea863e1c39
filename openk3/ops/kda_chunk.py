"""Chunkwise KDA, CPU/eager fast path: same function as the reference, cheaper evaluation order.

Shape legend: B batch rows, T tokens, H heads, K key dim, V value dim, C chunk size,
NC number of chunks (ceil(T / C)), n sub-tiles per chunk (C / tile), L tile length.

Same function and signature as :func:`openk3.ops.kda_reference.kda_chunk` (which stays the readable
reference and the test oracle; this module imports nothing from it, only the shared argument checks
of :mod:`openk3.ops.kda_inputs` and the packing of :mod:`openk3.ops.varlen`). What differs:

* under the gate bound (every per-step log-decay >= -:data:`MATMUL_GATE_BOUND`, always true for
  K3's gate, and for the unbounded Kimi-Linear gate while its decays stay moderate) the work runs on
  sub-chunks of :data:`SUB` tokens: each sub-chunk's decayed scores are one matmul factored through
  its middle position (exponents within +-40, no overflow), with no cross-tile terms, and the
  intra-chunk FLOPs shrink with the chunk length; snapshots are still taken every ``chunk_size``;
* otherwise :func:`decayed_scores` evaluates the ``chunk_size`` chunks' scores with batched sub-tile
  ops (exact pairwise form, the same numerics as the reference's tile loop);
* the state-independent stage (G, ``A_kk``, the triangular solve for W and U, ``A_qk``, decayed q
  and k) is computed for all sub-chunks at once (the exact form: chunk by chunk, so its pairwise
  tensors stay cache-sized), then :func:`openk3.ops.kda_scan.kda_state_pass` runs
  the sequential inter-chunk pass with a hand-written backward.

Source: architecture.md §3.4 (chunkwise form, numerics); fla ``chunk_kda`` (the same split into a
parallel intra-chunk stage and a sequential inter-chunk state pass).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.kda_inputs import finish_output, prepare_inputs
from openk3.ops.kda_scan import kda_state_pass
from openk3.ops.varlen import run_packed

# Sub-tile length of the exact pairwise scores (pairwise decays formed exactly only inside a tile).
TILE = 16
# Sub-chunk length used under the gate bound when it divides chunk_size (see _chunk_rows).
SUB = 16
# Largest per-step |log-decay| for which the sub-chunk matmul factorisation (_intra_bounded) is used
# (16 tokens: exponents stay within +-40). K3's gate is bounded by gate_lower_bound = -5 so it always
# qualifies; the unbounded Kimi-Linear gate qualifies while its decays stay moderate.
MATMUL_GATE_BOUND = 5.0
LOG2E = 1.4426950408889634  # e^x = 2^(x log2 e)


def decayed_scores(
    a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, strict: bool, tile: int = TILE
) -> torch.Tensor:
    """``out[i, j] = sum_c a_i[c] exp(G_i[c] - G_j[c]) b_j[c]`` for j < i (j <= i unless strict), else 0.

    The exact pairwise form, for gates outside the bound (where no matmul factorisation is safe).

    Args:
        a, b, G: [..., C, K] fp32; G non-increasing along C (cumulative log-decay).
        strict: exclude the diagonal. tile: sub-tile length L (a C that is not a multiple of
            it, or a single tile, is padded to whole tiles: zero ``a`` / ``b`` rows add nothing).
    Returns:
        [..., C, C].
    Numerics: as the reference, no exponent is ever positive. Inside a tile the pairwise
    differences are masked to -inf before ``exp``; a row of tile p (p >= 1) reaches every earlier
    column through the last position r of tile p-1: ``exp(G_i - G_r) * exp(G_r - G_j)``, both <= 0
    for j <= r (columns j > r are masked, their exponent replaced by 0 before ``exp``).
    """
    C, K = G.shape[-2:]
    if C % tile or C <= tile:
        # Repeating G's last row keeps it non-increasing; the padded rows and columns are cut off.
        pad = max(2, -(-C // tile)) * tile - C
        a_p, b_p = (F.pad(t, (0, 0, 0, pad)) for t in (a, b))
        G_p = torch.cat([G, G[..., -1:, :].expand(*G.shape[:-2], pad, K)], dim=-2)
        return decayed_scores(a_p, b_p, G_p, strict, tile)[..., :C, :C]
    n = C // tile
    lead = G.shape[:-2]
    Gt, at, bt = (t.reshape(*lead, n, tile, K) for t in (G, a, b))
    keep = torch.ones(tile, tile, dtype=torch.bool, device=G.device).tril(-1 if strict else 0)
    diff = Gt[..., :, None, :] - Gt[..., None, :, :]  # [..., n, L, L, K]
    decay = torch.where(keep[:, :, None], diff, float("-inf")).exp()
    diag = (at[..., :, None, :] * decay * bt[..., None, :, :]).sum(-1)  # [..., n, L, L]
    # Block-diagonal placement: [..., n, L, n, L] with only the p == p' blocks non-zero.
    eye_n = torch.eye(n, dtype=G.dtype, device=G.device)
    out = (diag[..., :, :, None, :] * eye_n[:, None, :, None]).reshape(*lead, n, tile, C)

    ref = Gt[..., :-1, -1:, :]  # [..., n-1, 1, K]: last position of tiles 0..n-2
    a_hat = at[..., 1:, :, :] * (Gt[..., 1:, :, :] - ref).exp()  # [..., n-1, L, K]
    col = torch.arange(C, device=G.device)
    before = (
        col[None, :] < (torch.arange(1, n, device=G.device) * tile)[:, None]
    )  # [n-1, C]: j <= r_p
    expo = torch.where(
        before[:, :, None], ref - G[..., None, :, :], torch.zeros((), device=G.device)
    )
    b_hat = b[..., None, :, :] * expo.exp()  # [..., n-1, C, K]
    cross = torch.where(
        before[:, None, :], a_hat @ b_hat.transpose(-1, -2), torch.zeros((), device=G.device)
    )
    out = out + F.pad(cross, (0, 0, 0, 0, 1, 0))  # tile 0 has no earlier columns
    return out.reshape(*lead, C, C)


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """``(I + A)^-1`` for strictly lower-triangular ``A`` [..., C, C], C a power of two.

    Blocked bottom-up (the recursive triangular inversion of LAPACK's ``trtri``): the inverses of
    the diagonal blocks of size s are known (s = 1: ones); each pair of neighbours merges into a
    block of 2s by ``X21 = -inv22 @ A21 @ inv11``, all pairs of a level in one batched product.
    log2(C) levels of two small matmuls each, differentiable, no in-place writes; on the CPU it
    runs in ~0.8x the time of ``torch.linalg.solve_triangular`` applied to a [C, K + V] right side,
    and it needs no concatenated right side (the WY factors are two products with the inverse).

    Raises:
        ValueError: A is not [..., C, C] with C a power of two. (The upper triangle and diagonal
        of A are never read.)
    """
    C = A.shape[-1]
    if A.dim() < 2 or A.shape[-2] != C or C < 1 or C & (C - 1):
        raise ValueError(
            f"A: expected [..., C, C] with C a power of two, got shape {tuple(A.shape)}"
        )
    lead = A.shape[:-2]
    inv = A.new_ones(*lead, C, 1, 1)  # C diagonal blocks of size 1
    s = 1
    while s < C:
        nb = C // (2 * s)
        # A21 of every pair: rows of block 2p+1, columns of block 2p -> [..., nb, s, s]
        a21 = (
            A.view(*lead, nb, 2, s, nb, 2, s)[..., :, 1, :, :, 0, :]
            .diagonal(dim1=-4, dim2=-2)
            .movedim(-1, -3)
        )
        pairs = inv.view(*lead, nb, 2, s, s)
        i11 = pairs[..., 0, :, :]
        i22 = pairs[..., 1, :, :]
        x21 = -(i22 @ a21 @ i11)
        inv = torch.cat(
            [torch.cat([i11, torch.zeros_like(i11)], -1), torch.cat([x21, i22], -1)], -2
        )
        s *= 2
    return inv.view(*lead, C, C)


def _intra_bounded(q, k, v, g, beta):
    """State-independent stage on chunks of :data:`SUB` tokens under the gate bound.

    q, k, g: [B, H, N, SUB, K]; v: [B, H, N, SUB, V]; beta: [B, H, N, SUB, 1]. Every score is one
    matmul factored through the chunk's middle position m (|G_x - G_m| <= (SUB/2) * bound = 40,
    e^40 ~ 2e17); the masked j > i pairs stay finite (exponent <= 75) and are dropped. Decays are
    taken in base 2 (``exp2`` of the log-decay times log2 e: torch's CPU ``exp2`` is ~3x faster
    than ``exp`` at the same accuracy), ``e^{G_m - G_x}`` as the reciprocal of ``e^{G_x - G_m}``,
    and ``(I + A_kk)^-1`` by :func:`unit_lower_inverse`.
    Returns the :func:`~openk3.ops.kda_scan.kda_state_pass` inputs (W, U, A, Q, Kt, D).
    """
    C, K = q.shape[-2:]
    G = g.cumsum(-2) * LOG2E  # base-2 cumulative log-decay
    mid = G[..., C // 2 : C // 2 + 1, :]
    up = (G - mid).exp2()  # e^{G_x - G_m}
    k_down = k * up.reciprocal()  # k e^{G_m - G_x}
    keep = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    zero = torch.zeros((), device=q.device)
    A_kk = torch.where(keep.tril(-1), (k * up) @ k_down.transpose(-1, -2), zero) * beta
    A_qk = torch.where(keep, (q * up) @ k_down.transpose(-1, -2), zero)
    eG = G.exp2()
    # W = (I + A_kk)^-1 diag(beta) (k e^G), U = (I + A_kk)^-1 diag(beta) v
    inv_beta = unit_lower_inverse(A_kk) * beta.transpose(-1, -2)
    W, U = inv_beta @ (k * eG), inv_beta @ v
    G_end = G[..., -1:, :]
    Kt = (k * (G_end - G).exp2()).transpose(-1, -2)
    return W, U, A_qk, q * eG, Kt, G_end.exp2().transpose(-1, -2)


def _intra_general(q, k, v, g, beta):
    """State-independent stage on chunks of any length, exact pairwise scores (any gate)."""
    K = q.shape[-1]
    G = g.cumsum(-2)  # in-chunk cumulative log-decay
    eG = G.exp()
    eye = torch.eye(q.shape[-2], dtype=torch.float32, device=q.device)
    A_kk = beta * decayed_scores(k, k, G, strict=True)
    WU = torch.linalg.solve_triangular(
        eye + A_kk, beta * torch.cat([k * eG, v], dim=-1), upper=False, unitriangular=True
    )
    W, U = WU.split([K, v.shape[-1]], dim=-1)
    A_qk = decayed_scores(q, k, G, strict=False)
    G_end = G[..., -1:, :]
    Kt = (k * (G_end - G).exp()).transpose(-1, -2)
    return W, U, A_qk, q * eG, Kt, G_end.exp().transpose(-1, -2)


def _chunk_rows(
    q,
    k,
    v,
    g,
    beta,
    scale,
    initial_state,
    lengths,
    chunk_size=64,
    output_chunk_states=False,
    validate=True,
):
    dtype = v.dtype
    q, k, v, g, beta, S, valid = prepare_inputs(
        q, k, v, g, beta, scale, initial_state, lengths, chunk_size, validate
    )
    B, T, H, K = q.shape
    V = v.shape[-1]
    NC = -(-T // chunk_size)
    if NC == 0:
        res = (finish_output(v.new_zeros(B, 0, H, V), valid, dtype), S)
        return res + ((S.new_zeros(B, 0, *S.shape[1:]),) if output_chunk_states else ())
    pad = NC * chunk_size - T
    # One host sync per call; padding is g = 0, which never disqualifies.
    bounded = bool(g.min() >= -MATMUL_GATE_BOUND)
    # Under the bound, work in sub-chunks of SUB tokens: their scores need no cross-tile terms and
    # the intra-chunk FLOPs scale with the chunk length; snapshots stay at chunk_size boundaries.
    C = SUB if bounded and chunk_size % SUB == 0 else chunk_size
    N = NC * chunk_size // C
    # [B, H, N, C, *]; padded tail positions are identity steps (g = 0, beta = 0, k = 0).
    # Contiguous in the [B, H, N, C, *] order: the elementwise ops below combine these with
    # tensors they produce; mixed layouts (token-major inputs against head-major results) made
    # each of those ops a strided gather, ~15x slower than the contiguous form on the CPU.
    q, k, v, g = (
        F.pad(t.transpose(1, 2), (0, 0, 0, pad)).contiguous().reshape(B, H, N, C, -1)
        for t in (q * scale, k, v, g)
    )
    beta = F.pad(beta.transpose(1, 2), (0, pad)).reshape(B, H, N, C, 1)
    if C == SUB:
        parts = _intra_bounded(q, k, v, g, beta)
    else:  # one chunk at a time: the pairwise [.., L, L, K] tensors of the exact form must stay cache-sized
        pieces = [
            _intra_general(*xs) for xs in zip(*(t.split(1, dim=2) for t in (q, k, v, g, beta)))
        ]
        parts = [torch.cat(p, dim=2) for p in zip(*pieces)]
    every = chunk_size // C if output_chunk_states else None
    o, states = kda_state_pass(*parts, S, every=every)
    o = o.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    res = (finish_output(o, valid, dtype), states[:, :, -1])
    if output_chunk_states:
        res += (states.transpose(1, 2),)
    return res


def kda_chunk_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    output_chunk_states: bool = False,
    validate: bool = True,
):
    """Chunkwise-parallel KDA, state-independent work batched over chunks.

    Args, Returns, Raises: exactly as :func:`openk3.ops.kda_reference.kda_chunk` (same function up to
    fp32 rounding; tests/ops/test_kda_ops.py checks values and gradients against it).
    Source: architecture.md §3.4.
    """
    return run_packed(
        _chunk_rows,
        (q, k, v, g, beta),
        lengths,
        cu_seqlens,
        scale,
        initial_state,
        chunk_size=chunk_size,
        output_chunk_states=output_chunk_states,
        validate=validate,
    )
