"""Engine-side request state and the unit of a step plan.

* :class:`Request` — one request as the engine tracks it: its tokens and progress (owned by the
  :class:`~openk3.engine.engine.Engine`), the cache resources it holds (written only by the
  :class:`~openk3.engine.cache_manager.CacheManager`) and its image inputs.
* :class:`Piece` — tokens ``[start, end)`` of one request computed as one row of a batched
  forward; the :class:`~openk3.engine.scheduler.Scheduler` plans a step as pieces, the
  :class:`~openk3.engine.runner.ModelRunner` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from openk3.engine.mm import spans_salt
from openk3.engine.sampling import SamplingParams


@dataclass(eq=False)
class Request:
    """Engine-side state of one request.

    ``tokens`` = prompt + sampled tokens still to be fed (the stop token is never appended);
    ``num_computed`` tokens of it are in the caches (KDA slot + MLA blocks). Cache resources:
    ``slot`` (KDA slot row), ``blocks`` (block table, physical MLA block ids), ``reserved`` (blocks
    promised at admission and not allocated yet), ``keys`` (prefix-cache chain keys of its full
    blocks), ``published`` (leading blocks already in the prefix cache), ``cached_tokens`` (prompt
    tokens served from the prefix cache) and ``pending_logits`` ([V] fp32 logits restored with a
    whole-prompt hit, sampled without a forward). Image requests: ``images``
    (:class:`~openk3.engine.mm.ImageInput`, dropped once the prompt is computed),
    ``image_features`` (per image, [N, D] on the model's device, computed on first use) and
    ``spans`` (kept: they salt the prefix-cache keys, :meth:`salt`).
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    constraint: Any
    arrival: int
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    num_computed: int = 0
    cached_tokens: int = 0
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)
    reserved: int = 0
    keys: list[bytes] = field(default_factory=list)
    published: int = 0
    pending_logits: torch.Tensor | None = None
    generator: torch.Generator | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: Any = None
    images: list = field(default_factory=list)
    spans: list = field(default_factory=list)
    image_features: list | None = None
    tower_job: Any = None  # (image index, generator) of the tower work in progress
    to_encode: list = field(default_factory=list)  # indices of images still to encode, in order

    def salt(self, start: int, end: int) -> bytes:
        """Prefix-cache key material of the images overlapping positions ``[start, end)``."""
        return spans_salt(self.spans, start, end) if self.spans else b""

    @property
    def key_salt(self):
        """:meth:`salt` for image requests, None for text-only ones (keys hash tokens only)."""
        return self.salt if self.spans else None

    @property
    def remaining(self) -> int:
        """Tokens to feed before the next sample."""
        return len(self.tokens) - self.num_computed

    @property
    def in_prefill(self) -> bool:
        """True until every prompt token is computed."""
        return self.num_computed < len(self.prompt)


@dataclass(frozen=True, eq=False)
class Piece:
    """One row of a batched forward: tokens ``request.tokens[start:end]`` at positions
    ``[start, end)``, resuming from ``start`` computed tokens (``start == request.num_computed``
    when the forward runs). ``marks``: positions in ``(start, end)`` (increasing) where the
    forward also captures the KDA state, for the prefix cache's snapshots there."""

    request: Request
    start: int
    end: int
    marks: tuple[int, ...] = ()

    @property
    def length(self) -> int:
        """Tokens in the piece (``end - start``, >= 1)."""
        return self.end - self.start
