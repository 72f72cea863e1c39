"""The one entry point for Kimi Delta Attention: which backend runs is decided here and nowhere else.

Shape legend: B batch rows, T tokens, H heads, K key dim, V value dim, N packed documents,
NC number of chunks.

Backends: ``"batched"`` (default: :func:`openk3.ops.kda_chunk.kda_chunk_batched` for the chunk
mode; the recurrent mode runs the token loop of :mod:`openk3.ops.kda_reference`, and a decode step
of the layer the fused :func:`openk3.ops.kda_decode.kda_decode_step`, see :func:`fused_decode`) and ``"reference"`` (the readable fp32 references, both modes).
A kernel fast path (FLA ``chunk_kda`` / ``fused_recurrent_kda``, FlashKDA) plugs in with
:func:`register_backend` (same semantic signature: pre-activated gate, sigmoid beta, state
[B, H, K, V]); callers never change. Overrides go through the one switch of
:mod:`openk3.ops.backends`: ``use_backend("kda", name)`` or ``OPENK3_KDA_BACKEND``.
"""

from __future__ import annotations

from typing import Callable

import torch

from openk3.ops import backends, kda_reference
from openk3.ops.kda_chunk import kda_chunk_batched

MODES = ("chunk", "recurrent")

# The chunk length of the chunkwise form (tokens). ``output_chunk_states`` yields the state after
# every multiple of it, so a caller that wants the state at a position inside one call (the
# engine's prefix-cache snapshots) needs that position to be a multiple of it from the call's start.
CHUNK_SIZE = 64

# backend name -> {mode -> function with the kda_reference signature}
_BACKENDS: dict[str, dict[str, Callable]] = {
    "reference": {"chunk": kda_reference.kda_chunk, "recurrent": kda_reference.kda_recurrent},
    "batched": {"chunk": kda_chunk_batched, "recurrent": kda_reference.kda_recurrent},
}


def register_backend(name: str, chunk: Callable, recurrent: Callable) -> None:
    """Add a backend; both callables take the :func:`kda` arguments (minus ``mode``/``backend``),
    ``validate`` included."""
    _BACKENDS[name] = {"chunk": chunk, "recurrent": recurrent}
    backends.register_backend("kda", name)


def _select_backend(q: torch.Tensor) -> str:
    """Automatic choice: ``"batched"`` (eager PyTorch, any device); a kernel backend would be
    picked here when importable and ``q`` lives on a supported device. An override of
    :mod:`openk3.ops.backends` (``use_backend``, then ``OPENK3_KDA_BACKEND``) wins.

    Raises:
        ValueError: ``OPENK3_KDA_BACKEND`` names an unknown backend.
    """
    return backends.forced_backend("kda") or "batched"


def fused_decode() -> bool:
    """Whether a decode step (one token per row, no padding) runs the fused
    :func:`openk3.ops.kda_decode.kda_decode_step`: with the default ``"batched"`` backend; a forced
    ``"reference"`` (or a registered kernel backend) keeps the layer on the general path through
    :func:`kda`."""
    return _select_backend(None) == "batched"


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    mode: str = "chunk",
    *,
    chunk_size: int = CHUNK_SIZE,
    output_chunk_states: bool = False,
    backend: str | None = None,
    validate: bool = True,
):
    """Kimi Delta Attention over a (right-padded or packed) batch.

    Args:
        q, k: [B, T, H, K] L2-normalised. v: [B, T, H, V]. g: [B, T, H, K] log-decay (gate applied).
        beta: [B, T, H] in (0, 1). scale: query scale (K ** -0.5).
        initial_state: [B, H, K, V] fp32 ([N, H, K, V] with ``cu_seqlens``); None = zeros.
        lengths: [B] valid tokens per row; positions past it leave the state unchanged, output 0.
        cu_seqlens: [N+1] packed document offsets (B == 1), state restarts per document.
        mode: ``"chunk"`` (chunkwise-parallel, prefill/training) or ``"recurrent"`` (token loop,
            decode); both compute the same function.
        chunk_size, output_chunk_states: see :func:`openk3.ops.kda_reference.kda_chunk`.
        backend: force a backend by name (default: the automatic choice).
        validate: check the values of ``lengths`` (a host read); False when the caller has (the
            KDA layer). Shapes are always checked.
    Returns:
        (o [B, T, H, V], final_state [B or N, H, K, V] fp32) and, with ``output_chunk_states``,
        chunk_states [B or N, NC, H, K, V] fp32 (state after each chunk of ``chunk_size`` tokens).
    Raises:
        ValueError: unknown mode or backend, or invalid tensors (from the backend).
    Source: architecture.md §3.2-§3.5.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: must be one of {MODES}")
    name = backend or _select_backend(q)
    backends.check_backend("kda", name)
    fn = _BACKENDS[name][mode]
    return fn(
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        lengths,
        cu_seqlens,
        chunk_size=chunk_size,
        output_chunk_states=output_chunk_states,
        validate=validate,
    )
