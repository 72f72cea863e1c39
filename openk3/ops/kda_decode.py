"""One KDA decode step per row, fused: short-conv step of q, k, v together, SiLU, L2 norm, decay
gate, sigmoid beta and the delta-rule state update in one function of few, large tensor ops.

Shape legend: B rows (one new token each), H heads, K = V head dim, P = H*K projection width,
W short-conv kernel width.

:func:`kda_decode_step` is what the KDA layer runs for a decode step (one token per row, no
padding): q, k and v share one [B, 3, P, W] conv window (the cache already keeps their tails
stacked, ``KDALayerState.conv``), q and k one L2 norm, and the recurrence is the four products of
the token update written out (no per-call argument checks, no padding handling, no loop).
:func:`openk3.ops.kda_reference.kda_decode_step` computes the same from the oracle's pieces (the
``F.conv1d`` short-conv reference, the oracle gates and L2 norm, the token recurrence) and is what
the tests compare it against; this module imports nothing from the oracle.

Token update (architecture.md §3.2, §3.5), per row and head, S [K, V] fp32:
    S <- S * exp(g)[:, None];  u = beta * (v - S^T k);  S <- S + k u^T;  o = S^T (q * scale)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.cast import cast, fp32
from openk3.ops.kda_gate import kda_gate_lower_bound, kda_gate_softplus, l2_normalize


def kda_decode_step(
    qkv: torch.Tensor,
    conv_tail: torch.Tensor,
    conv_weight: torch.Tensor,
    z: torch.Tensor,
    beta_logit: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    scale: float,
    gate_lower_bound: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row through KDA's conv, norms, gates and state update.

    Args:
        qkv: [B, 3, P] the token's q, k, v projections (before the conv), any float dtype.
        conv_tail: [B, 3, P, W-1] their previous W-1 inputs, oldest first.
        conv_weight: [3, P, W] the q, k, v depthwise conv kernels.
        z: [B, H, K] decay logits (``f_b_proj(f_a_proj x)``). beta_logit: [B, H] (``b_proj x``).
        A_log: [H]; dt_bias: [H*K]. state: [B, H, K, V] fp32 recurrent state.
        scale: query scale (K ** -0.5).
        gate_lower_bound: K3's bound (< 0) of the lower-bounded gate; None = Kimi Linear's
            softplus gate.
    Returns:
        (o [B, H, V] fp32, new_tail [B, 3, P, W-1] in ``conv_tail.dtype``, new_state [B, H, K, V]
        fp32).
    Shapes are trusted (the layer built them); no host sync.
    """
    B, _, P = qkv.shape
    H, K = z.shape[1:]
    window = torch.cat([fp32(conv_tail), fp32(qkv).unsqueeze(-1)], dim=-1)  # [B, 3, P, W]
    mixed = F.silu((window * fp32(conv_weight)).sum(-1))  # [B, 3, P]
    qk = l2_normalize(mixed[:, :2].view(B, 2, H, K))
    q = qk[:, 0]
    k = qk[:, 1]
    v = mixed[:, 2].view(B, H, K)
    if gate_lower_bound is not None:
        g = kda_gate_lower_bound(z, A_log, dt_bias, gate_lower_bound)
    else:
        g = kda_gate_softplus(z, A_log, dt_bias)
    beta = torch.sigmoid(fp32(beta_logit))
    S = state * g.exp().unsqueeze(-1)  # decay
    u = beta.unsqueeze(-1) * (v - torch.einsum("bhk,bhkv->bhv", k, S))  # delta-correct
    S = S + k.unsqueeze(-1) * u.unsqueeze(-2)
    o = torch.einsum("bhk,bhkv->bhv", q * scale, S)  # read
    return o, cast(window[..., 1:], conv_tail.dtype), S
