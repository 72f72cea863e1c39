"""Dtype casts that cost nothing when there is nothing to cast.

``Tensor.to(dtype)`` / ``Tensor.float()`` return the tensor itself when it already has the dtype,
but still make a dispatcher round trip (an aten ``to`` call, about a microsecond on CPU); the
fp32 decode step made ~200 of them per step, all no-ops. These helpers check the dtype in Python
first. The result is the same tensor object either way, so callers must not write to it.
"""

from __future__ import annotations

import torch


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``: ``x`` itself when it already is, else ``x.to(dtype)`` (a copy)."""
    return x if x.dtype == dtype else x.to(dtype)


def fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 (``cast(x, torch.float32)``): the compute dtype of norms, gates and state."""
    return x if x.dtype == torch.float32 else x.float()
