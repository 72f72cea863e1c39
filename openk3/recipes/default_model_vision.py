"""The ``default-model-vision`` recipe: a MoonViT tower for the shipped ``openk3-tiny``.

One stage after the text model (``default-model``, whose pretraining / SFT stay text-only)::

    openk3 train --recipe default-model-vision --out runs/vision \\
        --set extra='{"text_ckpt": "runs/default-model/checkpoints/step-0004000"}'

The shipped ``openk3-tiny`` is this command's run with the defaults below (1200 steps x 1024
tokens, half image rows and half text SFT rows; 12 min on the 2-core machine at ~0.6 s/step).

It builds ``openk3-tiny`` (vocabulary and special ids from the tokenizer) as a ``kimi_k3`` wrapper
with a tiny ``vision_config`` (:func:`tiny_vision_config`: 3 layers, width 64, patch 14, merge 2,
projector into the LM width 128), loads every text weight (and router bias) from
``extra.text_ckpt`` (a text training checkpoint; :func:`openk3.train.checkpointing.
load_model_weights_`), keeps the fresh ``vision_tower.*`` / ``mm_projector.*`` init (seed
``seed``), and trains **everything** with MXFP4 QAT on the routed experts: the projector must learn
to write embeddings the frozen-in-distribution LM can read, and a 4.6 M-parameter LM has no spare
capacity to leave untouched; forgetting is held off by a peak LR of 2e-3 (below the text SFT's
5e-3) and by ``text_share`` of the rows being text SFT conversations (a different seed,
``sft_seed``) through :class:`~openk3.train.mixed_data.MixedLoader`.

Data: ``image_items`` image-question conversations (:mod:`openk3.datasets.vision_data`, seed
``image_seed``) packed by :class:`~openk3.train.vision_loader.ImageSFTLoader`; eval: held-out
image conversations (another seed, disjoint by hash). Knobs (:class:`VisionStageSettings`,
``--set extra='{...}'``): ``text_ckpt`` (required), ``tokenizer_dir``, ``vision`` (VisionConfig fields
over :func:`tiny_vision_config`), ``image_items``, ``image_seed``, ``text_share`` in [0, 1),
``sft_items``, ``sft_seed``, ``sft_mixture`` (task -> share merged over
:data:`openk3.datasets.sft_data.MIXTURE`, e.g. ``{"copy": 0.3}`` for the copying curriculum),
``facts_share`` / ``facts_items`` (column-fact drill rows among the text rows), ``long_share`` /
``long_seq_len`` / ``long_items`` (long harness-prompt rows among the text rows), ``lm_lr_scale``
(the language model's LR as a fraction of the tower's), ``eval_items``, ``model_overrides`` (K3Config fields; tests shrink
the LM). Resume with ``--resume`` (data positions are in the checkpoint).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from openk3.recipes.settings import OWNER, RecipeSettings, check_at_least, check_fraction
from openk3.train.run_config import RunConfig


@dataclass(frozen=True)
class VisionStageSettings(RecipeSettings):
    """The ``default-model-vision`` recipe's knobs (module docstring); defaults are the shipped run.

    Attributes:
        text_ckpt: a text SFT training checkpoint, or a checkpoint that already has the tower
            (a vision-stage checkpoint or an export, for ``default-model-long``: its
            ``vision_tower.*`` / ``mm_projector.*`` load too); required by the stage, None until
            given.
        tokenizer_dir: the text model's tokenizer.
        vision: VisionConfig fields over :func:`tiny_vision_config`.
        image_items, image_seed: the image conversations.
        text_share: share of rows that are text SFT conversations, in [0, 1).
        sft_items, sft_seed, sft_mixture (None: ``sft_data.MIXTURE``; else ``{task: share}``
            merged over it; :attr:`mixture` is the normalised result): those text rows.
        facts_share (in [0, 1)), facts_items (seed ``sft_seed`` + 400): share of the text rows
            that are column-fact drill documents (:mod:`openk3.datasets.column_facts`), as in
            the text SFT (``sft_facts_share``): without them this stage's updates wear down the
            one-digit facts the arithmetic answers are built from.
        long_share (in [0, 1)), long_seq_len (tokens per row, >= 2,048), long_items (>= 1; seed
            ``sft_seed`` + 100): share of the text rows that are SFT conversations behind a
            synthetic agent-harness prompt (:func:`openk3.recipes.default_model.long_rows`), as
            the text SFT's ``long_share``: the 1,024-token rows alone teach nothing about finding
            the last user turn behind a 15K-token system prompt. 0 (the default) serves none.
        lm_lr_scale: LR multiplier, in (0, 1], of the language model's parameters (every one
            outside ``vision_tower.`` / ``mm_projector.``, which train at the peak LR): the
            LLaVA-style split between a fresh tower that must learn fast and a trained LM whose
            text skills the stage should keep (``RunConfig.lr_scales``); 1 = one LR for all.
        eval_items: held-out image conversations.
        model_overrides: K3Config fields replaced (tests shrink the LM).
    Raises (construction):
        ValueError: a value of the wrong type or out of range, naming ``extra.<field>``.
    """

    text_ckpt: str | None = None
    tokenizer_dir: str = "data/tokenizer"
    vision: dict[str, Any] = field(default_factory=dict)
    image_items: int = 6000
    image_seed: int = 2
    text_share: float = 0.5
    sft_items: int = 12000
    sft_seed: int = 3
    sft_mixture: dict[str, float] | None = None
    facts_share: float = 0.2
    facts_items: int = 4000
    long_share: float = 0.0
    long_seq_len: int = 8192
    long_items: int = 1000
    lm_lr_scale: float = 1.0
    eval_items: int = 24
    model_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.sft_mixture is not None:
            from openk3.datasets.sft_data import normalise_mixture

            normalise_mixture(self.sft_mixture, f"{OWNER}.sft_mixture")
        super().__post_init__()

    def check(self) -> None:
        check_fraction(self, "text_share")
        check_fraction(self, "facts_share")
        check_fraction(self, "long_share")
        check_at_least(self, "facts_items", 1)
        check_at_least(self, "long_items", 1)
        # harness.long_conversations needs 1,024 tokens of prompt + 1,024 for the item
        check_at_least(self, "long_seq_len", 2048)
        if not 0 < self.lm_lr_scale <= 1:
            raise ValueError(f"{OWNER}.lm_lr_scale={self.lm_lr_scale!r}: must be in (0, 1]")

    @property
    def mixture(self) -> dict[str, float] | None:
        """``sft_mixture`` merged over MIXTURE and normalised to sum 1 (None: MIXTURE itself)."""
        if self.sft_mixture is None:
            return None
        from openk3.datasets.sft_data import normalise_mixture

        return normalise_mixture(self.sft_mixture, f"{OWNER}.sft_mixture")


def settings(run: RunConfig) -> VisionStageSettings:
    """The run's :class:`VisionStageSettings`.

    Raises:
        ValueError: ``run.settings`` is not a VisionStageSettings (another recipe's run).
    """
    if not isinstance(run.settings, VisionStageSettings):
        raise ValueError(
            f"RunConfig.settings={run.settings!r}: the vision stage needs VisionStageSettings"
        )
    return run.settings


def tiny_vision_config(text_hidden_size: int = 128, **changes):
    """The tower of the shipped model: 3 layers, D = 64, 2 heads of 32, MLP 128, 8 x 8 position
    table (112 px images = 8 x 8 patches), patch 14, merge 2 -> 16 tokens per 112 px image;
    ``changes`` replace fields (validated)."""
    from openk3.vision.config import VisionConfig

    vc = VisionConfig(
        vt_num_hidden_layers=3,
        vt_hidden_size=64,
        vt_intermediate_size=128,
        vt_num_attention_heads=2,
        qkv_hidden_size=64,
        init_pos_emb_height=8,
        init_pos_emb_width=8,
        mm_hidden_size=64,
        text_hidden_size=text_hidden_size,
    )
    return vc.replace(**changes) if changes else vc


def vision_model_config(run: RunConfig, text_config=None):
    """The LM config as a ``kimi_k3`` wrapper with the ``vision_config`` of
    :func:`tiny_vision_config` (+ ``extra.vision``).

    The LM is ``text_config`` when given (the text checkpoint's own ``config.json``: the stage
    loads its weights, so its shapes — ``kv_lora_rank``, widths, layer pattern — are the ones a
    text run trained with ``model_overrides`` chose), else the run's preset with the tokenizer's
    ids; ``extra.model_overrides`` apply on top either way."""
    from openk3.tokenizer import load_tokenizer

    x = settings(run)
    tok = load_tokenizer(x.tokenizer_dir)
    cfg = run.model_config() if text_config is None else text_config
    if cfg.wrapper is not None and cfg.wrapper.get("vision_config") is not None:
        return cfg  # already prepared
    cfg = cfg.replace(media_placeholder_token_id=tok.media_pad_id)
    if text_config is None:
        cfg = cfg.replace(
            vocab_size=tok.vocab_size,
            bos_token_id=tok.bos_id,
            eos_token_id=tok.eos_id,
            pad_token_id=tok.pad_id,
        )
    if x.model_overrides:
        cfg = cfg.replace(**x.model_overrides)
    vc = tiny_vision_config(cfg.hidden_size, **dict(x.vision))
    cfg = cfg.as_k3_wrapper()
    cfg.wrapper["vision_config"] = vc.to_dict()
    return cfg


def vision_data(run: RunConfig, split: str):
    """ "train": image conversations mixed with ``text_share`` text rows (SFT conversations, of
    which ``facts_share`` are drill rows and then ``long_share`` long harness-prompt rows);
    "eval": the held-out image conversations in fixed order."""
    from openk3.tokenizer import load_tokenizer
    from openk3.datasets.vision_data import eval_image_items, image_items
    from openk3.train.vision_loader import ImageSFTLoader, image_chat_document

    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: must be 'train' or 'eval'")
    x = settings(run)
    tok = load_tokenizer(x.tokenizer_dir)
    pad = run.model_config().pad_token_id
    items = (
        image_items(x.image_seed, x.image_items)
        if split == "train"
        else eval_image_items(0, x.eval_items)
    )
    docs = [image_chat_document(it.conversation(), tok) for it in items]
    images = ImageSFTLoader(docs, run.seq_len, seed=run.seed, shuffle=split == "train", pad_id=pad)
    if split == "eval" or x.text_share == 0:
        return images
    from openk3.train.data import DocumentStore, PackedLoader
    from openk3.train.mixed_data import MixedLoader
    from openk3.datasets.sft_data import sft_conversations

    store = DocumentStore.from_conversations(
        sft_conversations(x.sft_seed, x.sft_items, mixture=x.mixture), tok
    )
    text = PackedLoader(store, run.seq_len, 1, seed=run.seed + 1, split_documents=False, pad_id=pad)
    if x.facts_share > 0:
        from openk3.datasets.column_facts import column_facts_store

        facts = column_facts_store(x.sft_seed + 400, x.facts_items, tok)
        drills = PackedLoader(facts, run.seq_len, 1, seed=run.seed + 2, pad_id=pad)
        text = MixedLoader(text, drills, x.facts_share, seed=run.seed + 6)
    if x.long_share > 0:
        from openk3.recipes.default_model import long_rows

        long = long_rows(
            x.sft_seed + 100,
            x.long_items,
            x.long_seq_len,
            tok,
            mixture=x.mixture,
            loader_seed=run.seed + 3,
            pad_id=pad,
        )
        text = MixedLoader(text, long, x.long_share, seed=run.seed + 7)
    return MixedLoader(images, text, x.text_share, seed=run.seed)


def prepare_vision(run: RunConfig, out_dir: str, resume: bool) -> RunConfig:
    """The vision model config and ``init_from = extra.text_ckpt`` (text weights; fresh tower).

    Raises:
        ValueError: no ``extra.text_ckpt``, or see :func:`settings`.
    """
    x = settings(run)
    ckpt = x.text_ckpt
    if not ckpt:
        raise ValueError(
            "extra.text_ckpt: required (a text SFT checkpoint, e.g. runs/default-model/checkpoints/step-0004000)"
        )
    if not isinstance(ckpt, str) or not os.path.isfile(os.path.join(ckpt, "config.json")):
        raise ValueError(
            f"extra.text_ckpt={ckpt!r}: not a checkpoint directory (no config.json); give a text SFT "
            f"checkpoint such as runs/default-model/checkpoints/step-0004000"
        )
    print(
        f"[default-model-vision] vision stage from {x.text_ckpt} with {run.qat or 'no'} QAT",
        file=sys.stderr,
    )
    from openk3.config import K3Config
    from openk3.tokenizer import load_tokenizer

    text_config = K3Config.from_pretrained(ckpt)
    vocab = load_tokenizer(x.tokenizer_dir).vocab_size
    if text_config.vocab_size != vocab:
        raise ValueError(
            f"extra.text_ckpt={ckpt!r}: vocab_size {text_config.vocab_size} differs from the tokenizer at "
            f"extra.tokenizer_dir={x.tokenizer_dir!r} ({vocab})"
        )
    model = vision_model_config(run, text_config)
    changes: dict[str, Any] = {}
    if x.lm_lr_scale != 1:
        from openk3.multimodal import VISION_PREFIXES

        changes["lr_scales"] = {**{p: 1.0 for p in VISION_PREFIXES}, "": x.lm_lr_scale}
    return run.replace(model=model, init_from=str(x.text_ckpt), prepare=None, **changes)


def default_model_vision() -> RunConfig:
    """openk3-tiny + a tiny MoonViT trained on synthetic image questions."""
    return RunConfig(
        name="default-model-vision",
        model="openk3-tiny",
        data=vision_data,
        total_steps=1200,
        seq_len=1024,
        warmup_steps=20,
        lr=2e-3,
        min_lr_ratio=0.1,
        qat="mxfp4",
        eval_every=100,
        eval_batches=2,
        ckpt_every=100,
        keep_checkpoints=2,
        seed=0,
        prepare=prepare_vision,
        settings=VisionStageSettings(),
    )


def default_model_long() -> RunConfig:
    """The long-prompt stage of the shipped ``openk3-tiny``, after the vision stage.

    This recipe is the vision stage's, continued from the vision stage's last checkpoint
    (``extra.text_ckpt``; the tower and projector load too). The same image and text rows are
    used, and ``long_share`` of the text rows are ``long_seq_len``-token SFT conversations behind a
    synthetic agent-harness prompt (:func:`openk3.recipes.default_model.long_rows`).

    Why a stage of its own: neither earlier stage saw a row longer than 1,024 tokens, so behind a
    15K-token system prompt the model loses the last user turn. A measured A/B on 300 text steps
    showed that the long rows move those suites and the extra steps alone do not (MODEL_CARD.md).
    The stage runs 400 steps at peak LR 1e-3, below the vision stage's 2e-3 because every weight
    is already trained; 25 % of its text rows are 8,192-token rows. Each long row costs about 23 s
    of step time on one core (median, 2-core AMD EPYC), against about 1 s for a 1,024-token row.
    """
    return default_model_vision().replace(
        name="default-model-long",
        total_steps=400,
        lr=1e-3,
        keep_checkpoints=4,
        settings=VisionStageSettings(long_share=0.25, long_seq_len=8192),
    )


__all__ = [
    "default_model_long",
    "VisionStageSettings",
    "settings",
    "tiny_vision_config",
    "vision_model_config",
    "vision_data",
    "prepare_vision",
    "default_model_vision",
]
