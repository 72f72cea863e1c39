"""Per-Head Muon and QK-Clip on sharded parameters (FSDP2 ``Shard(0)`` and expert-parallel DTensors).

Shape legend: P rows of a parameter (dim 0), C its columns, R ranks of the mesh dim it is
sharded on, H heads, S = sum(parts) rows per head, E experts.

Source: architecture.md §9 (Muon, Per-Head Muon, QK-Clip); the update rules are those of
:class:`openk3.train.muon.Muon` and :func:`openk3.train.muon.qk_clip_weights_`, which this module
reuses. What sharding changes: Newton-Schulz needs each orthogonalised block whole, while a rank
holds only rows ``[r·ceil(P/R), ...)`` of each parameter. Per parameter:

* 3-D stacked experts [E, F, L] sharded on dim 0 (FSDP or EP): every block (one expert) is whole
  on its rank -> orthogonalise locally, no communication.
* per-head Q/K/V whose local rows start and end on head boundaries (the usual case: H divisible
  by R): every head block is whole -> orthogonalise locally.
* anything else (full-matrix weights, heads cut by a shard boundary, other placements): gather
  the Nesterov update with ``full_tensor()``, orthogonalise the full matrix on every rank (the
  same deterministic computation everywhere), keep this rank's rows. Simple and exact; it costs
  one all-gather and redundant Newton-Schulz work per matrix (a production run would spread the
  matrices over owner ranks instead).

Momentum is pointwise, so it stays sharded (a DTensor of the parameter's placement). AdamW
parameters go through :class:`Muon`'s own update, whose pointwise ops DTensor runs shard-local.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from openk3.train.muon import (
    HeadBlocks,
    Muon,
    mla_modules,
    muon_blocks,
    qk_clip_weights_,
    rms_match_scale,
    zeropower_newton_schulz,
)
from openk3.train.optim import build_optimizer

# Constructor keywords of Muon that live in its ``defaults``.
MUON_KWARGS = (
    "lr",
    "weight_decay",
    "momentum",
    "nesterov",
    "ns_steps",
    "ns_coefficients",
    "ns_dtype",
    "ns_eps",
    "rms",
    "betas",
    "eps",
)


def _row_shard(t: DTensor) -> tuple[int, int] | None:
    """(first global row, local rows) if ``t`` is split only along dim 0 on one mesh dim (other
    mesh dims replicated), else None."""
    sharded = [(d, pl) for d, pl in enumerate(t.placements) if not isinstance(pl, Replicate)]
    if len(sharded) != 1 or not isinstance(sharded[0][1], Shard) or sharded[0][1].dim != 0:
        return None
    d = sharded[0][0]
    size = t.device_mesh.size(d)
    coord = t.device_mesh.get_local_rank(d)
    chunk = -(-t.shape[0] // size)  # torch.chunk rows per rank
    return min(coord * chunk, t.shape[0]), t.to_local().shape[0]


def local_blocks(p: DTensor, head_blocks: HeadBlocks | None) -> HeadBlocks | None | bool:
    """Whether this rank's shard of ``p`` consists of whole Muon blocks.

    Returns:
        ``False`` if not (gather needed); otherwise the block layout of the local shard: None for
        3-D experts (one block per local expert), or ``(local heads, parts)`` for per-head weights.
    """
    rows = _row_shard(p)
    if rows is None:
        return False
    start, count = rows
    if p.ndim == 3 and head_blocks is None:
        return None
    if head_blocks is None or p.ndim != 2:
        return False
    heads, parts = head_blocks
    width = sum(parts)
    if start % width or count % width or count == 0:
        return False
    return count // width, parts


class DistMuon(Muon):
    """:class:`~openk3.train.muon.Muon` that also accepts DTensor parameters (FSDP2 shards and
    expert-parallel weights); plain tensors take the parent's code path unchanged.

    Same constructor, param-group keys, state names and results as :class:`Muon` on the full
    parameters (up to the rounding of the gradient reduction). State tensors of DTensor
    parameters are DTensors of the same placement (so ``torch.distributed.checkpoint`` can save
    them). The step is collective when a parameter needs gathering: every rank must call it.

    Raises:
        ValueError: as :class:`Muon`.
    """

    @classmethod
    def from_muon(cls, optimizer: Muon) -> "DistMuon":
        """A :class:`DistMuon` over ``optimizer``'s param groups (same hyperparameters).

        Raises:
            ValueError: ``optimizer`` already has state (convert before the first step).
        """
        if any(optimizer.state.values()):
            raise ValueError(
                "optimizer: already stepped; convert to DistMuon before the first step"
            )
        kwargs = {k: optimizer.defaults[k] for k in MUON_KWARGS}
        return cls(optimizer.param_groups, **kwargs)

    def _muon_update(self, p: torch.Tensor, group: dict) -> None:
        if not isinstance(p, DTensor):
            return super()._muon_update(p, group)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, dtype=torch.float32)
        grad = p.grad.to_local().float()
        buf = state["momentum_buffer"].to_local()
        mu = group["momentum"]
        buf.lerp_(grad, 1 - mu)
        u = grad.lerp(buf, mu) if group["nesterov"] else buf
        lr = group["lr"]
        local_p = p.to_local()
        local_p.mul_(1 - lr * group["weight_decay"])
        ns_args = (group["ns_steps"], group["ns_coefficients"], group["ns_eps"], group["ns_dtype"])
        layout = local_blocks(p, group["head_blocks"])
        if layout is not False:
            # The shard holds whole blocks: the parent's block loop, on local tensors. The RMS
            # factor uses the block shape, which the shard shares with the full parameter.
            for rows, cols, p_blk, u_blk in muon_blocks(local_p, u, layout):
                o = zeropower_newton_schulz(u_blk, *ns_args)
                p_blk.add_(
                    o.view_as(p_blk), alpha=-(lr * rms_match_scale(rows, cols, group["rms"]))
                )
            return
        u_full = DTensor.from_local(
            u, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        ).full_tensor()
        o_full = torch.empty_like(u_full)
        blocks = group["head_blocks"]
        # One block shape: apply the RMS factor through ``alpha`` exactly as the parent does;
        # parts of different shapes (kv_b_proj's k^C / v) get their factor folded in first.
        single = blocks is None or len(blocks[1]) == 1
        for rows, cols, o_blk, u_blk in muon_blocks(o_full, u_full, blocks):
            o = zeropower_newton_schulz(u_blk, *ns_args).view_as(o_blk)
            scale = rms_match_scale(rows, cols, group["rms"])
            o_blk.copy_(o if single else o * scale)
        o_local = distribute_tensor(
            o_full, p.device_mesh, p.placements, src_data_rank=None
        ).to_local()
        local_p.add_(o_local.to(local_p.dtype), alpha=-(lr * scale) if single else -lr)


def build_sharded_optimizer(model: nn.Module, config, lr: float, **kwargs) -> DistMuon:
    """:func:`openk3.train.optim.build_optimizer` (same arguments, same groups by parameter
    name) returning a :class:`DistMuon`; call after :func:`~openk3.train.distributed.parallel.apply_fsdp` /
    :func:`~openk3.train.distributed.expert_parallel.apply_expert_parallel`."""
    return DistMuon.from_muon(build_optimizer(model, config, lr, **kwargs))


@torch.no_grad()
def qk_clip_sharded_(
    model: nn.Module,
    max_logits_per_layer: Mapping[int, torch.Tensor],
    tau: float,
    config=None,
    group=None,
    reduce_max: bool = True,
) -> dict[int, torch.Tensor]:
    """QK-Clip (:func:`openk3.train.muon.qk_clip_`) for a data-parallel model whose MLA weights
    may be FSDP shards.

    The per-head max logits are first MAX-reduced over ``group`` (each rank saw only its part of
    the step's batch) so every rank clips with the global max, in place on ``max_logits_per_layer``.
    The row scales come from :func:`qk_clip_weights_` applied to a column of ones (so the rule
    lives in one place) and each rank scales its own rows.

    Args:
        model: the (sharded) model; MLA modules found as in :func:`~openk3.train.muon.qk_clip_`.
        max_logits_per_layer: {layer index: [H]} from the step's forward passes on this rank.
        tau: threshold. config: defaults to ``model.config``. group: data-parallel group
            (default: the world); ignored without torch.distributed.
        reduce_max: False when the caller already MAX-reduced ``max_logits_per_layer``.
    Returns:
        {layer index: gamma [H]}, equal on every rank.
    Raises:
        ValueError: no config, a layer without an MLA module, or from :func:`qk_clip_weights_`.
    """
    config = config if config is not None else getattr(model, "config", None)
    if config is None:
        raise ValueError("config: required when model has no .config")
    modules = mla_modules(model)
    H, Dn, Dr, Dv = (
        config.num_attention_heads,
        config.qk_nope_head_dim,
        config.qk_rope_head_dim,
        config.v_head_dim,
    )
    distributed = reduce_max and dist.is_available() and dist.is_initialized()
    gammas = {}
    for idx in sorted(max_logits_per_layer):
        attn = modules.get(int(idx))
        if attn is None:
            raise ValueError(f"max_logits_per_layer: layer {idx} has no MLA module (kv_b_proj)")
        s = max_logits_per_layer[idx]
        if distributed:
            dist.all_reduce(s, op=dist.ReduceOp.MAX, group=group)
        q_w = (attn.q_b_proj if hasattr(attn, "q_b_proj") else attn.q_proj).weight
        kv_w = attn.kv_b_proj.weight
        q_scale = torch.ones(H * (Dn + Dr), 1, device=s.device)
        k_scale = torch.ones(H * (Dn + Dv), 1, device=s.device)
        gammas[int(idx)] = qk_clip_weights_(
            q_scale,
            k_scale,
            s,
            tau,
            num_heads=H,
            qk_nope_head_dim=Dn,
            qk_rope_head_dim=Dr,
            v_head_dim=Dv,
        )
        for w, scale in ((q_w, q_scale), (kv_w, k_scale)):
            _scale_rows_(w, scale)
    return gammas


def _scale_rows_(w: torch.Tensor, scale: torch.Tensor) -> None:
    """``w *= scale`` row-wise for a plain or row-sharded weight ([P, C] by [P, 1])."""
    if not isinstance(w, DTensor):
        w.mul_(scale.to(device=w.device, dtype=w.dtype))
        return
    rows = _row_shard(w)
    if rows is None:
        raise ValueError(
            f"weight placements {w.placements}: QK-Clip supports row (Shard(0)) sharding only"
        )
    start, count = rows
    local = w.to_local()
    local.mul_(scale[start : start + count].to(device=local.device, dtype=local.dtype))


__all__ = ["DistMuon", "build_sharded_optimizer", "qk_clip_sharded_", "local_blocks"]
