"""Data parallel training with FSDP2 (``torch.distributed.fsdp.fully_shard``) over a DeviceMesh,
applied from outside to the unmodified single-device model.

Shape legend: R data-parallel ranks; a sharded parameter of global shape [P, ...] holds rows
``[r·ceil(P/R), (r+1)·ceil(P/R))`` on rank r (``Shard(0)``, ``torch.chunk`` semantics).

Sources: the issue's "Scale-out" item; PyTorch FSDP2 (per-parameter ``Shard(0)`` DTensors,
all-gather before a unit's forward/backward, reduce-scatter of the gradients, averaged over the
mesh).

FSDP units. :class:`~openk3.model.K3Model` calls each decoder layer through its ``mixer``/``ffn``
methods and reads the Block AttnRes weights (``*_res_norm``, ``*_res_proj``) directly, so a
``DecoderLayer`` is never entered through ``forward`` and cannot be an FSDP unit. The units are
therefore the modules that *are* called: ``embed_tokens``, every ``self_attn``, every ``mlp`` /
``block_sparse_moe``, and ``lm_head`` (unless tied to the embeddings); the root unit (the whole
model) owns what is left (norms, AttnRes vectors), which it gathers for the duration of the
forward/backward. Expert weights made expert parallel by
:func:`openk3.train.distributed.expert_parallel.apply_expert_parallel` are left out of FSDP (they are already
split over the EP ranks and synchronise themselves).

Loss convention: FSDP averages gradients over the R ranks, so each rank's loss must be its
share of the global loss times R (``sum of its token losses / global token count · R``).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from openk3.train.distributed.expert_parallel import expert_parameters


def init_meshes(
    ep_size: int = 1, device_type: str | None = None
) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The meshes of a ``torchrun`` job: all R ranks data parallel, optionally expert parallel.

    Args:
        ep_size: expert-parallel size; must divide R. 1 = no expert parallelism.
        device_type: ``"cuda"`` / ``"cpu"``; default cuda when available.
    Returns:
        ``(dp_mesh, ep_mesh)``: ``dp_mesh`` 1-D ``("dp",)`` over all ranks (FSDP);
        ``ep_mesh`` 2-D ``("ep_replica", "ep")`` of shape (R/ep_size, ep_size), or None when
        ``ep_size`` is 1. Rank ``i·ep_size + j`` holds expert slice j.
    Raises:
        ValueError: torch.distributed not initialised, or ``ep_size`` not dividing R.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("init_meshes: torch.distributed is not initialised (launch with torchrun)")
    world = dist.get_world_size()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size={ep_size}: must be >= 1 and divide the world size {world}")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    dp_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    if ep_size == 1:
        return dp_mesh, None
    ep_mesh = init_device_mesh(
        device_type, (world // ep_size, ep_size), mesh_dim_names=("ep_replica", "ep")
    )
    return dp_mesh, ep_mesh


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The sub-modules :func:`apply_fsdp` shards as their own units (see the module docstring),
    in model order. ``model`` is a :class:`~openk3.model.K3ForCausalLM` (or a ``K3Model``)."""
    backbone = getattr(model, "model", model)
    units: list[nn.Module] = []
    embed = getattr(backbone, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    tied = embed is not None and head is not None and head.weight is embed.weight
    if embed is not None and not tied:
        units.append(embed)
    for layer in getattr(backbone, "layers", []):
        units.append(layer.self_attn)
        units.append(layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe)
    if head is not None and not tied:
        units.append(head)
    return units


@torch.no_grad()
def broadcast_from_rank0_(model: nn.Module, group=None) -> None:
    """Copy rank 0's parameters and buffers to every rank (before sharding), for models that
    were initialised differently per rank. Must be called by every rank."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=src, group=group)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2 in place (returns it): :func:`fsdp_units` then the root.

    Every rank must hold the same single-device model (same seed or checkpoint; see
    :func:`broadcast_from_rank0_`). Parameters become ``Shard(0)`` DTensors over ``mesh``;
    buffers (e.g. the router's ``e_score_correction_bias``) stay replicated plain tensors.
    Expert-parallel weights (:func:`~openk3.train.distributed.expert_parallel.expert_parameters`) are ignored.

    Args:
        mesh: 1-D data-parallel mesh (``init_meshes()[0]``).
        reshard_after_forward: free gathered weights after each unit's forward (ZeRO-3) or keep
            them until backward (ZeRO-2 like).
        mp_policy: FSDP mixed precision; default none (fp32 everywhere, the correctness gate).
    Raises:
        ValueError: a mesh that is not 1-D.
    """
    if mesh.ndim != 1:
        raise ValueError(f"mesh: expected a 1-D data-parallel mesh, got {mesh.ndim} dims")
    # LatentMoE and KimiDeltaAttention return views (reshapes); FSDP warns in case the caller
    # modifies them in place. K3Model's AttnRes state uses mixer and FFN outputs out of place
    # (``p = a``, ``p = p + f``), so the warning is moot.
    warnings.filterwarnings(
        "ignore",
        message=r"FSDP2-wrapped module \(FSDP(LatentMoE|KimiDeltaAttention)\) "
        r"returned a view tensor",
    )
    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "ignored_params": expert_parameters(model) or None,
    }
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for unit in fsdp_units(model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    for module in [model, *fsdp_units(model)]:
        module.register_forward_pre_hook(_shield_routing_sink, prepend=True, with_kwargs=True)
    return model


class _SinkProxy:
    """Stands in for a ``routing_sink`` list while an FSDP unit runs: FSDP's pre-forward rebuilds
    any list argument holding tensors that require grad (to attach its backward hooks), so the
    second MoE layer would append to a copy. A non-container object is passed through as is."""

    def __init__(self, target: list) -> None:
        self.target = target

    def append(self, item) -> None:
        self.target.append(item)


def _shield_routing_sink(module: nn.Module, args: tuple, kwargs: dict):
    sink = kwargs.get("routing_sink")
    if isinstance(sink, list):
        return args, {**kwargs, "routing_sink": _SinkProxy(sink)}
    return None


# ----------------------------------------------------------------------------- sharded utilities
def _sharded_mesh_dims(t: DTensor) -> tuple[int, ...]:
    return tuple(i for i, p in enumerate(t.placements) if isinstance(p, Shard))


@torch.no_grad()
def grad_norm(parameters) -> torch.Tensor:
    """Global L2 norm of the gradients of ``parameters`` (plain tensors, FSDP and EP DTensors
    on any meshes): local squared sums, summed over the mesh dims each tensor is sharded on
    (not over replicated dims). Collective: every rank must pass the same parameters.

    Returns:
        0-dim fp32 tensor, equal on every rank.
    Raises:
        ValueError: a gradient with a ``Partial`` placement (not reduced yet).
    """
    total = torch.zeros((), dtype=torch.float32)
    # (mesh id, sharded mesh dims) -> [mesh, local squared sum]: one all-reduce per bucket and dim.
    buckets: dict[tuple, list] = {}
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                raise ValueError(
                    f"grad placements {g.placements}: partial gradients are not reduced yet"
                )
            key = (id(g.device_mesh), _sharded_mesh_dims(g))
            entry = buckets.setdefault(
                key, [g.device_mesh, torch.zeros((), dtype=torch.float32, device=g.device)]
            )
            entry[1] = entry[1] + g.to_local().float().pow(2).sum()
        else:
            total = total.to(g.device) + g.float().pow(2).sum()
    for (_, dims), (mesh, sq) in buckets.items():
        for d in dims:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=mesh.get_group(d))
        total = total.to(sq.device) + sq
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for sharded models: scale every gradient by
    ``min(1, max_norm / (norm + 1e-6))`` with the global :func:`grad_norm`. Collective.

    Returns:
        The total norm before clipping (0-dim fp32).
    Raises:
        ValueError: ``max_norm`` <= 0, or from :func:`grad_norm`.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r}: must be > 0")
    parameters = list(parameters)
    norm = grad_norm(parameters)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in parameters:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return norm


@torch.no_grad()
def full_state_dict(model: nn.Module, *, to_cpu: bool = True) -> dict[str, torch.Tensor]:
    """The full (unsharded) ``state_dict`` on every rank: DTensors gathered with
    ``full_tensor()``. Collective; for checkpoints of small models and for tests (large models
    should use ``torch.distributed.checkpoint``)."""
    out = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = full.detach().cpu() if to_cpu else full.detach()
    return out


def all_reduce_mean_(value: torch.Tensor, group=None) -> torch.Tensor:
    """In-place SUM / R over ``group`` (no-op without torch.distributed): for logging a loss."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
        value.div_(dist.get_world_size(group))
    return value


__all__ = [
    "init_meshes",
    "fsdp_units",
    "broadcast_from_rank0_",
    "apply_fsdp",
    "grad_norm",
    "clip_grad_norm_",
    "full_state_dict",
    "all_reduce_mean_",
]
