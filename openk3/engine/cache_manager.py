"""The engine's cache memory under one owner: the paged MLA block pool, the KDA slot pool, the KDA
snapshot pool and the prefix cache over them (performance.md §2.5).

Shape legend: L tokens per MLA block (``block_size``), V vocabulary.

A request's cache resources live on its :class:`~openk3.engine.request.Request` (``slot``,
``blocks``, ``reserved``, ``keys``, ``published``, ``cached_tokens``, ``pending_logits``) and are
written only here, through the request's life:

1. :meth:`CacheManager.admit` — a free KDA slot, the longest usable prefix-cache hit (shared
   full blocks, the KDA snapshot copied into the slot, a latent tail copied into a private
   block) and a reservation of every other block the request will ever write, or nothing at all;
2. :meth:`CacheManager.allocate` — blocks out of that reservation, before the forward that
   writes them (the scheduler allocates a whole step's inside its plan);
3. :meth:`CacheManager.on_computed` — after a forward: newly full blocks are published, and the
   KDA state is snapshotted at snapshot points (those the forward ran past from the states it
   captured there) and at the prompt end (with the logits there);
4. :meth:`CacheManager.on_finished` — a sequence-end snapshot when the request stopped normally;
5. :meth:`CacheManager.release` — block references, the unused reservation and the slot go back.

Reservations make every allocation succeed, so nothing runs out of memory mid-generation and
nothing is preempted (:mod:`.scheduler`).
"""

from __future__ import annotations

import torch

from openk3.config import K3Config
from openk3.engine.kv_pool import (
    CacheLayout,
    KDAStatePool,
    MLABlockPool,
    SlotPool,
    SnapshotPool,
    cache_layout,
)
from openk3.engine.prefix_cache import PrefixCache, extend_keys
from openk3.engine.request import Request
from openk3.ops.kda import CHUNK_SIZE


class CacheManager:
    """Owner of the engine's pools and prefix cache.

    Args:
        config: the model's :class:`~openk3.config.K3Config`.
        memory: bytes for MLA blocks + KDA slots + snapshots (:func:`~openk3.engine.kv_pool.cache_layout`).
        block_size: L. max_num_seqs: KDA slots wanted.
        snapshot_interval: KDA snapshot spacing in tokens (a multiple of L); None = the smallest
            multiple of L that is >= 512.
        snapshot_fraction: share of ``memory`` for snapshots (0 when the prefix cache is off).
        enable_prefix_cache: reuse prompt prefixes across requests.
        device, dtype: of the pools (the model's).
    Attributes:
        layout: the :class:`~openk3.engine.kv_pool.CacheLayout`; blocks, slots, snapshots: the
        pools; prefix: the :class:`~openk3.engine.prefix_cache.PrefixCache`.
    Raises:
        ValueError: ``memory`` too small for one KDA state plus one MLA block.
    """

    def __init__(
        self,
        config: K3Config,
        memory: int,
        *,
        block_size: int,
        max_num_seqs: int,
        snapshot_interval: int | None,
        snapshot_fraction: float,
        enable_prefix_cache: bool,
        device,
        dtype: torch.dtype,
    ) -> None:
        L = block_size
        self.block_size = L
        self.layout: CacheLayout = cache_layout(
            config,
            memory,
            block_size=L,
            max_num_seqs=max_num_seqs,
            snapshot_fraction=snapshot_fraction,
            dtype=dtype,
        )
        lay = self.layout
        self.blocks = MLABlockPool(config, lay.num_blocks, L, device, dtype)
        self.slots = SlotPool(config, lay.num_slots, device, dtype)
        self.snapshots = SnapshotPool(config, lay.num_snapshots, L, device, dtype)
        interval = snapshot_interval or L * -(-512 // L)
        self.prefix = PrefixCache(self.blocks, self.snapshots, L, interval, enable_prefix_cache)

    @property
    def snapshot_interval(self) -> int | None:
        """Where prefill pieces must stop so the KDA state can be snapshotted (tokens, a multiple
        of L), None when the prefix cache is off."""
        return self.prefix.interval if self.prefix.enabled else None

    @property
    def state_mark_align(self) -> int:
        """A forward can hand over the KDA state after t of its tokens when t is a multiple of
        this (tokens: the KDA chunk kernel's chunk, whose per-chunk states those are); a snapshot
        point off that grid ends the forward instead."""
        return CHUNK_SIZE

    # ------------------------------------------------------------------ admission
    def blocks_needed(self, req: Request) -> int:
        """MLA blocks a request writes over its life: positions 0 .. prompt + max_tokens - 2."""
        return -(-(len(req.prompt) + req.max_tokens - 1) // self.block_size)

    def cached_length(self, req: Request) -> int:
        """Prompt tokens of ``req`` the prefix cache would serve now (0 when off); takes nothing
        (it only computes the request's block keys)."""
        if not self.prefix.enabled:
            return 0
        extend_keys(req.keys, req.prompt, self.block_size, req.key_salt)
        return self.prefix.match(req.prompt, req.keys, req.key_salt).length

    def admit(self, req: Request) -> bool:
        """Give ``req`` everything it needs for its whole life, or nothing: a zeroed KDA slot, the
        prefix-cache hit (shared blocks referenced, snapshot restored into the slot, latent tail
        copied into a new private block; ``num_computed = cached_tokens`` = the hit length;
        ``pending_logits`` [V] fp32 when the hit covers the whole prompt) and a reservation of the
        remaining blocks. False (nothing taken) when no slot is free or the blocks are not
        available."""
        if self.slots.num_free == 0:
            return False
        extend_keys(req.keys, req.prompt, self.block_size, req.key_salt)
        hit = self.prefix.match(req.prompt, req.keys, req.key_salt)
        need = self.blocks_needed(req) - len(hit.blocks)
        revived = sum(
            1 for b in hit.blocks if self.blocks.refcount[b] == 0
        )  # leave the evictable set
        if need > self.blocks.num_available - revived:
            return False
        for b in hit.blocks:
            self.blocks.incref(b)
        self.blocks.reserve(need)
        req.reserved = need
        req.blocks = list(hit.blocks)
        req.slot = self.slots.allocate()
        if hit.snapshot is not None:
            tail = self._allocate_block(req) if hit.snapshot.tail_len else None
            req.pending_logits = self.prefix.restore(
                hit, self.slots, req.slot, tail, len(req.prompt)
            )
        req.num_computed = req.cached_tokens = hit.length
        req.published = len(hit.blocks)
        self.prefix.commit(hit, len(req.prompt))
        return True

    # ------------------------------------------------------------------ allocation
    def _allocate_block(self, req: Request) -> int:
        """Append one block to ``req``'s table, out of its reservation."""
        b = self.blocks.allocate()
        req.reserved -= 1
        req.blocks.append(b)
        return b

    def allocate(self, req: Request, end: int) -> None:
        """Make ``req``'s block table cover positions ``[0, end)`` (out of its reservation)."""
        while len(req.blocks) * self.block_size < end:
            self._allocate_block(req)

    # ------------------------------------------------------------------ publishing
    def on_computed(
        self,
        req: Request,
        logits: torch.Tensor | None,
        marked: list[tuple[int, KDAStatePool, int]] = (),
    ) -> None:
        """After a forward brought ``req`` to ``num_computed`` tokens: publish its newly full
        blocks and take the snapshots due: at each of ``marked`` (position, pool, row), the KDA
        state the forward captured at a snapshot point it ran past (in increasing position, each
        a multiple of the snapshot interval), then at ``num_computed`` (the prompt end, with
        ``logits`` [V] fp32 of its last token when given; or a multiple of the interval)."""
        if not self.prefix.enabled:
            return
        L = self.block_size
        extend_keys(req.keys, req.tokens, L, req.key_salt)
        req.published = self.prefix.publish_blocks(
            req.keys, req.blocks, req.num_computed // L, req.published
        )
        for position, pool, row in marked:
            self.prefix.save(
                req.tokens, req.keys, position, pool, row, req.blocks, salt=req.key_salt
            )
        p = req.num_computed
        if p == len(req.prompt) and logits is not None:
            self.prefix.save(
                req.tokens, req.keys, p, self.slots, req.slot, req.blocks, logits, salt=req.key_salt
            )
        elif p % self.prefix.interval == 0:
            self.prefix.save(
                req.tokens, req.keys, p, self.slots, req.slot, req.blocks, salt=req.key_salt
            )

    def on_finished(self, req: Request) -> None:
        """Sequence-end snapshot of a request that stopped normally (before :meth:`release`): a
        follow-up turn that extends this conversation resumes here."""
        if self.prefix.enabled and req.slot is not None:
            extend_keys(req.keys, req.tokens, self.block_size, req.key_salt)
            self.prefix.save(
                req.tokens,
                req.keys,
                req.num_computed,
                self.slots,
                req.slot,
                req.blocks,
                salt=req.key_salt,
            )

    def release(self, req: Request) -> None:
        """Return every block reference, the unused reservation and the slot of ``req`` at once
        (published blocks stay cached, evictable once unreferenced)."""
        for b in req.blocks:
            self.blocks.decref(b)
        req.blocks = []
        self.blocks.unreserve(req.reserved)
        req.reserved = 0
        if req.slot is not None:
            self.slots.release(req.slot)
            req.slot = None
        req.pending_logits = None

    # ------------------------------------------------------------------ introspection
    @staticmethod
    def holds(req: Request) -> bool:
        """True while ``req`` holds a block, a reservation or a slot."""
        return bool(req.blocks or req.reserved or req.slot is not None)

    def check(self, live: list[Request]) -> list[str]:
        """Pool accounting against the requests that may hold resources (empty when consistent):
        block references, reservations and slots equal theirs, every block is free, cached or
        referenced. O(blocks + requests)."""
        b = self.blocks
        problems = []
        refs = sum(len(r.blocks) for r in live)
        if sum(b.refcount) != refs:
            problems.append(f"MLA block references {sum(b.refcount)} != {refs} held by requests")
        reserved = sum(r.reserved for r in live)
        if b.reserved != reserved:
            problems.append(f"MLA reservations {b.reserved} != {reserved} held by requests")
        if b.num_free + b.num_evictable + sum(1 for c in b.refcount if c > 0) != b.num_blocks:
            problems.append("MLA blocks neither free, cached nor referenced")
        slots = sum(1 for r in live if r.slot is not None)
        if self.slots.num_used != slots:
            problems.append(f"KDA slots in use {self.slots.num_used} != {slots} held by requests")
        return problems

    def stats(self) -> dict:
        """Pool occupancy, prefix-cache counters per pool and the memory layout."""
        b = self.blocks
        s = self.slots
        n = self.snapshots
        lay = self.layout
        return {
            "mla_blocks": {
                "total": b.num_blocks,
                "used": b.num_used,
                "cached": b.num_evictable,
                "free": b.num_free,
                "reserved": b.reserved,
                "evictions": b.evictions,
            },
            "kda_slots": {"total": s.n, "used": s.num_used, "free": s.num_free},
            "kda_snapshots": {
                "total": n.n,
                "used": n.num_used,
                "free": n.num_free,
                "evictions": n.evictions,
            },
            "prefix_cache": self.prefix.stats(),
            "memory": {
                "block_bytes": lay.block_bytes,
                "slot_bytes": lay.slot_bytes,
                "snapshot_bytes": lay.snapshot_bytes,
                "total": lay.total_bytes,
            },
        }
