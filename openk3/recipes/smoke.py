"""The ``smoke`` recipe: ``k3-test-tiny`` (every K3 branch) on a synthetic byte-level corpus
(:func:`synthetic_document`, packed by :class:`~openk3.train.data.PackedLoader`); its data is
generated, not read, so it runs on any machine and in CI.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from openk3.recipes.settings import RecipeSettings, check_at_least
from openk3.train.run_config import RunConfig


@dataclass(frozen=True)
class SmokeSettings(RecipeSettings):
    """Settings of the ``smoke`` recipe.

    Attributes:
        num_docs: synthetic training documents (>= 1); the held-out set is always 200.
    """

    num_docs: int = 4000

    def check(self) -> None:
        check_at_least(self, "num_docs", 1)


# ----------------------------------------------------------------------------- synthetic text
_ADJ = ("small", "red", "old", "quiet", "bright", "heavy", "green", "happy")
_NOUN = (
    "cat",
    "dog",
    "river",
    "teacher",
    "garden",
    "machine",
    "bird",
    "city",
    "window",
    "farmer",
    "ship",
    "tree",
)
_VERB = (
    "sees",
    "finds",
    "likes",
    "follows",
    "paints",
    "carries",
    "visits",
    "builds",
    "hears",
    "keeps",
)
_PLACE = (
    "near the hill",
    "in the morning",
    "by the sea",
    "at night",
    "under the bridge",
    "after the rain",
)


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
    return (
        math.log(len(_ADJ))
        + 2 * math.log(len(_NOUN))
        + math.log(len(_VERB))
        + math.log(2)
        + 0.5 * math.log(len(_PLACE))
    )


def synthetic_store(seed: int, num_docs: int, bos: int, eos: int):
    """A :class:`~openk3.train.data.DocumentStore` of ``num_docs`` synthetic documents as
    byte-level tokens: ``bos``, the UTF-8 bytes (0-255), ``eos``; every next token is a target."""
    from openk3.train.data import DocumentStore, document_from_ids

    return DocumentStore.from_documents(
        document_from_ids([bos, *synthetic_document(seed, i).encode("utf-8"), eos])
        for i in range(num_docs)
    )


def synthetic_data(run: RunConfig, split: str):
    """Data factory over :func:`synthetic_store`: a shuffled, endless
    :class:`~openk3.train.data.PackedLoader` for "train" (corpus seed ``run.seed``,
    ``run.settings.num_docs`` documents, :class:`SmokeSettings`), and a fixed, unshuffled held-out corpus
    (another seed, 200 documents) for "eval"."""
    from openk3.train.data import PackedLoader

    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: must be 'train' or 'eval'")
    cfg = run.model_config()
    if split == "train":
        store = synthetic_store(
            run.seed, _settings(run).num_docs, cfg.bos_token_id, cfg.eos_token_id
        )
        return PackedLoader(
            store, run.seq_len, run.batch_size, seed=run.seed, pad_id=cfg.pad_token_id
        )
    store = synthetic_store(run.seed + 7919, 200, cfg.bos_token_id, cfg.eos_token_id)
    return PackedLoader(store, run.seq_len, run.batch_size, shuffle=False, pad_id=cfg.pad_token_id)


def _settings(run: RunConfig) -> SmokeSettings:
    """``run.settings``, or the defaults for a run built by hand without settings.

    Raises:
        ValueError: settings of another recipe.
    """
    if run.settings is None:
        return SmokeSettings()
    if not isinstance(run.settings, SmokeSettings):
        raise ValueError(
            f"RunConfig.settings: {type(run.settings).__name__}, expected SmokeSettings for synthetic_data"
        )
    return run.settings


def smoke() -> RunConfig:
    """``k3-test-tiny`` on the synthetic byte corpus (:func:`synthetic_data`)."""
    return RunConfig(
        name="smoke",
        model="k3-test-tiny",
        data=synthetic_data,
        total_steps=300,
        seq_len=256,
        warmup_steps=15,
        lr=2e-2,
        min_lr_ratio=0.1,
        eval_every=50,
        eval_batches=4,
        ckpt_every=100,
        keep_checkpoints=2,
        seed=0,
        settings=SmokeSettings(),
    )


__all__ = [
    "smoke",
    "SmokeSettings",
    "synthetic_store",
    "synthetic_data",
    "synthetic_document",
    "synthetic_entropy_per_sentence",
]
