"""Causal depthwise short convolution (KDA's q/k/v ``*_conv1d``) with an explicit carried tail.

Shape legend: B batch rows, T tokens, C channels, W kernel width (``linear_conv_kernel_dim``).
A *tail* is the last W-1 inputs a row has seen, oldest first: [B, C, W-1]. It is what the decode
cache keeps (``KDALayerState.conv``) and what lets a sequence be processed in pieces.

Semantics (architecture.md §3.2): ``out_t[c] = sum_{j=0..W-1} w[c, j] * x_{t-W+1+j}[c]`` with the
W-1 positions before the first token taken from the tail (zeros when there is none), no bias.
Math is fp32 whatever the input dtype (the reference keeps conv weights in fp32); the result is cast
back to the input dtype after the optional activation.

Two implementations of one function: :func:`short_conv` (fast path: channels-last shifted
multiply-adds with a hand-written backward; the depthwise ``F.conv1d`` backward is slow on CPU and
needs two transposes) and :func:`short_conv_reference` (the plain ``F.conv1d`` formulation, the
readable reference the tests compare against).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.cast import cast, fp32
from openk3.ops.varlen import check_lengths

_ACTIVATIONS = {None: lambda y: y, "silu": F.silu}


def _check_weight(weight: torch.Tensor, channels: int) -> torch.Tensor:
    """Accept the checkpoint layout [C, 1, W] or a plain [C, W]; return fp32 [C, W]."""
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(
            f"weight: expected [C={channels}, 1, W] or [C, W], got {tuple(weight.shape)}"
        )
    return fp32(weight)


def _check_activation(activation: str | None) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: must be None or 'silu'")


def _check_args(
    x, weight, tail, lengths, activation, validate: bool = True
) -> tuple[int, int, int, torch.Tensor]:
    """Validate the :func:`short_conv` arguments (the values of ``lengths`` only when
    ``validate``); return (B, T, C, fp32 weight [C, W])."""
    if x.dim() != 3:
        raise ValueError(f"x: expected [B, T, C], got shape {tuple(x.shape)}")
    B, T, C = x.shape
    w = _check_weight(weight, C)
    W = w.shape[1]
    _check_activation(activation)
    if tail is not None and tuple(tail.shape) != (B, C, W - 1):
        raise ValueError(f"tail: expected [B={B}, C={C}, W-1={W - 1}], got {tuple(tail.shape)}")
    if lengths is not None:
        check_lengths(lengths, B, T, values=validate)
    return B, T, C, w


class _ShiftConv(torch.autograd.Function):
    """Channels-last depthwise causal conv as W shifted multiply-adds, with optional fused SiLU.

    forward(x [B, T, C] fp32, tail [B, W-1, C] fp32 or None (= zeros), wt [W, C] fp32, silu: bool)
    -> y [B, T, C] fp32. Output t reads stream position t + j (stream = tail ++ x) with tap j,
    i.e. x[t - s] for shift s = W-1-j when t >= s, and tail[t + j] when t < s.
    Forward and backward are a handful of strided elementwise kernels: no transposes, no im2col,
    none of the depthwise ``conv1d`` backward kernels (slow on CPU).
    """

    @staticmethod
    def forward(ctx, x, tail, wt, silu):
        T = x.shape[1]
        W = wt.shape[0]
        y = x * wt[W - 1]
        for j in range(W - 1):
            s = W - 1 - j
            if T > s:
                y[:, s:].addcmul_(x[:, : T - s], wt[j])
            if tail is not None:
                n = min(s, T)
                y[:, :n].addcmul_(tail[:, j : j + n], wt[j])
        ctx.silu = silu
        ctx.save_for_backward(x, tail, wt, y if silu else None)
        return F.silu(y) if silu else y

    @staticmethod
    def backward(ctx, gy):
        x, tail, wt, pre = ctx.saved_tensors
        if ctx.silu:
            gy = torch.ops.aten.silu_backward(gy, pre)
        T = x.shape[1]
        W = wt.shape[0]
        need_x, need_tail, need_w = ctx.needs_input_grad[:3]
        gx = gtail = gwt = None
        if need_x:
            gx = gy * wt[W - 1]
            for j in range(W - 1):
                s = W - 1 - j
                if T > s:
                    gx[:, : T - s].addcmul_(gy[:, s:], wt[j])
        if need_tail:
            gtail = torch.zeros_like(tail)
            for j in range(W - 1):
                n = min(W - 1 - j, T)
                gtail[:, j : j + n].addcmul_(gy[:, :n], wt[j])
        if need_w:
            taps = []
            for j in range(W):
                s = W - 1 - j
                gj = (gy[:, s:] * x[:, : T - s]).sum((0, 1)) if T > s else wt.new_zeros(wt.shape[1])
                if tail is not None and s > 0:
                    n = min(s, T)
                    gj = gj + (gy[:, :n] * tail[:, j : j + n]).sum((0, 1))
                taps.append(gj)
            gwt = torch.stack(taps)
        return gx, gtail, gwt, None


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    tail: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    validate: bool = True,
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
        validate: check the values of ``lengths`` (a host read); False when the caller has (the
            KDA layer). Shapes are always checked.
    Returns:
        (y, new_tail): y [B, T, C] in ``x.dtype`` (values at padded positions are unspecified);
        new_tail [B, C, W-1] in ``x.dtype``: the last W-1 *valid* inputs of the stream
        ``tail ++ x[b, :lengths[b]]``, oldest first (rows with fewer than W-1 valid tokens keep the
        newest part of the old tail).
    Raises:
        ValueError: wrong rank/shape of x, weight, tail or lengths, lengths outside [0, T], or an
            unknown activation.
    """
    B, T, C, w = _check_args(x, weight, tail, lengths, activation, validate)
    W = w.shape[1]
    xf = x.float()
    tail_cl = None if tail is None else tail.float().transpose(1, 2)  # [B, W-1, C]
    y = _ShiftConv.apply(xf, tail_cl, w.t().contiguous(), activation == "silu").to(x.dtype)

    if W == 1:
        return y, x.new_zeros(B, C, 0)
    if tail_cl is None:
        tail_cl = xf.new_zeros(B, W - 1, C)
    if lengths is None:
        # Only the last W-1 stream positions are needed: never copy the whole stream.
        last = torch.cat([tail_cl, xf[:, max(T - (W - 1), 0) :]], dim=1)[:, -(W - 1) :]
    else:
        stream = torch.cat([tail_cl, xf], dim=1)  # [B, W-1+T, C]
        # stream index lengths[b] + i (i < W-1) is the i-th oldest of the last W-1 valid inputs.
        idx = lengths.long()[:, None] + torch.arange(W - 1, device=x.device)  # [B, W-1]
        last = stream.gather(1, idx[:, :, None].expand(B, W - 1, C))
    return y, last.transpose(1, 2).contiguous().to(x.dtype)


def tails_at(
    x: torch.Tensor, tail: torch.Tensor | None, marks: tuple[tuple[int, int], ...], width: int
) -> torch.Tensor:
    """The tail a row would carry had its call stopped after ``t`` tokens, for each mark ``(b, t)``:
    the last W-1 inputs of the stream ``tail[b] ++ x[b, :t]``, oldest first (what
    :func:`short_conv` returns as ``new_tail`` for ``lengths[b] = t``).

    Args:
        x: [B, T, C] the call's inputs. tail: [B, C, W-1] the inputs before them (None = zeros).
        marks: M pairs (row b, tokens t) with 0 <= b < B and 0 <= t <= T (host ints).
        width: W, the kernel width.
    Returns:
        [M, C, W-1] in ``x.dtype`` (copies, contiguous).
    """
    W1 = width - 1
    C = x.shape[-1]
    out = []
    for b, t in marks:
        recent = x[b, max(t - W1, 0) : t].transpose(0, 1)  # [C, <= W-1]
        if recent.shape[1] < W1:  # fewer than W-1 tokens into the call: the old tail continues
            old = x.new_zeros(C, W1) if tail is None else tail[b].to(x.dtype)
            recent = torch.cat([old, recent], dim=1)[:, -W1:]
        out.append(recent)
    if not out:
        return x.new_zeros(0, C, W1)
    return torch.stack(out).contiguous()


def short_conv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    tail: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`short_conv` (same arguments, returns, errors): the stream
    ``tail ++ x`` channels-first [B, C, W-1+T] through a depthwise ``F.conv1d``. Plain autograd."""
    B, T, C, w = _check_args(x, weight, tail, lengths, activation)
    W = w.shape[1]
    if tail is None:
        tail = x.new_zeros(B, C, W - 1)

    stream = torch.cat([tail.float(), x.float().transpose(1, 2)], dim=2)  # [B, C, W-1+T]
    if T > 0:
        y = F.conv1d(stream, w.unsqueeze(1), groups=C)  # [B, C, T]
        y = _ACTIVATIONS[activation](y).transpose(1, 2).to(x.dtype)
    else:
        y = x.new_zeros(B, 0, C)

    if W == 1:
        return y, x.new_zeros(B, C, 0)
    ends = (
        torch.full((B,), T, dtype=torch.long, device=x.device)
        if lengths is None
        else lengths.long()
    )
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

    window = torch.cat([fp32(tail), fp32(x).unsqueeze(2)], dim=2)  # [B, C, W]
    y = cast(_ACTIVATIONS[activation]((window * w).sum(-1)), x.dtype)
    new_tail = window[:, :, 1:]
    if valid is not None:
        new_tail = torch.where(valid[:, None, None], new_tail, fp32(tail))
    return y, cast(new_tail, x.dtype)
