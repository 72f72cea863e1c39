"""Explicit, typed decode caches, owned by the caller and passed into ``forward``.

Shape legend: B batch rows, T tokens, P KDA projection width (H*K), H heads, K key dim,
V value dim, W-1 conv tail length (short_conv_kernel_size - 1), S cache capacity in tokens,
C MLA latent width (kv_lora_rank), R MLA shared key width (qk_rope_head_dim).

* KDA keeps a constant-size state per sequence: the last ``W-1`` pre-conv inputs of q, k and v,
  and the fp32 recurrent state S[K, V] per head (architecture.md §3.5). Layout here is
  [B, H, K, V] (the spec's S); the official reference stores [B, H, V, K] (transpose).
* MLA keeps the compressed latent ``c_kv`` (after ``kv_a_layernorm``) and the shared key slice
  ``k_rope`` per token: C + R values (architecture.md §4, §14).

The model never allocates state on its modules; :class:`HybridCache` holds one entry per layer
and the per-row number of tokens already cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from openk3.config import KDA, K3Config


@dataclass
class KDALayerState:
    """Per-layer KDA decode state.

    Attributes:
        conv: [B, 3, P, W-1] pre-conv inputs of (q, k, v), oldest first; model dtype.
        recurrent: [B, H, K, V] fp32 recurrent state S.
    """

    conv: torch.Tensor
    recurrent: torch.Tensor

    @classmethod
    def zeros(cls, config: K3Config, batch: int, device=None, dtype=torch.float32) -> "KDALayerState":
        P, W = config.linear_proj_dim, config.linear_conv_kernel_dim
        H, K = config.linear_num_heads, config.linear_head_dim
        return cls(
            conv=torch.zeros(batch, 3, P, W - 1, device=device, dtype=dtype),
            recurrent=torch.zeros(batch, H, K, K, device=device, dtype=torch.float32),
        )

    def index_select(self, rows: torch.Tensor) -> "KDALayerState":
        return KDALayerState(self.conv[rows], self.recurrent[rows])


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
    def zeros(cls, config: K3Config, batch: int, capacity: int, device=None, dtype=torch.float32) -> "MLALayerCache":
        return cls(
            latent=torch.zeros(batch, capacity, config.kv_lora_rank, device=device, dtype=dtype),
            k_rope=torch.zeros(batch, capacity, config.qk_rope_head_dim, device=device, dtype=dtype),
        )

    @property
    def capacity(self) -> int:
        return self.latent.shape[1]


@dataclass
class HybridCache:
    """One state per decoder layer plus per-row cached lengths.

    Attributes:
        layers: ``KDALayerState`` for KDA layers, ``MLALayerCache`` for MLA layers.
        lengths: [B] int64, tokens already processed per row (before the current forward).
    """

    layers: list
    lengths: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    @classmethod
    def empty(cls, config: K3Config, batch: int, capacity: int, device=None, dtype=torch.float32) -> "HybridCache":
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
        return int(self.lengths.shape[0])
