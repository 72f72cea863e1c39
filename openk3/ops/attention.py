"""Softmax attention for gated MLA: the full causal form and the absorbed latent form over a cache.

Shape legend: B batch rows, H heads, T query tokens, S key positions (cache capacity or T),
K query/key head dim (qk_nope + qk_rope), V value head dim, C latent width (kv_lora_rank),
R shared key width (qk_rope_head_dim), N packed documents.

Two entry points, one per MLA form (architecture.md §4):

* :func:`causal_attention` — expanded per-head q/k/v over the whole sequence (training, prefill
  without a cache). Rows may be right-padded (``lengths``) or hold packed documents
  (``cu_seqlens``, block-diagonal causal mask). Dispatches to
  ``torch.nn.functional.scaled_dot_product_attention`` (``"sdpa"``) or to the plain softmax
  :func:`causal_attention_reference` (``"reference"``); the choice is made here only, overridden
  through :mod:`openk3.ops.backends` (``use_backend("attention", name)``, ``OPENK3_ATTENTION_BACKEND``).
* :func:`latent_attention` — the absorbed form: queries already multiplied into the latent space
  (q̃_h = W_UK,hᵀ q^C_h) attend over the cached normalised latent ĉ and shared key k^R. Query t of
  row b sees cache positions ``< past_lengths[b] + t + 1``, which serves single-token decode and
  chunked prefill on top of history alike. It returns Σ_j p_j ĉ_j per head; the caller applies
  W_UV. Multi-token calls (prefill) run the tiled online-softmax form
  (:func:`openk3.ops.latent_blocked.latent_attention_blocked`); decode steps, QK-Clip max-logit
  requests and the ``"reference"`` backend run the dense :func:`latent_attention_reference`.

Both can report the per-head maximum of the scaled pre-softmax logits over the unmasked pairs
(QK-Clip, architecture.md §9), accumulated in place into a caller-owned [H] tensor.

Padded query positions (``t >= lengths[b]``) produce zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops import backends
from openk3.ops.cast import cast, fp32
from openk3.ops.latent_blocked import latent_attention_blocked
from openk3.ops.varlen import (
    check_cache_room,
    check_cu_seqlens,
    check_lengths,
    check_past_lengths,
)

BACKENDS = tuple(backends.BACKENDS["attention"])

# Query rows per block when the SDPA path computes max logits separately (bounds memory).
_MAX_LOGIT_CHUNK = 512


def get_attention_backend() -> str:
    """The backend :func:`causal_attention` uses when none is passed: ``"sdpa"`` or ``"reference"``
    (an override of :mod:`openk3.ops.backends`: ``use_backend("attention", name)`` or
    ``OPENK3_ATTENTION_BACKEND``; else ``"sdpa"``)."""
    return backends.forced_backend("attention") or "sdpa"


def _check_backend(name: str) -> None:
    backends.check_backend("attention", name)


# ------------------------------------------------------------------------------- masks
def _check_full_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    validate: bool = True,
) -> None:
    """Shapes always; the values of ``lengths`` / ``cu_seqlens`` (host reads) when ``validate``."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"q, k, v: expected [B, H, T, K], [B, H, T, K], [B, H, T, V]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, _, T, _ = q.shape
    if lengths is not None and cu_seqlens is not None:
        raise ValueError(
            "lengths and cu_seqlens: pass at most one (padded rows or packed documents)"
        )
    if lengths is not None:
        check_lengths(lengths, B, T, values=validate)
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens: packed documents need a single row (B=1), got B={B}")
        if validate:
            check_cu_seqlens(cu_seqlens, T)


def _segment_ids(cu_seqlens: torch.Tensor, T: int, device: torch.device) -> torch.Tensor:
    """[T] document index of every packed position."""
    pos = torch.arange(T, device=device)
    return torch.searchsorted(cu_seqlens.to(device=device, dtype=torch.long)[1:], pos, right=True)


def _full_mask(
    T: int, cu_seqlens: torch.Tensor | None, device: torch.device, rows: slice = slice(None)
) -> torch.Tensor:
    """[t, T] bool, True where query i may see key j: j <= i, and the same document if packed.

    Right padding needs no key mask: a valid query i < lengths[b] only sees keys j <= i, which
    are valid too.
    """
    i = torch.arange(T, device=device)[rows]
    j = torch.arange(T, device=device)
    mask = j[None, :] <= i[:, None]
    if cu_seqlens is not None:
        seg = _segment_ids(cu_seqlens, T, device)
        mask = mask & (seg[rows][:, None] == seg[None, :])
    return mask


def _query_valid(
    lengths: torch.Tensor | None, B: int, T: int, device: torch.device
) -> torch.Tensor | None:
    """[B, T] bool, True for real (not padded) query positions; None when nothing is padded."""
    if lengths is None:
        return None
    return torch.arange(T, device=device)[None, :] < lengths.to(device)[:, None]


def _update_max(max_logits_out: torch.Tensor, per_head: torch.Tensor) -> None:
    """In-place running max into the caller's [H] buffer; gradients never flow into it."""
    if max_logits_out.shape != per_head.shape:
        raise ValueError(
            f"max_logits_out: expected shape {tuple(per_head.shape)} (H), got {tuple(max_logits_out.shape)}"
        )
    with torch.no_grad():
        torch.maximum(
            max_logits_out, per_head.detach().to(max_logits_out.dtype), out=max_logits_out
        )


# --------------------------------------------------------------------- full causal form
def causal_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_logits_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain masked softmax attention (the readable ground truth of :func:`causal_attention`).

    Args:
        q, k: [B, H, T, K]; v: [B, H, T, V]; any float dtype (logits and softmax in fp32).
        scale: multiplies q·k (MLA: (qk_nope + qk_rope)^-0.5).
        lengths: [B] int64 valid tokens per row (right padding) or None.
        cu_seqlens: [N+1] int64 document starts of a packed row (B = 1) or None.
        max_logits_out: [H] float, updated in place with the max scaled logit over valid pairs.
    Returns:
        [B, H, T, V] in ``q.dtype``; zero at padded query positions.
    Raises:
        ValueError: bad shapes, lengths or cu_seqlens (named).
    """
    _check_full_args(q, k, v, lengths, cu_seqlens)
    B, H, T, _ = q.shape
    logits = torch.einsum("bhik,bhjk->bhij", q.float(), k.float()) * scale
    causal = _full_mask(T, cu_seqlens, q.device)
    qvalid = _query_valid(lengths, B, T, q.device)
    if max_logits_out is not None:
        valid = causal if qvalid is None else causal & qvalid[:, None, :, None]
        _update_max(max_logits_out, logits.masked_fill(~valid, float("-inf")).amax(dim=(0, 2, 3)))
    # Every row keeps its diagonal, so no row is fully masked; padded rows are zeroed below.
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    out = torch.einsum("bhij,bhjv->bhiv", probs, v.float())
    if qvalid is not None:
        out = out * qvalid[:, None, :, None]
    return out.to(q.dtype)


def _max_logits_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor | None,
    qvalid: torch.Tensor | None,
) -> torch.Tensor:
    """[H] max scaled logit over valid pairs, computed in query blocks so memory stays O(T·chunk)."""
    B, H, T, _ = q.shape
    best = torch.full((H,), float("-inf"), device=q.device, dtype=torch.float32)
    with torch.no_grad():
        kf = k.float()
        for start in range(0, T, _MAX_LOGIT_CHUNK):
            rows = slice(start, min(T, start + _MAX_LOGIT_CHUNK))
            logits = torch.einsum("bhik,bhjk->bhij", q[:, :, rows].float(), kf) * scale
            mask = _full_mask(T, cu_seqlens, q.device, rows)[None, None]
            if qvalid is not None:
                mask = mask & qvalid[:, None, rows, None]
            best = torch.maximum(best, logits.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3)))
    return best


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_logits_out: torch.Tensor | None = None,
    backend: str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Causal softmax attention over a full sequence, via SDPA or the plain reference.

    Args:
        q, k: [B, H, T, K]; v: [B, H, T, V] (V may differ from K).
        scale: multiplies q·k.
        lengths: [B] int64 valid tokens per row (right padding) or None (all T valid).
        cu_seqlens: [N+1] int64 packed document boundaries (B = 1, ``cu_seqlens[-1] == T``):
            query i sees key j iff j <= i and both lie in the same document.
        max_logits_out: [H] float, updated in place (running max) with the max scaled logit
            over valid pairs; no gradient.
        backend: ``"sdpa"`` or ``"reference"``; None = :func:`get_attention_backend`.
        validate: check the values of ``lengths`` / ``cu_seqlens`` (host reads); False when the
            caller has (the MLA layer under :meth:`~openk3.model.K3Model.forward`). Shapes are
            always checked.
    Returns:
        [B, H, T, V] in ``q.dtype``; zero at padded query positions.
    Raises:
        ValueError: bad shapes, lengths, cu_seqlens or backend (named).
    """
    backend = backend or get_attention_backend()
    _check_backend(backend)
    if backend == "reference":
        return causal_attention_reference(
            q,
            k,
            v,
            scale=scale,
            lengths=lengths,
            cu_seqlens=cu_seqlens,
            max_logits_out=max_logits_out,
        )
    _check_full_args(q, k, v, lengths, cu_seqlens, validate)
    B, H, T, K = q.shape
    V = v.shape[-1]
    qvalid = _query_valid(lengths, B, T, q.device)
    # The CPU fused (flash) kernel needs V == K; otherwise SDPA falls back to its math path, which
    # materialises [B, H, T, T] scores (2.6 GB at T = 8192, H = 4). Zero value columns change nothing.
    vv = F.pad(v, (0, K - V)) if q.device.type == "cpu" and V < K else v
    if cu_seqlens is None:
        out = F.scaled_dot_product_attention(q, k, vv, is_causal=True, scale=scale)
    else:
        mask = _full_mask(T, cu_seqlens, q.device)
        out = F.scaled_dot_product_attention(q, k, vv, attn_mask=mask, scale=scale)
    out = out[..., :V] if vv is not v else out
    if qvalid is not None:
        out = out * qvalid[:, None, :, None].to(out.dtype)
    if max_logits_out is not None:
        _update_max(max_logits_out, _max_logits_chunked(q, k, scale, cu_seqlens, qvalid))
    return out


# --------------------------------------------------------------------- absorbed latent form
def latent_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    past_lengths: torch.Tensor,
    *,
    scale: float,
    lengths: torch.Tensor | None = None,
    max_logits_out: torch.Tensor | None = None,
    backend: str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Absorbed MLA attention of new queries over a latent cache (architecture.md §4).

    Arguments, result and errors as :func:`latent_attention_reference` (``validate=False``: the
    caller has checked that the cache covers every query's visible prefix, as the MLA layer does); ``backend``: ``"reference"``
    forces the dense form, None = :func:`get_attention_backend` (``"reference"`` there forces it as
    well). Otherwise a call with more than one query token, no ``max_logits_out`` and no gradient
    runs the tiled form (:func:`~openk3.ops.latent_blocked.latent_attention_blocked`: no
    [B, H, T, S] logits, inference only), everything else the dense form (a decode step's logits
    are [B, H, 1, S]; training through a cache differentiates the dense form).
    """
    backend = backend or get_attention_backend()
    _check_backend(backend)
    grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q_latent, q_rope, latent, k_rope)
    )
    if backend != "reference" and max_logits_out is None and q_latent.shape[1] > 1 and not grad:
        return latent_attention_blocked(
            q_latent, q_rope, latent, k_rope, past_lengths, scale=scale, lengths=lengths
        )
    return latent_attention_reference(
        q_latent,
        q_rope,
        latent,
        k_rope,
        past_lengths,
        scale=scale,
        lengths=lengths,
        max_logits_out=max_logits_out,
        validate=validate,
    )


def latent_attention_reference(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    past_lengths: torch.Tensor,
    *,
    scale: float,
    lengths: torch.Tensor | None = None,
    max_logits_out: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Absorbed MLA attention of new queries over a latent cache, dense (the readable form).

    logit[b, h, t, j] = (q_latent[b,t,h]·latent[b,j] + q_rope[b,t,h]·k_rope[b,j]) * scale, visible
    iff ``j < past_lengths[b] + t + 1`` and t is a valid query (``t < lengths[b]``). The cache
    must already hold the new tokens at ``past_lengths[b] + t``.

    Args:
        q_latent: [B, T, H, C] queries absorbed into the latent space (W_UK,hᵀ q^C_h).
        q_rope: [B, T, H, R] the per-head "rope" query slice (never rotated).
        latent: [B, S, C] normalised latent cache; k_rope: [B, S, R] shared key slice.
        past_lengths: [B] int64 positions cached before this call's tokens.
        scale: multiplies the logit.
        lengths: [B] int64 valid new tokens per row, or None (all T).
        max_logits_out: [H] float, updated in place with the max scaled logit over visible pairs.
        validate: check the values of ``past_lengths`` / ``lengths`` and that no query sees
            beyond the cache (host reads); False when the caller has (shapes are always checked).
    Returns:
        [B, T, H, C] in ``q_latent.dtype``: Σ_j p_j latent[b, j] per head (zero for padded queries).
    Raises:
        ValueError: shapes disagree, or a query would see beyond the cache (S too small).
    """
    B, T, H, C = q_latent.shape
    S, R = latent.shape[1], k_rope.shape[-1]
    if q_rope.shape != (B, T, H, R) or latent.shape != (B, S, C) or k_rope.shape != (B, S, R):
        raise ValueError(
            f"q_latent, q_rope, latent, k_rope: expected [B,T,H,C], [B,T,H,R], [B,S,C], [B,S,R]; got "
            f"{tuple(q_latent.shape)}, {tuple(q_rope.shape)}, {tuple(latent.shape)}, {tuple(k_rope.shape)}"
        )
    check_past_lengths(past_lengths, B, values=validate)
    if lengths is not None:
        check_lengths(lengths, B, T, values=validate)
    if validate:
        check_cache_room(past_lengths, lengths, T, S)
    dev = q_latent.device
    t = torch.arange(T, device=dev)
    limit = past_lengths.to(dev)[:, None] + t[None, :] + 1  # [B, T] visible prefix length
    qvalid = (
        None if lengths is None else t[None, :] < lengths.to(dev)[:, None]
    )  # [B, T]; None: all valid
    visible = torch.arange(S, device=dev)[None, None, :] < limit[:, :, None]  # [B, T, S]
    if qvalid is not None:  # padded queries see nothing
        visible = visible & qvalid[:, :, None]
    visible = visible[:, None]  # [B, 1, T, S]

    latent = cast(latent, q_latent.dtype)
    logits = (
        fp32(
            torch.einsum("bthc,bsc->bhts", q_latent, latent)
            + torch.einsum("bthr,bsr->bhts", q_rope, cast(k_rope, q_rope.dtype))
        )
        * scale
    )
    logits = logits.masked_fill(~visible, float("-inf"))
    if max_logits_out is not None:
        _update_max(max_logits_out, logits.amax(dim=(0, 2, 3)))
    # Rows with nothing visible (padded queries) would be all -inf -> NaN; they output zero.
    probs = torch.softmax(logits, dim=-1).masked_fill(~visible, 0.0)
    return torch.einsum("bhts,bsc->bthc", cast(probs, q_latent.dtype), latent)
