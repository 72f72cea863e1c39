"""Readable fp32 references for Kimi Delta Attention: gates, L2 norm, token recurrence, chunked form.

Shape legend: B batch rows, T tokens, H heads, K key dim, V value dim, N packed documents,
C chunk size, NC number of chunks (ceil(T / C)).

Conventions (kept semantic on purpose, see spec/style.md "flags that change what an argument means"):
* ``q``, ``k`` are already L2-normalised (:func:`l2_normalize`); ``scale`` multiplies q inside.
* ``g`` is the per-channel log-decay (<= 0), already passed through a gate function; ``beta`` is
  already in (0, 1).
* The state is S[K, V] per head, fp32, layout [B, H, K, V] (the spec's S; the official reference
  stores the transpose [B, H, V, K]).
* Right padding: with ``lengths`` [B], positions ``t >= lengths[b]`` are treated as g = 0,
  beta = 0, k = 0, so they leave the state unchanged; their outputs are zero.
* Packed documents: with ``cu_seqlens`` [N+1] (B must be 1) the state starts afresh at every
  document (zeros, or ``initial_state[n]``) and the final state is returned per document.

The oracle stands on its own: it imports no fast path (:mod:`openk3.ops.kda_chunk`,
:mod:`openk3.ops.kda_scan`) and no fast path imports it; the gates and L2 norm here are the oracle
forms of the production :mod:`openk3.ops.kda_gate`. Argument checks, padding handling
(:mod:`openk3.ops.kda_inputs`) and document packing (:mod:`openk3.ops.varlen`) are shared, so every
implementation refuses the same inputs the same way.

Source: architecture.md §3.2 (token recurrence), §3.4 (chunkwise form, numerics), §3.5 (decode);
k3-release-notes.md §1.4 (gate forms, A_log per head); oracle ``fla/ops/kda/naive.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.kda_inputs import finish_output, prepare_inputs
from openk3.ops.short_conv import short_conv_reference
from openk3.ops.varlen import run_packed

# Sub-tile length inside a chunk: pairwise decays are formed exactly only inside a tile; across
# tiles they factor through a reference position so that no exponent is positive (no overflow for
# any gate, including the unbounded Kimi-Linear softplus gate).
_TILE = 16


# ----------------------------------------------------------------------------- gates and norms (oracle forms)
def _per_head(
    z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate and return (z + dt_bias [..., H, K] fp32, exp(A_log) [H, 1] fp32)."""
    if z.dim() < 2:
        raise ValueError(f"z: expected [..., H, K], got shape {tuple(z.shape)}")
    H, K = z.shape[-2:]
    if A_log.shape != (H,):
        raise ValueError(f"A_log: expected one value per head [H={H}], got {tuple(A_log.shape)}")
    if dt_bias.numel() != H * K:
        raise ValueError(
            f"dt_bias: expected H*K={H * K} values ([H*K] or [H, K]), got {tuple(dt_bias.shape)}"
        )
    return z.float() + dt_bias.float().reshape(H, K), A_log.float().exp()[:, None]


def kda_gate_lower_bound(
    z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float
) -> torch.Tensor:
    """K3 decay gate: ``g = lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias))``.

    Args:
        z: [..., H, K] decay logits (``f_b_proj(f_a_proj(x))`` viewed per head), any float dtype.
        A_log: [H] fp32, one value per head. dt_bias: [H*K] or [H, K].
        lower_bound: g_min < 0 (``linear_attn_config.gate_lower_bound``, -5 in K3).
    Returns:
        [..., H, K] fp32 log-decay in (lower_bound, 0).
    Raises:
        ValueError: shape mismatch, or lower_bound not negative.
    Source: architecture.md §3.2; fla ``naive_kda_lowerbound_gate``.
    """
    if not lower_bound < 0:
        raise ValueError(f"lower_bound={lower_bound!r}: must be negative")
    zb, A = _per_head(z, A_log, dt_bias)
    return lower_bound * torch.sigmoid(A * zb)


def kda_gate_softplus(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi Linear decay gate: ``g = -exp(A_log[h]) * softplus(z + dt_bias)``.

    Args/Returns: as :func:`kda_gate_lower_bound` (no bound; g in (-inf, 0)).
    Raises:
        ValueError: shape mismatch.
    Source: architecture.md §3.2 (Kimi Linear remark); transformers ``KimiLinearForgetGate``.
    """
    zb, A = _per_head(z, A_log, dt_bias)
    return -A * F.softplus(zb)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim (one head), in fp32.

    Args:
        x: [..., K] any float dtype.
    Returns:
        [..., K] fp32.
    Source: architecture.md §3.2 (L2N, eps 1e-6, as fla ``l2norm``).
    """
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- token recurrence
def _recurrent_rows(
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
    T = q.shape[1]
    outs = []
    snaps = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]  # decay: [B, H, K, V]
        u = beta[:, t, :, None] * (
            v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        )  # delta-correct
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))  # read
        if output_chunk_states and ((t + 1) % chunk_size == 0 or t == T - 1):
            snaps.append(S)
    o = torch.stack(outs, 1) if outs else v.new_zeros(v.shape)
    res = (finish_output(o, valid, dtype), S)
    if output_chunk_states:
        res += (torch.stack(snaps, 1) if snaps else S.new_zeros(S.shape[0], 0, *S.shape[1:]),)
    return res


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    *,
    chunk_size: int = 64,
    output_chunk_states: bool = False,
    validate: bool = True,
):
    """Token-by-token KDA: per step ``S = S*exp(g)[:, None]; u = beta*(v - S^T k); S += k u^T;
    o = S^T (q*scale)``.

    Args:
        q, k: [B, T, H, K] L2-normalised. v: [B, T, H, V]. g: [B, T, H, K] log-decay.
        beta: [B, T, H] in (0, 1). scale: query scale (K ** -0.5 in KDA).
        initial_state: [B, H, K, V] (with ``cu_seqlens``: [N, H, K, V]); None = zeros.
        lengths: [B] valid tokens per row (right padding); None = all valid.
        cu_seqlens: [N+1] packed document offsets (requires B == 1; excludes ``lengths``).
        chunk_size, output_chunk_states: as :func:`kda_chunk` (snapshots every ``chunk_size`` steps).
        validate: check the values of ``lengths`` (a host read); False when the caller has.
    Returns:
        (o [B, T, H, V] in v's dtype, final_state [B or N, H, K, V] fp32), plus chunk_states
        [B or N, NC, H, K, V] fp32 when ``output_chunk_states``.
    Raises:
        ValueError: inconsistent shapes, bad lengths/cu_seqlens/scale.
    Source: architecture.md §3.2 (decay, delta-correct, read).
    """
    return run_packed(
        _recurrent_rows,
        (q, k, v, g, beta),
        lengths,
        cu_seqlens,
        scale,
        initial_state,
        chunk_size=chunk_size,
        output_chunk_states=output_chunk_states,
        validate=validate,
    )


# ----------------------------------------------------------------------------- chunkwise form
def _decayed_scores(
    a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, strict: bool
) -> torch.Tensor:
    """``out[i, j] = sum_c a_i[c] exp(G_i[c] - G_j[c]) b_j[c]`` for j < i (j <= i unless strict), else 0.

    a, b, G: [..., C, K] (G the in-chunk cumulative log-decay, non-increasing along C). Returns [..., C, C].
    Inside a sub-tile the pairwise differences are masked before exponentiating (j > i would give
    exp(+large)); across tiles the decay factors through the last position r of the earlier tile:
    exp(G_i - G_r) * exp(G_r - G_j), both exponents <= 0, so plain matmuls never overflow.
    """
    C = G.shape[-2]
    out = G.new_zeros(*G.shape[:-2], C, C)
    for s0 in range(0, C, _TILE):
        s1 = min(s0 + _TILE, C)
        n = s1 - s0
        keep = torch.ones(n, n, dtype=torch.bool, device=G.device).tril(-1 if strict else 0)
        diff = G[..., s0:s1, None, :] - G[..., None, s0:s1, :]  # [..., i, j, K]
        decay = diff.masked_fill(~keep[:, :, None], float("-inf")).exp()
        out[..., s0:s1, s0:s1] = (a[..., s0:s1, None, :] * decay * b[..., None, s0:s1, :]).sum(-1)
        if s1 < C:
            ref = G[..., s1 - 1 : s1, :]
            a_hat = a[..., s1:, :] * (G[..., s1:, :] - ref).exp()
            b_hat = b[..., s0:s1, :] * (ref - G[..., s0:s1, :]).exp()
            out[..., s1:, s0:s1] = a_hat @ b_hat.transpose(-1, -2)
    return out


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
    C = chunk_size
    NC = -(-T // C)
    pad = NC * C - T
    # [B, H, NC*C, *]; padded tail positions are identity steps (g = 0, beta = 0, k = 0).
    q, k, v, g = (F.pad(t.transpose(1, 2), (0, 0, 0, pad)) for t in (q * scale, k, v, g))
    beta = F.pad(beta.transpose(1, 2), (0, pad))
    eye = torch.eye(C, dtype=torch.float32, device=q.device)
    outs = []
    snaps = []
    for c in range(NC):
        sl = slice(c * C, (c + 1) * C)
        qc = q[:, :, sl]
        kc = k[:, :, sl]
        vc = v[:, :, sl]
        bc = beta[:, :, sl, None]
        G = g[:, :, sl].cumsum(-2)  # in-chunk cumulative log-decay, [B, H, C, K]
        A_kk = bc * _decayed_scores(kc, kc, G, strict=True)  # strictly lower
        # W = (I + A_kk)^-1 Diag(beta) (Gamma*K), U = (I + A_kk)^-1 Diag(beta) V, by forward substitution.
        rhs = bc * torch.cat([kc * G.exp(), vc], dim=-1)
        WU = torch.linalg.solve_triangular(eye + A_kk, rhs, upper=False, unitriangular=True)
        Wc, Uc = WU.split([K, vc.shape[-1]], dim=-1)
        v_new = Uc - Wc @ S  # pseudo-values
        A_qk = _decayed_scores(qc, kc, G, strict=False)  # diagonal included
        outs.append((qc * G.exp()) @ S + A_qk @ v_new)
        G_end = G[:, :, -1:, :]  # [B, H, 1, K]
        S = G_end.exp().transpose(-1, -2) * S + (kc * (G_end - G).exp()).transpose(-1, -2) @ v_new
        if output_chunk_states:
            snaps.append(S)
    if outs:
        o = torch.cat(outs, dim=2)[:, :, :T].transpose(1, 2)
    else:
        o = v.new_zeros(B, 0, H, v.shape[-1])
    res = (finish_output(o, valid, dtype), S)
    if output_chunk_states:
        res += (torch.stack(snaps, 1) if snaps else S.new_zeros(B, 0, *S.shape[1:]),)
    return res


def kda_chunk(
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
    """Chunkwise-parallel KDA (same function as :func:`kda_recurrent`, up to fp32 rounding).

    Per chunk of ``chunk_size`` tokens: cumulative log-decay G, strictly-lower
    ``A_kk = beta_i sum_c k_i e^{G_i-G_j} k_j``, ``W, U = (I + A_kk)^-1 Diag(beta) [Gamma*K, V]``,
    pseudo-values ``U - W S``, ``O = (Gamma*Q) S + A_qk (U - W S)`` with A_qk's diagonal included,
    ``S <- Diag(Gamma_C) S + (K * e^{G_C - G})^T (U - W S)``. Vectorised over B and H.

    Args:
        q, k, v, g, beta, scale, initial_state, lengths, cu_seqlens, validate: as
            :func:`kda_recurrent`.
        chunk_size: C (64 as in every implementation). output_chunk_states: also return the state
            after every chunk, i.e. after min((i+1)*C, length) tokens of each row/document.
    Returns:
        (o [B, T, H, V] in v's dtype, final_state [B or N, H, K, V] fp32), plus chunk_states
        [B or N, NC, H, K, V] fp32 when ``output_chunk_states`` (NC = ceil(T / C), T the padded
        row length or the longest document; the last entry equals final_state).
    Raises:
        ValueError: inconsistent shapes, bad lengths/cu_seqlens/scale/chunk_size.
    Source: architecture.md §3.4; fla ``naive_chunk_kda``.
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


# ----------------------------------------------------------------------------- one decode token
def kda_decode_step(
    qkv, conv_tail, conv_weight, z, beta_logit, A_log, dt_bias, state, scale, gate_lower_bound
):
    """Oracle of the fused decode step :func:`openk3.ops.kda_decode.kda_decode_step` (same
    arguments and returns): each of q, k, v through the ``F.conv1d`` short-conv reference on a
    one-token sequence with SiLU, then :func:`l2_normalize`, the gate, and :func:`kda_recurrent`.
    Source: architecture.md §3.2, §3.5."""
    B, _, P = qkv.shape
    H, K = z.shape[1:]
    outs = []
    tails = []
    for j in range(3):
        y, tail = short_conv_reference(
            qkv[:, j, None], conv_weight[j], conv_tail[:, j], activation="silu"
        )
        outs.append(y.float().view(B, 1, H, K))
        tails.append(tail)
    q = l2_normalize(outs[0])
    k = l2_normalize(outs[1])
    if gate_lower_bound is not None:
        g = kda_gate_lower_bound(z[:, None], A_log, dt_bias, gate_lower_bound)
    else:
        g = kda_gate_softplus(z[:, None], A_log, dt_bias)
    beta = torch.sigmoid(beta_logit.float())[:, None]
    o, S = kda_recurrent(q, k, outs[2], g, beta, scale, state)
    return o[:, 0], torch.stack(tails, dim=1).to(conv_tail.dtype), S
