"""The training step and loop: gradient accumulation, clipping, LR schedule, Quantile Balancing,
QK-Clip, periodic eval, checkpoints, signal handling, NaN/inf stop.

Shape legend: B rows of a micro-batch, T tokens per row, N packed documents, H MLA heads,
E routed experts, k experts per token.

Sources: architecture.md §7 (QB: bias from the step's own routing, used from the NEXT step),
§9 (Muon + AdamW, cosine schedule with 1 % warmup, QK-Clip after each optimizer step from the
forward's per-head max logits).

One step (:func:`train_step`), a named function per stage::

    _forward_backward:                  # bias b fixed for the whole step
        for micro-batch in step:
            forward -> loss, routing (per MoE layer), per-head max logits (per MLA layer)
            QB observe(scores, b)       # counts only, no communication
            finite check of loss_mb
            (loss_mb * n_mb / N).backward()  # N = labelled tokens of the whole step
    _clip_and_update: clip grads; lr = initial_lr * cfg.lr_multiplier(step) (cosine or WSD);
        optimizer.step()
    _qk_clip: QK-Clip(max logits of the step)      # after the update (K2)
    _update_router_biases: QB counts; b <- QB(b)   # routes the next step only
    metrics

What differs under ``torchrun`` (all-reduces of the finite flag, max logits and QB counts, the
sharded gradient clip and QK-Clip, a zero backward for an unlabelled micro-batch) is a method of
the run context (:class:`~openk3.train.distributed.run.SingleProcess` /
:class:`~openk3.train.distributed.run.DistributedRun`); the step itself has no distributed branch.

A micro-batch is a mapping with ``input_ids`` [B, T] int64, ``labels`` [B, T] int64 (already
aligned next-token targets, -100 ignored) and optionally ``cu_seqlens`` [N+1] (packed row, B = 1)
or ``lengths`` [B], and for image rows ``pixel_values`` [L, 3, P, P] + ``grid_thws`` [G, 3] (the
row's images in the order of its ``<|media_pad|>`` runs; K3ForConditionalGeneration only).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from openk3.config import MLA, K3Config
from openk3.train.balance import QuantileBalancer
from openk3.train.distributed.run import ONE_PROCESS, DistributedRun, SingleProcess
from openk3.train.optim import (
    Schedule,
    cosine_with_warmup,
    decay_steps,
    default_warmup,
    wsd_with_warmup,
)
from openk3.typed_fields import check_fields

_BATCH_KEYS = ("input_ids", "labels", "cu_seqlens", "lengths", "pixel_values", "grid_thws")
_IMAGE_KEYS = ("pixel_values", "grid_thws")  # image rows only (K3ForConditionalGeneration)


def _image_kwargs(x: Mapping) -> dict:
    return {k: x[k] for k in _IMAGE_KEYS if x.get(k) is not None}


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm; raised before the optimizer step, so the parameters
    still hold the last finite state. ``step`` is the 0-based index of the failing step."""

    def __init__(self, step: int, what: str, value: float) -> None:
        super().__init__(f"non-finite {what} ({value}) at step {step + 1}")
        self.step = step
        self.what = what
        self.value = value


class TrainingStopped(RuntimeError):
    """The loop stopped on a non-finite value; the message names the step and the last good
    checkpoint (``checkpoint`` None if none was saved yet)."""

    def __init__(self, message: str, step: int, checkpoint: str | None) -> None:
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


@dataclass
class StepConfig:
    """What :func:`train_step` needs besides the model, data and optimizer.

    Attributes:
        total_steps: schedule length (the LR reaches ``min_lr_ratio`` there).
        warmup_steps: linear warmup; None = 1 % of ``total_steps`` (architecture.md §9).
        min_lr_ratio: final LR as a fraction of the peak.
        schedule: ``"cosine"`` (:func:`~openk3.train.optim.cosine_with_warmup`, architecture.md
            §9) or ``"wsd"`` (:func:`~openk3.train.optim.wsd_with_warmup`: constant after the
            warmup, cosine decay over the last ``decay_fraction`` of ``total_steps``).
        decay_fraction: WSD's decay share of ``total_steps`` in [0, 1] (ignored by cosine).
        grad_clip: max global L2 norm of the gradient; None = no clipping (norm still logged).
        qk_clip_tau: QK-Clip threshold tau (K2: 100); None disables QK-Clip.
    Raises:
        ValueError: a value of the wrong type (``StepConfig.field=value: must be ...``,
            :func:`openk3.typed_fields.check_fields`) or out of range, naming the field.
    """

    total_steps: int
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.0
    grad_clip: float | None = 1.0
    qk_clip_tau: float | None = 100.0
    schedule: Schedule = "cosine"
    decay_fraction: float = 0.2

    def __post_init__(self) -> None:
        check_fields(self)  # types first; the schedule functions check the ranges
        if self.warmup_steps is None:
            self.warmup_steps = default_warmup(self.total_steps)
        cosine_with_warmup(0, self.total_steps, self.warmup_steps, self.min_lr_ratio)  # validates
        self._decay = decay_steps(
            self.total_steps, self.warmup_steps, self.decay_fraction
        )  # validates
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip={self.grad_clip!r}: must be > 0 or None")
        if self.qk_clip_tau is not None and not self.qk_clip_tau > 0:
            raise ValueError(f"qk_clip_tau={self.qk_clip_tau!r}: must be > 0 or None")

    def lr_multiplier(self, step: int) -> float:
        """The schedule's LR multiplier of the 0-based ``step``."""
        if self.schedule == "wsd":
            return wsd_with_warmup(
                step, self.total_steps, self.warmup_steps, self._decay, self.min_lr_ratio
            )
        return cosine_with_warmup(step, self.total_steps, self.warmup_steps, self.min_lr_ratio)


# ------------------------------------------------------------------------------ model helpers
def _config_of(model: nn.Module) -> K3Config:
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise ValueError(f"model: {type(model).__name__} has no .config (expected a K3ForCausalLM)")
    return cfg


def moe_routers(model: nn.Module) -> dict[int, nn.Module]:
    """{layer index: router} of every MoE layer, in execution (= layer) order.

    The router is ``model.model.layers[l].block_sparse_moe.gate``; its buffer
    ``e_score_correction_bias`` [E] fp32 is the bias QB sets.
    """
    out = {}
    for i, layer in enumerate(model.model.layers):
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            out[i] = moe.gate
    return out


def make_balancers(
    model: nn.Module, num_bins: int = 1000, ema: float | None = None
) -> dict[int, QuantileBalancer]:
    """One :class:`QuantileBalancer` per MoE layer of ``model`` ({layer index: balancer})."""
    dev = model.lm_head.weight.device
    return {
        i: QuantileBalancer(r.num_experts, r.top_k, num_bins, ema=ema, device=dev)
        for i, r in moe_routers(model).items()
    }


def new_max_logits(model: nn.Module) -> dict[int, torch.Tensor]:
    """{MLA layer index: [H] fp32 filled with -inf}: the forward's running per-head max logits."""
    cfg = _config_of(model)
    dev = model.lm_head.weight.device
    return {
        i: torch.full((cfg.num_attention_heads,), -math.inf, device=dev)
        for i, kind in enumerate(cfg.layer_types)
        if kind == MLA
    }


def _model_inputs(mb: Mapping, device: torch.device) -> dict:
    if not isinstance(mb, Mapping) or "input_ids" not in mb or "labels" not in mb:
        raise ValueError(
            f"batch: each micro-batch must be a mapping with input_ids and labels, got "
            f"{type(mb).__name__} with keys {sorted(mb) if isinstance(mb, Mapping) else '-'}"
        )
    return {k: mb[k].to(device) for k in _BATCH_KEYS if mb.get(k) is not None}


# -------------------------------------------------------------------------------- one step
def train_step(
    model: nn.Module,
    batch: Sequence[Mapping],
    optimizer: torch.optim.Optimizer,
    balancers: Mapping[int, QuantileBalancer],
    cfg: StepConfig,
    *,
    step: int,
    token_normalizer: float | None = None,
    ctx: SingleProcess | DistributedRun | None = None,
) -> dict:
    """One optimizer step over the micro-batches of ``batch`` (gradient accumulation).

    The step is the sequence of the module docstring: :func:`_forward_backward` (with QB
    observation and the finite-loss check), :func:`_clip_and_update`, :func:`_qk_clip`,
    :func:`_update_router_biases`, then the metrics. What differs under ``torchrun`` (the
    collectives, the sharded clip and QK-Clip, when a non-finite loss stops) is asked of ``ctx``.

    Args:
        model: a :class:`~openk3.model.K3ForCausalLM` in train mode (or a wrapper with the same
            ``forward`` keywords and ``.config`` / ``.model.layers``).
        batch: the step's micro-batches (see the module docstring); at least one.
        optimizer: built by :func:`~openk3.train.optim.build_optimizer`; each group's LR is set
            to ``initial_lr * cfg.lr_multiplier(step)`` (``initial_lr`` is recorded from the
            group's ``lr`` on first use and saved with the optimizer state).
        balancers: {MoE layer index: QuantileBalancer} from :func:`make_balancers`; empty to
            freeze the router bias.
        cfg: :class:`StepConfig`.
        step: 0-based index of this step (the LR schedule position).
        token_normalizer: what the summed token losses are divided by; default: the labelled
            tokens of this step. Data-parallel callers whose gradient all-reduce averages over
            R ranks pass ``global_tokens / R``, so the result is the global token mean.
        ctx: the run context (:mod:`openk3.train.distributed.run`); default one process.
            :func:`train` passes its :class:`~openk3.train.distributed.run.DistributedRun` under
            ``torchrun``.
    Returns:
        metrics: ``loss`` (token-mean over the step, float), ``tokens``, ``grad_norm``
        (before clipping), ``lr`` (of the first group), ``qb_max_over_mean`` (worst MoE layer),
        ``expert_loads`` {layer: [E] list of ints}, ``qb_layer_max_over_mean`` {layer: float},
        ``max_logit`` (over MLA heads; None without MLA), ``qk_clipped_heads``.
    Raises:
        NonFiniteError: a micro-batch loss or the gradient norm is NaN/inf (before any update).
            Under torch.distributed every rank raises in the same step: a non-finite loss is
            flagged after the step's backward passes (MAX all-reduce). A micro-batch without
            labels still runs a zero backward there, for the collectives.
        ValueError: an empty batch, a micro-batch without input_ids/labels, or a routing record
            count that does not match the MoE layers.
    """
    ctx = ctx if ctx is not None else ONE_PROCESS
    if not batch:
        raise ValueError("batch: needs at least one micro-batch")
    device = model.lm_head.weight.device
    routers = moe_routers(model)
    if set(balancers) - set(routers):
        raise ValueError(f"balancers: layers {sorted(set(balancers) - set(routers))} have no MoE")
    inputs = [_model_inputs(mb, device) for mb in batch]
    counts = [int((x["labels"] != -100).sum()) for x in inputs]
    n_step = sum(counts)
    denom = float(token_normalizer) if token_normalizer is not None else float(max(n_step, 1))
    max_logits = new_max_logits(model)
    optimizer.zero_grad(set_to_none=True)

    loss_sum = _forward_backward(
        model, inputs, counts, denom, routers, balancers, max_logits, ctx, step
    )
    grad_norm = _clip_and_update(optimizer, cfg, ctx, step)
    clipped, max_logit = _qk_clip(model, max_logits, cfg, ctx)
    per_layer, loads = _update_router_biases(routers, balancers, ctx)
    return {
        "loss": loss_sum / max(n_step, 1),
        "tokens": n_step,
        "grad_norm": grad_norm,
        "lr": optimizer.param_groups[0]["lr"],
        "qb_max_over_mean": max(per_layer.values(), default=None),
        "qb_layer_max_over_mean": per_layer,
        "expert_loads": loads,
        "max_logit": max_logit,
        "qk_clipped_heads": clipped,
    }


def _forward_backward(
    model,
    inputs: list[dict],
    counts: list[int],
    denom: float,
    routers: dict,
    balancers: Mapping[int, QuantileBalancer],
    max_logits: dict[int, torch.Tensor],
    ctx,
    step: int,
) -> float:
    """Forward and backward of every micro-batch, the gradients accumulating as
    ``sum(loss_mb * n_mb) / denom``; each forward's routing is observed by the balancers (bias
    fixed for the whole step) and its per-head max logits go into ``max_logits`` (in place).

    Returns:
        The summed token losses of the step (``sum(loss_mb * n_mb)``).
    Raises:
        NonFiniteError: a non-finite micro-batch loss, at once in one process; under
            ``torchrun`` after every rank's backward passes (any rank's flag stops all).
        ValueError: a routing record count that does not match the MoE layers.
    """
    loss_sum = 0.0
    for x, n_mb in zip(inputs, counts):
        sink: list = []
        out = model(
            x["input_ids"],
            labels=x["labels"],
            cu_seqlens=x.get("cu_seqlens"),
            lengths=x.get("lengths"),
            routing_sink=sink,
            max_logits=max_logits,
            **_image_kwargs(x),
        )
        if len(sink) != len(routers):
            raise ValueError(f"model: {len(sink)} routing records for {len(routers)} MoE layers")
        for (idx, router), route in zip(routers.items(), sink):
            if idx in balancers:
                balancers[idx].observe(
                    route.scores, router.e_score_correction_bias, topk_idx=route.topk_idx
                )
        del sink
        if n_mb == 0:  # nothing to learn from; its routing still counts for QB
            ctx.backward_unlabelled(out)
            continue
        loss = out.loss
        value = float(loss.detach())
        if not math.isfinite(value) and ctx.stop_on_nonfinite_loss(value):
            raise NonFiniteError(step, "loss", value)
        loss_sum += value * n_mb
        (loss * (n_mb / denom)).backward()
    bad = ctx.nonfinite_loss_on_any_rank()
    if bad is not None:
        raise NonFiniteError(step, "loss", bad)
    return loss_sum


def _clip_and_update(optimizer: torch.optim.Optimizer, cfg: StepConfig, ctx, step: int) -> float:
    """Clip the gradient to ``cfg.grad_clip`` (global L2 norm), set the scheduled LR, step the
    optimizer and clear the gradients. Returns the norm before clipping.

    Raises:
        NonFiniteError: a non-finite gradient norm (nothing updated).
    """
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    clip = cfg.grad_clip if cfg.grad_clip is not None else math.inf
    grad_norm = float(ctx.clip_grad_norm(params, clip)) if params else 0.0
    if not math.isfinite(grad_norm):
        raise NonFiniteError(step, "gradient norm", grad_norm)
    mult = cfg.lr_multiplier(step)
    for g in optimizer.param_groups:
        g.setdefault("initial_lr", g["lr"])
        g["lr"] = g["initial_lr"] * mult
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def _qk_clip(
    model: nn.Module, max_logits: dict[int, torch.Tensor], cfg: StepConfig, ctx
) -> tuple[int, float | None]:
    """QK-Clip after the update (K2) from the step's per-head max logits (the maximum over every
    rank). Layers whose max is not finite (no token reached them) are skipped.

    Returns:
        ``(heads clipped, largest max logit or None without MLA)``.
    """
    max_logits = ctx.reduce_max_logits(max_logits)
    seen = {i: s for i, s in max_logits.items() if bool(torch.isfinite(s).all())}
    clipped = 0
    if cfg.qk_clip_tau is not None and seen:
        gammas = ctx.qk_clip(model, seen, cfg.qk_clip_tau, _config_of(model))
        clipped = int(sum(int((gm < 1).sum()) for gm in gammas.values()))
    return clipped, max((float(s.max()) for s in seen.values()), default=None)


def _update_router_biases(
    routers: dict, balancers: Mapping[int, QuantileBalancer], ctx
) -> tuple[dict[int, float], dict[int, list[int]]]:
    """Quantile Balancing: the step's routing counts (summed over ranks) set each router's
    ``e_score_correction_bias``, used from the next step on, never on this batch.

    Returns:
        ``({layer: max/mean load}, {layer: [E] expert loads})`` of the layers with statistics.
    """
    per_layer = {}
    loads = {}
    if not balancers:
        return per_layer, loads
    ctx.reduce_balancers(list(balancers.values()))
    for idx, bal in balancers.items():
        bias = routers[idx].e_score_correction_bias
        bias.copy_(bal.step(bias))
        if bal.last_stats:
            loads[idx] = bal.last_stats["loads"].tolist()
            per_layer[idx] = bal.last_stats["max_over_mean"]
    return per_layer, loads


@torch.no_grad()
def evaluate(model: nn.Module, batches) -> dict:
    """Token-mean loss over ``batches`` (micro-batch mappings), bias frozen, no state change.

    Returns:
        ``{"eval_loss": float, "eval_tokens": int}`` (``eval_loss`` NaN when nothing is labelled).
    """
    was_training = model.training
    model.eval()
    device = model.lm_head.weight.device
    total = 0.0
    n = 0
    try:
        for mb in batches:
            x = _model_inputs(mb, device)
            k = int((x["labels"] != -100).sum())
            if k == 0:
                continue
            out = model(
                x["input_ids"],
                labels=x["labels"],
                cu_seqlens=x.get("cu_seqlens"),
                lengths=x.get("lengths"),
                **_image_kwargs(x),
            )
            total += float(out.loss) * k
            n += k
    finally:
        model.train(was_training)
    return {"eval_loss": total / n if n else math.nan, "eval_tokens": n}


# -------------------------------------------------------------------------------- the loop
class _StopFlag:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint after the current step and exits.
    A second SIGINT falls through to Python's default (KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def __enter__(self) -> "_StopFlag":
        if sys.platform != "win32" and _in_main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


@dataclass
class TrainResult:
    """What :func:`train` did. ``signal`` is the signal number that stopped it (None if it ran
    to ``end_step``); ``checkpoint`` the last checkpoint written or loaded."""

    step: int
    end_step: int
    signal: int | None
    checkpoint: str | None
    last_metrics: dict


def train(
    run,
    out_dir: str | os.PathLike,
    *,
    resume: bool = False,
    max_steps: int | None = None,
    progress: bool = True,
) -> TrainResult:
    """Run a recipe (:class:`~openk3.train.run_config.RunConfig`) into ``out_dir``.

    Writes ``out_dir/metrics.jsonl`` (one record per step and per eval), ``out_dir/metrics.png``
    (loss and expert load) and ``out_dir/checkpoints/step-XXXXXXX`` every ``run.ckpt_every`` steps,
    at the end, and when SIGTERM/SIGINT arrives (after the current step).

    Under ``torchrun`` every rank calls this: FSDP2 (+ expert parallel if ``run.ep_size`` > 1),
    a step of ``grad_accum x world`` micro-batches, rank 0 writing metrics and single-process-format
    checkpoints, ``resume`` supported (see :mod:`openk3.train.distributed.run`).

    Args:
        run: the run configuration.
        out_dir: output directory (created).
        resume: continue from the latest checkpoint in ``out_dir`` (a fresh start if none).
        max_steps: stop after this many completed steps (the schedule still spans
            ``run.total_steps``), e.g. to train in pieces.
        progress: show a progress bar (tqdm) with loss, tokens/s and ETA on stderr.
    Returns:
        :class:`TrainResult` (on every rank).
    Raises:
        TrainingStopped: a non-finite loss or gradient norm; the message names the step and the
            last good checkpoint.
        ValueError: a bad run configuration, an ``out_dir`` that is a file, is in use by another
            trainer (its pid named) or already holds a run while ``resume`` is false, ``resume`` onto a checkpoint of another model, or
            (under torchrun) a multi-stage recipe or an ``ep_size`` that does not divide the world.
    """
    from openk3.train.checkpointing import CheckpointManager, check_out_dir
    from openk3.train.distributed.run import NullLog, distributed_requested, run_context
    from openk3.train.metrics import MetricsLog, Progress, plot_metrics

    out_dir = os.fspath(out_dir)
    # one trainer per run directory: held from here to the end (rank 0 holds it for a torchrun job)
    lock = check_out_dir(out_dir, resume, lock=os.environ.get("RANK", "0") == "0")
    try:
        if (
            run.prepare is not None and not distributed_requested()
        ):  # multi-stage: earlier stages first
            run = run.prepare(run, out_dir, resume)
        ctx = run_context(run)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    try:
        if run.threads:
            torch.set_num_threads(run.threads)
        torch.manual_seed(run.seed)
        model, optimizer, balancers = run.build(device=ctx.device)
        model.train()
        step_cfg = run.step_config()
        train_data = run.data(run, "train")
        ckpts = CheckpointManager(os.path.join(out_dir, "checkpoints"), keep=run.keep_checkpoints)
        start = 0
        ckpt_path = None
        if (
            resume
        ):  # into the plain model, before any sharding (the checkpoint is single-process format)
            ckpt_path = ckpts.latest()
            if ckpt_path is not None:
                start = ckpts.load(ckpt_path, model, optimizer, balancers, train_data)["step"]
        model, optimizer = ctx.parallelize(model, optimizer)
        end = run.total_steps if max_steps is None else min(run.total_steps, max_steps)
        log = (
            MetricsLog(os.path.join(out_dir, "metrics.jsonl"), truncate_after=start)
            if ctx.is_writer
            else NullLog()
        )
        last: dict = {}
        tokens_done = 0
        t0 = time.perf_counter()
        bar = Progress(total=end, initial=start, enabled=progress and ctx.is_writer)
        step = start
        saved_step = start if ckpt_path else None
        with _StopFlag() as stop:
            try:
                stop_sig = ctx.agree_signal(stop.signum)
                while step < end and stop_sig is None:
                    batch, normalizer = ctx.step_batch(train_data, run.grad_accum)
                    t_step = time.perf_counter()
                    try:
                        m = train_step(
                            model,
                            batch,
                            optimizer,
                            balancers,
                            step_cfg,
                            step=step,
                            token_normalizer=normalizer,
                            ctx=ctx,
                        )
                    except NonFiniteError as e:
                        where = ckpt_path or "none saved yet (nothing to resume from)"
                        msg = (
                            f"training stopped: {e}; parameters not updated by that step. Last good checkpoint: "
                            f"{where}" + (" (resume with --resume)" if ckpt_path else "")
                        )
                        log.write({"kind": "error", "step": step + 1, "message": msg})
                        raise TrainingStopped(msg, step + 1, ckpt_path) from e
                    m = ctx.reduce_metrics(m)
                    step += 1
                    tokens_done += m["tokens"]
                    elapsed = time.perf_counter() - t0
                    m.update(
                        kind="train",
                        step=step,
                        step_time=time.perf_counter() - t_step,
                        tokens_per_s=tokens_done / max(elapsed, 1e-9),
                        elapsed=elapsed,
                    )
                    log.write(m)
                    last = m
                    bar.update(step, m)
                    if run.eval_every and step % run.eval_every == 0 and run.eval_batches:
                        # every rank evaluates the same batches (FSDP / EP forwards are collective)
                        ev = evaluate(model, _take(run.data(run, "eval"), run.eval_batches))
                        log.write({"kind": "eval", "step": step, **ev})
                        bar.note(f"step {step}: eval loss {ev['eval_loss']:.4f}")
                    if step % run.ckpt_every == 0 or step == end:
                        ckpt_path = ctx.save(
                            ckpts, step, model, optimizer, balancers, train_data, run, last
                        )
                        saved_step = step
                    stop_sig = ctx.agree_signal(stop.signum)
                if stop_sig is not None and saved_step != step:
                    ckpt_path = ctx.save(
                        ckpts, step, model, optimizer, balancers, train_data, run, last
                    )
                    saved_step = step
            finally:
                bar.close()
                log.close()
                if ctx.is_writer:
                    try:
                        plot_metrics(
                            os.path.join(out_dir, "metrics.jsonl"),
                            os.path.join(out_dir, "metrics.png"),
                        )
                    except Exception as e:  # a plot must never turn a finished run into a failure
                        print(f"openk3 train: no plot ({e})", file=sys.stderr)
    finally:
        ctx.close()
        if lock is not None:
            lock.release()
    return TrainResult(
        step=step, end_step=end, signal=stop_sig, checkpoint=ckpt_path, last_metrics=last
    )


def _take(source, n: int) -> list:
    return [source.next_batch() for _ in range(n)]


__all__ = [
    "StepConfig",
    "NonFiniteError",
    "TrainingStopped",
    "TrainResult",
    "train_step",
    "evaluate",
    "train",
    "make_balancers",
    "moe_routers",
    "new_max_logits",
]
