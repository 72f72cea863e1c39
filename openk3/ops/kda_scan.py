"""The inter-chunk state pass of chunkwise KDA, with a hand-written backward.

Shape legend: B batch rows, H heads, N chunks, C chunk length, K key dim, V value dim.

Chunkwise KDA (architecture.md §3.4) splits into a state-independent stage, computed for all
chunks at once, and this sequential pass over chunks. Given per chunk i the WY factors ``W_i``
[C, K] and ``U_i`` [C, V], the intra-chunk query-key scores ``A_i`` [C, C], the decayed queries
``Q_i`` [C, K], the decayed keys ``Kt_i`` [K, C] (already transposed) and the chunk's total decay
``D_i`` [K, 1], starting from ``S_0``:

    v_i     = U_i - W_i S_i               (pseudo-values)
    O_i     = Q_i S_i + A_i v_i           (chunk output)
    S_{i+1} = D_i * S_i + Kt_i v_i        (state after the chunk)

Autograd through this loop records ~8 small ops per chunk and replays them backwards; here the
loop keeps only what is truly sequential (two matmuls per chunk each way) and every product that
does not depend on the running state is done once for all chunks as a batched matmul. The
backward recurrence (with ``dS`` the gradient of the state after chunk i):

    dv_i = A_i^T dO_i + Kt_i^T dS             dS_i = D_i * dS + Q_i^T dO_i - W_i^T dv_i
    dQ_i = dO_i S_i^T    dA_i = dO_i v_i^T    dKt_i = dS v_i^T    dD_i = sum_V(dS * S_i)
    dU_i = dv_i          dW_i = -dv_i S_i^T

:func:`kda_state_pass_reference` is the same pass as a plain autograd loop (the test oracle).
"""

from __future__ import annotations

import torch


def _check(W, U, A, Q, Kt, D, S0, every) -> int:
    if W.dim() != 5:
        raise ValueError(f"W: expected [B, H, N, C, K], got shape {tuple(W.shape)}")
    B, H, N, C, K = W.shape
    V = U.shape[-1]
    expected = {
        "U": (U, (B, H, N, C, V)),
        "A": (A, (B, H, N, C, C)),
        "Q": (Q, (B, H, N, C, K)),
        "Kt": (Kt, (B, H, N, K, C)),
        "D": (D, (B, H, N, K, 1)),
        "S0": (S0, (B, H, K, V)),
    }
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{name}: expected shape {shape} (from W {tuple(W.shape)}), got {tuple(t.shape)}"
            )
    if N == 0:
        raise ValueError("W: need at least one chunk (N >= 1)")
    every = N if every is None else every
    if not (isinstance(every, int) and every > 0 and N % every == 0):
        raise ValueError(f"every={every!r}: must be a positive divisor of the chunk count N={N}")
    return every


def kda_state_pass_reference(W, U, A, Q, Kt, D, S0, every: int | None = None):
    """Plain autograd form of the state pass (see the module docstring for the recurrence).

    Args:
        W: [B, H, N, C, K]; U: [B, H, N, C, V]; A: [B, H, N, C, C]; Q: [B, H, N, C, K];
        Kt: [B, H, N, K, C]; D: [B, H, N, K, 1]; S0: [B, H, K, V]; all fp32.
        every: return the state after every ``every``-th chunk (N must be a multiple of it);
            None = only the final state.
    Returns:
        (O [B, H, N, C, V], states [B, H, N / every, K, V]); the last state is the final one.
    Raises:
        ValueError: inconsistent shapes, or ``every`` not dividing N.
    """
    every = _check(W, U, A, Q, Kt, D, S0, every)
    S = S0
    outs = []
    states = []
    for i, (Wi, Ui, Ai, Qi, Ki, Di) in enumerate(zip(*(t.unbind(2) for t in (W, U, A, Q, Kt, D)))):
        v_new = Ui - Wi @ S
        outs.append(Qi @ S + Ai @ v_new)
        S = Di * S + Ki @ v_new
        if (i + 1) % every == 0:
            states.append(S)
    return torch.stack(outs, 2), torch.stack(states, 2)


def _bmm_add(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0
) -> torch.Tensor:
    """``base + alpha * a @ b`` for [B, H, x, y] operands, as one baddbmm over B*H."""
    return torch.baddbmm(base.flatten(0, 1), a.flatten(0, 1), b.flatten(0, 1), alpha=alpha).view(
        base.shape
    )


def _inference_pass(W, U, A, Q, Kt, D, S0, every):
    # No backward. Substituting v_i into the state update gives an affine map per chunk,
    # S_{i+1} = M_i S_i + N_i with M_i = diag(D_i) - Kt_i W_i and N_i = Kt_i U_i; both are
    # state-independent, so they are built for all chunks at once and the sequential loop is one
    # product per chunk, written in place into a chunk-major buffer of entering states. Outputs
    # then come from the entering states in two batched products.
    B, H, N, C, K = W.shape
    V = U.shape[-1]
    chunk_major = lambda t: t.permute(2, 0, 1, 3, 4).reshape(N * B * H, *t.shape[3:])  # noqa: E731  [N*B*H, x, y]
    Wc, Uc, Ac, Qc, Ktc, Dc = (chunk_major(t) for t in (W, U, A, Q, Kt, D))
    M = torch.baddbmm(torch.diag_embed(Dc[..., 0]), Ktc, Wc, alpha=-1.0).view(N, B * H, K, K)
    Nc = torch.bmm(Ktc, Uc).view(N, B * H, K, V)
    S = W.new_empty(N + 1, B * H, K, V)  # S[i]: the state entering chunk i; S[N]: the final state
    S[0] = S0.reshape(B * H, K, V)
    for i in range(N):
        torch.baddbmm(Nc[i], M[i], S[i], out=S[i + 1])
    S_in = S[:N].view(N * B * H, K, V)
    v_all = torch.baddbmm(Uc, Wc, S_in, alpha=-1.0)
    O = torch.baddbmm(torch.bmm(Qc, S_in), Ac, v_all).view(N, B, H, C, V).permute(1, 2, 0, 3, 4)
    states = S[every::every].view(-1, B, H, K, V).permute(1, 2, 0, 3, 4)
    return O, states


RECOMPUTE = (
    4  # keep 1 in RECOMPUTE entering states for the backward (4 sub-chunks of 16 = one 64-chunk)
)


def _rebuild_states(S_saved, Kt, D, v_all):
    """[B, H, N, K, V] entering states from every RECOMPUTE-th one: ``S_{i+1} = D_i * S_i + Kt_i v_i``."""
    N = Kt.shape[2]
    states = []
    for i in range(N):
        if i % RECOMPUTE == 0:
            S = S_saved[:, :, i // RECOMPUTE]
        else:
            S = _bmm_add(D[:, :, i - 1] * S, Kt[:, :, i - 1], v_all[:, :, i - 1])
        states.append(S)
    return torch.stack(states, 2)


class _StatePass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, W, U, A, Q, Kt, D, S0, every):
        N = W.shape[2]
        S = S0
        starts = []
        vs = []
        for i in range(N):  # the loop carries S only; all other products are batched below
            starts.append(S)
            v_new = _bmm_add(U[:, :, i], W[:, :, i], S, alpha=-1.0)
            vs.append(v_new)
            S = _bmm_add(D[:, :, i] * S, Kt[:, :, i], v_new)
        S_in = torch.stack(starts, 2)  # [B, H, N, K, V]: the state entering each chunk
        v_all = torch.stack(vs, 2)  # [B, H, N, C, V]
        O = torch.baddbmm((Q @ S_in).flatten(0, 2), A.flatten(0, 2), v_all.flatten(0, 2)).view_as(
            v_all
        )
        states = torch.cat([S_in[:, :, every::every], S.unsqueeze(2)], dim=2)
        ctx.every = every
        # Keep every RECOMPUTE-th entering state only; the backward rebuilds the others with one
        # matmul each (v is kept), so activation memory across layers is RECOMPUTE times smaller.
        ctx.save_for_backward(W, A, Q, Kt, D, S_in[:, :, ::RECOMPUTE].clone(), v_all)
        return O, states

    @staticmethod
    def backward(ctx, dO, dStates):
        W, A, Q, Kt, D, S_saved, v_all = ctx.saved_tensors
        N = W.shape[2]
        every = ctx.every
        S_in = _rebuild_states(S_saved, Kt, D, v_all)
        if dO is None:
            dO = torch.zeros_like(v_all)
        # State-independent parts of dv_i and dS_i, for all chunks at once.
        At_dO = A.transpose(-1, -2) @ dO  # [B, H, N, C, V]
        Qt_dO = Q.transpose(-1, -2) @ dO  # [B, H, N, K, V]
        Kt_T = Kt.transpose(-1, -2)
        W_T = W.transpose(-1, -2)
        dS = torch.zeros_like(S_in[:, :, 0])
        dv_list = [None] * N
        dS_after = [None] * N
        for i in range(N - 1, -1, -1):
            if dStates is not None and (i + 1) % every == 0:
                dS = dS + dStates[:, :, (i + 1) // every - 1]
            dS_after[i] = dS  # gradient of the state after chunk i
            dv = _bmm_add(At_dO[:, :, i], Kt_T[:, :, i], dS)
            dv_list[i] = dv
            dS = _bmm_add(D[:, :, i] * dS + Qt_dO[:, :, i], W_T[:, :, i], dv, alpha=-1.0)
        dv_all = torch.stack(dv_list, 2)  # [B, H, N, C, V]
        dS_next = torch.stack(dS_after, 2)  # [B, H, N, K, V]
        S_t = S_in.transpose(-1, -2)
        dW = -(dv_all @ S_t)
        dA = dO @ v_all.transpose(-1, -2)
        dQ = dO @ S_t
        dKt = dS_next @ v_all.transpose(-1, -2)
        dD = (dS_next * S_in).sum(-1, keepdim=True)
        return dW, dv_all, dA, dQ, dKt, dD, dS, None


def kda_state_pass(W, U, A, Q, Kt, D, S0, every: int | None = None):
    """The chunk-sequential state pass of chunkwise KDA with a hand-written backward.

    Same arguments, returns and errors as :func:`kda_state_pass_reference` (equal up to fp32
    rounding; tests/ops/test_kda_scan.py checks values and gradients, and gradcheck in fp64).
    Memory: with autograd it keeps one entering state in :data:`RECOMPUTE` ([B, H, N / 4, K, V])
    and rebuilds the rest in the backward (one matmul per chunk); the autograd loop keeps all N.
    Without autograd (inference) only the requested states are kept.
    """
    every = _check(W, U, A, Q, Kt, D, S0, every)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (W, U, A, Q, Kt, D, S0))):
        return _inference_pass(W, U, A, Q, Kt, D, S0, every)
    return _StatePass.apply(W, U, A, Q, Kt, D, S0, every)
