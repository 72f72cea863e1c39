"""Expert parallelism for :class:`~openk3.layers.moe.LatentMoE`: each of R expert-parallel ranks
holds E/R routed experts, tokens travel to the rank that owns their expert and back.

Shape legend: N tokens on this rank (flattened B·T), k experts per token, A = N·k (token, slot)
assignments sent, M rows received, E routed experts (global), El = E/R experts per rank, R
expert-parallel ranks, L expert width, F expert FFN width.

Sources: architecture.md §6.1 (the routed-expert sum ``u = Σ_j w_j E_j(z)``), the issue's
"Scale-out" item (all-to-all dispatch with uneven splits over a DeviceMesh, model code
unchanged). The layout follows GShard / DeepSeek-V3 style EP: expert e lives on EP rank
``e // El``; a rank's experts are the contiguous slice ``[r·El, (r+1)·El)`` of the stacked
``w1``/``w3``/``w2``.

How it plugs in: :func:`apply_expert_parallel` replaces every ``block_sparse_moe.experts``
(:class:`~openk3.layers.moe.Experts`) by an :class:`ExpertParallelExperts` with the same call
signature and the same parameter names (``w1``, ``w3``, ``w2``), whose parameters are DTensors
``Shard(0)`` over the EP mesh dim (``Replicate`` over an optional replica dim). ``LatentMoE``
itself is not modified. One step of the module:

    dispatch  (token rows -> owning ranks; all-to-all with per-rank split sizes)
    compute   (:func:`~openk3.ops.grouped_mm.routed_experts` on the local experts, weight 1)
    combine   (rows back to their tokens; fp32 weighted sum over the k slots, fixed order)

The dispatcher is an interface with two implementations: :class:`LocalDispatcher` (no
communication; R = 1, and the readable reference) and :class:`AllToAllDispatcher`.

Gradients of the expert weights: every rank's loss is its share of the global loss (data
parallel), and an expert's weight gradient already sums the contributions of the tokens every
EP rank sent it. To equal FSDP's averaged dense gradients, expert gradients are divided by the
data-parallel degree (all ranks of the mesh) and, if the mesh has a replica dim (several ranks
holding the same experts), summed over it; both happen in the backward of the forward's
weight read (:class:`_ExpertGradSync`), so gradient accumulation needs nothing special.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from openk3.layers.moe import Experts
from openk3.ops.grouped_mm import routed_experts


# ----------------------------------------------------------------------------- autograd pieces
class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send = send
        ctx.recv = recv
        ctx.group = group
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        out = g.new_empty((sum(ctx.send),) + tuple(g.shape[1:]))
        dist.all_to_all_single(out, g.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


class _ExpertGradSync(torch.autograd.Function):
    """Identity forward; backward divides the weight gradient by the data-parallel degree and
    sums it over the replica group (ranks that hold the same experts), if any."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, dp_degree: int, replica_group) -> torch.Tensor:
        ctx.dp_degree = dp_degree
        ctx.replica_group = replica_group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g / ctx.dp_degree
        if ctx.replica_group is not None:
            g = g.contiguous()
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.replica_group)
        return g, None, None


# ----------------------------------------------------------------------------- dispatchers
@dataclass
class DispatchHandle:
    """What :meth:`combine` needs to undo a :meth:`dispatch`.

    Attributes:
        n_tokens, top_k: N and k of the dispatched batch.
        order: [A] int64 sorted position -> assignment index (None for the local dispatcher).
        send, recv: per-rank row counts sent / received (lists of R ints; empty when local).
    """

    n_tokens: int
    top_k: int
    order: torch.Tensor | None = None
    send: list[int] | None = None
    recv: list[int] | None = None


class LocalDispatcher:
    """Every expert is local (R = 1): rows stay in (token, slot) order, no communication.

    Args:
        num_experts: E (all local).
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.num_local_experts = num_experts

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """x: [N, L], topk_idx: [N, k] -> (rows [A, L], local expert id [A] int64, handle)."""
        n, k = topk_idx.shape
        rows = x.repeat_interleave(k, dim=0) if k > 1 else x
        return rows, topk_idx.reshape(-1).long(), DispatchHandle(n, k)

    def combine(
        self, y: torch.Tensor, handle: DispatchHandle, topk_weight: torch.Tensor
    ) -> torch.Tensor:
        """y: [A, L] expert outputs in dispatch order -> [N, L] fp32 ``Σ_j w_j y_j``."""
        return _weighted_sum(y, handle, topk_weight)


class AllToAllDispatcher:
    """Token dispatch over an expert-parallel process group of R ranks (uneven splits).

    ``dispatch`` sorts the A assignments by global expert id (stable), exchanges the per-expert
    counts (one all-to-all of R·El integers, then a host sync for the split sizes), and sends
    each rank the rows of its experts. A receiver gets, from every source rank in rank order, its
    rows sorted by expert; the local expert id of each row follows from the counts. ``combine``
    runs the reverse all-to-all and restores (token, slot) order. Both are differentiable.

    Args:
        num_experts: E, divisible by R.
        group: the EP process group (R ranks); this rank owns experts
            ``[rank·El, (rank+1)·El)`` with rank its index in the group.
    Attributes:
        last_send, last_recv: row counts per peer of the last dispatch (logging, tests).
    Raises:
        ValueError: E not divisible by R.
    """

    def __init__(self, num_experts: int, group) -> None:
        world = dist.get_world_size(group)
        if num_experts % world:
            raise ValueError(
                f"num_experts={num_experts}: not divisible by the expert-parallel size {world}"
            )
        self.num_experts = num_experts
        self.group = group
        self.world = world
        self.num_local_experts = num_experts // world
        self.last_send: list[int] = []
        self.last_recv: list[int] = []

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """x: [N, L], topk_idx: [N, k] global ids -> (rows [M, L], local expert id [M] int64, handle)."""
        n, k = topk_idx.shape
        r = self.world
        el = self.num_local_experts
        flat = topk_idx.reshape(-1).long()
        order = torch.argsort(flat, stable=True)  # groups rows by expert, hence by owner rank
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        recv_counts = torch.empty_like(counts)  # [R·El]: (source rank, local expert)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send = counts.view(r, el).sum(1).tolist()  # host sync: the split sizes must be known
        recv = recv_counts.view(r, el).sum(1).tolist()
        rows = _AllToAll.apply(
            x[torch.div(order, k, rounding_mode="floor")], send, recv, self.group
        )
        local_ids = torch.arange(el, device=flat.device).repeat(r)
        expert = torch.repeat_interleave(local_ids, recv_counts)
        self.last_send = send
        self.last_recv = recv
        return rows, expert, DispatchHandle(n, k, order, send, recv)

    def combine(
        self, y: torch.Tensor, handle: DispatchHandle, topk_weight: torch.Tensor
    ) -> torch.Tensor:
        """y: [M, L] outputs of the received rows -> [N, L] fp32 ``Σ_j w_j y_j`` for this rank's tokens."""
        back = _AllToAll.apply(y, handle.recv, handle.send, self.group)  # [A, L] in sorted order
        inverse = torch.empty_like(handle.order)
        inverse[handle.order] = torch.arange(handle.order.numel(), device=handle.order.device)
        return _weighted_sum(back[inverse], handle, topk_weight)


def _weighted_sum(
    y: torch.Tensor, handle: DispatchHandle, topk_weight: torch.Tensor
) -> torch.Tensor:
    """[A, L] rows in (token, slot) order -> [N, L] in the accumulation dtype, summed over slots
    in a fixed order (as :func:`~openk3.ops.grouped_mm.routed_experts` does)."""
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32
    per_slot = y.to(acc).view(handle.n_tokens, handle.top_k, y.shape[-1])
    return (per_slot * topk_weight.to(acc).unsqueeze(-1)).sum(1)


# ----------------------------------------------------------------------------- the module
class ExpertParallelExperts(nn.Module):
    """Drop-in replacement of :class:`~openk3.layers.moe.Experts` holding only this rank's experts.

    Parameters ``w1``/``w3`` [E, F, L] and ``w2`` [E, L, F] keep their names and global shapes
    as DTensors on ``mesh`` (``Shard(0)`` over the EP dim, ``Replicate`` over a replica dim);
    locally each rank stores [El, F, L] / [El, L, F]. ``full_tensor()`` gathers them.

    ``qat``: the QAT scheme (:class:`openk3.quant.qat.QuantScheme` or None), copied from
    ``experts`` and switched by :func:`openk3.quant.qat.model_qat` like :class:`Experts`. When
    set, the local expert weights are MXFP4 fake-quantised and the GEMM input rows MXFP8, with
    straight-through gradients, as :meth:`Experts.forward` does (architecture.md §10). A
    :class:`~openk3.quant.qat.RoutedExperts`, like ``Experts``.

    Args:
        experts: the single-device module to split (its weights must be equal on every rank,
            e.g. same seed or same checkpoint). Its values are copied, not shared.
        mesh: 1-D mesh (EP only) or 2-D mesh (replica, EP) of the data-parallel ranks.
        ep_dim: name (or index) of the EP dim of ``mesh``.
    Raises:
        ValueError: E not divisible by the EP size, a mesh of more than 2 dims, or an unknown dim.
    """

    def __init__(self, experts: Experts, mesh: DeviceMesh, ep_dim: str | int = -1) -> None:
        super().__init__()
        if mesh.ndim not in (1, 2):
            raise ValueError(f"mesh: expected 1 or 2 dims (replica, ep), got {mesh.ndim}")
        names = list(mesh.mesh_dim_names or [])
        if isinstance(ep_dim, str):
            if ep_dim not in names:
                raise ValueError(f"ep_dim={ep_dim!r}: not a dim of the mesh {names}")
            ep_dim = names.index(ep_dim)
        ep_dim = ep_dim % mesh.ndim
        e = experts.w1.shape[0]
        ep_size = mesh.size(ep_dim)
        if e % ep_size:
            raise ValueError(
                f"n_routed_experts={e}: not divisible by the expert-parallel size {ep_size}"
            )
        self.mesh = mesh
        self.ep_dim = ep_dim
        self.act = experts.act
        self.qat = getattr(
            experts, "qat", None
        )  # QAT scheme of the source module (model_qat switches it)
        self.initializer_range = experts.initializer_range
        self.num_experts = e
        self.num_local_experts = e // ep_size
        self.dp_degree = mesh.size()
        rep_dim = 1 - ep_dim if mesh.ndim == 2 else None
        self.replica_group = (
            mesh.get_group(rep_dim) if rep_dim is not None and mesh.size(rep_dim) > 1 else None
        )
        self.placements = tuple(Shard(0) if d == ep_dim else Replicate() for d in range(mesh.ndim))
        group = mesh.get_group(ep_dim)
        self.dispatcher = AllToAllDispatcher(e, group) if ep_size > 1 else LocalDispatcher(e)
        self.ep_rank = mesh.get_local_rank(ep_dim)
        for name in ("w1", "w3", "w2"):
            self.register_parameter(
                name, nn.Parameter(self._shard(getattr(experts, name).detach()))
            )

    def _shard(self, full: torch.Tensor) -> DTensor:
        lo = self.ep_rank * self.num_local_experts
        local = full[lo : lo + self.num_local_experts].clone()
        return DTensor.from_local(
            local,
            self.mesh,
            self.placements,
            run_check=False,
            shape=full.shape,
            stride=full.stride(),
        )

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, ``initializer_range``) drawn at full size from the default generator, as
        :meth:`Experts.init_weights` does, then sliced: same values as the single-device module
        for the same RNG state (every rank must be seeded alike)."""
        for w in (self.w1, self.w2, self.w3):
            full = torch.empty(w.shape, dtype=w.dtype, device=w.to_local().device).normal_(
                0.0, self.initializer_range
            )
            lo = self.ep_rank * self.num_local_experts
            w.to_local().copy_(full[lo : lo + self.num_local_experts])

    def _local(self, w: torch.Tensor) -> torch.Tensor:
        return _ExpertGradSync.apply(w.to_local(), self.dp_degree, self.replica_group)

    def forward(
        self,
        z: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weight: torch.Tensor,
        backend: str | None = None,
    ) -> torch.Tensor:
        """z: [N, L]; topk_idx, topk_weight: [N, k] -> [N, L] fp32, equal to the single-device
        :meth:`Experts.forward` on the same tokens (up to fp summation order of the expert GEMMs).

        Every EP rank must call it the same number of times (it communicates). Raises the
        errors of :func:`~openk3.ops.grouped_mm.routed_experts`."""
        if (
            topk_idx.dim() != 2
            or topk_idx.shape[0] != z.shape[0]
            or topk_weight.shape != topk_idx.shape
        ):
            raise ValueError(
                f"topk_idx {tuple(topk_idx.shape)} / topk_weight {tuple(topk_weight.shape)}: "
                f"expected [N={z.shape[0]}, k]"
            )
        rows, expert, handle = self.dispatcher.dispatch(z, topk_idx)
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        w1, w3, w2 = (self._local(w) for w in (self.w1, self.w3, self.w2))
        q = self.qat
        if q is not None:
            # MXFP4 blocks run along each weight's last dim within one expert, so quantising the
            # local experts equals slicing the quantised full stack; the MXFP8 input fake-quant
            # is row-wise, so a row quantised after the all-to-all equals the same row before it.
            w1, w3, w2 = (q.fake_quant_weight(w) for w in (w1, w3, w2))
        y = routed_experts(
            rows,
            expert[:, None],
            ones,
            w1,
            w3,
            w2,
            self.act,
            backend=backend,
            input_quant=q.input_quant if q is not None else None,
        )
        # Weight 1 over a single slot is exact; back to the row dtype as the single-device path
        # keeps per-slot outputs in x's dtype before its fp32 combine.
        return self.dispatcher.combine(y.to(z.dtype), handle, topk_weight)

    def extra_repr(self) -> str:
        e, f, l = self.w1.shape
        qat = f", qat={self.qat.name}" if self.qat is not None else ""
        return f"experts={e}, local={self.num_local_experts}, width={l}, hidden={f}{qat}"


def apply_expert_parallel(
    model: nn.Module, mesh: DeviceMesh, ep_dim: str | int = -1
) -> list[ExpertParallelExperts]:
    """Replace every ``block_sparse_moe.experts`` of ``model`` by an :class:`ExpertParallelExperts`.

    Call on the unmodified single-device model (identical on every rank), before
    :func:`openk3.train.distributed.parallel.apply_fsdp` (which leaves the expert weights to this module).

    Args:
        model: e.g. :class:`~openk3.model.K3ForCausalLM`; every :class:`Experts` child is replaced.
        mesh: 1-D EP mesh, or 2-D (replica, EP) mesh over all data-parallel ranks.
        ep_dim: the EP dim of ``mesh`` (name or index; default the last).
    Returns:
        The new modules, in model order.
    Raises:
        ValueError: ``model`` has no :class:`Experts`, or the errors of
            :class:`ExpertParallelExperts`.
    """
    replaced = []
    for _, parent in list(model.named_modules()):
        child = getattr(parent, "experts", None)
        if isinstance(child, Experts):
            new = ExpertParallelExperts(child, mesh, ep_dim)
            parent.experts = new
            replaced.append(new)
    if not replaced:
        raise ValueError(
            "model: no block_sparse_moe.experts (openk3.layers.moe.Experts) to parallelise"
        )
    return replaced


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The parameters owned by :class:`ExpertParallelExperts` modules (FSDP must ignore them)."""
    return {
        p
        for m in model.modules()
        if isinstance(m, ExpertParallelExperts)
        for p in m.parameters(recurse=False)
    }


__all__ = [
    "LocalDispatcher",
    "AllToAllDispatcher",
    "DispatchHandle",
    "ExpertParallelExperts",
    "apply_expert_parallel",
    "expert_parameters",
]
