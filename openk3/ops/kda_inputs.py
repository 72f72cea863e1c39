"""Argument checks and padding handling shared by every KDA implementation (the references in
:mod:`openk3.ops.kda_reference` and the fast path in :mod:`openk3.ops.kda_chunk`): both accept the
same arguments and must refuse the same bad ones with the same messages.

Shape legend: B batch rows, T tokens, H heads, K key dim, V value dim.
"""

from __future__ import annotations

import math

import torch

from openk3.ops.cast import cast, fp32
from openk3.ops.varlen import check_lengths


def prepare_inputs(q, k, v, g, beta, scale, initial_state, lengths, chunk_size, validate=True):
    """Validate the KDA arguments, cast to fp32 and neutralise padded positions.

    Args: as :func:`openk3.ops.kda.kda` (q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
        initial_state [B, H, K, V] or None; lengths [B] or None; ``validate=False`` checks the
        shape of ``lengths`` but not its values, a host read the caller has already made).
    Returns:
        (q, k, v, g, beta fp32 with padded positions set to 0, S0 [B, H, K, V] fp32, valid [B, T]
        bool or None when there is no padding).
    Raises:
        ValueError: naming the first inconsistent argument.
    """
    if q.dim() != 4:
        raise ValueError(f"q: expected [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k: expected shape {tuple(q.shape)} (as q), got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v: expected [B={B}, T={T}, H={H}, V], got {tuple(v.shape)}")
    V = v.shape[3]
    if g.shape != q.shape:
        raise ValueError(
            f"g: expected per-channel log-decay {tuple(q.shape)}, got {tuple(g.shape)}"
        )
    if beta.shape != (B, T, H):
        raise ValueError(f"beta: expected [B={B}, T={T}, H={H}], got {tuple(beta.shape)}")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r}: must be a positive finite number")
    if not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"chunk_size={chunk_size!r}: must be a positive integer")
    if initial_state is None:
        S0 = q.new_zeros(B, H, K, V, dtype=torch.float32)
    elif initial_state.shape != (B, H, K, V):
        raise ValueError(
            f"initial_state: expected [B={B}, H={H}, K={K}, V={V}], got {tuple(initial_state.shape)}"
        )
    else:
        S0 = fp32(initial_state)
    q, k, v, g, beta = (fp32(t) for t in (q, k, v, g, beta))
    valid = None
    if lengths is not None:
        check_lengths(lengths, B, T, values=validate)
        valid = torch.arange(T, device=q.device)[None, :] < lengths.to(q.device)[:, None]  # [B, T]
        # where(), not a product: garbage (even NaN) in padding must not leak into the state.
        m4 = valid[:, :, None, None]
        q, k, v, g = (torch.where(m4, t, torch.zeros((), device=t.device)) for t in (q, k, v, g))
        beta = torch.where(valid[:, :, None], beta, torch.zeros((), device=beta.device))
    return q, k, v, g, beta, S0, valid


def finish_output(o: torch.Tensor, valid: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """o [B, T, H, V] with padded positions zeroed, cast to ``dtype`` (v's dtype)."""
    if valid is not None:
        o = torch.where(valid[:, :, None, None], o, torch.zeros((), device=o.device))
    return cast(o, dtype)
