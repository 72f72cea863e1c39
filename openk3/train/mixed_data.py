"""Replay: a deterministic interleaving of two data sources (``default-model`` ``extra.sft_replay``).

SFT alone overwrites the pretrained language model (openk3-tiny: corpus val loss 5.12 -> 12.09);
mixing a fraction of pretraining rows back into the SFT stream ("replay") keeps it. The sources
are :class:`~openk3.train.data.DataSource` s: ``next_batch()`` -> ``{"input_ids" [1, T'],
"labels" [1, T'], "cu_seqlens" [N+1]}`` with T' = batch_size x seq_len, ``state_dict()`` /
``load_state_dict()``; so are both loaders here. Both must produce the same T' (same ``seq_len`` and
``batch_size``), so a step's token count does not depend on which source served it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from openk3.train.data import DataSource

MIXED_STATE_VERSION = 1


class MixedLoader:
    """Serves each micro-batch from ``secondary`` with probability ``fraction``, else from ``primary``.

    Batch ``k`` (0-based, counted over the whole stream) comes from ``secondary`` iff
    ``numpy.random.default_rng([seed, k]).random() < fraction``: a fixed function of
    ``(seed, k)``, so the choice sequence is identical on every platform and after a resume. With
    ``batch_size`` 1 (the recipes' default) a micro-batch is one row, so ``fraction`` is the
    expected share of rows. Each source advances only when it serves a batch.

    Args:
        primary: the main DataSource (SFT conversations).
        secondary: the replayed DataSource (pretraining corpus rows).
        fraction: share of batches taken from ``secondary``, in [0, 1). 0 = exactly ``primary``'s
            batches (``secondary`` is never touched).
        seed: seed of the choice sequence.
    Raises:
        ValueError: ``fraction`` outside [0, 1).
    """

    def __init__(self, primary: DataSource, secondary: DataSource, fraction: float, seed: int = 0):
        if (
            not isinstance(fraction, (int, float))
            or isinstance(fraction, bool)
            or not 0.0 <= fraction < 1.0
        ):
            raise ValueError(f"fraction={fraction!r}: must lie in [0, 1)")
        self.primary = primary
        self.secondary = secondary
        self.fraction, self.seed = float(fraction), int(seed)
        self.batches = 0  # k of the next batch
        self.served_secondary = 0

    def uses_secondary(self, k: int) -> bool:
        """Whether batch ``k`` of the stream comes from ``secondary``."""
        if self.fraction == 0.0:
            return False
        return bool(np.random.default_rng([self.seed, int(k)]).random() < self.fraction)

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next batch (the trainer's protocol) from the source :meth:`uses_secondary` picks.

        Raises:
            StopIteration: the chosen source ended (single-pass sources only).
        """
        use_secondary = self.uses_secondary(self.batches)
        batch = (self.secondary if use_secondary else self.primary).next_batch()
        self.batches += 1
        self.served_secondary += int(use_secondary)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position: batches served (of which from ``secondary``), the mixing
        config, and both sources' own states."""
        return {
            "version": MIXED_STATE_VERSION,
            "batches": self.batches,
            "served_secondary": self.served_secondary,
            "fraction": self.fraction,
            "seed": self.seed,
            "primary": self.primary.state_dict(),
            "secondary": self.secondary.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the following batches equal an uninterrupted run's.

        Raises:
            ValueError: another state version, a different ``fraction`` or ``seed`` (named), or
                a source's own mismatch (from its ``load_state_dict``).
        """
        if not isinstance(state, dict) or state.get("version") != MIXED_STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else state
            raise ValueError(f"state.version: expected {MIXED_STATE_VERSION}, got {got!r}")
        for k in ("fraction", "seed"):
            if state.get(k) != getattr(self, k):
                raise ValueError(
                    f"state.{k}: saved {state.get(k)!r}, this loader has {getattr(self, k)!r}"
                )
        self.primary.load_state_dict(state["primary"])
        self.secondary.load_state_dict(state["secondary"])
        self.batches, self.served_secondary = int(state["batches"]), int(state["served_secondary"])


class CurriculumLoader:
    """Serves the first ``steps`` micro-batches from ``first``, every later one from ``then``
    (``default-model`` ``extra.pretrain_copy_steps``: copy documents before the corpus mixture).

    Same DataSource protocol and resume guarantee as :class:`MixedLoader`; each source advances
    only when it serves a batch, so ``then`` starts at its own first batch.

    Args:
        first: the DataSource of the first ``steps`` batches.
        then: the DataSource of the rest.
        steps: batches taken from ``first``; 0 = exactly ``then``'s batches.
    Raises:
        ValueError: ``steps`` not an integer >= 0.
    """

    def __init__(self, first: DataSource, then: DataSource, steps: int):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps={steps!r}: must be an integer >= 0")
        self.first = first
        self.then = then
        self.steps = steps
        self.batches = 0

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next batch: from ``first`` while fewer than ``steps`` were served, else ``then``.

        Raises:
            StopIteration: the serving source ended (single-pass sources only).
        """
        batch = (self.first if self.batches < self.steps else self.then).next_batch()
        self.batches += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position: batches served, ``steps``, and both sources' states."""
        return {
            "version": MIXED_STATE_VERSION,
            "kind": "curriculum",
            "batches": self.batches,
            "steps": self.steps,
            "first": self.first.state_dict(),
            "then": self.then.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`.

        Raises:
            ValueError: another state version or kind, a different ``steps`` (named), or a
                source's own mismatch.
        """
        if (
            not isinstance(state, dict)
            or state.get("version") != MIXED_STATE_VERSION
            or state.get("kind") != "curriculum"
        ):
            got = (state.get("version"), state.get("kind")) if isinstance(state, dict) else state
            raise ValueError(
                f"state.version/kind: expected ({MIXED_STATE_VERSION}, 'curriculum'), got {got!r}"
            )
        if state.get("steps") != self.steps:
            raise ValueError(
                f"state.steps: saved {state.get('steps')!r}, this loader has {self.steps!r}"
            )
        self.first.load_state_dict(state["first"])
        self.then.load_state_dict(state["then"])
        self.batches = int(state["batches"])


__all__ = ["MIXED_STATE_VERSION", "MixedLoader", "CurriculumLoader"]
