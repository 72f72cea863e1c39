"""RMSNorm and gated RMSNorm, computed in fp32 and cast back to the input dtype.

Shape legend: ``*`` any leading dims, D normalised (last) dim.
Source: architecture.md §1 (RMSNorm, eps ``rms_norm_eps``), §3.1 (KDA ``o_norm``: sigmoid-gated).
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.ops.cast import cast, fp32


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, in fp32.

    Args:
        x: [*, D], any float dtype. weight: [D] or None (no scale). eps: added to the mean square.
    Returns:
        [*, D] in ``x.dtype``.
    """
    xf = fp32(x)
    if torch.is_grad_enabled() and (
        xf.requires_grad or (weight is not None and weight.requires_grad)
    ):
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if weight is not None:
            y = y * fp32(weight)
        return cast(y, x.dtype)
    # Without autograd: the same ops, bit for bit, with two temporaries fewer (written in place;
    # 0.75-0.9x of the time for [2048, 128] rows, 1 thread).
    y = torch.mul(xf, xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_())
    if weight is not None:
        y.mul_(fp32(weight))
    return cast(y, x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale (checkpoint tensor ``weight`` [D], init ones)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedRMSNorm(RMSNorm):
    """``RMSNorm(x) * sigmoid(gate)`` (FLA ``FusedRMSNormGated`` with activation="sigmoid").

    Used as KDA's per-head output norm: one weight [head_dim] shared by all heads.
    """

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """x, gate: [*, D] -> [*, D] (x.dtype)."""
        y = fp32(rms_norm(x, self.weight, self.eps))
        if torch.is_grad_enabled() and (y.requires_grad or gate.requires_grad):
            return cast(y * torch.sigmoid(fp32(gate)), x.dtype)
        # y is a fresh tensor here (rms_norm's own result): gate it in place, same values.
        return cast(y.mul_(torch.sigmoid(fp32(gate))), x.dtype)
