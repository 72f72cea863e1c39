"""What one training run needs: :class:`RunConfig`, the input of :func:`openk3.train.trainer.train`.

A run config names the model (a preset or a :class:`~openk3.config.K3Config`), the data (a
factory ``data(run, split) -> DataSource`` for ``split`` in {"train", "eval"}, the protocol
:class:`openk3.train.data.DataSource`), the schedule, the batch (``seq_len`` tokens per
micro-batch, ``grad_accum`` micro-batches per step), QAT, eval and checkpoint cadence. Recipes
(:mod:`openk3.recipes`) are functions that return one.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from openk3.config import K3Config, preset
from openk3.train.data import DataSource
from openk3.train.trainer import StepConfig
from openk3.typed_fields import check_fields, replace_fields


@dataclass
class RunConfig:
    """Everything a training run needs (see the module docstring).

    Attributes:
        name: recipe name. model: preset name or :class:`K3Config`. data: data factory.
        seq_len: tokens per packed row. batch_size: rows per micro-batch (the data source packs
            them into one row with ``cu_seqlens``). grad_accum: micro-batches per step.
        total_steps, warmup_steps (None: 1 %), min_lr_ratio: the LR schedule's length, warmup
            and final LR (a fraction of the peak).
        schedule: ``"cosine"`` (architecture.md §9, the default) or ``"wsd"``
            (warmup-stable-decay: the peak LR until the last ``decay_fraction`` of the steps,
            then a cosine decay to ``min_lr_ratio``; :func:`openk3.train.optim.wsd_with_warmup`).
        decay_fraction: WSD's decay share of ``total_steps``, in [0, 1].
        lr: peak LR of both Muon and AdamW (Muon's RMS matching makes them comparable);
            adamw_lr overrides it for the AdamW group. weight_decay: Muon groups (K3: 0.1).
        lr_scales: LR multipliers by parameter-name prefix, first match in order, ``""`` for
            every other name (:func:`openk3.train.optim.param_groups`); None: one LR for all.
        grad_clip: global norm clip. qk_clip_tau: QK-Clip threshold (None: off).
        qb_bins, qb_ema: Quantile Balancing histogram bins and optional EMA.
        qat: None or a scheme name of :data:`openk3.quant.qat.SCHEMES` ("mxfp4": MXFP4 weights
            and MXFP8 inputs of the routed experts, as K3's QAT).
        eval_every (0: never), eval_batches: periodic eval.
        ckpt_every, keep_checkpoints: checkpoint cadence and retention.
        seed: model init, data order. threads: torch CPU threads (None: torch's default).
        device: "cpu" / "cuda".
        ep_size: expert-parallel size under ``torchrun`` (routed experts split over groups of
            ``ep_size`` ranks; must divide the world size and ``n_routed_experts``); 1 = experts
            FSDP-sharded like every other weight. Ignored in a single process (same numbers).
        init_from: a checkpoint directory (``save_pretrained`` format, e.g. the last checkpoint
            of a pretraining run) whose weights and router biases start this run; the optimizer,
            schedule and data start fresh (an SFT phase after pretraining).
        settings: the recipe's own typed settings (a frozen dataclass, e.g.
            :class:`openk3.recipes.default_model.DefaultModelSettings`; None for a recipe without
            any), read by its data factory and stages. They validate themselves on construction;
            :meth:`replace` changes them with ``extra={field: value}`` (the CLI's ``--set
            extra='{...}'``) or by field name (``--set pretrain_steps=3``).
        prepare: a multi-stage recipe's earlier stages: ``prepare(run, out_dir, resume) ->
            RunConfig`` runs them (each resumable, e.g. corpus, tokenizer, pretraining) and returns
            the config of the final stage, which :func:`~openk3.train.trainer.train` then runs into
            ``out_dir`` (``default-model``: :mod:`openk3.recipes.default_model`). None: one stage.
    Raises:
        ValueError: a value out of range, naming the field.
    """

    name: str
    model: str | K3Config = field(metadata={"expect": "a preset name or a K3Config"})
    data: Callable[["RunConfig", str], DataSource] = field(
        metadata={"expect": "a data factory (callable; set by the recipe)"}
    )
    total_steps: int
    seq_len: int = 256
    batch_size: int = 1
    grad_accum: int = 1
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1
    schedule: str = "cosine"
    decay_fraction: float = 0.2
    lr: float = 1e-2
    adamw_lr: float | None = None
    lr_scales: dict[str, float] | None = None
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0
    qk_clip_tau: float | None = 100.0
    qb_bins: int = 1000
    qb_ema: float | None = None
    qat: str | None = None
    eval_every: int = 0
    eval_batches: int = 0
    ckpt_every: int = 100
    keep_checkpoints: int | None = 3
    seed: int = 0
    threads: int | None = None
    device: str = field(
        default="cpu", metadata={"expect": 'a device string ("cpu", "cuda", "cuda:1")'}
    )
    ep_size: int = 1
    init_from: str | None = None
    settings: Any = None
    prepare: Callable[["RunConfig", str, bool], "RunConfig"] | None = None

    def __post_init__(self) -> None:
        check_fields(self, skip=("settings",))
        if self.settings is not None and not (
            dataclasses.is_dataclass(self.settings) and not isinstance(self.settings, type)
        ):
            raise ValueError(
                f"RunConfig.settings={self.settings!r}: must be a recipe's settings dataclass or null"
            )
        for name in (
            "total_steps",
            "seq_len",
            "batch_size",
            "grad_accum",
            "ckpt_every",
            "qb_bins",
            "ep_size",
        ):
            v = getattr(self, name)
            if v < 1:
                raise ValueError(f"RunConfig.{name}={v!r}: must be a positive integer")
        for name in ("eval_every", "eval_batches"):
            v = getattr(self, name)
            if v < 0:
                raise ValueError(f"RunConfig.{name}={v!r}: must be a non-negative integer")
        if self.threads is not None and self.threads < 1:
            raise ValueError(
                f"RunConfig.threads={self.threads!r}: must be a positive integer or None"
            )
        if self.adamw_lr is not None and not self.adamw_lr > 0:
            raise ValueError(f"RunConfig.adamw_lr={self.adamw_lr!r}: must be > 0 or None")
        self._check_device()
        ctx = self.model_config().max_position_embeddings
        if self.seq_len > ctx:  # the model's declared context; beyond it a row only exhausts memory
            raise ValueError(
                f"RunConfig.seq_len={self.seq_len}: exceeds the model's max_position_embeddings={ctx}"
            )
        if self.ep_size > 1 and self.model_config().n_routed_experts % self.ep_size:
            raise ValueError(
                f"RunConfig.ep_size={self.ep_size}: must divide n_routed_experts="
                f"{self.model_config().n_routed_experts}"
            )
        if self.qat is not None:
            from openk3.quant.qat import resolve_scheme

            try:
                resolve_scheme(self.qat)
            except ValueError as e:
                raise ValueError(f"RunConfig.qat={self.qat!r}: {e}") from None
        if not self.lr > 0:
            raise ValueError(f"RunConfig.lr={self.lr!r}: must be > 0")
        if self.lr_scales:
            from openk3.train.optim import check_lr_scales

            check_lr_scales(self.lr_scales, "RunConfig.lr_scales")
        self.step_config()  # validates the schedule and clip fields

    def _check_device(self) -> None:
        try:
            dev = torch.device(self.device)
        except RuntimeError:
            raise ValueError(
                f'RunConfig.device={self.device!r}: not a torch device ("cpu", "cuda", "cuda:1")'
            ) from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"RunConfig.device={self.device!r}: CUDA is not available in this torch build"
            )
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"RunConfig.device={self.device!r}: only cpu and cuda are supported")

    def model_config(self) -> K3Config:
        """The model's :class:`K3Config` (a preset is built on each call)."""
        return preset(self.model) if isinstance(self.model, str) else self.model

    def step_config(self) -> StepConfig:
        """The step settings; the schedule's errors name the ``RunConfig`` field.

        Raises:
            ValueError: a bad ``schedule`` / ``decay_fraction`` / warmup / clip value.
        """
        try:
            return StepConfig(
                total_steps=self.total_steps,
                warmup_steps=self.warmup_steps,
                min_lr_ratio=self.min_lr_ratio,
                grad_clip=self.grad_clip,
                qk_clip_tau=self.qk_clip_tau,
                schedule=self.schedule,
                decay_fraction=self.decay_fraction,
            )
        except ValueError as e:
            msg = str(e)
            if msg.startswith("StepConfig."):  # the same field under the same name here
                raise ValueError(f"RunConfig.{msg.removeprefix('StepConfig.')}") from None
            if msg.startswith(("schedule=", "decay_fraction=")):
                raise ValueError(f"RunConfig.{msg}") from None
            raise

    def build(self, device: str | torch.device = "cpu"):
        """Fresh ``(model, optimizer, balancers)`` for this run: the model initialised from
        ``seed``, QAT switched on if asked, K3's optimizer, one balancer per MoE layer.

        Raises:
            ValueError: an unknown ``qat`` scheme, expert widths it cannot quantise, or an
                ``init_from`` checkpoint that does not fit the model (tensor named).
            FileNotFoundError: ``init_from`` holds no weights.
        """
        from openk3.pretrained import build_model
        from openk3.train.optim import build_optimizer
        from openk3.train.trainer import make_balancers

        model = build_model(self.model_config(), device=device, seed=self.seed)
        if self.init_from is not None:
            from openk3.train.checkpointing import load_model_weights_

            # a text checkpoint may start a vision model: its tower / projector keep the fresh init
            load_model_weights_(model, self.init_from, allow_missing_vision=True)
        if self.qat is not None:
            from openk3.quant.qat import model_qat

            model_qat(model, self.qat)
        optimizer = build_optimizer(
            model,
            model.config,
            lr=self.lr,
            weight_decay=self.weight_decay,
            adamw_lr=self.adamw_lr,
            lr_scales=self.lr_scales,
        )
        return model, optimizer, make_balancers(model, self.qb_bins, self.qb_ema)

    def to_dict(self) -> dict:
        """A JSON-friendly description (the data factory by qualified name)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.settings is not None:
            d["settings"] = dataclasses.asdict(self.settings)
        if isinstance(self.model, K3Config):
            d["model"] = json.loads(self.model.to_json_string())
        for name in ("data", "prepare"):
            fn = getattr(self, name)
            if fn is not None:
                d[name] = f"{fn.__module__}:{getattr(fn, '__qualname__', repr(fn))}"
        return d

    def replace(self, **changes) -> "RunConfig":
        """A validated copy with ``changes``.

        ``changes`` name RunConfig fields, or the recipe's settings: ``extra={field: value}``
        (applied over the current :attr:`settings`, the ``--set extra='{...}'`` spelling) or a
        settings field by its own name (``pretrain_steps=3``; a RunConfig field of the same name
        would win, none exists).

        Raises:
            ValueError: an unknown field (``RunConfig: unknown field 'x' (known: ...)``), an
                unknown settings key (``RunConfig.extra: unknown key 'x' (known: ...)``), a
                non-object ``extra``, settings given to a recipe that has none, or any field's
                own validation error (naming the field, its value and what it must be).
        """
        names = {f.name for f in dataclasses.fields(self)}
        base = changes.get("settings", self.settings)
        known_settings = {f.name for f in dataclasses.fields(base)} if base is not None else set()
        settings_changes: dict = {}
        if "extra" in changes:
            extra = changes.pop("extra")
            if not isinstance(extra, Mapping):
                raise ValueError(f"RunConfig.extra={extra!r}: must be a JSON object")
            settings_changes.update(extra)
        for key in [k for k in changes if k not in names and k in known_settings]:
            settings_changes[key] = changes.pop(key)
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ValueError(
                f"RunConfig: unknown field {unknown[0]!r} (known: "
                f"{', '.join(sorted(names | known_settings | {'extra'}))})"
            )
        if settings_changes:
            if base is None:
                raise ValueError(
                    f"RunConfig.extra={settings_changes!r}: recipe {self.name!r} has no settings"
                )
            changes["settings"] = replace_fields(base, settings_changes, owner="RunConfig.extra")
        return dataclasses.replace(self, **changes)


__all__ = ["RunConfig"]
