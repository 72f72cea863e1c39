"""Distributed-parity worker: a few training steps of ``k3-test-tiny`` (Per-Head Muon + AdamW,
QK-Clip, Quantile Balancing, gradient clipping), either in one process over the whole global
batch (:func:`run_single`) or data parallel under torchrun (``main``) in one of the modes:

* ``fsdp``: FSDP2 over the 2 ranks; the stacked experts are FSDP shards too.
* ``fsdp_ep2``: FSDP2 for the dense weights, expert parallel over the same 2 ranks (4 experts
  each), all-to-all dispatch with uneven splits.
* ``fsdp_ep1``: FSDP2 for the dense weights, experts replicated on a (2 replicas x 1) mesh
  (exercises the expert-gradient all-reduce over replicas and the local dispatcher).

The global batch of a step is the union of the ranks' micro-batches (different shapes per rank
and some ignored labels, so every rank holds a different token count); the single process runs
all of them as gradient-accumulation micro-batches. Rank 0 saves what the test compares.

Launch: ``torchrun --nproc-per-node 2 tests/train/dist_workers/parity.py OUT_DIR MODE...`` (with
the repository root on PYTHONPATH); the modes ``ep_layer`` and ``dist_muon`` run the unit checks
of ``checks.py`` instead.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from openk3.config import MLA, preset
from openk3.model import K3ForCausalLM
from openk3.train.balance import QuantileBalancer, all_reduce_balancers_
from openk3.train.muon import qk_clip_
from openk3.train.optim import build_optimizer

PRESET = "k3-test-tiny"
STEPS = 4
WORLD = 2
LR = 0.003
MAX_NORM = 0.5
QB_BINS = 200
# The random model's per-head max logits start near 0.04: this clips some heads every step.
QK_TAU = 0.045
# Micro-batch shapes (B, T) per rank; both ranks run the same number of micro-batches (each
# forward/backward is collective), with different token counts.
SHAPES = {0: [(2, 16), (1, 12)], 1: [(1, 24), (1, 20)]}


def make_model() -> K3ForCausalLM:
    torch.manual_seed(1234)
    return K3ForCausalLM(preset(PRESET)).train()


def micro_batches(step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids [B, T], labels [B, T]) of ``rank`` at ``step``; the first label of every row
    and every 7th one are ignored (-100)."""
    vocab = preset(PRESET).vocab_size
    out = []
    for i, (b, t) in enumerate(SHAPES[rank]):
        g = torch.Generator().manual_seed(10_000 * step + 100 * rank + i)
        seq = torch.randint(0, vocab, (b, t + 1), generator=g)
        labels = seq[:, 1:].clone()
        labels[:, 0] = -100
        labels[:, ::7] = -100
        out.append((seq[:, :-1], labels))
    return out


def global_tokens(step: int) -> int:
    return sum(int((lab != -100).sum()) for r in SHAPES for _, lab in micro_batches(step, r))


def routers(model) -> list:
    return [layer.block_sparse_moe.gate for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]


def train(model, optimizer, ranks: list[int], *, world: int, clip_fn, qk_clip_fn) -> dict:
    """STEPS steps over the micro-batches of ``ranks``; returns per-step records."""
    cfg = model.config
    gates = routers(model)
    balancers = [QuantileBalancer(g.num_experts, g.top_k, QB_BINS) for g in gates]
    mla = [i for i, kind in enumerate(cfg.layer_types) if kind == MLA]
    rec = {"loss": [], "grad_norm": [], "bias": [], "gamma": []}
    for step in range(STEPS):
        n_global = global_tokens(step)
        max_logits = {i: torch.full((cfg.num_attention_heads,), -math.inf) for i in mla}
        loss_sum = torch.zeros(())
        for rank in ranks:
            for ids, labels in micro_batches(step, rank):
                sink: list = []
                out = model(ids, labels=labels, routing_sink=sink, max_logits=max_logits)
                for bal, gate, route in zip(balancers, gates, sink, strict=True):
                    bal.observe(route.scores, gate.e_score_correction_bias, topk_idx=route.topk_idx)
                share = int((labels != -100).sum()) / n_global
                (out.loss * (share * world)).backward()  # FSDP averages over `world` ranks
                loss_sum += out.loss.detach() * share
        if dist.is_initialized():
            dist.all_reduce(loss_sum)
        all_reduce_balancers_(balancers)
        rec["grad_norm"].append(float(clip_fn(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        gam = qk_clip_fn(model, max_logits, QK_TAU)
        rec["gamma"].append(torch.stack([gam[i] for i in sorted(gam)]))
        for bal, gate in zip(balancers, gates):
            gate.e_score_correction_bias.copy_(bal.step(gate.e_score_correction_bias))
        rec["bias"].append(torch.stack([g.e_score_correction_bias.clone() for g in gates]))
        rec["loss"].append(float(loss_sum))
    return rec


def run_single() -> tuple[dict, dict]:
    """The single-process reference: (records, state_dict)."""
    model = make_model()
    opt = build_optimizer(model, model.config, LR)
    rec = train(model, opt, sorted(SHAPES), world=1, clip_fn=torch.nn.utils.clip_grad_norm_,
                qk_clip_fn=lambda m, s, tau: qk_clip_(m, s, tau))
    return rec, {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_distributed(mode: str) -> tuple[dict, dict, dict]:
    from torch.distributed.device_mesh import init_device_mesh

    from openk3.train.distributed.muon import build_sharded_optimizer, qk_clip_sharded_
    from openk3.train.distributed.expert_parallel import apply_expert_parallel
    from openk3.train.distributed.parallel import apply_fsdp, clip_grad_norm_, full_state_dict, init_meshes

    model = make_model()
    dp_mesh, ep_mesh = init_meshes(ep_size=2 if mode == "fsdp_ep2" else 1, device_type="cpu")
    if mode == "fsdp_ep1":
        ep_mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("ep_replica", "ep"))
    ep_modules = apply_expert_parallel(model, ep_mesh, "ep") if ep_mesh is not None else []
    apply_fsdp(model, dp_mesh)
    opt = build_sharded_optimizer(model, model.config, LR)
    rec = train(model, opt, [dist.get_rank()], world=WORLD, clip_fn=clip_grad_norm_, qk_clip_fn=qk_clip_sharded_)
    extra = {"send": [m.dispatcher.last_send for m in ep_modules if hasattr(m.dispatcher, "last_send")],
             "param_types": {n: type(p).__name__ for n, p in model.named_parameters()},
             "local_shapes": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()
                              if hasattr(p, "to_local")}}
    return rec, full_state_dict(model), extra


def main(argv: list[str]) -> None:
    from tests.train.dist_workers.checks import check_dist_muon, check_ep_layer

    out_dir, modes = argv[0], argv[1:]
    dist.init_process_group("gloo")
    try:
        for mode in modes:
            if mode in ("ep_layer", "dist_muon"):
                result, state = (check_ep_layer if mode == "ep_layer" else check_dist_muon)(), None
            else:
                rec, state, extra = run_distributed(mode)
                result = {"rec": rec, "extra": extra}
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, result)
            if dist.get_rank() == 0:
                torch.save({"ranks": gathered, "state": state}, f"{out_dir}/{mode}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
