"""Continuous-batching scheduler: FCFS admission, and the per-step plan (one batched decode +
chunked prefill pieces under a shared token budget). It decides; the memory a decision takes is
the :class:`~openk3.engine.cache_manager.CacheManager`'s (reservations at admission).

Policy, per step:

1. **Decode** every running request whose next forward is a single token (one batched forward).
   Each costs one token of the step budget ``prefill_chunk``.
2. **Prefill** the running requests with more than one token to compute, oldest first, in pieces
   that fill the remaining budget (at least ``min(prefill_chunk, block_size)`` tokens per step
   even when decodes use it all, so prompts always progress). Without chunked prefill a prompt is
   computed whole in one step (the budget then only bounds how many prompts start together).
3. **Admit** waiting requests in arrival order while the budget, ``max_num_seqs``, a free KDA slot
   and the MLA blocks for the request's whole lifetime (prompt + max_tokens - 1 positions, less
   prefix-shared blocks) are available. Admission is strict FCFS: if the head does not fit,
   nobody behind it is admitted, so no request can starve; reserved blocks guarantee that a
   running request never runs out of memory, so nothing is ever preempted.

When the prefix cache is on, the KDA state is snapshotted at every multiple of
``snapshot_interval`` (see :mod:`.prefix_cache`). A piece runs past such a point when the forward
can capture the state there: the point lies a multiple of the KDA chunk
(:attr:`CacheManager.state_mark_align`) after the piece's start, and the piece carries it as a
mark; otherwise the piece is split there. So forwards are as long as the budget allows (fewer,
larger forwards: 0.906x of a cold 24K-token prefill with 2,048-token forwards instead of 512,
1 CPU thread) while the snapshots stay at K3's 512-token hashing granularity. Pieces of one step
run as "rounds" (round i = the i-th sub-piece of every prefilling request). A round's rows are padded to
its longest piece, so mixed prompt lengths waste work (32/64/96/128 in one forward: 896 token
positions for 512 tokens); each round is therefore split into length groups, one batched forward
each, wherever the padding saved exceeds ``forward_cost`` token positions per extra forward
(:func:`length_groups`). Pieces are independent (each touches only its own request's state), so
grouping changes no result beyond fp rounding of the batched kernels.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from openk3.engine.cache_manager import CacheManager
from openk3.engine.request import Piece, Request


def length_groups(lengths: list[int], forward_cost: int) -> list[list[int]]:
    """Split rows with piece lengths ``lengths`` into groups (one padded forward each) minimising
    Σ_groups (forward_cost + rows · longest), i.e. padded token positions plus a fixed price per
    forward.

    Rows are ordered by length (longest first, ties by index) and groups are contiguous runs of
    that order (an optimal grouping always is); the dynamic programme only cuts between distinct
    lengths, O(m²) for m distinct lengths.

    Args:
        lengths: tokens per row (>= 1). forward_cost: price of one extra forward in padded token
            positions (0: one group per distinct length; large: a single group).
    Returns:
        groups of row indices, longest group first; together they hold every index once.
    Raises:
        ValueError: negative ``forward_cost``.
    """
    if forward_cost < 0:
        raise ValueError(f"forward_cost={forward_cost}: must be >= 0")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if len(set(lengths)) <= 1:
        return [order] if order else []
    # Run boundaries: positions in ``order`` where the length changes (plus the end).
    cuts = [k for k in range(1, len(order)) if lengths[order[k]] != lengths[order[k - 1]]] + [
        len(order)
    ]
    starts = [0] + cuts[:-1]
    best = [0.0] + [math.inf] * len(cuts)  # best[j]: cost of the first j runs
    prev = [0] * (len(cuts) + 1)
    for j in range(1, len(cuts) + 1):
        for i in range(j):
            cost = best[i] + forward_cost + (cuts[j - 1] - starts[i]) * lengths[order[starts[i]]]
            if cost < best[j]:
                best[j] = cost
                prev[j] = i
    groups = []
    j = len(cuts)
    while j:
        i = prev[j]
        groups.append(order[starts[i] : cuts[j - 1]])
        j = i
    return groups[::-1]


@dataclass
class StepPlan:
    """What one engine step runs: ``decode`` (one token each, one forward), ``prefill`` forwards
    of :class:`Piece` rows in order (the length groups of each round, round by round), and
    ``ready`` requests sampled from stored logits (full hits)."""

    decode: list[Request] = field(default_factory=list)
    prefill: list[list[Piece]] = field(default_factory=list)
    ready: list[Request] = field(default_factory=list)


class Scheduler:
    """Waiting queue, running set and the plan of each step; the cache resources are the
    :class:`~openk3.engine.cache_manager.CacheManager`'s.

    Args:
        cache: the engine's cache manager (admission, block allocation, snapshot points, L).
        max_num_seqs: most running requests. prefill_chunk: step token budget.
        chunked_prefill: split prompts across steps.
        forward_cost: price of one extra prefill forward in padded token positions
            (:func:`length_groups`); None = every round is one forward.
    """

    def __init__(
        self,
        cache: CacheManager,
        *,
        max_num_seqs: int,
        prefill_chunk: int,
        chunked_prefill: bool,
        forward_cost: int | None = None,
    ) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.budget = prefill_chunk
        self.chunked = chunked_prefill
        self.forward_cost = forward_cost
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def _try_admit(self, req: Request) -> bool:
        """Admit ``req`` if a running place is free and the cache can take it (all or nothing)."""
        if len(self.running) >= self.max_num_seqs:
            return False
        return self.cache.admit(req)

    def remove(self, req: Request) -> None:
        """Take ``req`` out of the running set or the waiting queue (its cache resources are
        released by the caller, :meth:`CacheManager.release`)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    # ------------------------------------------------------------------ planning
    def _pieces(self, req: Request, n: int) -> list[Piece]:
        """``req``'s next ``n`` tokens as pieces: snapshot points (when the prefix cache is on)
        that a forward can capture become marks of the piece running past them, the others
        split it (see the module docstring)."""
        start = req.num_computed
        end = req.num_computed + n
        step = self.cache.snapshot_interval
        if step is None:
            return [Piece(req, start, end)]
        align = self.cache.state_mark_align
        bounds, marks = [start], [[]]
        for point in range((start // step + 1) * step, end, step):
            if (point - bounds[-1]) % align:
                bounds.append(point)
                marks.append([])
            else:
                marks[-1].append(point)
        bounds.append(end)
        return [Piece(req, a, b, tuple(m)) for a, b, m in zip(bounds, bounds[1:], marks)]

    def schedule(self) -> StepPlan:
        """Admit what fits, decide this step's work (see the module docstring) and allocate the
        MLA blocks all of it writes (out of the reservations made at admission, so this cannot
        fail): the decode rows' first, then the prefill forwards' in the order they run."""
        plan = StepPlan()
        plan.decode = [r for r in self.running if r.pending_logits is None and r.remaining == 1]
        left = max(self.budget - len(plan.decode), min(self.budget, self.cache.block_size))
        pieces: list[list[Piece]] = []
        started = False

        def take(r: Request) -> bool:
            nonlocal left, started
            if self.chunked:
                n = min(r.remaining, left)
                if n <= 0:
                    return False
            else:
                n = r.remaining
                if started and n > left:
                    return False
            pieces.append(self._pieces(r, n))
            left -= n
            started = True
            return True

        for r in self.running:
            if r.pending_logits is None and r.remaining > 1 and not take(r):
                break
        while self.waiting and left > 0 and self._try_admit(self.waiting[0]):
            r = self.waiting.popleft()
            self.running.append(r)
            if r.pending_logits is not None:
                plan.ready.append(r)
            elif r.remaining == 1:
                plan.decode.append(r)
                left -= 1
            elif not take(r):
                break
        rounds = max((len(p) for p in pieces), default=0)
        for i in range(rounds):
            rnd = [p[i] for p in pieces if i < len(p)]
            if self.forward_cost is None or len(rnd) == 1:
                plan.prefill.append(rnd)
            else:
                groups = length_groups([p.length for p in rnd], self.forward_cost)
                plan.prefill += [[rnd[j] for j in g] for g in groups]
        for r in plan.decode:
            self.cache.allocate(r, r.num_computed + 1)
        for forward in plan.prefill:
            for p in forward:
                self.cache.allocate(p.request, p.end)
        return plan
