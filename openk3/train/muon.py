"""Per-Head Muon (with an AdamW side for non-matrix parameters) and K2's QK-Clip.

Shape legend: A, B rows / columns of one orthogonalised matrix (block); N a batch of blocks;
H heads; E experts; S rows of one head in a fused projection; C input width of a projection;
Dn ``qk_nope_head_dim``, Dr ``qk_rope_head_dim``, Dv ``v_head_dim``.

Sources: architecture.md §9 (Muon as in Moonlight/K2, Per-Head Muon, QK-Clip), Keller Jordan's
Muon (quintic Newton-Schulz), Moonlight "Muon is scalable" (update RMS 0.2*sqrt(max(A, B))),
Kimi K2 report (QK-Clip). ``torch.optim.Muon`` (torch 2.13) implements the same update for plain
2-D matrices; it is not reused because it cannot split a matrix into head blocks, rejects 3-D
stacked experts and always runs Newton-Schulz in bf16 (fp32 is this project's correctness
gate). ``tests/train/test_muon.py`` checks this optimizer against it where the two agree
(2-D matrices, ``ns_dtype=bfloat16``, ``adjust_lr_fn="match_rms_adamw"``): bit for bit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7

HeadBlocks = tuple[int, tuple[int, ...]]
"""``(num_heads, part_rows)``: the rows of a fused projection are ``num_heads`` consecutive
head slabs of ``sum(part_rows)`` rows each; every part of every head is orthogonalised on its
own (e.g. ``(96, (128, 128))`` splits each kv_b_proj head into its k^C and v rows)."""


def zeropower_newton_schulz(
    g: torch.Tensor,
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Approximate orthogonalisation ``U V^T`` of ``g = U S V^T`` by quintic Newton-Schulz.

    The matrix is divided by its Frobenius norm (so every singular value is <= 1), then
    ``X <- a X + (b X X^T + c (X X^T)^2) X`` runs ``steps`` times. The coefficients maximise the
    slope at zero rather than converging exactly, so singular values land in a band around 1
    (roughly [0.7, 1.2] once converged), which is what Muon uses.

    Args:
        g: [A, B] or [N, A, B]; a batch is orthogonalised matrix by matrix (each one normalised
            by its own Frobenius norm).
        steps, coefficients: iteration count and (a, b, c).
        eps: lower clamp of the norm, so a zero matrix stays zero.
        dtype: arithmetic dtype (fp32 by default; bf16 is what GPUs run and what
            ``torch.optim.Muon`` hard-codes).
    Returns:
        Same shape as ``g``, in ``dtype``.
    Raises:
        ValueError: ``g`` not 2-D or 3-D, or ``steps`` < 0.
    """
    if g.ndim not in (2, 3):
        raise ValueError(
            f"g: expected a [A, B] matrix or [N, A, B] batch, got shape {tuple(g.shape)}"
        )
    if steps < 0:
        raise ValueError(f"steps={steps}: must be >= 0")
    a, b, c = coefficients
    x = g.to(dtype)
    # X X^T is the smaller Gram matrix when rows <= columns; orthogonalising the transpose is
    # the same operation.
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
    else:
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


def rms_match_scale(rows: int, cols: int, rms: float = 0.2) -> float:
    """Moonlight's update scale ``rms * sqrt(max(rows, cols))``: an orthogonalised [rows, cols]
    matrix has entry RMS ``1/sqrt(max(rows, cols))``, so the scaled update has RMS ``rms``
    (AdamW's typical update RMS), letting Muon reuse AdamW's learning rate and weight decay."""
    return rms * math.sqrt(max(rows, cols))


def _check_head_blocks(p: torch.Tensor, blocks: HeadBlocks) -> None:
    heads, parts = blocks
    if (
        p.ndim != 2
        or heads <= 0
        or not parts
        or min(parts) <= 0
        or p.shape[0] != heads * sum(parts)
    ):
        raise ValueError(
            f"head_blocks={blocks!r} does not tile a parameter of shape {tuple(p.shape)}: "
            f"need a 2-D weight with {heads} * {sum(parts) if parts else 0} rows"
        )


class Muon(torch.optim.Optimizer):
    """Muon for matrix parameters (full-matrix, per-head, per-expert) plus AdamW for the rest.

    Param-group keys (defaults from the constructor; :func:`openk3.train.optim.build_optimizer`
    builds the groups from parameter names):

    * ``use_muon`` (bool): Muon (True) or AdamW (False) for the group.
    * ``head_blocks`` (:data:`HeadBlocks` or None, Muon groups only): per-head orthogonalisation.
    * ``lr``, ``weight_decay`` (decoupled: ``p *= 1 - lr * weight_decay`` in both algorithms).
    * Muon: ``momentum``, ``nesterov``, ``ns_steps``, ``ns_coefficients``, ``ns_dtype``,
      ``ns_eps``, ``rms``. AdamW: ``betas``, ``eps``.

    Muon update of one parameter (architecture.md §9), gradient G in fp32:

    * momentum: ``M <- mu M + (1 - mu) G``; Nesterov input ``U = (1 - mu) G + mu M``. This is
      Moonlight's ``M' = mu M' + G``, ``U' = G + mu M'`` times the constant ``1 - mu`` (same as
      ``torch.optim.Muon``); Newton-Schulz divides by the Frobenius norm, so the factor cancels.
    * orthogonalise U block by block: a 2-D weight is one block; a 3-D stacked-expert weight
      [E, A, B] is E blocks; a weight with ``head_blocks = (H, parts)`` is viewed as [H, S, C]
      with S = sum(parts) and each part's [H, part, C] slab is orthogonalised head by head.
    * ``p <- p (1 - lr wd) - lr * rms * sqrt(max(A_blk, B_blk)) * NS(U_blk)`` per block, i.e.
      the RMS-matching factor uses the block shape, so every head's update has RMS ``rms``.

    Per-head block convention (the report names Q, K and V; the blocks are [P] in the spec):

    * KDA ``q_proj``/``k_proj``/``v_proj`` [H*K, D]: H blocks of K x D, one per head.
    * MLA ``q_b_proj`` [H*(Dn+Dr), q_lora] (or ``q_proj`` [H*(Dn+Dr), D]): H blocks of
      (Dn+Dr) x in, one per head. q^C and q^R stay together: both are halves of the same
      query-key dot product of the head.
    * MLA ``kv_b_proj`` [H*(Dn+Dv), kv_lora]: 2H blocks, each head's k^C rows (Dn x kv_lora)
      and its v rows (Dv x kv_lora) separately. K and V are different projections (W_UK and
      W_UV) that are fused only in storage; splitting them treats MLA exactly like KDA, whose
      k_proj and v_proj are separate weights, and keeps the key update independent of the
      value gradient, as QK-Clip (which rescales k^C rows only) also assumes.
    * ``g_proj``/``o_proj`` stay full-matrix: the report names only Q, K and V.

    AdamW (``use_muon=False``) is ``torch.optim.AdamW``'s update (bias-corrected moments).
    State: Muon ``momentum_buffer`` (fp32, param shape); AdamW ``step`` (int), ``exp_avg``,
    ``exp_avg_sq`` (fp32).

    Raises:
        ValueError: bad hyperparameters, a Muon parameter that is not 2-D/3-D, or
            ``head_blocks`` that do not tile the parameter (all naming the value).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = NS_STEPS,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_dtype: torch.dtype = torch.float32,
        ns_eps: float = NS_EPS,
        rms: float = 0.2,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ) -> None:
        for name, value in (("lr", lr), ("weight_decay", weight_decay), ("rms", rms), ("eps", eps)):
            if not value >= 0:
                raise ValueError(f"{name}={value!r}: must be >= 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum!r}: must be in [0, 1)")
        if not all(0.0 <= bb < 1.0 for bb in betas):
            raise ValueError(f"betas={betas!r}: each must be in [0, 1)")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            use_muon=True,
            head_blocks=None,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=tuple(ns_coefficients),
            ns_dtype=ns_dtype,
            ns_eps=ns_eps,
            rms=rms,
            betas=tuple(betas),
            eps=eps,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(
                        f"Muon group: parameter of shape {tuple(p.shape)} is not 2-D or 3-D"
                    )
                if group["head_blocks"] is not None:
                    _check_head_blocks(p, group["head_blocks"])

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("Muon/AdamW: sparse gradients are not supported")
                if group["use_muon"]:
                    self._muon_update(p, group)
                else:
                    self._adamw_update(p, group)
        return loss

    def _muon_update(self, p: torch.Tensor, group: dict) -> None:
        grad = p.grad.float()
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf = state["momentum_buffer"]
        mu = group["momentum"]
        buf.lerp_(grad, 1 - mu)
        u = grad.lerp(buf, mu) if group["nesterov"] else buf
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        for rows, cols, p_blk, u_blk in muon_blocks(p, u, group["head_blocks"]):
            o = zeropower_newton_schulz(
                u_blk,
                group["ns_steps"],
                group["ns_coefficients"],
                group["ns_eps"],
                group["ns_dtype"],
            )
            p_blk.add_(o.view_as(p_blk), alpha=-(lr * rms_match_scale(rows, cols, group["rms"])))

    def _adamw_update(self, p: torch.Tensor, group: dict) -> None:
        grad = p.grad.float()
        state = self.state[p]
        if "step" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(grad)
            state["exp_avg_sq"] = torch.zeros_like(grad)
        state["step"] += 1
        t = state["step"]
        beta1, beta2 = group["betas"]
        m = state["exp_avg"]
        v = state["exp_avg_sq"]
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        denom = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(group["eps"])
        p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))


def muon_blocks(p: torch.Tensor, u: torch.Tensor, head_blocks: HeadBlocks | None):
    """Yield ``(rows, cols, param_view, update_view)`` for each batch of same-shaped blocks.

    The param view is written in place; the update view is [A, B] or [N, A, B].
    """
    if head_blocks is None:
        yield p.shape[-2], p.shape[-1], p, u
        return
    heads, parts = head_blocks
    width = sum(parts)
    p3 = p.view(heads, width, p.shape[-1])
    u3 = u.view(heads, width, u.shape[-1])
    start = 0
    for rows in parts:
        yield rows, p.shape[-1], p3[:, start : start + rows], u3[:, start : start + rows]
        start += rows


# ---------------------------------------------------------------------------------- QK-Clip
@torch.no_grad()
def qk_clip_weights_(
    q_weight: torch.Tensor,
    kv_b_weight: torch.Tensor,
    max_logits: torch.Tensor,
    tau: float,
    *,
    num_heads: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
) -> torch.Tensor:
    """QK-Clip of one MLA layer, in place on its two head-specific query/key weights.

    For each head h with ``max_logits[h] > tau``: ``gamma = tau / max_logits[h]``; the head's
    q^C rows are scaled by ``sqrt(gamma)``, its q^R rows by ``gamma`` and its k^C rows by
    ``sqrt(gamma)``, so every logit ``q^C.k^C + q^R.k^R`` of the head is scaled by exactly gamma
    (the max becomes tau). v rows and the shared k^R (in ``kv_a_proj_with_mqa``) are untouched.

    Args:
        q_weight: [H*(Dn+Dr), in] ``q_b_proj.weight`` (or ``q_proj.weight`` without q_lora).
        kv_b_weight: [H*(Dn+Dv), kv_lora] ``kv_b_proj.weight``.
        max_logits: [H] per-head max of the scaled logits ``q.k / sqrt(Dn+Dr)`` over the step's
            forward passes.
        tau: threshold (K2: 100).
    Returns:
        gamma [H] fp32 (1 for heads left alone).
    Raises:
        ValueError: shapes that do not match the head dims, non-finite ``max_logits`` or
            ``tau`` <= 0.
    """
    if not tau > 0:
        raise ValueError(f"tau={tau!r}: must be > 0")
    H, Dn, Dr, Dv = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    if q_weight.ndim != 2 or q_weight.shape[0] != H * (Dn + Dr):
        raise ValueError(f"q_weight: shape {tuple(q_weight.shape)}, expected [{H}*({Dn}+{Dr}), in]")
    if kv_b_weight.ndim != 2 or kv_b_weight.shape[0] != H * (Dn + Dv):
        raise ValueError(
            f"kv_b_weight: shape {tuple(kv_b_weight.shape)}, expected [{H}*({Dn}+{Dv}), kv_lora]"
        )
    s = max_logits.detach().float().reshape(-1).to(q_weight.device)
    if s.numel() != H:
        raise ValueError(f"max_logits: {s.numel()} entries, expected num_heads={H}")
    if not torch.isfinite(s).all():
        raise ValueError(f"max_logits: non-finite values {s.tolist()}")
    gamma = torch.where(s > tau, tau / s, torch.ones_like(s))
    root = gamma.sqrt()
    q_scale = torch.cat([root[:, None].expand(H, Dn), gamma[:, None].expand(H, Dr)], dim=1).reshape(
        -1
    )
    k_scale = torch.cat(
        [root[:, None].expand(H, Dn), torch.ones(H, Dv, device=s.device)], dim=1
    ).reshape(-1)
    q_weight.mul_(q_scale[:, None].to(q_weight.dtype))
    kv_b_weight.mul_(k_scale[:, None].to(device=kv_b_weight.device, dtype=kv_b_weight.dtype))
    return gamma


_ATTN_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn$")


def mla_modules(model_or_layers) -> dict[int, nn.Module]:
    """Layer index -> MLA attention module (one with ``kv_b_proj``)."""

    def attn_of(m: nn.Module) -> nn.Module:
        return m if hasattr(m, "kv_b_proj") else getattr(m, "self_attn", m)

    if isinstance(model_or_layers, Mapping):
        return {int(i): attn_of(m) for i, m in model_or_layers.items()}
    if isinstance(model_or_layers, (Sequence, nn.ModuleList)):
        return {i: attn_of(m) for i, m in enumerate(model_or_layers)}
    if not isinstance(model_or_layers, nn.Module):
        raise ValueError(
            f"model_or_layers: expected an nn.Module, a sequence or a mapping of layers, "
            f"got {type(model_or_layers).__name__}"
        )
    found: dict[int, nn.Module] = {}
    for name, m in model_or_layers.named_modules():
        hit = _ATTN_NAME.search(name)
        if hit and hasattr(m, "kv_b_proj") and "vision" not in name:
            idx = int(hit.group(1))
            if idx in found:
                raise ValueError(
                    f"model_or_layers: two MLA modules for layer {idx} (second: {name})"
                )
            found[idx] = m
    return found


def qk_clip_(
    model_or_layers,
    max_logits_per_layer: Mapping[int, torch.Tensor],
    tau: float,
    config=None,
) -> dict[int, torch.Tensor]:
    """Apply QK-Clip (Kimi K2 MuonClip, architecture.md §9) to every MLA layer after a step.

    Args:
        model_or_layers: a model whose MLA modules are named ``...layers.{l}.self_attn``, or a
            sequence / {index: module} mapping of decoder layers or attention modules. An MLA
            module is recognised by its ``kv_b_proj``; the query weight is ``q_b_proj`` or, with
            ``q_lora_rank=None``, ``q_proj``.
        max_logits_per_layer: {layer index: [H] per-head max scaled logit of the step}.
        tau: threshold; heads with max logit <= tau are not touched.
        config: a :class:`~openk3.config.K3Config` (``num_attention_heads``, ``qk_nope_head_dim``,
            ``qk_rope_head_dim``, ``v_head_dim``); defaults to ``model_or_layers.config``.
    Returns:
        {layer index: gamma [H]} for the layers given.
    Raises:
        ValueError: no config, a layer index with no MLA module, or the errors of
            :func:`qk_clip_weights_`.
    """
    config = config if config is not None else getattr(model_or_layers, "config", None)
    if config is None:
        raise ValueError("config: required when model_or_layers has no .config")
    modules = mla_modules(model_or_layers)
    gammas: dict[int, torch.Tensor] = {}
    for idx, s in max_logits_per_layer.items():
        attn = modules.get(int(idx))
        if attn is None or not hasattr(attn, "kv_b_proj"):
            raise ValueError(f"max_logits_per_layer: layer {idx} has no MLA module (kv_b_proj)")
        q = attn.q_b_proj if hasattr(attn, "q_b_proj") else attn.q_proj
        gammas[int(idx)] = qk_clip_weights_(
            q.weight,
            attn.kv_b_proj.weight,
            s,
            tau,
            num_heads=config.num_attention_heads,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
        )
    return gammas
