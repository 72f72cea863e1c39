"""Causal depthwise short convolution (KDA's q/k/v ``*_conv1d``) with an explicit carried tail.

Shape legend: B batch rows, T tokens, C channels, W kernel width (``linear_conv_kernel_dim``).
A *tail* is the last W-1 inputs a row has seen, oldest first: [B, C, W-1]. It is what the decode
cache keeps (``KDALayerState.conv``) and what lets a sequence be processed in pieces.

Semantics (architecture.md §3.2): ``out_t[c] = sum_{j=0..W-1} w[c, j] * x_{t-W+1+j}[c]`` with the
W-1 positions before the first token taken from the tail (zeros when there is none), no bias.
Math is fp32 whatever the input dtype (the reference keeps conv weights in fp32); the result is cast
back to the input dtype after the optional activation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ACTIVATIONS = {None: lambda y: y, "silu": F.silu}


def _check_weight(weight: torch.Tensor, channels: int) -> torch.Tensor:
    """Accept the checkpoint layout [C, 1, W] or a plain [C, W]; return fp32 [C, W]."""
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(f"weight: expected [C={channels}, 1, W] or [C, W], got {tuple(weight.shape)}")
    return weight.float()


def _check_activation(activation: str | None) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: must be None or 'silu'")


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    tail: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over a whole (right-padded) sequence, continuing from ``tail``.

    Args:
        x: [B, T, C] inputs (any float dtype), channels last.
        weight: [C, 1, W] (``nn.Conv1d(C, C, W, groups=C)`` layout) or [C, W].
        tail: [B, C, W-1] the W-1 inputs preceding ``x``, oldest first; None = zeros.
        lengths: [B] int, valid tokens per row (positions ``t >= lengths[b]`` are padding);
            None = all T valid. Padding never reaches a valid output (the conv is causal) and is
            excluded from the returned tail.
        activation: None or ``"silu"``, applied in fp32 before the cast back.
    Returns:
        (y, new_tail): y [B, T, C] in ``x.dtype`` (values at padded positions are unspecified);
        new_tail [B, C, W-1] in ``x.dtype``: the last W-1 *valid* inputs of the stream
        ``tail ++ x[b, :lengths[b]]``, oldest first (rows with fewer than W-1 valid tokens keep the
        newest part of the old tail).
    Raises:
        ValueError: wrong rank/shape of x, weight, tail or lengths, lengths outside [0, T], or an
            unknown activation.
    """
    if x.dim() != 3:
        raise ValueError(f"x: expected [B, T, C], got shape {tuple(x.shape)}")
    B, T, C = x.shape
    w = _check_weight(weight, C)
    W = w.shape[1]
    _check_activation(activation)
    if tail is None:
        tail = x.new_zeros(B, C, W - 1)
    elif tuple(tail.shape) != (B, C, W - 1):
        raise ValueError(f"tail: expected [B={B}, C={C}, W-1={W - 1}], got {tuple(tail.shape)}")
    if lengths is not None:
        if lengths.shape != (B,):
            raise ValueError(f"lengths: expected shape [B={B}], got {tuple(lengths.shape)}")
        if bool(((lengths < 0) | (lengths > T)).any()):
            raise ValueError(f"lengths: values must lie in [0, T={T}], got {lengths.tolist()}")

    stream = torch.cat([tail.float(), x.float().transpose(1, 2)], dim=2)  # [B, C, W-1+T]
    if T > 0:
        y = F.conv1d(stream, w.unsqueeze(1), groups=C)  # [B, C, T]
        y = _ACTIVATIONS[activation](y).transpose(1, 2).to(x.dtype)
    else:
        y = x.new_zeros(B, 0, C)

    if W == 1:
        return y, x.new_zeros(B, C, 0)
    ends = torch.full((B,), T, dtype=torch.long, device=x.device) if lengths is None else lengths.long()
    # stream index lengths[b] + i (i < W-1) is the i-th oldest of the last W-1 valid inputs.
    idx = ends[:, None] + torch.arange(W - 1, device=x.device)  # [B, W-1]
    new_tail = stream.gather(2, idx[:, None, :].expand(B, C, W - 1)).to(x.dtype)
    return y, new_tail


def short_conv_step(
    x: torch.Tensor,
    weight: torch.Tensor,
    tail: torch.Tensor,
    valid: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of :func:`short_conv`: push one token through the conv.

    Args:
        x: [B, C] the new input token per row.
        weight: [C, 1, W] or [C, W].
        tail: [B, C, W-1] the previous W-1 inputs, oldest first.
        valid: [B] bool, rows whose token is real; rows with False keep their tail unchanged
            (their output is unspecified). None = all rows valid.
        activation: None or ``"silu"`` (fp32, before the cast back).
    Returns:
        (y, new_tail): y [B, C] in ``x.dtype``; new_tail [B, C, W-1] in ``x.dtype``
        (``tail`` shifted left by one with ``x`` appended).
    Raises:
        ValueError: wrong shapes or an unknown activation.
    """
    if x.dim() != 2:
        raise ValueError(f"x: expected [B, C], got shape {tuple(x.shape)}")
    B, C = x.shape
    w = _check_weight(weight, C)
    W = w.shape[1]
    _check_activation(activation)
    if tuple(tail.shape) != (B, C, W - 1):
        raise ValueError(f"tail: expected [B={B}, C={C}, W-1={W - 1}], got {tuple(tail.shape)}")
    if valid is not None and valid.shape != (B,):
        raise ValueError(f"valid: expected shape [B={B}], got {tuple(valid.shape)}")

    window = torch.cat([tail.float(), x.float().unsqueeze(2)], dim=2)  # [B, C, W]
    y = _ACTIVATIONS[activation]((window * w).sum(-1)).to(x.dtype)
    new_tail = window[:, :, 1:]
    if valid is not None:
        new_tail = torch.where(valid[:, None, None], new_tail, tail.float())
    return y, new_tail.to(x.dtype)
