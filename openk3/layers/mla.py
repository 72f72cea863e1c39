"""Gated multi-head latent attention with NoPE (K3's full-attention layer; also Kimi Linear's).

Shape legend: B batch rows, T tokens of this call, S cache capacity, D hidden size, H heads,
N qk_nope_head_dim, R qk_rope_head_dim (the "rope" slice, never rotated), V v_head_dim,
C kv_lora_rank (latent width), Q q_lora_rank.

Equations (architecture.md §4, k3-release-notes.md §1.5, fixture README "Conventions"):

    q            = W_UQ RMSNorm_q(W_DQ x)        (or q_proj x when q_lora_rank is None)
                   per head [q^C (N) | q^R (R)]
    [c_kv | k^R] = W_DKV x ;  ĉ = RMSNorm_kv(c_kv)
    [k^C_h | v_h] = W_UKV,h ĉ                      (kv_b_proj rows per head: [k^C (N) | v (V)])
    o_h          = softmax_j((q^C_h·k^C_{h,j} + q^R_h·k^R_j) · (N+R)^-1/2, causal) · v_{h,j}
    y            = o_proj( sigmoid(g_proj x) ⊙ concat_h o_h )   (gate only if mla_use_output_gate)

Both latent norms use eps 1e-6 (the reference builds them with its RMSNorm default), not
``rms_norm_eps``. The cached path uses the absorbed form: q̃_h = W_UK,hᵀ q^C_h scores against
ĉ directly and o_h = W_UV,h Σ_j p_j ĉ_j; the gate sits between W_UV and o_proj, so W_UV cannot be
folded into o_proj.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.cache import MLACacheEntry
from openk3.config import K3Config
from openk3.layers.norm import RMSNorm
from openk3.ops.attention import causal_attention, latent_attention
from openk3.ops.varlen import check_cache_room, check_lengths, check_past_lengths
from openk3.weight_init import init_module

# eps of q_a_layernorm / kv_a_layernorm: the reference's RMSNorm default, not config.rms_norm_eps.
MLA_LATENT_NORM_EPS = 1e-6


class GatedMLA(nn.Module):
    """Gated MLA (NoPE) layer; attribute names are the checkpoint tensor names.

    Parameters (all bias-free):
        q_proj [H*(N+R), D] if ``q_lora_rank is None``, else q_a_proj [Q, D], q_a_layernorm [Q],
        q_b_proj [H*(N+R), Q]; kv_a_proj_with_mqa [C+R, D]; kv_a_layernorm [C];
        kv_b_proj [H*(N+V), C]; g_proj [H*V, D] (only if ``mla_use_output_gate``); o_proj [D, H*V].

    Source: architecture.md §4; config fields ``num_attention_heads``, ``q_lora_rank``,
    ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
    ``mla_use_output_gate``.
    """

    def __init__(self, config: K3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = D = config.hidden_size
        self.num_heads = H = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = C = config.kv_lora_rank
        self.qk_nope_head_dim = N = config.qk_nope_head_dim
        self.qk_rope_head_dim = R = config.qk_rope_head_dim
        self.v_head_dim = V = config.v_head_dim
        self.use_output_gate = config.mla_use_output_gate
        self.scaling = (N + R) ** -0.5
        self.initializer_range = config.initializer_range

        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * (N + R), bias=False)
        else:
            self.q_a_proj = nn.Linear(D, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=MLA_LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, H * (N + R), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, C + R, bias=False)
        self.kv_a_layernorm = RMSNorm(C, eps=MLA_LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(C, H * (N + V), bias=False)
        if self.use_output_gate:
            self.g_proj = nn.Linear(D, H * V, bias=False)
        self.o_proj = nn.Linear(H * V, D, bias=False)
        self.init_weights()

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Linear weights ~ normal(0, ``initializer_range``), norm weights = 1 (not public for K3,
        architecture.md §16; DeepSeek/transformers default), by :mod:`openk3.weight_init`. Safe
        after meta-device construction."""
        init_module(self, self.initializer_range, is_k3=True, generator=generator)

    # ------------------------------------------------------------------ projections
    def _queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> (q_nope [B, T, H, N], q_rope [B, T, H, R])."""
        B, T, _ = x.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        return q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

    def _latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> (normalised latent ĉ [B, T, C], shared key k^R [B, T, R])."""
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        return self.kv_a_layernorm(c_kv), k_rope

    def _kv_b_heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: (W_UK [H, N, C], W_UV [H, V, C])."""
        w = self.kv_b_proj.weight.view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank
        )
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def _output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Head outputs o [B, T, H*V] -> gate (if any) -> o_proj -> [B, T, D]."""
        if self.use_output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    # ---------------------------------------------------------------------- forward
    def forward(
        self,
        x: torch.Tensor,
        cache: MLACacheEntry | None = None,
        *,
        lengths: torch.Tensor | None = None,
        past_lengths: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_logits_out: torch.Tensor | None = None,
        validate: bool = True,
    ) -> torch.Tensor:
        """Attend causally over this call's tokens (and the cached history, if a cache is given).

        Args:
            x: [B, T, D] the RMSNorm'd layer input (``input_layernorm`` output).
            cache: caller-owned latent cache (``MLALayerCache`` or the engine's paged
                ``PagedMLACache``), updated in place: the valid new tokens' ĉ and k^R are
                written at positions ``past_lengths[b] .. past_lengths[b] + lengths[b] - 1``.
                None = full causal form over x alone (expanded k/v, SDPA).
            lengths: [B] int64 valid tokens per row (right padding) or None (all T). Outputs at
                padded positions are ``o_proj(0) = 0``.
            past_lengths: [B] int64 tokens already cached per row (``HybridCache.lengths``); only
                with a cache; None = empty cache.
            cu_seqlens: [N+1] int64 packed document boundaries (B = 1, no cache): attention is
                block-diagonal causal.
            max_logits_out: [H] float, updated in place with the per-head max of the scaled
                pre-softmax logits over valid pairs (QK-Clip input, architecture.md §9).
            validate: check the values of ``lengths`` / ``past_lengths`` and the cache room
                (host reads). False when the caller checked them (:meth:`K3Model.forward`): then
                ``lengths`` / ``past_lengths`` must be int64 on x's device.
        Returns:
            [B, T, D] in x.dtype.
        Raises:
            ValueError: bad shapes/lengths, cu_seqlens with a cache, past_lengths without one,
                or a write past the cache capacity (named); shapes only when ``validate=False``.
        """
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected [B, T, D={self.hidden_size}], got {tuple(x.shape)}")
        if cache is None:
            if past_lengths is not None:
                raise ValueError("past_lengths: only meaningful with a cache")
            return self._forward_full(x, lengths, cu_seqlens, max_logits_out, validate)
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens: packed documents are not supported with a cache")
        return self._forward_cached(x, cache, lengths, past_lengths, max_logits_out, validate)

    def _forward_full(
        self,
        x: torch.Tensor,
        lengths: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
        max_logits_out: torch.Tensor | None,
        validate: bool = True,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        H, N, V = self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        q_nope, q_rope = self._queries(x)
        latent, k_rope = self._latent(x)
        kv = self.kv_b_proj(latent).view(B, T, H, N + V)
        k_nope, v = kv.split([N, V], dim=-1)
        k = torch.cat(
            [k_nope, k_rope[:, :, None, :].expand(B, T, H, self.qk_rope_head_dim)], dim=-1
        )
        q = torch.cat([q_nope, q_rope], dim=-1)
        o = causal_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            scale=self.scaling,
            lengths=lengths,
            cu_seqlens=cu_seqlens,
            max_logits_out=max_logits_out,
            validate=validate,
        )
        return self._output(x, o.transpose(1, 2).reshape(B, T, H * V))

    def _forward_cached(
        self,
        x: torch.Tensor,
        cache: MLACacheEntry,
        lengths: torch.Tensor | None,
        past_lengths: torch.Tensor | None,
        max_logits_out: torch.Tensor | None,
        validate: bool = True,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        dev = x.device
        if cache.batch_size != B:
            raise ValueError(f"cache: holds {cache.batch_size} rows, x has B={B}")
        if validate:
            lengths, past_lengths = (
                None if v is None else v.to(dev, torch.long) for v in (lengths, past_lengths)
            )
        past = (
            torch.zeros(B, dtype=torch.long, device=dev) if past_lengths is None else past_lengths
        )
        if validate:
            self._check_room(cache, lengths, past, T)

        q_nope, q_rope = self._queries(x)
        latent, k_rope = self._latent(x)
        t = torch.arange(T, device=dev)
        cols = past[:, None] + t[None, :]  # [B, T] cache position of every new token
        if lengths is None:  # every position is a real token: a fixed-size write, no mask
            rows = torch.arange(B, device=dev)[:, None].expand(B, T)
            cache.write(
                rows.reshape(-1),
                cols.reshape(-1),
                latent.reshape(B * T, -1),
                k_rope.reshape(B * T, -1),
            )
        else:  # right padding: write the valid tokens only (a boolean gather, whose size the host reads)
            valid = t[None, :] < lengths[:, None]  # [B, T]
            rows = torch.arange(B, device=dev)[:, None].expand(B, T)[valid]
            cache.write(rows, cols[valid], latent[valid], k_rope[valid])

        w_uk, w_uv = self._kv_b_heads()
        q_latent = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)
        # The whole capacity, positions past each row's end masked by the attention: a read sized
        # by the furthest write would need that end on the host (a sync) and change shape every
        # step. The engine's block tables end at its rows' last block, so little is masked; a
        # caller-owned dense cache should be sized to what it will hold.
        cached_latent, cached_k_rope = cache.read(cache.capacity)
        ctx = latent_attention(
            q_latent,
            q_rope,
            cached_latent,
            cached_k_rope,
            past,
            scale=self.scaling,
            lengths=lengths,
            max_logits_out=max_logits_out,
            validate=False,
        )
        o = torch.einsum("bthc,hvc->bthv", ctx, w_uv)
        return self._output(x, o.reshape(B, T, self.num_heads * self.v_head_dim))

    @staticmethod
    def _check_room(cache, lengths: torch.Tensor | None, past: torch.Tensor, T: int) -> None:
        """Raise unless ``lengths`` [B] lie in [0, T], ``past`` [B] is non-negative and every
        row's end fits the cache (three host reads)."""
        B = cache.batch_size
        if lengths is not None:
            check_lengths(lengths, B, T)
        check_past_lengths(past, B)
        check_cache_room(past, lengths, T, cache.capacity)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope={self.qk_nope_head_dim}, qk_rope={self.qk_rope_head_dim}, v={self.v_head_dim}, "
            f"output_gate={self.use_output_gate}"
        )
