"""Training recipes: Python functions that return a :class:`RunConfig`, and their registry.

``openk3 train --recipe NAME`` looks NAME up in :data:`RECIPES` (add one with
:func:`register_recipe`), or imports ``package.module:function`` for a recipe kept elsewhere.

A run config names the model (a preset or a :class:`~openk3.config.K3Config`), the data (a
factory ``data(run, split) -> DataSource`` for ``split`` in {"train", "eval"}), the schedule,
the batch (``seq_len`` tokens per micro-batch, ``grad_accum`` micro-batches per step), QAT,
eval and checkpoint cadence. A DataSource has ``next_batch() -> {"input_ids" [1, T],
"labels" [1, T], "cu_seqlens" [N+1]}``, ``state_dict() -> JSON-serialisable position`` and
``load_state_dict(state)``; the "eval" source must yield the same batches every time it is built.

Built in:

* ``smoke``: ``k3-test-tiny`` (every K3 branch) on a synthetic byte-level corpus
  (:func:`synthetic_document`, packed by :class:`~openk3.train.data.PackedLoader`); its data is
  generated, not read, so it runs on any machine and in CI.
* ``default-model`` (:mod:`openk3.train.default_model`) and ``default-model-vision``
  (:mod:`openk3.train.vision_stage`: the vision stage from a text SFT checkpoint).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from openk3.config import K3Config, preset
from openk3.train.trainer import StepConfig

# ----------------------------------------------------------------------------- synthetic text
_ADJ = ("small", "red", "old", "quiet", "bright", "heavy", "green", "happy")
_NOUN = ("cat", "dog", "river", "teacher", "garden", "machine", "bird", "city", "window", "farmer", "ship", "tree")
_VERB = ("sees", "finds", "likes", "follows", "paints", "carries", "visits", "builds", "hears", "keeps")
_PLACE = ("near the hill", "in the morning", "by the sea", "at night", "under the bridge", "after the rain")


def synthetic_document(seed: int, index: int) -> str:
    """Document ``index`` of the synthetic corpus ``seed``: 2-6 sentences
    ``"The <adj> <noun> <verb> the <noun>[ <place>]."`` with uniform independent choices.

    Its true entropy is known in closed form (:func:`synthetic_entropy_per_sentence`), which is
    what makes a loss threshold on it meaningful. Deterministic in ``(seed, index)``.
    """
    rng = random.Random(seed * 1_000_003 + index)
    out = []
    for _ in range(rng.randint(2, 6)):
        s = f"The {rng.choice(_ADJ)} {rng.choice(_NOUN)} {rng.choice(_VERB)} the {rng.choice(_NOUN)}"
        if rng.random() < 0.5:
            s += " " + rng.choice(_PLACE)
        out.append(s + ".")
    return " ".join(out)


def synthetic_entropy_per_sentence() -> float:
    """Entropy (nats) of one synthetic sentence: adjective, noun, verb, noun, place-or-not."""
    return (math.log(len(_ADJ)) + 2 * math.log(len(_NOUN)) + math.log(len(_VERB))
            + math.log(2) + 0.5 * math.log(len(_PLACE)))


def synthetic_store(seed: int, num_docs: int, bos: int, eos: int):
    """A :class:`~openk3.train.data.DocumentStore` of ``num_docs`` synthetic documents as
    byte-level tokens: ``bos``, the UTF-8 bytes (0-255), ``eos``; every next token is a target."""
    from openk3.train.data import DocumentStore, document_from_ids

    return DocumentStore.from_documents(
        document_from_ids([bos, *synthetic_document(seed, i).encode("utf-8"), eos]) for i in range(num_docs))


def synthetic_data(run: "RunConfig", split: str):
    """Data factory over :func:`synthetic_store`: a shuffled, endless
    :class:`~openk3.train.data.PackedLoader` for "train" (corpus seed ``run.seed``,
    ``run.extra["num_docs"]`` documents, default 4000), and a fixed, unshuffled held-out corpus
    (another seed, 200 documents) for "eval"."""
    from openk3.train.data import PackedLoader

    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: must be 'train' or 'eval'")
    cfg = run.model_config()
    if split == "train":
        store = synthetic_store(run.seed, int(run.extra.get("num_docs", 4000)), cfg.bos_token_id, cfg.eos_token_id)
        return PackedLoader(store, run.seq_len, run.batch_size, seed=run.seed, pad_id=cfg.pad_token_id)
    store = synthetic_store(run.seed + 7919, 200, cfg.bos_token_id, cfg.eos_token_id)
    return PackedLoader(store, run.seq_len, run.batch_size, shuffle=False, pad_id=cfg.pad_token_id)


# ------------------------------------------------------------------------------- run config
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
        extra: free-form settings read by the recipe's own data factory (``num_docs`` for
            :func:`synthetic_data`).
        prepare: a multi-stage recipe's earlier stages: ``prepare(run, out_dir, resume) ->
            RunConfig`` runs them (each resumable, e.g. corpus, tokenizer, pretraining) and returns
            the config of the final stage, which :func:`~openk3.train.trainer.train` then runs into
            ``out_dir`` (``default-model``: :mod:`openk3.train.default_model`). None: one stage.
    Raises:
        ValueError: a value out of range, naming the field.
    """

    name: str
    model: str | K3Config
    data: Callable[["RunConfig", str], Any]
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
    device: str = "cpu"
    ep_size: int = 1
    init_from: str | None = None
    extra: dict = field(default_factory=dict)
    prepare: Callable[["RunConfig", str, bool], "RunConfig"] | None = None

    def __post_init__(self) -> None:
        self._check_types()
        for name in ("total_steps", "seq_len", "batch_size", "grad_accum", "ckpt_every", "qb_bins", "ep_size"):
            v = getattr(self, name)
            if v < 1:
                raise ValueError(f"RunConfig.{name}={v!r}: must be a positive integer")
        for name in ("eval_every", "eval_batches"):
            v = getattr(self, name)
            if v < 0:
                raise ValueError(f"RunConfig.{name}={v!r}: must be a non-negative integer")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"RunConfig.threads={self.threads!r}: must be a positive integer or None")
        if self.adamw_lr is not None and not self.adamw_lr > 0:
            raise ValueError(f"RunConfig.adamw_lr={self.adamw_lr!r}: must be > 0 or None")
        self._check_device()
        ctx = self.model_config().max_position_embeddings
        if self.seq_len > ctx:  # the model's declared context; beyond it a row only exhausts memory
            raise ValueError(f"RunConfig.seq_len={self.seq_len}: exceeds the model's max_position_embeddings={ctx}")
        if self.ep_size > 1 and self.model_config().n_routed_experts % self.ep_size:
            raise ValueError(f"RunConfig.ep_size={self.ep_size}: must divide n_routed_experts="
                             f"{self.model_config().n_routed_experts}")
        if self.qat is not None:
            from openk3.quant.qat import resolve_scheme

            try:
                resolve_scheme(self.qat)
            except ValueError as e:
                raise ValueError(f"RunConfig.qat={self.qat!r}: {e}") from None
        if not self.lr > 0:
            raise ValueError(f"RunConfig.lr={self.lr!r}: must be > 0")
        self.step_config()  # validates the schedule and clip fields

    _INTS = ("total_steps", "seq_len", "batch_size", "grad_accum", "ckpt_every", "qb_bins", "ep_size",
             "eval_every", "eval_batches", "seed")
    _OPT_INTS = ("warmup_steps", "keep_checkpoints", "threads")
    _FLOATS = ("min_lr_ratio", "decay_fraction", "lr", "weight_decay")
    _OPT_FLOATS = ("adamw_lr", "grad_clip", "qk_clip_tau", "qb_ema")
    _STRS = ("schedule",)
    _OPT_STRS = ("qat", "init_from")

    def _check_types(self) -> None:
        """Every field has its declared type (``--set`` values arrive as JSON): a bool is not an
        integer here, numbers are finite.

        Raises:
            ValueError: naming the field, the value and the expected type.
        """
        def bad(name: str, want: str):
            return ValueError(f"RunConfig.{name}={getattr(self, name)!r}: must be {want}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)

        checks = ((self._INTS, False, is_int, "an integer"), (self._OPT_INTS, True, is_int, "an integer"),
                  (self._FLOATS, False, is_num, "a finite number"), (self._OPT_FLOATS, True, is_num, "a finite number"),
                  (self._STRS, False, lambda v: isinstance(v, str), "a string"),
                  (self._OPT_STRS, True, lambda v: isinstance(v, str), "a string"))
        for names, optional, ok, want in checks:
            for n in names:
                v = getattr(self, n)
                if not (ok(v) or (optional and v is None)):
                    raise bad(n, want + (" or null" if optional else ""))
        if not isinstance(self.name, str):
            raise bad("name", "a string")
        if not isinstance(self.model, (str, K3Config)):
            raise bad("model", "a preset name or a K3Config")
        if not isinstance(self.device, str):
            raise bad("device", 'a device string ("cpu", "cuda", "cuda:1")')
        if not isinstance(self.extra, dict):
            raise bad("extra", "a JSON object")
        if not callable(self.data):
            raise bad("data", "a data factory (callable; set by the recipe)")
        if self.prepare is not None and not callable(self.prepare):
            raise bad("prepare", "a callable or null")

    def _check_device(self) -> None:
        try:
            dev = torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"RunConfig.device={self.device!r}: not a torch device (\"cpu\", \"cuda\", "
                             f"\"cuda:1\")") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"RunConfig.device={self.device!r}: CUDA is not available in this torch build")
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
            return StepConfig(total_steps=self.total_steps, warmup_steps=self.warmup_steps,
                              min_lr_ratio=self.min_lr_ratio, grad_clip=self.grad_clip, qk_clip_tau=self.qk_clip_tau,
                              schedule=self.schedule, decay_fraction=self.decay_fraction)
        except ValueError as e:
            msg = str(e)
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
        optimizer = build_optimizer(model, model.config, lr=self.lr, weight_decay=self.weight_decay,
                                    adamw_lr=self.adamw_lr)
        return model, optimizer, make_balancers(model, self.qb_bins, self.qb_ema)

    def to_dict(self) -> dict:
        """A JSON-friendly description (the data factory by qualified name)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if isinstance(self.model, K3Config):
            d["model"] = json.loads(self.model.to_json_string())
        for name in ("data", "prepare"):
            fn = getattr(self, name)
            if fn is not None:
                d[name] = f"{fn.__module__}:{getattr(fn, '__qualname__', repr(fn))}"
        return d

    def replace(self, **changes) -> "RunConfig":
        """A validated copy with ``changes``. Raises ValueError for an unknown field."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ValueError(f"RunConfig: unknown field {unknown[0]!r} (known: {', '.join(sorted(names))})")
        return dataclasses.replace(self, **changes)


# -------------------------------------------------------------------------------- registry
RECIPES: dict[str, Callable[[], RunConfig]] = {}


def register_recipe(name: str):
    """Decorator: ``@register_recipe("name")`` on a function returning a :class:`RunConfig`.

    Raises:
        ValueError: the name is already registered.
    """
    def deco(fn: Callable[[], RunConfig]) -> Callable[[], RunConfig]:
        if name in RECIPES and RECIPES[name] is not fn:
            raise ValueError(f"recipe {name!r} is already registered")
        RECIPES[name] = fn
        return fn

    return deco


def get_recipe(name: str, **overrides) -> RunConfig:
    """The run config of recipe ``name`` (registered, or ``module:function``), with overrides.

    Raises:
        ValueError: an unknown recipe (the message lists the known ones), a function that does
            not return a RunConfig, or an unknown override field.
    """
    if ":" in name:
        mod, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"recipe {name!r}: cannot import ({e})") from None
    elif name in RECIPES:
        fn = RECIPES[name]
    else:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(sorted(RECIPES))} (or module:function)")
    run = fn()
    if not isinstance(run, RunConfig):
        raise ValueError(f"recipe {name!r}: returned {type(run).__name__}, expected RunConfig")
    return run.replace(**overrides) if overrides else run


@register_recipe("smoke")
def smoke() -> RunConfig:
    """``k3-test-tiny`` on the synthetic byte corpus (:func:`synthetic_data`)."""
    return RunConfig(
        name="smoke", model="k3-test-tiny", data=synthetic_data, total_steps=300, seq_len=256,
        warmup_steps=15, lr=2e-2, min_lr_ratio=0.1, eval_every=50, eval_batches=4, ckpt_every=100,
        keep_checkpoints=2, seed=0,
    )


# Recipes kept in their own modules register on import (after RunConfig exists: they import it).
import openk3.train.default_model  # noqa: E402,F401  ("default-model")
import openk3.train.vision_stage  # noqa: E402,F401  ("default-model-vision")
import openk3.train.tiny_chat  # noqa: E402,F401  ("tiny-chat")

__all__ = ["RunConfig", "RECIPES", "register_recipe", "get_recipe", "smoke", "synthetic_store", "synthetic_data",
           "synthetic_document", "synthetic_entropy_per_sentence"]
