"""Explicit, typed decode caches, owned by the caller and passed into ``forward``.

Shape legend: B batch rows, T tokens, P KDA projection width (H*K), H heads, K key dim,
V value dim, W-1 conv tail length (short_conv_kernel_size - 1), S cache capacity in tokens,
C MLA latent width (kv_lora_rank), R MLA shared key width (qk_rope_head_dim), N slots of a state
pool, NB physical blocks of a paged pool, L tokens per block, MB block-table width.

* KDA keeps a constant-size state per sequence: the last ``W-1`` pre-conv inputs of q, k and v,
  and the fp32 recurrent state S[K, V] per head (architecture.md §3.5). Layout here is
  [B, H, K, V] (the spec's S); the official reference stores [B, H, V, K] (transpose).
* MLA keeps the compressed latent ``c_kv`` (after ``kv_a_layernorm``) and the shared key slice
  ``k_rope`` per token: C + R values (architecture.md §4, §14).

The model never allocates state on its modules; :class:`HybridCache` holds one entry per layer
and the per-row number of tokens already cached.

Layers talk to a cache entry through a small interface, so an engine can keep its state in pools:

* KDA (:class:`KDAStateEntry`): ``conv`` / ``recurrent`` (read the incoming state) and
  ``store(conv, recurrent)`` (write the outgoing one). :class:`KDALayerState` owns dense tensors;
  :class:`SlotKDAState` is a view of rows ``slots`` of a per-layer slot pool (gathered on read,
  scattered on store). Both can also ask for the state at positions inside the call (``marks``:
  the engine's prefix-cache snapshot points, so that one prefill forward may run past them); the
  layer hands those over with ``store_marks`` and they are kept on the entry as ``marked``.
* MLA (:class:`MLACacheEntry`): ``batch_size``, ``capacity``, ``write(rows, cols, latent, k_rope)``
  and ``read(used)``. :class:`MLALayerCache` owns a dense [B, S, *] buffer; :class:`PagedMLACache`
  addresses a paged block pool through per-row block tables (token position p of row b lives in
  physical block ``block_tables[b, p // L]`` at offset ``p % L``). Reads gather the visible prefix
  of one layer only, so the transient copy is one layer's history, never the whole model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from openk3.config import KDA, K3Config
from openk3.ops.cast import cast


class KDAStateEntry(Protocol):
    """The KDA layer's view of one layer's decode state (B rows); see the module docstring."""

    @property
    def conv(self) -> torch.Tensor:
        """[B, 3, P, W-1] pre-conv inputs of (q, k, v), oldest first; model dtype."""
        ...

    @property
    def recurrent(self) -> torch.Tensor:
        """[B, H, K, V] fp32 recurrent state S."""
        ...

    def store(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Replace the state of the B rows with conv [B, 3, P, W-1] and recurrent [B, H, K, V]."""
        ...

    @property
    def marks(self) -> tuple[tuple[int, int], ...]:
        """M pairs (row b, tokens t): the state of row b after the first t tokens of this call is
        wanted (0 < t <= the row's tokens, t a multiple of :data:`openk3.ops.kda.CHUNK_SIZE`);
        empty for none."""
        ...

    def store_marks(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Keep the states at :attr:`marks`: conv [M, 3, P, W-1], recurrent [M, H, K, V] fp32,
        in the order of the marks (read back as ``marked``)."""
        ...


class MLACacheEntry(Protocol):
    """The MLA layer's view of one layer's latent cache (B rows of S positions each)."""

    @property
    def batch_size(self) -> int:
        """Rows B."""
        ...

    @property
    def capacity(self) -> int:
        """S, positions each row can hold."""
        ...

    def write(
        self, rows: torch.Tensor, cols: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        """Store latent [M, C] and k_rope [M, R] of M tokens at (row, position) ``rows`` / ``cols`` [M]."""
        ...

    def read(self, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``used`` positions of every row: latent [B, used, C], k_rope [B, used, R]."""
        ...


@dataclass
class KDALayerState:
    """Per-layer KDA decode state.

    Attributes:
        conv: [B, 3, P, W-1] pre-conv inputs of (q, k, v), oldest first; model dtype.
        recurrent: [B, H, K, V] fp32 recurrent state S.
    """

    conv: torch.Tensor
    recurrent: torch.Tensor
    marks: tuple[tuple[int, int], ...] = ()
    marked: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def zeros(
        cls, config: K3Config, batch: int, device=None, dtype=torch.float32
    ) -> "KDALayerState":
        """Zero state/cache for ``batch`` rows (conv in ``dtype``, recurrent fp32) on ``device``."""
        P, W = config.linear_proj_dim, config.linear_conv_kernel_dim
        H, K = config.linear_num_heads, config.linear_head_dim
        return cls(
            conv=torch.zeros(batch, 3, P, W - 1, device=device, dtype=dtype),
            recurrent=torch.zeros(batch, H, K, K, device=device, dtype=torch.float32),
        )

    def index_select(self, rows: torch.Tensor) -> "KDALayerState":
        """The rows ``rows`` [B'] as a new state (copies)."""
        return KDALayerState(self.conv[rows], self.recurrent[rows])

    def store(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Overwrite the state in place: conv [B, 3, P, W-1], recurrent [B, H, K, V] (cast as needed)."""
        self.conv.copy_(conv)
        self.recurrent.copy_(recurrent)

    def store_marks(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Keep the states at ``marks`` as ``marked`` = (conv [M, 3, P, W-1] in this state's conv
        dtype, recurrent [M, H, K, V] fp32)."""
        self.marked = (cast(conv, self.conv.dtype), cast(recurrent, self.recurrent.dtype))


@dataclass
class SlotKDAState:
    """Rows ``slots`` of a per-layer KDA slot pool, presented as a layer state.

    Attributes:
        conv_pool: [N, 3, P, W-1] pre-conv tails of every slot; model dtype.
        recurrent_pool: [N, H, K, V] fp32 recurrent states of every slot.
        slots: [B] int64 pool rows of this batch (distinct, or repeated rows that store equal
            values).
        layer: None for the per-layer pools above; an index when ``conv_pool`` /
            ``recurrent_pool`` are the pools of every KDA layer stacked ([n_kda, N, ...], the
            engine's :class:`~openk3.engine.kv_pool.SlotPool`) and this state is that layer's.
        marks: (row, tokens) pairs whose states the call should also hand over
            (:class:`KDAStateEntry`); marked: after the call, (conv [M, 3, P, W-1],
            recurrent [M, H, K, V] fp32) at those marks, or None.
    ``conv`` / ``recurrent`` return gathered copies [B, ...]; :meth:`store` scatters back; the
    marked states stay on this object (the engine copies them into its snapshot pool).

    Why the stacked form: under ``torch.compile`` an in-place write through a view of a graph
    input (``pool[layer].index_copy_``) is functionalized into a rewrite of the whole base
    tensor, so every decode step copied every slot of the layer; :meth:`store` with ``layer``
    set is one ``index_put_`` on the stacked tensor itself, which Inductor keeps as a scatter of
    the B rows (measured on a [2, 64, 4, 64, 64] pool, B = 8: 745 -> 117 us per step).
    """

    conv_pool: torch.Tensor
    recurrent_pool: torch.Tensor
    slots: torch.Tensor
    layer: int | None = None
    marks: tuple[tuple[int, int], ...] = ()
    marked: tuple[torch.Tensor, torch.Tensor] | None = None

    def _of_layer(self, pool: torch.Tensor) -> torch.Tensor:
        return pool if self.layer is None else pool[self.layer]

    @property
    def conv(self) -> torch.Tensor:
        """[B, 3, P, W-1] gathered pre-conv tails of rows ``slots``."""
        return self._of_layer(self.conv_pool).index_select(0, self.slots)

    @property
    def recurrent(self) -> torch.Tensor:
        """[B, H, K, V] fp32 gathered recurrent states of rows ``slots``."""
        return self._of_layer(self.recurrent_pool).index_select(0, self.slots)

    def store(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Scatter conv [B, 3, P, W-1] and recurrent [B, H, K, V] into rows ``slots`` of the pools."""
        conv = cast(conv, self.conv_pool.dtype)
        recurrent = cast(recurrent, self.recurrent_pool.dtype)
        if self.layer is None:
            self.conv_pool.index_copy_(0, self.slots, conv)
            self.recurrent_pool.index_copy_(0, self.slots, recurrent)
            return
        at = (torch.full_like(self.slots, self.layer), self.slots)
        self.conv_pool.index_put_(at, conv)
        self.recurrent_pool.index_put_(at, recurrent)

    def store_marks(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Keep the states at ``marks`` as ``marked`` = (conv [M, 3, P, W-1] in the pool's conv
        dtype, recurrent [M, H, K, V] fp32); the pools are not touched."""
        self.marked = (cast(conv, self.conv_pool.dtype), cast(recurrent, self.recurrent_pool.dtype))


@dataclass
class MLALayerCache:
    """Per-layer MLA latent cache with fixed capacity S.

    Attributes:
        latent: [B, S, C] normalised compressed kv (``kv_a_layernorm`` output); model dtype.
        k_rope: [B, S, R] the shared (unrotated) key slice.
    Row b holds valid entries at positions ``[0, lengths[b])`` where ``lengths`` lives on the
    owning :class:`HybridCache`.
    """

    latent: torch.Tensor
    k_rope: torch.Tensor

    @classmethod
    def zeros(
        cls, config: K3Config, batch: int, capacity: int, device=None, dtype=torch.float32
    ) -> "MLALayerCache":
        """Zero latent [B, S, C] and k_rope [B, S, R] in ``dtype`` on ``device`` (S = ``capacity``)."""
        return cls(
            latent=torch.zeros(batch, capacity, config.kv_lora_rank, device=device, dtype=dtype),
            k_rope=torch.zeros(
                batch, capacity, config.qk_rope_head_dim, device=device, dtype=dtype
            ),
        )

    @property
    def capacity(self) -> int:
        """Tokens per row the cache can hold."""
        return self.latent.shape[1]

    @property
    def batch_size(self) -> int:
        """Rows B."""
        return self.latent.shape[0]

    def write(
        self, rows: torch.Tensor, cols: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        """Store latent [M, C] and k_rope [M, R] of M tokens at (row, position) pairs ``rows``/``cols`` [M]."""
        self.latent[rows, cols] = cast(latent, self.latent.dtype)
        self.k_rope[rows, cols] = cast(k_rope, self.k_rope.dtype)

    def read(self, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``[0, used)`` of every row: (latent [B, used, C], k_rope [B, used, R])."""
        return self.latent[:, :used], self.k_rope[:, :used]


@dataclass
class PagedMLACache:
    """One MLA layer's view of a paged latent pool through per-row block tables.

    Attributes:
        latent_pool: [NB, L, C] normalised latent of every physical block; model dtype.
        k_rope_pool: [NB, L, R] shared key slice of every physical block.
        block_tables: [B, MB] int64 physical block of each logical block of each row; entries
            past a row's last allocated block may hold any valid block id (never read unmasked).
        layer: None for the per-layer pools above; an index when the two pools are those of
            every MLA layer stacked ([n_mla, NB, L, ...], the engine's
            :class:`~openk3.engine.kv_pool.MLABlockPool`) and this view is that layer's
            (writes are then one ``index_put_`` on the stacked tensor: see :class:`SlotKDAState`
            for why; a [2, 2000, 16, 64] pool, 8 rows, compiled: 1.26 ms -> 34 us per write and
            read).
    Capacity per row is MB * L tokens. Blocks shared between rows (prefix cache) must only be
    read: writers address positions at or after their row's ``past_lengths``, which the engine
    keeps in private blocks.
    """

    latent_pool: torch.Tensor
    k_rope_pool: torch.Tensor
    block_tables: torch.Tensor
    layer: int | None = None

    def _of_layer(self, pool: torch.Tensor) -> torch.Tensor:
        return pool if self.layer is None else pool[self.layer]

    @property
    def block_size(self) -> int:
        """Tokens per block L."""
        return self.latent_pool.shape[-2]

    @property
    def capacity(self) -> int:
        """Tokens per row the cache can hold."""
        return self.block_tables.shape[1] * self.block_size

    @property
    def batch_size(self) -> int:
        """Rows B."""
        return self.block_tables.shape[0]

    def write(
        self, rows: torch.Tensor, cols: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        """Store latent [M, C] and k_rope [M, R] of M tokens at (row, position) pairs ``rows``/``cols`` [M]."""
        L = self.block_size
        block, offset = self.block_tables[rows, cols // L], cols % L
        at = (
            (block, offset)
            if self.layer is None
            else (torch.full_like(block, self.layer), block, offset)
        )
        self.latent_pool.index_put_(at, cast(latent, self.latent_pool.dtype))
        self.k_rope_pool.index_put_(at, cast(k_rope, self.k_rope_pool.dtype))

    def read(self, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather positions ``[0, used)`` of every row: (latent [B, used, C], k_rope [B, used, R]).

        Whole blocks are gathered (``index_select`` of the first ceil(used / L) table entries per
        row, then cut to ``used``): a block is L contiguous rows of the pool, and gathering it as one
        unit is ~6x faster on the CPU than indexing every position (3.7 -> 0.6 ms at 24K tokens).
        """
        B, L = self.batch_size, self.block_size
        nb = -(-used // L)
        blocks = self.block_tables[:, :nb].reshape(-1)
        return (
            self._of_layer(self.latent_pool).index_select(0, blocks).view(B, nb * L, -1)[:, :used],
            self._of_layer(self.k_rope_pool).index_select(0, blocks).view(B, nb * L, -1)[:, :used],
        )


@dataclass
class HybridCache:
    """One state per decoder layer plus per-row cached lengths.

    Attributes:
        layers: a :class:`KDAStateEntry` (``KDALayerState``, ``SlotKDAState``) per KDA layer, an
            :class:`MLACacheEntry` (``MLALayerCache``, ``PagedMLACache``) per MLA layer.
        lengths: [B] int64, tokens already processed per row (before the current forward).
    """

    layers: list[KDAStateEntry | MLACacheEntry]
    lengths: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    @classmethod
    def empty(
        cls, config: K3Config, batch: int, capacity: int, device=None, dtype=torch.float32
    ) -> "HybridCache":
        """Zero states for ``batch`` rows and room for ``capacity`` tokens per row in MLA layers."""
        layers = [
            KDALayerState.zeros(config, batch, device, dtype)
            if t == KDA
            else MLALayerCache.zeros(config, batch, capacity, device, dtype)
            for t in config.layer_types
        ]
        return cls(layers=layers, lengths=torch.zeros(batch, dtype=torch.long, device=device))

    @property
    def batch_size(self) -> int:
        """Rows B."""
        return int(self.lengths.shape[0])

    def check_room(self, new_tokens: torch.Tensor) -> None:
        """Raise before a forward that would overflow an MLA cache's per-row capacity.

        Args:
            new_tokens: [B] tokens each row is about to append.
        Raises:
            ValueError: naming the row, its cached length and the capacity.
        """
        capacities = [e.capacity for e in self.layers if hasattr(e, "capacity")]
        if not capacities:
            return  # KDA state is constant-size
        cap = min(capacities)
        need = self.lengths.to(new_tokens.device) + new_tokens
        if bool((need > cap).any()):
            b = int(torch.argmax((need > cap).to(torch.int8)))
            raise ValueError(
                f"cache overflow: row {b} holds {int(self.lengths[b])} tokens and needs {int(new_tokens[b])} more, "
                f"capacity is {cap}"
            )
