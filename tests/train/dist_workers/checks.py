"""Unit-level distributed checks run inside the torchrun worker (see ``parity.py``): each
returns {name: max abs error or observation}; the test asserts on them.

* :func:`check_ep_layer`: one LatentMoE with its experts made expert parallel (EP = 2) against
  the single-device layer, with forced routing in which rank 0 sends nothing to rank 1 (a zero
  split) and the ranks hold different token counts; outputs, input gradients and expert-weight
  gradients; then ``init_weights`` against the single-device init.
* :func:`check_dist_muon`: DistMuon on Shard(0) DTensors against Muon on the full tensors, for
  every layout (per-head aligned / cut by the shard boundary, uneven 3-D experts, uneven full
  matrix, AdamW vector), three steps.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from openk3.config import preset
from openk3.layers.moe import LatentMoE
from openk3.train.distributed.muon import DistMuon, local_blocks
from openk3.train.distributed.expert_parallel import apply_expert_parallel
from openk3.train.muon import Muon
from openk3.train.distributed.parallel import init_meshes


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def _rank_inputs(rank: int, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N_r, D], forced top-k ids [N_r, k], output cotangent [N_r, D] of ``rank``."""
    g = torch.Generator().manual_seed(50 + rank)
    n = 5 if rank == 0 else 9
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    x = torch.randn(n, cfg.hidden_size, generator=g)
    owned = e // 2 if rank == 0 else e  # rank 0 only uses experts of EP rank 0
    idx = torch.stack([torch.randperm(owned, generator=g)[:k] for _ in range(n)])
    return x, idx, torch.randn(n, cfg.hidden_size, generator=g)


def check_ep_layer() -> dict:
    cfg = preset("k3-test-tiny")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)
    ref = LatentMoE(cfg, layer_idx=1)
    ep = copy.deepcopy(ref)
    _, ep_mesh = init_meshes(ep_size=world, device_type="cpu")
    (module,) = apply_expert_parallel(ep, ep_mesh, "ep")
    x, idx, c = _rank_inputs(rank, cfg)
    x = x.requires_grad_()
    y = ep(x, force_topk_idx=idx)
    (y * c).sum().backward()
    ref_y, ref_xgrad = None, None
    for r in range(world):  # the single device sees every rank's tokens
        xr, idr, cr = _rank_inputs(r, cfg)
        xr.requires_grad_()
        yr = ref(xr, force_topk_idx=idr)
        (yr * cr).sum().backward()
        if r == rank:
            ref_y, ref_xgrad = yr, xr.grad
    out = {"y": _max_err(y, ref_y), "x_grad": _max_err(x.grad, ref_xgrad),
           "send": list(module.dispatcher.last_send), "recv": list(module.dispatcher.last_recv),
           "local_w1": tuple(module.w1.to_local().shape)}
    for name in ("w1", "w3", "w2"):
        # EP divides expert gradients by the data-parallel degree (FSDP's averaging convention).
        full = getattr(module, name).grad.full_tensor() * world
        out[f"{name}_grad"] = _max_err(full, getattr(ref.experts, name).grad)
    torch.manual_seed(99)
    ref.experts.init_weights()
    torch.manual_seed(99)
    module.init_weights()
    out["init"] = max(_max_err(getattr(module, n).full_tensor(), getattr(ref.experts, n)) for n in ("w1", "w3", "w2"))
    return out


# name -> (shape, use_muon, head_blocks)
MUON_CASES = {
    "per_head_aligned": ((4 * 3, 5), True, (4, (3,))),
    "per_head_cut": ((3 * 4, 5), True, (3, (1, 3))),  # rank 0 holds rows 0-5: head 1 is cut
    "experts_uneven": ((3, 4, 6), True, None),
    "full_uneven": ((7, 5), True, None),
    "adamw_vector": ((7,), False, None),
}


def check_dist_muon(steps: int = 3) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for i, (name, (shape, use_muon, blocks)) in enumerate(MUON_CASES.items()):
        g = torch.Generator().manual_seed(300 + i)  # same data on every rank
        full = torch.randn(shape, generator=g)
        grads = [torch.randn(shape, generator=g) for _ in range(steps)]
        plain = torch.nn.Parameter(full.clone())
        sharded = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
        group = {"use_muon": use_muon, "head_blocks": blocks}
        ref_opt = Muon([{"params": [plain], **group}], lr=0.02, weight_decay=0.1)
        opt = DistMuon([{"params": [sharded], **group}], lr=0.02, weight_decay=0.1)
        for gr in grads:
            plain.grad = gr.clone()
            sharded.grad = distribute_tensor(gr.clone(), mesh, [Shard(0)])
            ref_opt.step()
            opt.step()
        out[name] = _max_err(sharded.full_tensor(), plain)
        out[f"{name}_local"] = use_muon and local_blocks(sharded, blocks) is not False
    return out
