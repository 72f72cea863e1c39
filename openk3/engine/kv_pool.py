"""Decode-state memory of the engine: a paged MLA latent pool, a KDA slot pool and a KDA snapshot
pool, sized from one memory budget with the planner's formulas.

Shape legend: NB physical MLA blocks, L tokens per block (``block_size``), C latent width
(``kv_lora_rank``), R shared key width (``qk_rope_head_dim``), M MLA layers, NK KDA layers,
N slots (or snapshots), P KDA projection width, W conv kernel, H heads, K head dim, V vocabulary.

* :class:`MLABlockPool` — latent [M, NB, L, C] + k_rope [M, NB, L, R] (model dtype). Blocks are
  reference counted; a block that is registered in the prefix cache and no longer referenced is
  *evictable* (kept, LRU order) until an allocation needs it. Admission reserves blocks up front
  (``reserve``), so allocations never fail and nothing runs out of memory mid-generation.
* :class:`KDAStatePool` — conv [NK, N, 3, P, W-1] (model dtype) + recurrent [NK, N, H, K, K] fp32:
  one row per running request (the *slot*), or per snapshot.
* :class:`SnapshotPool` — a :class:`KDAStatePool` plus, per entry, the MLA latents of up to L-1
  tokens after the last full block and one fp32 logits row, indexed by prefix hash key with its
  own LRU (performance.md §2.5: two pools, separate LRU).
* :func:`cache_layout` — how many of each fit a budget (one formula set: :mod:`.planner`).

All pools are zero-initialised: masked cache positions are multiplied by zero probabilities, and
uninitialised memory could hold NaN (0 * NaN = NaN). On CPU the zeros are committed lazily
(:func:`pool_zeros`), so a pool sized for a 1M-token context costs resident memory only as far
as it is written.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

import numpy as np

from openk3.cache import PagedMLACache, SlotKDAState
from openk3.config import KDA, MLA, K3Config
from openk3.engine.planner import kda_state_bytes, kv_bytes_per_token, snapshot_bytes

# numpy dtypes of the same item size: a CPU pool is allocated as numpy zeros and viewed as this dtype.
_NUMPY_ITEM = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.bfloat16: np.uint16,
}


def pool_zeros(*shape: int, device, dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor for a cache pool.

    On CPU the memory comes from ``calloc`` (through numpy), whose large allocations are fresh
    zero pages that the OS commits on first write, so a pool reserved for the longest context
    costs resident memory only as far as it is used (``torch.zeros`` writes every byte up front:
    ~0.5 s and 800 MB resident for an 800 MB pool). Elsewhere: ``torch.zeros``.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cpu" or dtype not in _NUMPY_ITEM:
        return torch.zeros(*shape, device=dev, dtype=dtype)
    return torch.from_numpy(np.zeros(shape, dtype=_NUMPY_ITEM[dtype])).view(dtype)


# ----------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class CacheLayout:
    """Pool sizes for one budget. Bytes are exact: the pools allocate exactly these tensors."""

    block_size: int
    num_blocks: int
    num_slots: int
    num_snapshots: int
    block_bytes: int
    slot_bytes: int
    snapshot_bytes: int

    @property
    def total_bytes(self) -> int:
        """Bytes of all three pools."""
        return (
            self.num_blocks * self.block_bytes
            + self.num_slots * self.slot_bytes
            + self.num_snapshots * self.snapshot_bytes
        )


def cache_layout(
    config: K3Config,
    cache_memory: int,
    *,
    block_size: int,
    max_num_seqs: int,
    snapshot_fraction: float,
    dtype: torch.dtype,
) -> CacheLayout:
    """Split ``cache_memory`` bytes into snapshots, KDA slots and MLA blocks.

    Rule: snapshots get ``snapshot_fraction`` of the budget (0 disables them); of the rest, KDA
    slots take ``max_num_seqs`` states when that leaves at least half for MLA blocks, otherwise
    half the rest (at least one slot); MLA blocks take what remains.

    Raises:
        ValueError: the budget cannot hold one KDA state and one MLA block.
    """
    block_b = block_size * kv_bytes_per_token(config, dtype)
    slot_b = kda_state_bytes(config, dtype)["total"]
    snap_b = snapshot_bytes(config, block_size, dtype)
    n_snap = int(cache_memory * snapshot_fraction) // snap_b if snapshot_fraction > 0 else 0
    rest = cache_memory - n_snap * snap_b
    n_slots = (
        max_num_seqs
        if max_num_seqs * slot_b <= rest // 2
        else max(1, (rest // 2) // max(slot_b, 1))
    )
    n_slots = min(n_slots, max_num_seqs)
    n_blocks = (rest - n_slots * slot_b) // block_b if block_b else 0
    if n_blocks < 1 or rest < slot_b:
        raise ValueError(
            f"cache_memory={cache_memory}: too small for one KDA state ({slot_b} B) plus one MLA block of "
            f"{block_size} tokens ({block_b} B)"
        )
    return CacheLayout(
        block_size, int(n_blocks), int(n_slots), int(n_snap), block_b, slot_b, snap_b
    )


# ----------------------------------------------------------------------------- MLA blocks
class MLABlockPool:
    """Paged MLA latent storage with reference counts, prefix-cache keys and an evictable LRU.

    Args:
        config: reads layer_types, kv_lora_rank, qk_rope_head_dim.
        num_blocks: NB; block_size: L.
    Attributes:
        latent: [M, NB, L, C]; k_rope: [M, NB, L, R] (``latent[j]`` is MLA layer j's pool).
    """

    def __init__(
        self, config: K3Config, num_blocks: int, block_size: int, device, dtype: torch.dtype
    ) -> None:
        n_mla = config.layer_types.count(MLA)
        self.block_size = block_size
        self.num_blocks = num_blocks
        C, R = config.mla_cache_dims
        self.latent = pool_zeros(n_mla, num_blocks, block_size, C, device=device, dtype=dtype)
        self.k_rope = pool_zeros(n_mla, num_blocks, block_size, R, device=device, dtype=dtype)
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self.key_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        self.reserved = 0
        self.evictions = 0

    # counters
    @property
    def num_free(self) -> int:
        """Entries neither in use nor cached."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no request references (reusable, LRU order)."""
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        """Entries in use (blocks: referenced by a request; snapshots: stored)."""
        return self.num_blocks - self.num_free - self.num_evictable

    @property
    def num_available(self) -> int:
        """Blocks an allocation may still take: free + evictable - reserved."""
        return self.num_free + self.num_evictable - self.reserved

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's tensors."""
        return self.latent.nbytes + self.k_rope.nbytes

    # reservations (admission control)
    def reserve(self, n: int) -> None:
        """Promise ``n`` future allocations. Raises RuntimeError when they are not available."""
        if n > self.num_available:
            raise RuntimeError(
                f"MLA pool: cannot reserve {n} blocks, {self.num_available} available"
            )
        self.reserved += n

    def unreserve(self, n: int) -> None:
        """Give back ``n`` reserved, never-allocated blocks."""
        self.reserved -= n

    # blocks
    def allocate(self) -> int:
        """Take a block (refcount 1) out of a reservation: a free one, else evict the LRU cached one."""
        if self._free:
            b = self._free.popleft()
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)
            del self.block_of[self.key_of.pop(b)]
            self.evictions += 1
        else:
            raise RuntimeError("MLA pool exhausted (allocation outside a reservation)")
        self.reserved -= 1
        self.refcount[b] = 1
        return b

    def incref(self, b: int) -> None:
        """Add a reference to block ``b`` (taking it out of the evictable set)."""
        if self.refcount[b] == 0:
            del self._evictable[b]
        self.refcount[b] += 1

    def decref(self, b: int) -> None:
        """Drop a reference; at zero the block becomes evictable if published, else free."""
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            if b in self.key_of:
                self._evictable[b] = None
            else:
                self._free.append(b)

    def register(self, b: int, key: bytes) -> bool:
        """Publish block ``b`` (full, immutable) under prefix key ``key``; False if the key is taken."""
        if key in self.block_of or b in self.key_of:
            return False
        self.key_of[b] = key
        self.block_of[key] = b
        return True

    def lookup(self, key: bytes) -> int | None:
        """The block published under ``key``, or None."""
        return self.block_of.get(key)


# ----------------------------------------------------------------------------- KDA states
class KDAStatePool:
    """N rows of full-model KDA state.

    Attributes:
        conv: [NK, N, 3, P, W-1] model dtype; recurrent: [NK, N, H, K, K] fp32.
    """

    def __init__(self, config: K3Config, n: int, device, dtype: torch.dtype) -> None:
        n_kda = config.layer_types.count(KDA)
        P = config.linear_proj_dim
        H, K, W = config.kda_state_dims
        self.n = n
        self.conv = pool_zeros(n_kda, n, 3, P, W - 1, device=device, dtype=dtype)
        self.recurrent = pool_zeros(n_kda, n, H, K, K, device=device, dtype=torch.float32)

    @classmethod
    def of(cls, conv: torch.Tensor, recurrent: torch.Tensor) -> "KDAStatePool":
        """A pool over existing tensors conv [NK, N, 3, P, W-1] and recurrent [NK, N, H, K, K]
        (no copy): the states a forward captured at its marks, as rows to copy from."""
        pool = cls.__new__(cls)
        pool.n = conv.shape[1]
        pool.conv = conv
        pool.recurrent = recurrent
        return pool

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's tensors."""
        return self.conv.nbytes + self.recurrent.nbytes

    def zero_(self, i: int) -> None:
        """Zero row ``i`` (all KDA layers)."""
        self.conv[:, i].zero_()
        self.recurrent[:, i].zero_()

    def copy_row(self, dst: int, src_pool: "KDAStatePool", src: int) -> None:
        """Row ``dst`` of this pool := row ``src`` of ``src_pool`` (all KDA layers)."""
        self.conv[:, dst].copy_(src_pool.conv[:, src])
        self.recurrent[:, dst].copy_(src_pool.recurrent[:, src])


class SlotPool(KDAStatePool):
    """KDA working state, one slot per running request; slots are zeroed on allocation."""

    def __init__(self, config: K3Config, n: int, device, dtype: torch.dtype) -> None:
        super().__init__(config, n, device, dtype)
        self._free: deque[int] = deque(range(n))

    @property
    def num_free(self) -> int:
        """Entries neither in use nor cached."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Entries in use (blocks: referenced by a request; snapshots: stored)."""
        return self.n - len(self._free)

    def allocate(self) -> int:
        """A zeroed slot. Raises RuntimeError when none is free (admission checks first)."""
        if not self._free:
            raise RuntimeError("KDA slot pool exhausted")
        s = self._free.popleft()
        self.zero_(s)
        return s

    def release(self, s: int) -> None:
        """Return slot ``s`` to the free list."""
        self._free.append(s)


def layer_views(
    layer_pools: list[tuple[str, int]],
    blocks: MLABlockPool,
    slots: SlotPool,
    slot_ids: torch.Tensor,
    tables: torch.Tensor,
    marks: tuple[tuple[int, int], ...] = (),
) -> list:
    """The per-layer cache views of one forward over the pools, in decoder-layer order.

    Args:
        layer_pools: per decoder layer, ``("kda", i)`` or ``("mla", i)``: its index into the pools.
        blocks, slots: the MLA block pool and the KDA slot pool the views read and write.
        slot_ids: [B] int64, each row's KDA slot.
        tables: [B, MB] int64, each row's MLA block ids (padded with any valid block id).
        marks: (row, tokens into the forward) pairs at which every KDA layer also hands over its
            state (:class:`~openk3.cache.SlotKDAState` ``marks``).
    Returns:
        ``SlotKDAState`` for a KDA layer, ``PagedMLACache`` for an MLA layer, each over the
        stacked pools with its layer index (no copies; writes go to the stacked tensors).
    """
    return [
        SlotKDAState(slots.conv, slots.recurrent, slot_ids, layer=i, marks=marks)
        if kind == "kda"
        else PagedMLACache(blocks.latent, blocks.k_rope, tables, layer=i)
        for kind, i in layer_pools
    ]


@dataclass
class Snapshot:
    """Index entry of a stored snapshot: pool row, prefix length ``position``, how many latent
    tail tokens (``position % L``) it carries, the key of the last full block before it (``parent``,
    tail entries only) and whether it holds the logits after ``position``."""

    row: int
    position: int
    tail_len: int
    parent: bytes | None = None
    has_logits: bool = False


class SnapshotPool(KDAStatePool):
    """KDA state snapshots at prefix boundaries, keyed by prefix hash, with their own LRU.

    Attributes (besides the KDA state rows):
        tail_latent: [M, N, L-1, C]; tail_k_rope: [M, N, L-1, R] MLA latents of the tokens after
        the last full block (unaligned boundaries only); logits: [N, V] fp32.
    """

    def __init__(
        self, config: K3Config, n: int, block_size: int, device, dtype: torch.dtype
    ) -> None:
        super().__init__(config, n, device, dtype)
        n_mla = config.layer_types.count(MLA)
        t = max(block_size - 1, 0)
        C, R = config.mla_cache_dims
        self.tail_latent = pool_zeros(n_mla, n, t, C, device=device, dtype=dtype)
        self.tail_k_rope = pool_zeros(n_mla, n, t, R, device=device, dtype=dtype)
        self.logits = pool_zeros(n, config.vocab_size, device=device, dtype=torch.float32)
        self._free: deque[int] = deque(range(n))
        self._index: OrderedDict[bytes, Snapshot] = OrderedDict()  # least recently used first
        self._tails: dict[bytes, dict[bytes, int]] = {}  # parent key -> {key: tail length}
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's tensors."""
        return (
            super().nbytes + self.tail_latent.nbytes + self.tail_k_rope.nbytes + self.logits.nbytes
        )

    @property
    def num_used(self) -> int:
        """Entries in use (blocks: referenced by a request; snapshots: stored)."""
        return len(self._index)

    @property
    def num_free(self) -> int:
        """Entries neither in use nor cached."""
        return self.n - len(self._index)

    def get(self, key: bytes, touch: bool = False) -> Snapshot | None:
        """The entry under ``key`` (refreshing its LRU position only if ``touch``)."""
        snap = self._index.get(key)
        if snap is not None and touch:
            self._index.move_to_end(key)
        return snap

    def tails_after(self, parent: bytes) -> dict[bytes, int]:
        """{key: tail length} of the unaligned entries that continue the full-block prefix ``parent``
        (several tails of one length may coexist: different tokens after the same blocks)."""
        return self._tails.get(parent, {})

    def put(
        self, key: bytes, position: int, tail_len: int, parent: bytes | None
    ) -> Snapshot | None:
        """A new entry (evicting the LRU one when full); the caller fills its row. None if n == 0."""
        if self.n == 0:
            return None
        if self._free:
            row = self._free.popleft()
        else:
            old_key, old = self._index.popitem(last=False)
            row = old.row
            self.evictions += 1
            if old.parent is not None:
                tails = self._tails[old.parent]
                del tails[old_key]
                if not tails:
                    del self._tails[old.parent]
        snap = Snapshot(row, position, tail_len, parent)
        self._index[key] = snap
        if parent is not None:
            self._tails.setdefault(parent, {})[key] = tail_len
        return snap
