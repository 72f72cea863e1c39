"""Absorbed MLA attention over a latent cache, in cache-sized tiles: the fast prefill path.

Shape legend: B batch rows, T new query tokens, H heads, C latent width (kv_lora_rank), R shared
key width (qk_rope_head_dim), S cached positions, n valid queries of a row, r query rows of a tile
(tokens x heads), s keys of a tile.

Same function as :func:`openk3.ops.attention.latent_attention_reference` (the dense form, which
stays the readable oracle): query t of row b sees cache positions ``j < past_lengths[b] + t + 1``,
and the result is ``Σ_j softmax_j(logit) · latent[b, j]`` per head. What differs is the evaluation
order, which keeps the work in matrix products:

* In the absorbed form every head scores against the same key ``[ĉ_j | k^R_j]`` (one latent per
  token, architecture.md §4), so the heads fold into the query rows: one tile is a single
  ``[r, C+R] @ [C+R, s]`` product with r = tokens x heads, never a per-head batch.
* The softmax offset is fixed per query row up front and folded into the product: queries carry
  an extra column ``-m`` against a column of ones on the keys, so a tile comes out already shifted.
  Scores are kept in base 2 (queries pre-multiplied by log2 e, so ``exp2`` of a score is ``exp`` of
  the natural logit): torch's CPU ``exp2`` runs ~3x faster than its ``exp`` (measured 0.28 vs 0.81
  ns per element, AVX-512, 1 thread) at the same fp32 accuracy, and the exponential is a third of
  a tile's time. Values are the latent itself (C columns) and the denominators a row sum of each
  tile (an in-cache pass; cheaper than a ones column, which would make the second product C + 1
  wide). ``m`` is an upper bound of the row's logits (per channel ``q·max k`` or
  ``q·min k``, and Cauchy-Schwarz, whichever is tighter, over the visible keys) minus
  :data:`BOUND_MARGIN`, so no ``exp`` exceeds e^30 and no tile needs a maximum or a rescale: a
  tile is one product, one ``exp2``, one row sum and one product. The softmax does not depend on the offset as
  long as nothing overflows and the significant terms stay normal floats, which holds while the
  bound is loose by less than ~90 (real rows: 5-45); a row whose denominator shows a looser bound
  (below :data:`MIN_DENOMINATOR`) is recomputed with a running offset (the flash-attention
  online form, :func:`_tile_online`), so the result never depends on the bound being good.
* Causality costs nothing outside the diagonal: a tile of queries ``[t0, t1)`` sees keys
  ``[0, past + t0)`` whole and only the last ``t1 - t0`` keys through a triangular mask. The
  history is never expanded per head and the ``[B, H, T, S]`` logits never exist.

Padded query positions (``t >= lengths[b]``) produce zeros; rows are processed one at a time (each
has its own history length).
"""

from __future__ import annotations

import torch

# Query tokens and keys per tile: QUERY_TOKENS * H rows by KEY_BLOCK keys (512 KiB of fp32 scores
# for H = 4, resident in one core's L2), measured best on the 1-thread CPU.
QUERY_TOKENS = 128
KEY_BLOCK = 256
# The fixed offset of a query row is its logit upper bound minus this margin: every exp is then
# <= e^30 (~1e13; times 1M keys still far inside fp32), and rows whose bound is loose by up to
# ~90 (far beyond what real scores show, ~20-45) keep every significant term a normal float.
BOUND_MARGIN = 30.0
# Fallback test: a row whose denominator is below e^-50 had a bound loose by more than 80.
MIN_DENOMINATOR = 1.9e-22
LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2 e)


def _spans(n_full: int, nd: int, key_block: int) -> list[tuple[int, int, bool]]:
    spans = [(s, min(s + key_block, n_full), False) for s in range(0, n_full, key_block)]
    return spans + [(n_full, n_full + nd, True)]


def _causal_mask(nd: int, heads: int, device) -> torch.Tensor:
    """[nd*heads, nd] True where key j of the diagonal tile is after query row t*heads+h's token t."""
    t = torch.arange(nd, device=device)
    return t.repeat_interleave(heads)[:, None] < t[None, :]


def _tile_fixed(qx: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, n_full: int, heads: int,
                key_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_tiles exp2(qx @ keys_t) @ values and its row sums over the visible keys (``keys_t``
    [C+R+1, keys], the keys transposed), with the base-2 offsets already in qx's last column: the
    tile loop is a product into one reused score buffer, an in-place ``exp2``, a row sum and a
    product. Returns (acc [r, C], den [r])."""
    r = qx.shape[0]
    nd = r // heads
    acc = qx.new_zeros(r, values.shape[1])
    den = qx.new_zeros(r)
    part = qx.new_empty(r)
    buf = qx.new_empty(r * max(key_block, nd))
    for s, e, diagonal in _spans(n_full, nd, key_block):
        p = buf[: r * (e - s)].view(r, e - s)
        torch.mm(qx, keys_t[:, s:e], out=p)
        if diagonal:
            p.masked_fill_(_causal_mask(nd, heads, qx.device), float("-inf"))
        p.exp2_()
        acc.addmm_(p, values[s:e])
        den.add_(torch.sum(p, 1, out=part))
    return acc, den


def _tile_online(qx: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, n_full: int, heads: int,
                 key_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same sums with a running offset (flash-attention style), for rows whose bound was too
    loose: the offset starts at a real visible logit (key 0) and moves to a tile's maximum when
    that exceeds it by more than BOUND_MARGIN. ``qx`` [r, C+R+1] holds the base-2 queries (its
    last column is overwritten). Returns (acc [r, C], den [r])."""
    r, D = qx.shape[0], qx.shape[1] - 1
    nd = r // heads
    qx = qx.clone()
    m = qx[:, :D] @ keys_t[:D, 0]
    qx[:, D] = -m
    margin = BOUND_MARGIN * LOG2E
    acc = qx.new_zeros(r, values.shape[1])
    den = qx.new_zeros(r)
    for s, e, diagonal in _spans(n_full, nd, key_block):
        p = torch.mm(qx, keys_t[:, s:e])
        if diagonal:
            p.masked_fill_(_causal_mask(nd, heads, qx.device), float("-inf"))
        over = p.amax(1)
        if bool((over > margin).any()):
            shift = torch.where(over > margin, over, torch.zeros((), device=qx.device))
            p.sub_(shift[:, None])
            scale = torch.exp2(-shift)
            acc.mul_(scale[:, None])
            den.mul_(scale)
            m += shift
            qx[:, D] = -m
        p.exp2_()
        acc.addmm_(p, values[s:e])
        den.add_(p.sum(1))
    return acc, den


def latent_attention_blocked(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    past_lengths: torch.Tensor,
    *,
    scale: float,
    lengths: torch.Tensor | None = None,
    query_tokens: int = QUERY_TOKENS,
    key_block: int = KEY_BLOCK,
) -> torch.Tensor:
    """Absorbed MLA attention of new queries over a latent cache, tiled (see the module docstring).

    Args:
        q_latent: [B, T, H, C] queries absorbed into the latent space (W_UK,hᵀ q^C_h).
        q_rope: [B, T, H, R] the per-head "rope" query slice (never rotated).
        latent: [B, S, C] normalised latent cache; k_rope: [B, S, R] shared key slice; both must
            already hold the new tokens at ``past_lengths[b] + t``.
        past_lengths: [B] int64 positions cached before this call's tokens.
        scale: multiplies the logit.
        lengths: [B] int64 valid new tokens per row, or None (all T).
        query_tokens, key_block: tile sizes (tokens per query tile, keys per key tile).
    Returns:
        [B, T, H, C] in ``q_latent.dtype`` (computed in fp32); zero for padded queries.
    Raises:
        ValueError: shapes disagree, or a query would see beyond the cache (S too small).
    Source: architecture.md §4 (absorbed decode form of gated MLA).
    """
    B, T, H, C = q_latent.shape
    S, R = latent.shape[1], k_rope.shape[-1]
    if q_rope.shape != (B, T, H, R) or latent.shape != (B, S, C) or k_rope.shape != (B, S, R):
        raise ValueError(
            f"q_latent, q_rope, latent, k_rope: expected [B,T,H,C], [B,T,H,R], [B,S,C], [B,S,R]; got "
            f"{tuple(q_latent.shape)}, {tuple(q_rope.shape)}, {tuple(latent.shape)}, {tuple(k_rope.shape)}"
        )
    if past_lengths.shape != (B,):
        raise ValueError(f"past_lengths: expected shape [B={B}], got {tuple(past_lengths.shape)}")
    lens = [T] * B if lengths is None else [int(x) for x in lengths]
    past = [int(x) for x in past_lengths]
    if any(n > 0 and p + n > S for p, n in zip(past, lens)):
        raise ValueError(f"past_lengths + lengths exceed the cache length S={S}: "
                         f"{[p + n for p, n in zip(past, lens)]}")
    out = q_latent.new_zeros(B, T, H, C)
    for b in range(B):
        p, n = past[b], lens[b]
        if n <= 0:
            continue
        f32 = torch.float32
        lat = latent[b, : p + n]
        # keys transposed ([C+R+1, p+n], contiguous): a tile is a column slice the GEMM reads as is
        keys_t = torch.empty(C + R + 1, p + n, device=latent.device, dtype=f32)
        keys_t[:C], keys_t[C : C + R], keys_t[-1] = lat.T, k_rope[b, : p + n].T, 1.0
        values = lat.to(f32).contiguous()
        D = C + R
        qx = torch.empty(n * H, D + 1, device=latent.device, dtype=f32)
        qx[:, :D] = torch.cat([q_latent[b, :n], q_rope[b, :n]], dim=-1).reshape(n * H, D)
        q = qx[:, :D].mul_(scale)
        # Per-row upper bound of every visible logit: per channel the larger of q*max_j k and q*min_j k
        # (summed), and Cauchy-Schwarz; the offset sits BOUND_MARGIN below the tighter one.
        k = keys_t[:D]
        per_channel = q.clamp_min(0) @ k.amax(1) + q.clamp_max(0) @ k.amin(1)
        # (k * k).sum(0): a reduction across rows of the contiguous [D, keys] block; norm(dim=0)
        # reduces down strided columns, measured 10x slower at 24K keys
        cauchy = q.norm(dim=1) * (k * k).sum(0).amax().sqrt()
        qx[:, D] = BOUND_MARGIN - torch.minimum(per_channel, cauchy)
        qx.mul_(LOG2E)  # scores and offsets in base 2
        for t0 in range(0, n, query_tokens):
            t1 = min(n, t0 + query_tokens)
            rows = slice(t0 * H, t1 * H)
            acc, den = _tile_fixed(qx[rows], keys_t[:, : p + t1], values[: p + t1], p + t0, H, key_block)
            if not bool(((den >= MIN_DENOMINATOR) & torch.isfinite(den) & torch.isfinite(acc).all(1)).all()):
                acc, den = _tile_online(qx[rows], keys_t[:, : p + t1], values[: p + t1], p + t0, H, key_block)
            o = acc / den[:, None]
            out[b, t0:t1] = o.view(t1 - t0, H, C).to(out.dtype)
    return out
