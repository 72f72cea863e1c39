"""Variable-length batches, shared by every token mixer and its reference: the one ``lengths``
check (and those of ``past_lengths`` and the cache room), ``cu_seqlens`` validation, and packing /
unpacking of documents.

Shape legend: B batch rows, T tokens per row, N packed documents, L longest document, ``*`` any
trailing dims.

Two layouts reach the mixers: right-padded rows with ``lengths`` [B] (positions ``t >=
lengths[b]`` are padding), and one packed row (B = 1) of N documents with ``cu_seqlens`` [N+1]
(document n is tokens ``cu_seqlens[n]:cu_seqlens[n+1]``, FlashAttention / FLA convention).
"""

from __future__ import annotations

from typing import Callable

import torch


def check_lengths(
    lengths: torch.Tensor, batch: int, total: int, name: str = "lengths", *, values: bool = True
) -> None:
    """Validate valid-token counts per row: shape [B], every value in [0, T].

    The one ``lengths`` check of the package: the public entry points (model forward, layers,
    ops) call it once and hand ``values=False`` (or skip the call) to what they call inside.

    Args:
        lengths: [B] integer tensor, any device.
        batch, total: B and T of the call.
        name: the argument's name in the message.
        values: also check the range (a device->host read); False checks the shape only.
    Raises:
        ValueError: naming ``name``, the expected shape and range, and the values given.
    """
    if lengths.shape != (batch,) or (values and bool(((lengths < 0) | (lengths > total)).any())):
        raise ValueError(
            f"{name}: expected [B={batch}] values in [0, T={total}], got {lengths.tolist()}"
        )


def check_past_lengths(past_lengths: torch.Tensor, batch: int, *, values: bool = True) -> None:
    """Validate tokens already cached per row: shape [B], every value >= 0.

    Args:
        past_lengths: [B] integer tensor (``HybridCache.lengths``).
        batch: B of the call.
        values: also check the sign (a device->host read); False checks the shape only.
    Raises:
        ValueError: naming ``past_lengths``, the expected shape and the values given.
    """
    if past_lengths.shape != (batch,) or (values and bool((past_lengths < 0).any())):
        raise ValueError(
            f"past_lengths: expected [B={batch}] non-negative values, got {past_lengths.tolist()}"
        )


def check_cache_room(
    past_lengths: torch.Tensor, lengths: torch.Tensor | None, total: int, capacity: int
) -> None:
    """Validate that every row's new tokens fit the cache: ``past_lengths[b] + lengths[b] <=
    capacity`` for each row with ``lengths[b] > 0`` (a row without new tokens writes and reads
    nothing). One device->host read.

    Args:
        past_lengths: [B] tokens cached before this call; lengths: [B] new tokens, None = all
            ``total``; capacity: positions the cache holds per row (S).
    Raises:
        ValueError: ``cache overflow``, naming the row ends and the capacity.
    """
    lens = (
        torch.full_like(past_lengths, total) if lengths is None else lengths.to(past_lengths.device)
    )
    ends = past_lengths + lens
    if bool(((lens > 0) & (ends > capacity)).any()):
        raise ValueError(
            f"cache overflow: past_lengths + lengths = {ends.tolist()} exceed the cache length "
            f"S={capacity}"
        )


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> None:
    """Validate ``cu_seqlens`` [N+1]: integer, starts at 0, non-decreasing, ends at ``total``.

    Raises:
        ValueError: naming ``cu_seqlens`` and its value.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(
            f"cu_seqlens: expected a 1-D integer tensor [N+1] with N >= 1, got {cu_seqlens!r}"
        )
    c = cu_seqlens.tolist()
    if c[0] != 0 or c[-1] != total or any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(f"cu_seqlens={c}: must start at 0, be non-decreasing and end at T={total}")


def unpack_documents(
    x: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed [1, T, *] -> right-padded [N, L, *] (padding zeros) and lengths [N].

    Raises:
        ValueError: B != 1 or malformed ``cu_seqlens``.
    """
    if x.shape[0] != 1:
        raise ValueError(
            f"cu_seqlens given: the batch dim must be 1 (packed documents), got {x.shape[0]}"
        )
    check_cu_seqlens(cu_seqlens, x.shape[1])
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    L = int(lengths.max())
    pos = torch.arange(L, device=x.device)
    valid = pos[None, :] < lengths[:, None]  # [N, L]
    idx = (cu[:-1, None] + pos[None, :]).clamp(max=max(x.shape[1] - 1, 0))
    out = x[0][idx] if L > 0 else x.new_zeros(len(lengths), 0, *x.shape[2:])
    mask = valid.reshape(*valid.shape, *([1] * (x.dim() - 2)))
    return torch.where(mask, out, torch.zeros((), dtype=x.dtype, device=x.device)), lengths


def pack_documents(y: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Right-padded [N, L, *] with lengths [N] -> packed [1, sum(lengths), *] (document order)."""
    valid = torch.arange(y.shape[1], device=y.device)[None, :] < lengths.to(y.device)[:, None]
    return y[valid].unsqueeze(0)


def run_packed(
    rows: Callable,
    tensors: tuple[torch.Tensor, ...],
    lengths: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    *args,
    **kwargs,
) -> tuple:
    """Call ``rows(*tensors, *args, lengths, **kwargs)`` on right-padded rows; with ``cu_seqlens``,
    unpack every tensor of ``tensors`` (each [1, T, *]) into documents first and pack the first
    result back. ``rows`` returns a tuple whose first entry is [rows, L, *] per position; the
    others (states) are per row, i.e. per document, and are returned as they are.

    Raises:
        ValueError: ``lengths`` together with ``cu_seqlens``, or malformed ``cu_seqlens``.
    """
    if cu_seqlens is None:
        return rows(*tensors, *args, lengths, **kwargs)
    if lengths is not None:
        raise ValueError(
            "lengths and cu_seqlens are mutually exclusive (packed documents carry their own lengths)"
        )
    parts = [unpack_documents(t, cu_seqlens)[0] for t in tensors]
    doc_lengths = unpack_documents(tensors[-1], cu_seqlens)[1]
    out = rows(*parts, *args, doc_lengths, **kwargs)
    return (pack_documents(out[0], doc_lengths),) + tuple(out[1:])
