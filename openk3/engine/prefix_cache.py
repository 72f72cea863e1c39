"""KDA-aware prefix cache: hash-chained MLA blocks shared by reference count, plus KDA state
snapshots in a separate pool with its own LRU (performance.md §2.5).

Shape legend: L tokens per block (``block_size``), C latent width, R shared key width.

Design (the three granularities of §2.5 item 2, kept apart):

* **Prefix-match unit = the MLA block** (L tokens). Full blocks are keyed by a hash chain,
  ``key_i = sha256(key_{i-1} | tokens of block i)``, so one key identifies the whole prefix. A
  full block whose latents are computed is immutable and is published under its key; requests with
  the same prefix reference it (``MLABlockPool`` refcounts), and once unreferenced it stays
  evictable in LRU order until an allocation needs it.
* **Snapshot points.** A KDA state can only be resumed where one was saved, so it is saved at
  every multiple of ``snapshot_interval`` (a multiple of L; vLLM's "align" mode). A prefill
  forward that runs past such a point captures the state there (the KDA layers' per-chunk states
  and conv tails, :class:`~openk3.cache.SlotKDAState` ``marks``) and the engine copies it into the
  snapshot pool after the forward; where the point is off the KDA chunk grid relative to the
  forward's start, the scheduler ends the forward there instead and the request's slot is copied.
  Two more points are always saved: the prompt end (with the logits of the last prompt token, so
  an identical prompt is served without any forward) and the end of a finished sequence
  (multi-turn reuse). Capturing instead of always cutting lets forwards be as long as the step
  budget (fewer per-forward costs) with the snapshot spacing of K3's hashing.
* **Unaligned points** (prompt ends inside a block): the snapshot entry also stores the latents
  of the ``position % L`` tokens after the last full block, keyed by ``sha256(parent | tail
  tokens)``. A hit copies them into a private block (copy-on-write), so prompts shorter than one
  block and prompts of any length still hit (vllm #40696, #50235).

* **Image positions**: a block or tail that overlaps an image's pad run also hashes the
  image's content hash and position (the ``salt`` arguments, :mod:`openk3.engine.mm`), so identical
  ids with different images never share those blocks or snapshots.

Hit rule (§2.5 item 4): walk the block chain as far as it matches (the MLA hit), then take the
**deepest snapshot not beyond it** whose position is < the prompt length, or == the prompt length
if it carries logits. The request resumes there: its KDA slot receives a copy of the snapshot
(never shared in place, §2.5 item 5), full blocks below the position are shared, and a tail is
copied. ``cached_tokens`` is that position. Recomputed tokens are always written to private blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Callable

import torch

from openk3.engine.kv_pool import KDAStatePool, MLABlockPool, SlotPool, Snapshot, SnapshotPool

ROOT = hashlib.sha256(b"openk3 prefix cache v1").digest()


def _token_bytes(tokens) -> bytes:
    return array("q", tokens).tobytes()


Salt = Callable[
    [int, int], bytes
]  # (start, end) -> key material of non-token inputs in [start, end)


def _salted(data: bytes, salt: bytes) -> bytes:
    # Token bytes are a multiple of 8 long; b"M" + a 32-byte digest is not, so salted and unsalted
    # inputs can never collide. Blocks without salt hash exactly as before.
    return data + b"M" + hashlib.sha256(salt).digest() if salt else data


def chain_key(parent: bytes, block_tokens, salt: bytes = b"") -> bytes:
    """Key of a full block given its parent's key, its L tokens and the key material of any image
    features among its positions (:func:`openk3.engine.mm.spans_salt`)."""
    return hashlib.sha256(_salted(parent + b"B" + _token_bytes(block_tokens), salt)).digest()


def tail_key(parent: bytes, tail_tokens, salt: bytes = b"") -> bytes:
    """Key of an unaligned boundary: ``len(tail_tokens)`` (1..L-1) tokens after block key ``parent``
    (``salt``: as for :func:`chain_key`)."""
    return hashlib.sha256(_salted(parent + b"T" + _token_bytes(tail_tokens), salt)).digest()


def extend_keys(
    keys: list[bytes], tokens: list[int], block_size: int, salt: Salt | None = None
) -> None:
    """Append chain keys to ``keys`` for every full block of ``tokens`` not keyed yet; ``salt``
    gives the extra key material of positions ``[start, end)`` (image requests)."""
    while (len(keys) + 1) * block_size <= len(tokens):
        i = len(keys)
        a = i * block_size
        b = (i + 1) * block_size
        keys.append(chain_key(keys[-1] if keys else ROOT, tokens[a:b], salt(a, b) if salt else b""))


@dataclass
class PrefixHit:
    """Result of :meth:`PrefixCache.match`.

    Attributes:
        length: tokens reused (the snapshot position; 0 = miss).
        blocks: physical MLA blocks shared (the full blocks below ``length``).
        snapshot: the snapshot to copy (None on a miss).
        mla_tokens: tokens the MLA block chain matched (>= ``length`` rounded down to L).
    """

    length: int = 0
    blocks: list = field(default_factory=list)
    snapshot: Snapshot | None = None
    snapshot_key: bytes | None = None
    mla_tokens: int = 0


class PrefixCache:
    """Lookup, hit accounting and snapshot saving over an MLA block pool and a snapshot pool.

    Args:
        blocks: the paged MLA pool (holds the key -> block index).
        snapshots: the KDA snapshot pool (holds the key -> snapshot index and LRU).
        block_size: L. snapshot_interval: distance between interval snapshots (a multiple of L).
        enabled: False turns every lookup into a miss and saving into a no-op.
    Raises:
        ValueError: ``snapshot_interval`` not a positive multiple of ``block_size``.
    """

    def __init__(
        self,
        blocks: MLABlockPool,
        snapshots: SnapshotPool,
        block_size: int,
        snapshot_interval: int,
        enabled: bool = True,
    ) -> None:
        if snapshot_interval < block_size or snapshot_interval % block_size:
            raise ValueError(
                f"snapshot_interval={snapshot_interval}: must be a positive multiple of "
                f"block_size={block_size}"
            )
        self.blocks = blocks
        self.snapshots = snapshots
        self.block_size = block_size
        self.interval = snapshot_interval
        self.enabled = enabled and snapshots.n > 0
        self.counters = {
            "mla_queries": 0,
            "mla_hits": 0,
            "kda_queries": 0,
            "kda_hits": 0,
            "kda_hit_tokens": 0,
        }

    # ------------------------------------------------------------------------- lookup
    def _usable(self, snap: Snapshot | None, prompt_len: int) -> bool:
        return snap is not None and (
            snap.position < prompt_len or (snap.position == prompt_len and snap.has_logits)
        )

    def match(self, tokens: list[int], keys: list[bytes], salt: Salt | None = None) -> PrefixHit:
        """Find the reusable prefix of a prompt (no side effects).

        Args:
            tokens: the prompt. keys: its full-block chain keys (:func:`extend_keys`, same ``salt``).
            salt: the request's extra key material (image requests), see :func:`extend_keys`.
        """
        if not self.enabled:
            return PrefixHit()
        L = self.block_size
        n = len(tokens)
        matched: list[int] = []
        for key in keys:
            b = self.blocks.lookup(key)
            if b is None:
                break
            matched.append(b)
        m = len(matched)
        for k in range(m, -1, -1):  # deepest first: tails after block k, then the boundary at k
            parent = keys[k - 1] if k else ROOT
            tails = self.snapshots.tails_after(parent)
            for r in sorted(set(tails.values()), reverse=True):
                a = k * L
                b = k * L + r
                key = tail_key(parent, tokens[a:b], salt(a, b) if salt else b"") if b <= n else None
                if key in tails:
                    snap = self.snapshots.get(key)
                    if self._usable(snap, n):
                        return PrefixHit(snap.position, matched[:k], snap, key, m * L)
            if k:
                snap = self.snapshots.get(keys[k - 1])
                if self._usable(snap, n):
                    return PrefixHit(snap.position, matched[:k], snap, keys[k - 1], m * L)
        return PrefixHit(mla_tokens=m * L)

    def commit(self, hit: PrefixHit, prompt_len: int) -> None:
        """Count one admitted query and refresh the LRU position of the consumed snapshot only."""
        if not self.enabled:
            return
        c = self.counters
        c["mla_queries"] += prompt_len
        c["mla_hits"] += min(hit.mla_tokens, prompt_len)
        c["kda_queries"] += 1
        if hit.snapshot is not None:
            c["kda_hits"] += 1
            c["kda_hit_tokens"] += hit.length
            self.snapshots.get(hit.snapshot_key, touch=True)

    def restore(
        self, hit: PrefixHit, slots: SlotPool, slot: int, tail_block: int | None, prompt_len: int
    ) -> torch.Tensor | None:
        """Copy a hit's snapshot into a request's slot (and its latent tail into ``tail_block``,
        rows ``[0, position % L)``). Returns the stored logits [V] when the hit covers the whole
        prompt (``position == prompt_len``), else None."""
        snap = hit.snapshot
        slots.copy_row(slot, self.snapshots, snap.row)
        if snap.tail_len:
            t = snap.tail_len
            self.blocks.latent[:, tail_block, :t].copy_(self.snapshots.tail_latent[:, snap.row, :t])
            self.blocks.k_rope[:, tail_block, :t].copy_(self.snapshots.tail_k_rope[:, snap.row, :t])
        if snap.position == prompt_len:
            return self.snapshots.logits[snap.row].clone()
        return None

    # ------------------------------------------------------------------------- saving
    def publish_blocks(self, keys: list[bytes], blocks: list[int], n_full: int, start: int) -> int:
        """Publish full computed blocks ``start .. n_full-1`` of a request; returns ``n_full``."""
        if self.enabled:
            for i in range(start, n_full):
                self.blocks.register(blocks[i], keys[i])
        return n_full

    def save(
        self,
        tokens: list[int],
        keys: list[bytes],
        position: int,
        slots: KDAStatePool,
        slot: int,
        blocks: list[int],
        logits: torch.Tensor | None = None,
        salt: Salt | None = None,
    ) -> None:
        """Snapshot a request's state after ``position`` tokens.

        Args:
            tokens: the request's tokens (at least ``position``); keys: chain keys covering
                ``position // L`` blocks; slots, slot: the row holding the KDA state after exactly
                ``position`` tokens (the request's slot, or a state a forward captured at a mark:
                any :class:`~openk3.engine.kv_pool.KDAStatePool`); blocks: its block table
                (MLA tail latents are read from it); logits: [V] the logits after
                ``position`` (prompt ends), stored with the entry; salt: as for :func:`extend_keys`.
        """
        if not self.enabled or position <= 0:
            return
        L = self.block_size
        k, r = divmod(position, L)
        parent = keys[k - 1] if k else ROOT
        key = (
            keys[k - 1]
            if r == 0
            else tail_key(parent, tokens[k * L : position], salt(k * L, position) if salt else b"")
        )
        snap = self.snapshots.get(key, touch=True)
        if snap is None:
            snap = self.snapshots.put(key, position, r, parent if r else None)
            slots_row = slot
            self.snapshots.copy_row(snap.row, slots, slots_row)
            if r:
                self.snapshots.tail_latent[:, snap.row, :r].copy_(
                    self.blocks.latent[:, blocks[k], :r]
                )
                self.snapshots.tail_k_rope[:, snap.row, :r].copy_(
                    self.blocks.k_rope[:, blocks[k], :r]
                )
        if logits is not None and not snap.has_logits:
            self.snapshots.logits[snap.row].copy_(logits)
            snap.has_logits = True

    def stats(self) -> dict:
        """Hit/query counters per pool: MLA in tokens, KDA in requests and hit tokens."""
        c = self.counters
        return {
            "enabled": self.enabled,
            "mla": {"queries": c["mla_queries"], "hits": c["mla_hits"]},
            "kda": {
                "queries": c["kda_queries"],
                "hits": c["kda_hits"],
                "hit_tokens": c["kda_hit_tokens"],
            },
        }
