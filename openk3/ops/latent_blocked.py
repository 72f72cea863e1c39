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
* Scores are kept in base 2 (queries pre-multiplied by log2 e, so ``exp2`` of a score is ``exp`` of
  the natural logit): torch's CPU ``exp2`` runs ~3x faster than its ``exp`` (measured 0.28 vs 0.81
  ns per element, AVX-512, 1 thread) at the same fp32 accuracy, and the exponential is a sizeable
  part of a tile's time. Values are the latent itself (C columns) and the denominators a row sum
  of each tile (an in-cache pass; cheaper than a ones column, which would make the second product
  C + 1 wide). No tile needs a maximum or a rescale: a tile is one product, one ``exp2``, one row
  sum and one product. Each query row gets an upper bound ``U`` of its visible logits (per channel
  ``q·max k`` or ``q·min k``, and Cauchy-Schwarz, whichever is tighter), and a query tile runs in
  one of two forms:

  - **offset-free** when every row of the tile has ``U <= OFFSET_FREE_BOUND`` (2^90 in base 2;
    real rows: bounds of 5-45 natural, 7-65 base 2): ``exp2`` of the raw score. No term exceeds
    2^90, so neither the sums nor the products overflow for any cache below 2^30 positions, and the
    score product is ``[r, C+R] @ [C+R, s]`` with C + R a multiple of 16 (48 for the shipped
    model: 79 vs 77 GFLOP/s for the 49-wide form below, 1 thread, AVX-512) and no copy of the
    keys with a ones column is made;
  - **fixed offset** otherwise: queries carry an extra column ``-m`` against a column of ones on the
    keys (m = ``U`` minus :data:`BOUND_MARGIN`), so a tile comes out already shifted and no ``exp``
    exceeds e^30.

  The softmax does not depend on the offset as long as nothing overflows and the significant terms
  stay normal floats; a row whose denominator is not finite or below :data:`MIN_DENOMINATOR` (all
  its logits far below the offset, or below zero for the offset-free form) is recomputed with a
  running offset (the flash-attention online form, :func:`_tile_online`), so the result never
  depends on the bound being good. (Terms that do underflow to subnormals err by at most 2^-149
  each, nothing against a denominator of at least 2^-72.)
* Keys are row-major ``[keys, C+R]`` (latent and shared key slice side by side; a copy with the
  ones column is made only when a tile needs the fixed offset): a tile's score product takes its
  rows transposed (``keys[s:e].T``, the GEMM's transposed-operand layout, no copy).
* Causality costs nothing outside the diagonal: a tile of queries ``[t0, t1)`` sees keys
  ``[0, past + t0)`` whole and only the last ``t1 - t0`` keys through a triangular mask. The
  history is never expanded per head and the ``[B, H, T, S]`` logits never exist.

* On CPU with AVX-512F/DQ and C = 32, an offset-free query tile runs in one native call
  (:func:`openk3.ops.latent_tile_cpu.latent_tile`): the same sums per register block of 6 query
  rows x 32 keys, so no score tile is written and read back (0.94x of the cold long prefill). The
  tile loop (:func:`_tile_fixed`) stays the torch path and the oracle the kernel is tested against.

Padded query positions (``t >= lengths[b]``) produce zeros; rows are processed one at a time (each
has its own history length).
"""

from __future__ import annotations

import torch

from openk3.ops import exp2_cpu, latent_tile_cpu
from openk3.ops.varlen import check_cache_room, check_lengths, check_past_lengths

# Query tokens and keys per tile: QUERY_TOKENS * H rows by KEY_BLOCK keys (1 MiB of fp32 scores
# for H = 4, one core's L2), measured best on the 1-thread CPU (256 query tokens: 0.95x the time of
# 128 over prefixes of 2K-22K keys, 21 interleaved rounds, AMD EPYC).
QUERY_TOKENS = 256
KEY_BLOCK = 256
# The fixed offset of a query row is its logit upper bound minus this margin: every exp is then
# <= e^30 (~1e13; times 1M keys still far inside fp32), and rows whose bound is loose by up to
# ~90 (far beyond what real scores show, ~20-45) keep every significant term a normal float.
BOUND_MARGIN = 30.0
# Fallback test: a row whose denominator is below e^-50 (2^-72) had a bound loose by more than 80
# (fixed offset) or logits all below -50 (offset-free).
MIN_DENOMINATOR = 1.9e-22
# Largest base-2 logit bound of a query tile's rows for the offset-free form: every term is at most
# 2^90, a sum over 2^30 keys at most 2^120 (fp32 overflows at 2^128).
OFFSET_FREE_BOUND = 90.0
LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2 e)


def _spans(n_full: int, nd: int, key_block: int) -> list[tuple[int, int, bool]]:
    spans = [(s, min(s + key_block, n_full), False) for s in range(0, n_full, key_block)]
    return spans + [(n_full, n_full + nd, True)]


def _causal_mask(nd: int, heads: int, device) -> torch.Tensor:
    """[nd*heads, nd] True where key j of the diagonal tile is after query row t*heads+h's token t."""
    t = torch.arange(nd, device=device)
    return t.repeat_interleave(heads)[:, None] < t[None, :]


def _column_extrema(keys: torch.Tensor, fold: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-column (max, min) of ``keys`` [S, D] (S >= 1). The rows are folded ``fold`` at a time into
    [S / fold, fold * D] before reducing: torch's CPU reduction down a narrow column set runs ~9x
    slower than down a wide one (0.81 vs 0.09 ms for 16,896 x 48, 1 thread)."""
    S, D = keys.shape
    body = S - S % fold
    parts = []
    if body:
        wide = keys[:body].reshape(body // fold, fold * D)
        parts.append((wide.amax(0).view(fold, D).amax(0), wide.amin(0).view(fold, D).amin(0)))
    if body < S:
        parts.append((keys[body:].amax(0), keys[body:].amin(0)))
    hi = torch.stack([x for x, _ in parts]).amax(0)
    lo = torch.stack([y for _, y in parts]).amin(0)
    return hi, lo


def _sums_ok(acc: torch.Tensor, den: torch.Tensor) -> bool:
    """Whether a tile's sums can be used: every denominator at least MIN_DENOMINATOR (False for
    NaN) and every entry of ``acc`` [r, C] and ``den`` [r] finite. Checked through two sums (three
    reductions instead of a finiteness mask per entry): a sum of finite entries that overflows
    only sends the tile to the exact fallback needlessly."""
    return bool(den.min() >= MIN_DENOMINATOR) and bool(torch.isfinite(acc.sum() + den.sum()))


def _tile_fixed(
    qx: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    n_full: int,
    heads: int,
    key_block: int,
    native: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_tiles exp2(qx @ keysᵀ) @ values and its row sums over the visible keys (``qx`` [r, D'],
    ``keys`` [keys, D'] row-major with D' = C+R for the offset-free form, or C+R+1 with the base-2
    offsets in qx's last column against the keys' ones column): the tile loop is a product into one
    reused score buffer, an in-place ``exp2``, a product and a row sum into its own row of a
    [tiles, r] buffer (one reduction at the end instead of an add per tile). ``native``: the
    ``exp2``, the row sum and the diagonal tile's causal zeros in one pass of
    :func:`openk3.ops.exp2_cpu.exp2_rowsum_` (CPU, AVX-512F) instead of torch's ``masked_fill_``,
    ``exp2_`` and ``sum``. Returns (acc [r, C], den [r])."""
    r = qx.shape[0]
    nd = r // heads
    spans = _spans(n_full, nd, key_block)
    acc = qx.new_zeros(r, values.shape[1])
    dens = qx.new_empty(len(spans), r)
    buf = qx.new_empty(r * max(key_block, nd))
    # The tiles' operands as views made in one call each (split / unbind), not by slicing in the
    # loop: a tile is ~0.3 ms of arithmetic, and each Python-level view op costs a few us.
    # (split of an empty history would still give one empty piece: no full tiles then)
    key_tiles = (keys[:n_full].T.split(key_block, dim=1) if n_full else ()) + (keys[n_full:].T,)
    value_tiles = (values[:n_full].split(key_block) if n_full else ()) + (values[n_full:],)
    full = buf[: r * key_block].view(r, key_block)
    threads = torch.get_num_threads()
    for (s, e, diagonal), kt, vt, den in zip(spans, key_tiles, value_tiles, dens.unbind(0)):
        p = full if e - s == key_block else buf[: r * (e - s)].view(r, e - s)
        torch.mm(qx, kt, out=p)
        if native:
            exp2_cpu.exp2_rowsum_(p, den, heads=heads, diagonal=diagonal, threads=threads)
            acc.addmm_(p, vt)
            continue
        if diagonal:
            p.masked_fill_(_causal_mask(nd, heads, qx.device), float("-inf"))
        p.exp2_()
        acc.addmm_(p, vt)
        torch.sum(p, 1, out=den)
    return acc, dens.sum(0)


def _tile_online(
    qx: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    n_full: int,
    heads: int,
    key_block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same sums with a running offset (flash-attention style), for rows whose bound was too
    loose: the offset starts at a real visible logit (key 0) and moves to a tile's maximum when
    that exceeds it by more than BOUND_MARGIN. ``qx`` [r, C+R+1] holds the base-2 queries (its
    last column is overwritten), ``keys`` [keys, C+R+1] row-major with a ones column. Returns
    (acc [r, C], den [r])."""
    r = qx.shape[0]
    D = qx.shape[1] - 1
    nd = r // heads
    qx = qx.clone()
    m = qx[:, :D] @ keys[0, :D]
    qx[:, D] = -m
    margin = BOUND_MARGIN * LOG2E
    acc = qx.new_zeros(r, values.shape[1])
    den = qx.new_zeros(r)
    for s, e, diagonal in _spans(n_full, nd, key_block):
        p = torch.mm(qx, keys[s:e].T)
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
    native: bool | None = None,
    fused: bool | None = None,
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
        native: each tile's ``exp2`` and row sum in the native CPU kernel
            (:mod:`openk3.ops.exp2_cpu`); None = wherever it is available (CPU tensors, AVX-512F,
            not disabled by ``OPENK3_NO_NATIVE=1``). True where it is not raises RuntimeError.
        fused: offset-free query tiles in the fused native kernel
            (:func:`openk3.ops.latent_tile_cpu.latent_tile`: score, ``exp2``, row sum and value
            product per register block, no score tile in memory) instead of the tile loop; None =
            wherever it applies (CPU, AVX-512F/DQ, C = 32, ``native`` not False). True where it
            does not apply raises ValueError.
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
    # The tiles are planned on the host from every row's (past, new) counts, so the value
    # checks cost nothing extra here and always run.
    check_past_lengths(past_lengths, B)
    if lengths is not None:
        check_lengths(lengths, B, T)
    check_cache_room(past_lengths, lengths, T, S)
    if native is None:
        native = q_latent.device.type == "cpu" and exp2_cpu.available()
    fused_fits = (
        q_latent.device.type == "cpu"
        and C == latent_tile_cpu.VALUE_WIDTH
        and latent_tile_cpu.available()
    )
    if fused is None:
        fused = fused_fits and native is not False
    elif fused and not fused_fits:
        raise ValueError(
            "fused=True needs CPU tensors, C = 32 and the native tile kernel "
            f"(C = {C}; {latent_tile_cpu.unavailable_reason()})"
        )
    lens = [T] * B if lengths is None else lengths.tolist()
    past = past_lengths.tolist()
    out = q_latent.new_zeros(B, T, H, C)
    for b in range(B):
        p = past[b]
        n = lens[b]
        if n <= 0:
            continue
        f32 = torch.float32
        D = C + R
        keys = torch.cat([latent[b, : p + n], k_rope[b, : p + n]], dim=1).to(
            f32
        )  # [p+n, C+R] row-major
        keys1 = None  # with a ones column (the fixed offset's), built only if a tile needs it
        values = latent[b, : p + n].to(f32).contiguous()
        if fused:  # the kernel's operand layout, made once for every query tile of the row
            packed_keys = latent_tile_cpu.pack_keys(keys)
            padded_values = latent_tile_cpu.pad_values(values)
        q = torch.cat([q_latent[b, :n], q_rope[b, :n]], dim=-1).reshape(n * H, D).to(f32) * (
            scale * LOG2E
        )
        # Per-row upper bound of every visible (base-2) logit: per channel the larger of q*max_j k and
        # q*min_j k (summed), and Cauchy-Schwarz; the tighter one.
        k_hi, k_lo = _column_extrema(keys)
        # (q⁺·hi + q⁻·lo written as q·mid + |q|·half: one elementwise pass over q instead of two
        # clamps, the same sum up to rounding)
        per_channel = q @ ((k_hi + k_lo) * 0.5) + q.abs() @ ((k_hi - k_lo) * 0.5)
        cauchy = q.norm(dim=1) * torch.linalg.vector_norm(keys, dim=1).amax()
        bound = torch.minimum(per_channel, cauchy)
        starts = list(range(0, n, query_tokens))
        tops = torch.stack(
            [bound[t0 * H : min(n, t0 + query_tokens) * H].max() for t0 in starts]
        ).tolist()
        for t0, top in zip(starts, tops):
            t1 = min(n, t0 + query_tokens)
            rows = slice(t0 * H, t1 * H)
            if top <= OFFSET_FREE_BOUND:
                if fused:
                    acc, den = latent_tile_cpu.latent_tile(
                        q[rows], packed_keys, padded_values, p + t0, H
                    )
                else:
                    acc, den = _tile_fixed(
                        q[rows], keys[: p + t1], values[: p + t1], p + t0, H, key_block, native
                    )
                ok = _sums_ok(acc, den)
            else:
                ok = False
            if not ok:
                if keys1 is None:
                    keys1 = torch.cat([keys, keys.new_ones(p + n, 1)], dim=1)
                    # the base-2 queries with the fixed offset m = bound - BOUND_MARGIN in a last column
                    qx = torch.cat([q, (BOUND_MARGIN * LOG2E - bound)[:, None]], dim=1)
                if top > OFFSET_FREE_BOUND:
                    acc, den = _tile_fixed(
                        qx[rows], keys1[: p + t1], values[: p + t1], p + t0, H, key_block, native
                    )
                    ok = _sums_ok(acc, den)
                if not ok:
                    acc, den = _tile_online(
                        qx[rows], keys1[: p + t1], values[: p + t1], p + t0, H, key_block
                    )
            o = acc / den[:, None]
            out[b, t0:t1] = o.view(t1 - t0, H, C).to(out.dtype)
    return out
