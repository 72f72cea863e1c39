"""The KDA decay gates and the L2 norm of q / k, as the KDA layer runs them.

Shape legend: H heads, K head dim; ``...`` any leading dims (batch, tokens).

The readable oracle forms live in :mod:`openk3.ops.kda_reference` and are written there on their
own, so that tests compare this production code against them (a bug here cannot hide in both).

Source: architecture.md §3.2 (gates, L2N); k3-release-notes.md §1.4 (A_log per head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.cast import fp32


def _biased_logits(
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
    return fp32(z) + fp32(dt_bias).reshape(H, K), fp32(A_log).exp()[:, None]


def kda_gate_lower_bound(
    z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float
) -> torch.Tensor:
    """K3 decay gate ``lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias))``.

    Args:
        z: [..., H, K] decay logits, any float dtype. A_log: [H]. dt_bias: [H*K] or [H, K].
        lower_bound: < 0 (``linear_attn_config.gate_lower_bound``, -5 in K3).
    Returns:
        [..., H, K] fp32 log-decay in (lower_bound, 0).
    Raises:
        ValueError: shape mismatch (naming ``z``, ``A_log`` or ``dt_bias``), lower_bound not negative.
    """
    if not lower_bound < 0:
        raise ValueError(f"lower_bound={lower_bound!r}: must be negative")
    zb, A = _biased_logits(z, A_log, dt_bias)
    return lower_bound * torch.sigmoid(A * zb)


def kda_gate_softplus(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi Linear decay gate ``-exp(A_log[h]) * softplus(z + dt_bias)``: arguments and errors as
    :func:`kda_gate_lower_bound`, result in (-inf, 0)."""
    zb, A = _biased_logits(z, A_log, dt_bias)
    return -A * F.softplus(zb)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """[..., K] any float dtype -> [..., K] fp32 ``x * rsqrt(sum(x^2) + eps)`` over the last dim."""
    xf = fp32(x)
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)
