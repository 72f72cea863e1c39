"""How :func:`openk3.train.trainer.train` runs: in one process, or data parallel under ``torchrun``.

The training loop asks a *run context* for everything that depends on the number of processes
(the model's parallelism, the step's micro-batches, metrics reduction, stop agreement,
checkpoint writing). :class:`SingleProcess` is the plain case. :class:`DistributedRun` is used
when the process was started by ``torchrun`` (``WORLD_SIZE`` > 1) or a process group of more
than one rank already exists (:func:`run_context` decides).

Sources: the issue's "Scale-out" item (FSDP2 data parallel, expert parallel over a DeviceMesh,
model code unchanged; gloo on CPU, NCCL on GPUs); the building blocks
:mod:`openk3.train.distributed.parallel`, :mod:`openk3.train.distributed.expert_parallel` and
:mod:`openk3.train.distributed.muon`.

Design of :class:`DistributedRun` (R ranks):

* **Model.** Every rank builds the same single-device model, optimizer and balancers from the
  run config (same seed), and loads the same checkpoint on ``--resume``. Parallelism is applied
  afterwards, from outside: :func:`~openk3.train.distributed.expert_parallel.apply_expert_parallel` when
  ``run.ep_size`` > 1 (mesh (R/ep_size) x ep_size), then
  :func:`~openk3.train.distributed.parallel.apply_fsdp`. The plain :class:`~openk3.train.muon.Muon` becomes
  a :class:`~openk3.train.distributed.muon.DistMuon` over the sharded parameters, matched by name, with
  any loaded state sliced to each parameter's placement.
* **Data.** A global step is ``grad_accum x R`` micro-batches, taken in order from the run's
  deterministic data source. Every rank builds the same source and draws all of them; rank r
  trains micro-batches ``r, r + R, r + 2R, ...`` and drops the others. So the data position is
  the same on every rank, and a step equals a single-process step with ``grad_accum x R``
  micro-batches. The loss is normalised by the step's global labelled-token count over R
  (``token_normalizer``), so with FSDP's gradient mean it is the global token mean.
* **Writing.** Rank 0 alone writes ``metrics.jsonl``, the plot, the progress bar and the
  checkpoints. Metrics hold global values (loss and tokens summed over ranks).
* **Checkpoints and resume.** A checkpoint has the single-process format of
  :class:`~openk3.train.checkpointing.CheckpointManager`: the full model (gathered with
  :func:`~openk3.train.distributed.parallel.full_state_dict`, written with ``save_pretrained``) and the full
  optimizer state (every DTensor state gathered), balancers, data position and RNG. ``--resume``
  works under ``torchrun``. Each rank loads that checkpoint into its plain model before sharding.
  A checkpoint from R ranks therefore resumes on any number of ranks, one process included. The
  gathers cost one full copy of the model and optimizer state per rank, which is fine for the
  models openk3 trains. Large models would need ``torch.distributed.checkpoint``, which is not
  implemented. All ranks must see the same ``out_dir`` (one node, or a shared file system).
* **Stopping.** After every step the ranks agree on a stop (MAX all-reduce of the received
  signal number), so SIGTERM/SIGINT delivered to any rank stops all of them after the same step,
  with one checkpoint. A non-finite loss on any rank stops every rank in the same step, because
  :meth:`DistributedRun.nonfinite_loss_on_any_rank` all-reduces a flag after the backward passes. A non-finite gradient norm is
  global anyway.

Not supported under ``torchrun``: multi-stage recipes (``run.prepare``). They raise ValueError;
run their earlier stages in one process first.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from openk3.train.balance import all_reduce_balancers_
from openk3.train.data import IGNORE_INDEX, DataSource
from openk3.train.muon import qk_clip_


def distributed_requested() -> bool:
    """True when this process is one of several ranks: ``WORLD_SIZE`` > 1 in the environment
    (``torchrun``), or an initialised process group of more than one rank."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def run_context(run) -> "SingleProcess | DistributedRun":
    """The context :func:`~openk3.train.trainer.train` runs ``run`` in (see the module docstring).

    Raises:
        ValueError: from :class:`DistributedRun`.
    """
    return DistributedRun(run) if distributed_requested() else SingleProcess(run)


class SingleProcess:
    """One process: the model is used as built, a step is ``grad_accum`` micro-batches, this
    process writes everything. ``run.ep_size`` is ignored. EP=1 gives the same numbers."""

    world = 1
    rank = 0
    is_writer = True

    def __init__(self, run=None) -> None:
        self.device = run.device if run is not None else "cpu"

    def parallelize(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        """Returns ``(model, optimizer)`` unchanged."""
        return model, optimizer

    def step_batch(self, source: DataSource, grad_accum: int) -> tuple[list, float | None]:
        """The next ``grad_accum`` micro-batches and the default token normaliser (None)."""
        return [source.next_batch() for _ in range(grad_accum)], None

    # ------------------------------------------------------- the step (train_step asks these)
    def backward_unlabelled(self, out) -> None:
        """Nothing: a micro-batch without labelled tokens needs no backward here."""

    def stop_on_nonfinite_loss(self, value: float) -> bool:
        """True: a non-finite micro-batch loss stops the step at once."""
        return True

    def nonfinite_loss_on_any_rank(self) -> float | None:
        """None: a non-finite loss has already stopped the step."""
        return None

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_``: the total norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def reduce_max_logits(self, max_logits: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Identity: this process saw every token of the step."""
        return max_logits

    def qk_clip(
        self, model: nn.Module, max_logits: Mapping[int, torch.Tensor], tau: float, config
    ) -> dict:
        """:func:`openk3.train.muon.qk_clip_`: ``{layer: gamma [H]}``."""
        return qk_clip_(model, max_logits, tau, config)

    def reduce_balancers(self, balancers: list) -> None:
        """Nothing: the counts are this process's and complete."""

    def reduce_metrics(self, metrics: dict) -> dict:
        """Identity: a single process's metrics are already global."""
        return metrics

    def agree_signal(self, signum: int | None) -> int | None:
        """Identity: this process's received signal."""
        return signum

    def save(self, ckpts, step: int, model, optimizer, balancers, data, run, metrics) -> str:
        """``ckpts.save(...)`` (:meth:`~openk3.train.checkpointing.CheckpointManager.save`)."""
        return ckpts.save(step, model, optimizer, balancers, data, run, metrics)

    def close(self) -> None:
        """Nothing to release."""


class DistributedRun:
    """One rank of a data-parallel ``torchrun`` job (FSDP2, optionally expert parallel).

    Initialises the default process group when none exists: gloo for ``run.device == "cpu"``,
    NCCL for ``"cuda"``. In that case each rank uses ``cuda:LOCAL_RANK`` and :meth:`close`
    destroys the group again. Builds the meshes with
    :func:`~openk3.train.distributed.parallel.init_meshes`.

    Args:
        run: a :class:`~openk3.recipes.RunConfig`. Reads ``device``, ``ep_size`` and
            ``prepare``.
    Attributes:
        world, rank: R and this rank. is_writer: rank 0. device: this rank's device string.
        dp_mesh, ep_mesh: see :func:`~openk3.train.distributed.parallel.init_meshes`.
    Raises:
        ValueError: a multi-stage recipe (``run.prepare``), a device other than cpu/cuda, or
            ``ep_size`` not dividing R.
    """

    def __init__(self, run) -> None:
        from openk3.train.distributed.parallel import init_meshes

        if run.prepare is not None:
            raise ValueError(
                f"recipe {run.name!r}: multi-stage recipes (RunConfig.prepare) run in a single "
                "process only; run the earlier stages without torchrun first"
            )
        device_type = torch.device(run.device).type
        if device_type not in ("cpu", "cuda"):
            raise ValueError(
                f"RunConfig.device={run.device!r}: torchrun training supports 'cpu' (gloo) and "
                "'cuda' (NCCL)"
            )
        self.owns_group = not dist.is_initialized()
        if device_type == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
            self.device = f"cuda:{local_rank}"
        else:
            self.device = "cpu"
        if self.owns_group:
            dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.is_writer = self.rank == 0
        self._bad_loss: float | None = None  # this step's first non-finite loss on this rank
        try:
            self.dp_mesh, self.ep_mesh = init_meshes(run.ep_size, device_type)
        except ValueError:
            self.close()
            raise

    # ----------------------------------------------------------------------------- the model
    def parallelize(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        """Shard ``model`` in place (EP when ``ep_mesh`` is set, then FSDP2). Returns
        ``(model, DistMuon)``: the optimizer's groups, hyperparameters and state (sliced to each
        parameter's placement), matched by parameter name.

        Raises:
            ValueError: an optimizer that is not a :class:`~openk3.train.muon.Muon` with
                ``param_names`` in its groups (:func:`~openk3.train.optim.build_optimizer`).
        """
        from openk3.train.distributed.expert_parallel import apply_expert_parallel
        from openk3.train.distributed.muon import MUON_KWARGS, DistMuon
        from openk3.train.distributed.parallel import apply_fsdp
        from openk3.train.muon import Muon

        if not isinstance(optimizer, Muon) or any(
            "param_names" not in g for g in optimizer.param_groups
        ):
            raise ValueError(
                f"optimizer: {type(optimizer).__name__} is not a Muon built by build_optimizer "
                "(param groups with param_names); torchrun training needs one"
            )
        names = {id(p): n for n, p in model.named_parameters()}
        state = {names[id(p)]: s for p, s in optimizer.state.items() if s}
        if self.ep_mesh is not None:
            apply_expert_parallel(model, self.ep_mesh, "ep")
        apply_fsdp(model, self.dp_mesh)
        params = dict(model.named_parameters())
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [params[n] for n in g["param_names"]],
            }
            for g in optimizer.param_groups
        ]
        sharded = DistMuon(groups, **{k: optimizer.defaults[k] for k in MUON_KWARGS})
        for name, s in state.items():
            p = params[name]
            sharded.state[p] = {k: _like_param(v, p) for k, v in s.items()}
        return model, sharded

    # ------------------------------------------------------------------------------ the data
    def step_batch(self, source: DataSource, grad_accum: int) -> tuple[list, float]:
        """Draw the global step (``grad_accum x R`` micro-batches) and keep this rank's share
        (every R-th, from index ``rank``).

        Returns:
            ``(micro-batches, token_normalizer)`` where the normaliser is the global count of
            labelled tokens over R (at least 1/R).
        """
        batch = [source.next_batch() for _ in range(grad_accum * self.world)]
        n = sum(int((torch.as_tensor(mb["labels"]) != IGNORE_INDEX).sum()) for mb in batch)
        return batch[self.rank :: self.world], max(n, 1) / self.world

    # ------------------------------------------------------- the step (train_step asks these)
    def backward_unlabelled(self, out) -> None:
        """A zero backward through ``out.logits``: FSDP's and expert parallelism's backward
        collectives need every rank, also one whose micro-batch has no labelled token."""
        (out.logits.float().sum() * 0.0).backward()

    def stop_on_nonfinite_loss(self, value: float) -> bool:
        """False: remembered (the first value of the step) and reported by
        :meth:`nonfinite_loss_on_any_rank` after the step's backward passes, because raising on
        one rank alone would leave the others waiting in a collective."""
        if self._bad_loss is None:
            self._bad_loss = value
        return False

    def nonfinite_loss_on_any_rank(self) -> float | None:
        """The non-finite loss to report if any rank had one this step (this rank's value, or NaN
        for another rank's), else None; resets for the next step. Collective (MAX all-reduce)."""
        bad = self._bad_loss
        self._bad_loss = None
        flag = torch.tensor([0.0 if bad is None else 1.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not bool(flag.item()):
            return None
        return bad if bad is not None else math.nan

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """:func:`openk3.train.distributed.parallel.clip_grad_norm_`: the global norm of the
        sharded gradients. Collective."""
        from openk3.train.distributed.parallel import clip_grad_norm_

        return clip_grad_norm_(params, max_norm)

    def reduce_max_logits(self, max_logits: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The per-head max logits over every rank's tokens (one MAX all-reduce). Collective."""
        if not max_logits:
            return max_logits
        layers = sorted(max_logits)
        stacked = torch.stack([max_logits[i] for i in layers])
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
        return {i: stacked[j] for j, i in enumerate(layers)}

    def qk_clip(
        self, model: nn.Module, max_logits: Mapping[int, torch.Tensor], tau: float, config
    ) -> dict:
        """:func:`openk3.train.distributed.muon.qk_clip_sharded_` on the row shards, from the
        already reduced ``max_logits``: ``{layer: gamma [H]}``."""
        from openk3.train.distributed.muon import qk_clip_sharded_

        return qk_clip_sharded_(model, max_logits, tau, config, reduce_max=False)

    def reduce_balancers(self, balancers: list) -> None:
        """SUM all-reduce of every balancer's routing counts and loads (in place). Collective."""
        all_reduce_balancers_(balancers)

    def reduce_metrics(self, metrics: dict) -> dict:
        """Global ``loss`` (token mean over all ranks) and ``tokens`` (sum). The other
        :func:`~openk3.train.trainer.train_step` metrics are global already. Collective."""
        t = torch.tensor(
            [metrics["loss"] * metrics["tokens"], metrics["tokens"]],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        total, tokens = t.tolist()
        return {**metrics, "loss": total / max(tokens, 1.0), "tokens": int(round(tokens))}

    def agree_signal(self, signum: int | None) -> int | None:
        """The largest signal number any rank received (None if none did). Collective."""
        t = torch.tensor([signum or 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item()) or None

    # -------------------------------------------------------------------------- checkpoints
    def save(self, ckpts, step: int, model, optimizer, balancers, data, run, metrics) -> str:
        """Gather the full model and optimizer state (collective). Rank 0 then writes a
        single-process checkpoint with ``ckpts``. Returns its path on every rank.

        Raises:
            OSError and the errors of :meth:`~openk3.train.checkpointing.CheckpointManager.save`
                on rank 0. The other ranks raise RuntimeError naming them.
        """
        from openk3.train.distributed.parallel import full_state_dict

        full = _FullModel(model, full_state_dict(model))
        opt_state = _FullOptimizer(full_optimizer_state(optimizer))
        outcome: list = [None]
        if self.is_writer:
            try:
                outcome[0] = (
                    "ok",
                    ckpts.save(step, full, opt_state, balancers, data, run, metrics),
                )
            except BaseException as e:
                outcome[0] = ("error", f"{type(e).__name__}: {e}")
                dist.broadcast_object_list(outcome, src=0)
                raise
        dist.broadcast_object_list(outcome, src=0)
        status, value = outcome[0]
        if status != "ok":
            raise RuntimeError(f"rank 0 could not save the step-{step} checkpoint ({value})")
        return value

    def close(self) -> None:
        """Destroy the process group if this object created it."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


class NullLog:
    """The metrics log of ranks other than 0: ``write`` and ``close`` do nothing."""

    def write(self, record) -> None:
        pass

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------- state helpers
def _like_param(value, p: torch.Tensor):
    """An optimizer state value for the (possibly sharded) parameter ``p``. A full tensor of
    ``p``'s global shape is sliced to ``p``'s placement, locally (every rank holds the full
    value). Anything else (AdamW's step count, a plain parameter's state) is moved to
    ``p``'s device."""
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(p, DTensor) and tuple(value.shape) == tuple(p.shape):
        local = value.to(device=p.to_local().device)
        return distribute_tensor(local, p.device_mesh, p.placements, src_data_rank=None)
    return value.to(p.to_local().device if isinstance(p, DTensor) else p.device)


@torch.no_grad()
def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with every DTensor state value gathered to a full CPU tensor,
    which is the format of a single-process optimizer with the same groups. Collective: every
    rank gathers in the same order. The optimizer's own state is not modified."""
    sd = optimizer.state_dict()
    state = {}
    for idx in sorted(sd["state"]):
        entry = {}
        for key in sorted(sd["state"][idx]):
            v = sd["state"][idx][key]
            if isinstance(v, DTensor):
                v = v.full_tensor()
            entry[key] = v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
        state[idx] = entry
    return {"state": state, "param_groups": sd["param_groups"]}


class _FullModel:
    """Stands in for the sharded model in :meth:`CheckpointManager.save`: its ``config``, the
    gathered full ``state_dict`` and the model class's own ``save_pretrained`` applied to them."""

    def __init__(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        self.config = model.config
        self._state = dict(state)
        self._save = type(model).save_pretrained

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state

    def save_pretrained(self, path: str, **kwargs) -> None:
        self._save(self, path, **kwargs)


class _FullOptimizer:
    """Stands in for the sharded optimizer in :meth:`CheckpointManager.save`."""

    def __init__(self, state: dict) -> None:
        self._state = state

    def state_dict(self) -> dict:
        return self._state


#: The context of a step run outside :func:`~openk3.train.trainer.train` (tests, benchmarks):
#: one process, no collectives.
ONE_PROCESS = SingleProcess()

__all__ = [
    "distributed_requested",
    "run_context",
    "SingleProcess",
    "DistributedRun",
    "NullLog",
    "full_optimizer_state",
    "ONE_PROCESS",
]
