"""The ``default-model`` recipe: the shipped ``openk3-tiny`` trained end to end.

Stages (``openk3 train --recipe default-model --out runs/default-model``)::

    1. corpus      build_corpus(default_sources())          -> extra.corpus_dir   (skipped if built)
    2. tokenizer   train_tokenizer(corpus, 8192)            -> extra.tokenizer_dir (skipped if trained
                   from the same inputs: tokenizer_training.json)
    3. pretrain    openk3-tiny on the corpus, next-token     -> OUT/pretrain/checkpoints/step-*
    3b. mid-train  from the pretrained weights, the mixture with column-fact drill documents
                   (``mid_steps``; 0 skips it)               -> OUT/mid/checkpoints/step-*
    4. SFT + QAT   init_from the pretrain checkpoint, MXFP4 QAT of the routed experts (as K3),
                   the SFT mixture of :mod:`openk3.datasets.sft_data`  -> OUT/checkpoints/step-*

Stages 1-3b run inside :attr:`RunConfig.prepare <openk3.recipes.RunConfig>`; stage 4 is the
run config :func:`~openk3.train.trainer.train` executes. Resumable at any point: a finished corpus
or tokenizer is reused; pretraining and mid-training always continue from their latest checkpoint (a ``DONE``
file marks each finished); SFT continues with ``--resume``. Every size is a field of
:class:`DefaultModelSettings` (``RunConfig.settings``), overridable with ``--set
extra='{"pretrain_steps": 3, ...}'`` or ``--set pretrain_steps=3``.

SFT data knobs: ``sft_mixture`` (None = :data:`openk3.datasets.sft_data.MIXTURE`; a dict
task -> share merged over it and renormalised to sum 1, see
:func:`~openk3.datasets.sft_data.normalise_mixture`) and ``sft_replay`` (in [0, 1), default 0 =
plain SFT, bit-identical data): the expected share of SFT training rows (micro-batches; one row
each at ``batch_size`` 1) that are pretraining-corpus rows instead, at the SFT run's ``seq_len``,
interleaved by :class:`~openk3.train.mixed_data.MixedLoader` (seed ``seed``) to keep the language
model (the shipped model's SFT without replay raised the corpus val loss from 5.12 to 12.09).
The held-out eval data never changes.

Seeds: model init ``seed`` = 0 (pretraining and the SFT run's data order), corpus / tokenizer are
deterministic (hash-ordered), SFT data ``sft_seed`` = 1, held-out eval sets
``sft_data.EVAL_SEED_OFFSET`` + 0 and disjoint by prompt hash.

Size and time. ``openk3-tiny`` has 4,618,312 parameters in total and 2,365,512 active per token
(``openk3.params.count_parameters``; 2.1 M of each are the two 8192 x 128 vocabulary matrices).
The step counts are :class:`DefaultModelSettings`' defaults; the measured wall time of a whole run
(and why the machine should be otherwise idle: two OpenMP threads on two cores slow 10-25x when
anything else runs) is in the README's "The ``default-model`` recipe" section. The shipped model is
this run's last checkpoint, written by ``openk3 export`` (MODEL_CARD.md).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from openk3.recipes.settings import OWNER, RecipeSettings, check_at_least, check_fraction
from openk3.train.optim import Schedule
from openk3.train.run_config import RunConfig


@dataclass(frozen=True)
class DefaultModelSettings(RecipeSettings):
    """The ``default-model`` recipe's knobs (``--set extra='{"pretrain_steps": 3}'`` or
    ``--set pretrain_steps=3``); defaults are the shipped model's run.

    Attributes:
        corpus_dir: built by stage 1 unless it holds a manifest already.
        corpus_sources: None: :func:`~openk3.datasets.corpus_sources.default_sources`; else
            ``["NAME:LICENCE:PATH", ...]`` directories.
        tokenizer_dir: trained by stage 2 unless it holds ``tokenizer.json`` (then reused, and
            checked against the inputs its ``tokenizer_training.json`` records).
        vocab_size, tokenizer_max_mb (None: the whole corpus), tokenizer_split_digits (numbers
            pre-tokenized into single digits), tokenizer_sft_items (synthetic conversations,
            seed 77, added to the tokenizer's corpus): the BPE.
        cache_dir: the tokenised corpus store.
        model_overrides: K3Config fields replaced (tests shrink the model).
        pretrain_steps (>= 0; 0 skips pretraining), pretrain_seq_len, pretrain_lr,
            pretrain_eval_every, pretrain_schedule (``"wsd"``: the peak LR until the decay, or
            ``"cosine"``: the shipped weights' run), pretrain_decay_fraction (WSD's share of
            pretraining steps in the final decay, in [0, 1]): stage 3.
        pretrain_sft_share, pretrain_induction_share (each in [0, 1), summing to < 1; the rest
            is corpus), induction_items (>= 1, seed ``sft_seed`` + 200): pretraining's mixture.
        pretrain_copy_narrow_steps (>= 0), pretrain_copy_narrow_ids (>= 2),
            pretrain_copy_narrow_span ([lo, hi]; seed ``sft_seed`` + 301): the copy curriculum's
            first stage, spans over the first ``pretrain_copy_narrow_ids`` ordinary ids only;
            pretrain_copy_steps (>= 0), pretrain_copy_span ([lo, hi], 1 <= lo <= hi),
            pretrain_copy_items (>= 1, per stage; seed ``sft_seed`` + 300): its second stage,
            spans over every ordinary id. Both stages come first, then the mixture, all within
            ``pretrain_steps``.
        pretrain_copy_share (in [0, 1); seed ``sft_seed`` + 302): share of the mixture's rows
            that stay span-copy documents over every ordinary id (``pretrain_copy_span``), so
            the corpus does not wear the copy circuit away after the curriculum.
        sft_seed, sft_items (>= 1), sft_eval_items (per eval suite): the SFT data.
        sft_mixture: None (:data:`openk3.datasets.sft_data.MIXTURE`) or ``{task: share}`` merged
            over it (:attr:`mixture` is the normalised result).
        sft_replay: share of SFT train rows that are corpus rows, in [0, 1).
        long_share (in [0, 1)), long_seq_len (>= 2,048: 1,024 tokens of harness prompt + 1,024
            for the item), long_items (>= 1, seed ``sft_seed`` + 100): long harness-prompt SFT rows.
        mid_steps (>= 0; 0 skips the stage), mid_lr, mid_facts_share (in [0, 1)),
            mid_facts_items (>= 1, seed ``sft_seed`` + 400): stage 3b, mid-training from the
            pretrained weights on the pretraining mixture with ``mid_facts_share`` of the rows
            column-fact drill documents (:mod:`openk3.datasets.column_facts`).
        sft_facts_share (in [0, 1)): share of SFT train rows that are those drill rows (next-token
            loss on every token), interleaved with seed ``seed`` + 6.
        sft_copy_share (in [0, 1); seed ``sft_seed`` + 303): share of SFT train rows that are
            random-span copy documents over every ordinary id (``pretrain_copy_span``, every
            token a target), interleaved with seed ``seed`` + 7: SFT at its peak LR otherwise
            wears away the copy circuit pretraining built (the induction probe's second copy of
            a random span: ~1.2 nats after pretraining, no better than the first after SFT).
        sft_tool_reasoning: the reasoning of the SFT rows' tool-call turns
            (:data:`~openk3.datasets.sft_tasks.TOOL_REASONING`): ``"restate"`` (the shipped
            model's: the request restated, then the arguments JSON), ``"args"`` (each call's
            arguments JSON only, in the call's tokens) or ``"name"`` (the tool name only). Text
            only: the same conversations are drawn in every style. The README's "The
            ``default-model`` recipe" section has the continuation experiment that compares them.
    Raises (construction):
        ValueError: a value of the wrong type or out of range, naming ``extra.<field>``.
    """

    corpus_dir: str = "data/corpus"
    corpus_sources: list[str] | None = None
    tokenizer_dir: str = "data/tokenizer"
    vocab_size: int = 8192
    tokenizer_max_mb: float | None = None
    cache_dir: str = "data/cache"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    pretrain_steps: int = 3200
    pretrain_seq_len: int = 1024
    pretrain_lr: float = 1e-2
    pretrain_eval_every: int = 400
    pretrain_schedule: Schedule = "wsd"
    pretrain_decay_fraction: float = 0.2
    sft_seed: int = 1
    sft_items: int = 20000
    sft_eval_items: int = 16
    sft_mixture: dict[str, float] | None = None
    sft_replay: float = 0.0
    tokenizer_split_digits: bool = True
    tokenizer_sft_items: int = 12000
    pretrain_sft_share: float = 0.0
    pretrain_induction_share: float = 0.3
    induction_items: int = 20000
    pretrain_copy_narrow_steps: int = 1800
    pretrain_copy_narrow_ids: int = 128
    pretrain_copy_narrow_span: tuple[int, int] = (8, 24)
    pretrain_copy_steps: int = 400
    pretrain_copy_span: tuple[int, int] = (4, 20)
    pretrain_copy_items: int = 100000
    pretrain_copy_share: float = 0.3
    long_share: float = 0.0
    long_seq_len: int = 8192
    long_items: int = 1000
    mid_steps: int = 1500
    mid_lr: float = 3e-3
    mid_facts_share: float = 0.6
    mid_facts_items: int = 4000
    sft_facts_share: float = 0.2
    sft_copy_share: float = 0.0
    sft_tool_reasoning: Literal["restate", "args", "name"] = "restate"

    def __post_init__(self) -> None:
        if self.sft_mixture is not None:  # its own messages name the task and share
            from openk3.datasets.sft_data import normalise_mixture

            normalise_mixture(self.sft_mixture, f"{OWNER}.sft_mixture")
        super().__post_init__()

    def check(self) -> None:
        for name in (
            "sft_replay",
            "pretrain_sft_share",
            "pretrain_induction_share",
            "pretrain_copy_share",
            "long_share",
            "mid_facts_share",
            "sft_facts_share",
            "sft_copy_share",
        ):
            check_fraction(self, name)
        if self.pretrain_sft_share + self.pretrain_induction_share >= 1:
            raise ValueError(
                f"{OWNER}.pretrain_sft_share + {OWNER}.pretrain_induction_share = "
                f"{self.pretrain_sft_share + self.pretrain_induction_share!r}: must be < 1 (the rest is "
                f"corpus)"
            )
        if not 0.0 <= self.pretrain_decay_fraction <= 1.0:
            raise ValueError(
                f"{OWNER}.pretrain_decay_fraction={self.pretrain_decay_fraction!r}: must be a number in "
                f"[0, 1]"
            )
        for name in (
            "pretrain_steps",
            "pretrain_copy_steps",
            "pretrain_copy_narrow_steps",
            "mid_steps",
        ):
            check_at_least(self, name, 0)
        check_at_least(self, "pretrain_copy_narrow_ids", 2)
        # harness.long_conversations needs 1,024 tokens of prompt + 1,024 for the item
        check_at_least(self, "long_seq_len", 2048)
        for name in (
            "long_items",
            "sft_items",
            "induction_items",
            "pretrain_copy_items",
            "mid_facts_items",
        ):
            check_at_least(self, name, 1)
        for name in ("pretrain_copy_span", "pretrain_copy_narrow_span"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(
                    f"{OWNER}.{name}={getattr(self, name)!r}: must be [lo, hi] integers with 1 <= lo <= hi"
                )

    @property
    def mixture(self) -> dict[str, float] | None:
        """``sft_mixture`` merged over MIXTURE and normalised to sum 1 (None: MIXTURE itself)."""
        if self.sft_mixture is None:
            return None
        from openk3.datasets.sft_data import normalise_mixture

        return normalise_mixture(self.sft_mixture, f"{OWNER}.sft_mixture")


def settings(run: RunConfig) -> DefaultModelSettings:
    """The run's :class:`DefaultModelSettings` (validated when they were made).

    Raises:
        ValueError: ``run.settings`` is not a DefaultModelSettings (another recipe's run).
    """
    if not isinstance(run.settings, DefaultModelSettings):
        raise ValueError(
            f"RunConfig.settings={run.settings!r}: the default-model stages need DefaultModelSettings"
        )
    return run.settings


def _tokenizer(run: RunConfig):
    from openk3.tokenizer import load_tokenizer

    return load_tokenizer(settings(run).tokenizer_dir)


def corpus_data(run: RunConfig, split: str):
    """Pretraining data: the corpus ``train`` split (shuffled, documents cut at row ends) or its
    ``val`` split (fixed order) for "eval", tokenised with the recipe's tokenizer (cached)."""
    from openk3.train.data import DocumentStore, PackedLoader

    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: must be 'train' or 'eval'")
    x = settings(run)
    tok = _tokenizer(run)
    store = DocumentStore.from_corpus(
        x.corpus_dir, tok, "train" if split == "train" else "val", cache_dir=x.cache_dir
    )
    return PackedLoader(
        store,
        run.seq_len,
        run.batch_size,
        seed=run.seed,
        shuffle=split == "train",
        pad_id=run.model_config().pad_token_id,
    )


def _sft_loader(run: RunConfig, x: DefaultModelSettings, tok, seq_len: int, seed_offset: int = 0):
    from openk3.train.data import DocumentStore, PackedLoader
    from openk3.datasets.sft_data import sft_conversations

    convs = sft_conversations(
        x.sft_seed + seed_offset,
        x.sft_items,
        mixture=x.mixture,
        tool_reasoning=x.sft_tool_reasoning,
    )
    return PackedLoader(
        DocumentStore.from_conversations(convs, tok),
        seq_len,
        run.batch_size,
        seed=run.seed,
        split_documents=False,
        pad_id=run.model_config().pad_token_id,
    )


def long_rows(seed: int, items: int, seq_len: int, tok, *, mixture, loader_seed: int, pad_id: int):
    """Long harness-prompt rows: ``items`` SFT conversations of ``mixture`` behind synthetic
    agent-harness prompts (:func:`openk3.datasets.harness.long_conversations`, seed ``seed``), one
    or two per row of ``seq_len`` tokens (batch 1, assistant-only loss). Shared by the text SFT
    (``long_share``) and the vision stage's text rows.

    Returns:
        a PackedLoader whose batches hold ``input_ids`` / ``labels`` of shape [1, seq_len]
        (int64 token ids; labels -100 outside assistant turns and on padding ``pad_id``),
        shuffled with ``loader_seed``.
    Raises:
        ValueError: ``seq_len`` below 2,048 (no room for a prompt and an item).
    """
    from openk3.train.data import DocumentStore, PackedLoader
    from openk3.datasets.harness import long_conversations

    convs = long_conversations(seed, items, seq_len, tok, mixture=mixture)
    return PackedLoader(
        DocumentStore.from_conversations(convs, tok),
        seq_len,
        1,
        seed=loader_seed,
        split_documents=False,
        pad_id=pad_id,
    )


def long_data(run: RunConfig, x: DefaultModelSettings, tok):
    """The text SFT's long rows: :func:`long_rows` of ``long_items`` conversations (seed
    ``sft_seed`` + 100) at ``long_seq_len`` tokens."""
    return long_rows(
        x.sft_seed + 100,
        x.long_items,
        x.long_seq_len,
        tok,
        mixture=x.mixture,
        loader_seed=run.seed,
        pad_id=run.model_config().pad_token_id,
    )


def sft_data(run: RunConfig, split: str):
    """SFT data: ``sft_items`` conversations of the mixture (``sft_mixture``, seed ``sft_seed``) for
    "train", with ``long_share`` of the rows long harness-prompt rows (:func:`long_data`) and
    ``sft_replay`` of them corpus rows (:func:`corpus_data` at this run's ``seq_len``) and
    ``sft_facts_share`` column-fact drill rows when > 0; the held-out eval suites' reference conversations for "eval". Whole conversations per row
    (``split_documents=False``), assistant-only loss."""
    from openk3.train.data import DocumentStore, PackedLoader
    from openk3.train.mixed_data import MixedLoader
    from openk3.datasets.sft_data import EVAL_SUITES, eval_items

    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: must be 'train' or 'eval'")
    x = settings(run)
    tok = _tokenizer(run)
    if split == "eval":
        convs = [
            it.conversation() for s in EVAL_SUITES for it in eval_items(s, 0, x.sft_eval_items)
        ]
        return PackedLoader(
            DocumentStore.from_conversations(convs, tok),
            run.seq_len,
            run.batch_size,
            seed=run.seed,
            shuffle=False,
            split_documents=False,
            pad_id=run.model_config().pad_token_id,
        )
    data = _sft_loader(run, x, tok, run.seq_len)
    if x.long_share > 0:
        data = MixedLoader(data, long_data(run, x, tok), x.long_share, seed=run.seed + 1)
    if x.sft_replay > 0:
        data = MixedLoader(data, corpus_data(run, "train"), x.sft_replay, seed=run.seed)
    if x.sft_facts_share > 0:  # SFT's peak LR overwrites the facts mid-training taught otherwise
        data = MixedLoader(data, _facts_loader(run, x, tok), x.sft_facts_share, seed=run.seed + 6)
    if x.sft_copy_share > 0:
        from openk3.datasets.induction import span_store
        from openk3.train.data import PackedLoader

        spans = span_store(
            x.sft_seed + 303, x.pretrain_copy_items, tok, tuple(x.pretrain_copy_span)
        )
        pad = run.model_config().pad_token_id
        copies = PackedLoader(spans, run.seq_len, run.batch_size, seed=run.seed, pad_id=pad)
        data = MixedLoader(data, copies, x.sft_copy_share, seed=run.seed + 7)
    return data


def _facts_loader(run: RunConfig, x: DefaultModelSettings, tok):
    """Column-fact drill rows (:func:`~openk3.datasets.column_facts.column_facts_store`, seed
    ``sft_seed`` + 400, ``mid_facts_items`` documents) at the run's ``seq_len``."""
    from openk3.train.data import PackedLoader
    from openk3.datasets.column_facts import column_facts_store

    facts = column_facts_store(x.sft_seed + 400, x.mid_facts_items, tok)
    pad = run.model_config().pad_token_id
    return PackedLoader(facts, run.seq_len, run.batch_size, seed=run.seed, pad_id=pad)


def pretrain_mixture(run: RunConfig):
    """Pretraining's train mixture (after its copy curriculum): the corpus train split with
    ``pretrain_sft_share`` of the rows SFT conversations (data seed ``sft_seed`` + 50),
    ``pretrain_induction_share`` induction documents (:mod:`openk3.datasets.induction`, seed
    ``sft_seed`` + 200) and ``pretrain_copy_share`` random-span copy documents (seed ``sft_seed``
    + 302), every token of the synthetic documents a target."""
    from openk3.train.data import PackedLoader
    from openk3.datasets.induction import induction_store, span_store
    from openk3.train.mixed_data import MixedLoader

    x = settings(run)
    data = corpus_data(run, "train")
    p_sft = x.pretrain_sft_share
    p_ind = x.pretrain_induction_share
    tok = _tokenizer(run)
    if p_sft > 0:
        data = MixedLoader(
            data, _sft_loader(run, x, tok, run.seq_len, 50), p_sft / (1 - p_ind), seed=run.seed + 2
        )
    if p_ind > 0:
        ind = PackedLoader(
            induction_store(x.sft_seed + 200, x.induction_items, tok),
            run.seq_len,
            run.batch_size,
            seed=run.seed,
            pad_id=run.model_config().pad_token_id,
        )
        data = MixedLoader(data, ind, p_ind, seed=run.seed + 3)
    pad = run.model_config().pad_token_id
    if x.pretrain_copy_share > 0:  # after the curriculum too: the corpus alone lets copying fade
        kept = span_store(x.sft_seed + 302, x.pretrain_copy_items, tok, tuple(x.pretrain_copy_span))
        data = MixedLoader(
            data,
            PackedLoader(kept, run.seq_len, run.batch_size, seed=run.seed, pad_id=pad),
            x.pretrain_copy_share,
            seed=run.seed + 4,
        )
    return data


def mid_data(run: RunConfig, split: str):
    """Mid-training data (stage 3b): :func:`pretrain_mixture` with ``mid_facts_share`` of the rows
    column-fact drill documents (:func:`~openk3.datasets.column_facts.column_facts_store`, seed
    ``sft_seed`` + 400, interleaving seed ``seed`` + 5); the corpus val split for "eval"."""
    from openk3.train.mixed_data import MixedLoader

    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: must be 'train' or 'eval'")
    if split == "eval":
        return corpus_data(run, split)
    x = settings(run)
    return MixedLoader(
        pretrain_mixture(run),
        _facts_loader(run, x, _tokenizer(run)),
        x.mid_facts_share,
        seed=run.seed + 5,
    )


def pretrain_data(run: RunConfig, split: str):
    """Pretraining data: the corpus (:func:`corpus_data`) with ``pretrain_sft_share`` of the train
    rows SFT conversations (another data seed, ``sft_seed`` + 50) and ``pretrain_induction_share``
    induction documents (:mod:`openk3.datasets.induction`, seed ``sft_seed`` + 200, every token a
    target), so the skills' formats and the copying they need are trained from the first steps.
    Before the mixture, a copy curriculum of random-span documents only
    (:func:`~openk3.datasets.induction.span_store`), in which copying is the only way to lower the
    loss: ``pretrain_copy_narrow_steps`` batches of spans over the first
    ``pretrain_copy_narrow_ids`` ordinary ids (seed ``sft_seed`` + 301; where the circuit forms),
    then ``pretrain_copy_steps`` batches over every ordinary id (seed ``sft_seed`` + 300; where it
    carries over to the whole vocabulary)."""
    from openk3.train.data import PackedLoader
    from openk3.datasets.induction import span_store
    from openk3.train.mixed_data import CurriculumLoader

    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: must be 'train' or 'eval'")
    x = settings(run)
    if split == "eval":
        return corpus_data(run, split)
    data = pretrain_mixture(run)
    tok = _tokenizer(run)
    pad = run.model_config().pad_token_id
    if x.pretrain_copy_steps > 0:
        spans = span_store(
            x.sft_seed + 300, x.pretrain_copy_items, tok, tuple(x.pretrain_copy_span)
        )
        data = CurriculumLoader(
            PackedLoader(spans, run.seq_len, run.batch_size, seed=run.seed, pad_id=pad),
            data,
            x.pretrain_copy_steps,
        )
    if x.pretrain_copy_narrow_steps > 0:
        spans = span_store(
            x.sft_seed + 301,
            x.pretrain_copy_items,
            tok,
            tuple(x.pretrain_copy_narrow_span),
            ids=x.pretrain_copy_narrow_ids,
        )
        data = CurriculumLoader(
            PackedLoader(spans, run.seq_len, run.batch_size, seed=run.seed, pad_id=pad),
            data,
            x.pretrain_copy_narrow_steps,
        )
    return data


def model_for_tokenizer(run: RunConfig):
    """The run's model config with the tokenizer's vocabulary size and special ids (a small corpus
    can give fewer BPE tokens than asked) and ``model_overrides`` applied."""
    x = settings(run)
    tok = _tokenizer(run)
    cfg = run.model_config()
    cfg = cfg.replace(
        vocab_size=tok.vocab_size,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
        media_placeholder_token_id=tok.media_pad_id,
    )
    return cfg.replace(**x.model_overrides) if x.model_overrides else cfg


def tokenizer_texts(n: int, seed: int = 77) -> list[str]:
    """The text of ``n`` synthetic SFT conversations (seed ``seed``, not an SFT data seed) as the
    chat format renders them, markup tokens removed: added to the corpus the BPE is trained on, so
    the chat format's words, tool schemas and the pools' name pieces get their own ids (a third
    fewer tokens per conversation than a corpus-only BPE)."""
    import re

    from openk3.chat_format import render_training
    from openk3.datasets.sft_data import sft_conversations
    from openk3.train.tokenizer_train import train_tokenizer

    bootstrap = train_tokenizer(["bootstrap"], 512)  # bytes only: rendering needs some tokenizer
    special = re.compile(r"<\|[a-z_0-9]+\|>|\[[A-Z_]+\]")
    return [
        special.sub("\n", render_training(c, bootstrap).text) for c in sft_conversations(seed, n)
    ]


def tokenizer_source(x: DefaultModelSettings, corpus: Path) -> Any:
    """What stage 2 trains the BPE on: the corpus directory, or (``tokenizer_sft_items`` > 0) its
    train documents followed by :func:`tokenizer_texts` (rendering those takes about a minute at
    the default 12,000)."""
    if not x.tokenizer_sft_items:
        return corpus
    from openk3.datasets.corpus import read_documents

    return [d["text"] for d in read_documents(corpus, "train")] + tokenizer_texts(
        x.tokenizer_sft_items
    )


def prepare_default_model(run: RunConfig, out_dir: str, resume: bool) -> RunConfig:
    """Stages 1-3 (module docstring), then the SFT run config for stage 4.

    Raises:
        ValueError: a bad ``extra`` setting, a corpus source spec not ``NAME:LICENCE:PATH``, a
            ``tokenizer_dir`` whose ``tokenizer_training.json`` records other inputs than this
            run's (the differing field named), or a stage failure (from the corpus builder,
            tokenizer trainer or trainer).
    """

    x = settings(run)
    log = lambda line: print(f"[default-model] {line}", file=sys.stderr)
    corpus = Path(x.corpus_dir)
    if not (corpus / "manifest.json").is_file():
        from openk3.datasets.corpus import build_corpus
        from openk3.datasets.corpus_sources import default_sources, directory_source

        if x.corpus_sources is None:
            sources = default_sources()
        else:
            sources = []
            for spec in x.corpus_sources:
                name, _, rest = str(spec).partition(":")
                licence, _, path = rest.partition(":")
                if not (name and licence and path):
                    raise ValueError(
                        f"extra.corpus_sources: expected NAME:LICENCE:PATH, got {spec!r}"
                    )
                sources.append(directory_source(name, licence, path))
        log(f"stage 1/4: building the corpus into {corpus}")
        build_corpus(sources, corpus, overwrite=corpus.exists(), log=log)
    tok_dir = Path(x.tokenizer_dir)
    record_path = tok_dir / "tokenizer_training.json"
    max_mb = x.tokenizer_max_mb
    bpe_args = {
        "max_bytes": None if max_mb is None else int(max_mb * 2**20),
        "split_digits": x.tokenizer_split_digits,
    }
    if not (tok_dir / "tokenizer.json").is_file():
        from openk3.train.tokenizer_train import train_tokenizer

        log(f"stage 2/4: training a {x.vocab_size}-id BPE into {tok_dir}")
        train_tokenizer(tokenizer_source(x, corpus), x.vocab_size, tok_dir, **bpe_args)
    elif record_path.is_file():
        # A tokenizer directory outlives the code that trained it (every later run on the
        # machine reuses it): a run whose synthetic conversations changed would otherwise train
        # on ids the current recipe no longer reproduces.
        from openk3.train.tokenizer_train import training_inputs

        recorded = json.loads(record_path.read_text(encoding="utf-8"))
        want = training_inputs(tokenizer_source(x, corpus), x.vocab_size, **bpe_args)
        # "corpus" is where the text was read (a path): the manifest's or the texts' sha256
        # identifies what it was, so a moved corpus directory still matches.
        changed = [k for k in want if k != "corpus" and want[k] != recorded.get(k)]
        if changed:
            k = changed[0]
            raise ValueError(
                f"extra.tokenizer_dir={str(tok_dir)!r}: its BPE was trained from other inputs than "
                f"this recipe's ({k}: recorded {recorded.get(k)!r}, now {want[k]!r}); delete the "
                f"directory to retrain it, or delete {record_path} to use it unchecked"
            )
        log(f"stage 2/4: reusing {tok_dir} (trained from these inputs: {record_path.name})")
    else:
        log(f"stage 2/4: reusing {tok_dir} (no {record_path.name}: its inputs are unchecked)")
    cfg = model_for_tokenizer(run)
    if x.pretrain_steps == 0:
        log("stage 3/4: skipped (pretrain_steps 0); stage 4/4 starts from the initialisation")
        return run.replace(model=cfg, prepare=None)
    pre_dir = os.path.join(out_dir, "pretrain")
    pre = run.replace(
        name=f"{run.name}-pretrain",
        model=cfg,
        data=pretrain_data,
        total_steps=x.pretrain_steps,
        seq_len=x.pretrain_seq_len,
        lr=x.pretrain_lr,
        qat=None,
        init_from=None,
        prepare=None,
        eval_every=x.pretrain_eval_every,
        warmup_steps=None,
        schedule=x.pretrain_schedule,
        decay_fraction=x.pretrain_decay_fraction,
    )
    ckpt = _run_stage(
        pre,
        pre_dir,
        "pretraining",
        f"stage 3/4: pretraining {pre.total_steps} steps into {pre_dir}",
        log,
    )
    if x.mid_steps > 0:
        ckpt = _mid_train(run, cfg, x, out_dir, ckpt, log)
    log(f"stage 4/4: SFT with {run.qat or 'no'} QAT from {ckpt}")
    return run.replace(model=cfg, init_from=ckpt, prepare=None)


def _run_stage(stage: RunConfig, stage_dir: str, what: str, banner: str, log) -> str:
    """Train ``stage`` into ``stage_dir`` unless its ``DONE`` file exists (resuming a partial run),
    write ``DONE`` with the last checkpoint's path, and return that path.

    Raises:
        ValueError: the stage stopped before ``stage.total_steps`` (a signal): rerun with --resume.
    """
    from openk3.train.trainer import train

    done = Path(stage_dir) / "DONE"
    if not done.is_file():
        log(banner)
        result = train(stage, stage_dir, resume=True, progress=True)
        if result.signal is not None or result.step < stage.total_steps:
            raise ValueError(
                f"{what} stopped at step {result.step}/{stage.total_steps}; rerun with --resume"
            )
        done.write_text(str(result.checkpoint) + "\n")
    return done.read_text().strip()


def _mid_train(run: RunConfig, cfg, x: DefaultModelSettings, out_dir: str, ckpt: str, log) -> str:
    """Stage 3b: ``mid_steps`` steps from the pretraining checkpoint ``ckpt`` on :func:`mid_data`
    (fresh optimizer, peak LR ``mid_lr``, WSD with pretraining's decay fraction) into
    OUT/mid; a ``DONE`` file marks it finished. Returns its last checkpoint.

    Raises:
        ValueError: the stage stopped before ``mid_steps`` (a signal): rerun with --resume.
    """
    mid_dir = os.path.join(out_dir, "mid")
    mid = run.replace(
        name=f"{run.name}-mid",
        model=cfg,
        data=mid_data,
        total_steps=x.mid_steps,
        seq_len=x.pretrain_seq_len,
        lr=x.mid_lr,
        qat=None,
        init_from=ckpt,
        prepare=None,
        eval_every=x.pretrain_eval_every,
        warmup_steps=None,
        schedule="wsd",
        decay_fraction=x.pretrain_decay_fraction,
    )
    banner = f"stage 3b/4: mid-training {mid.total_steps} steps from {ckpt} into {mid_dir}"
    return _run_stage(mid, mid_dir, "mid-training", banner, log)


def default_model() -> RunConfig:
    """openk3-tiny end to end: corpus -> BPE -> pretraining -> SFT with MXFP4 QAT."""
    return RunConfig(
        name="default-model",
        model="openk3-tiny",
        data=sft_data,
        total_steps=4000,
        seq_len=1024,
        warmup_steps=None,
        lr=5e-3,
        min_lr_ratio=0.1,
        qat="mxfp4",
        eval_every=100,
        eval_batches=4,
        ckpt_every=100,
        keep_checkpoints=2,
        seed=0,
        prepare=prepare_default_model,
        settings=DefaultModelSettings(),
    )


__all__ = [
    "DefaultModelSettings",
    "settings",
    "corpus_data",
    "sft_data",
    "long_rows",
    "long_data",
    "pretrain_mixture",
    "pretrain_data",
    "mid_data",
    "model_for_tokenizer",
    "prepare_default_model",
    "default_model",
]
