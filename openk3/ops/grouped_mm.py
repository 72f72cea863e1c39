"""Routed-expert computation: sort (token, slot) assignments by expert, run every expert's GLU FFN
as grouped matmuls, and combine with the routing weights in fp32.

Shape legend: N tokens (flattened), k experts per token (``num_experts_per_tok``), A = N·k
assignments, E routed experts, L expert input/output width (the latent width ``moe_latent_size``,
or ``hidden_size`` for Kimi Linear), F expert FFN width (``moe_intermediate_size``), M the largest
per-expert assignment count (padded backend only).

Semantics (architecture.md §6.1):  ``out_n = Σ_j w_{n,j} · E_{e_{n,j}}(x_n)`` with
``E_e(x) = w2_e · act(w1_e x, w3_e x)``; the weighted sum is accumulated in fp32.

Backends (chosen in :func:`_select_backend`, the only place that decides):
  * ``"grouped_mm"``: ``torch._grouped_mm`` over the expert-sorted rows; no host sync. Needs
    fp32/bf16/fp16 (bf16 on CUDA, SM90+), and L·itemsize, F·itemsize multiples of 16 bytes.
  * ``"bmm"``: rows scattered into a zero-padded [E, M, L] buffer and one ``torch.bmm`` per
    projection. Works for any dtype/shape; costs a host sync for M and E·M·L memory.
  * ``"static"``: :func:`routed_experts_static`, every shape fixed by (N, k, E): no sort, no
    per-expert counts. What a compiled or graph-captured decode step runs (chosen automatically
    while ``torch.compile`` traces: ``torch._grouped_mm`` has no fp32 CPU meta kernel).
  * ``"loop"``: :func:`routed_experts_reference`, a plain loop over experts. Tests only.
Tests force a backend with ``backend=``, ``openk3.ops.backends.use_backend("grouped_mm", name)`` or
``OPENK3_GROUPED_MM_BACKEND``.

QAT (architecture.md §10) passes ``input_quant`` (MXFP8 fake-quant of every expert GEMM input) and
fake-quantized weights; packed MXFP4 weights run through :mod:`openk3.quant.packed`, which reuses
:func:`dispatch_combine` (the sort / un-sort / fp32 combine shared by every backend).
"""

from __future__ import annotations

from typing import Callable

import torch

from openk3.ops import backends
from openk3.ops.cast import cast

GluActivation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Fake-quantizer applied to each expert GEMM's input rows (QAT: MXFP8 along K), or None.
InputQuant = Callable[[torch.Tensor], torch.Tensor] | None
# ``(xs [A, L] rows sorted by expert, expert_sorted [A], counts [E]) -> ys [A, L]``.
ExpertFFN = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

BACKENDS = tuple(backends.BACKENDS["grouped_mm"])
# CUTLASS grouped GEMM on CUDA handles fewer than this many groups (torch's own dispatch notes).
_CUDA_MAX_GROUPS = 1024


def _check_inputs(x, topk_idx, topk_weight, w1, w3, w2) -> None:
    if x.dim() != 2:
        raise ValueError(f"x: expected [N, L], got shape {tuple(x.shape)}")
    if w1.dim() != 3 or w3.shape != w1.shape:
        raise ValueError(
            f"w1/w3: expected equal [E, F, L], got {tuple(w1.shape)} and {tuple(w3.shape)}"
        )
    e, f, l = w1.shape
    if w2.shape != (e, l, f):
        raise ValueError(f"w2: expected [E={e}, L={l}, F={f}], got {tuple(w2.shape)}")
    if x.shape[1] != l:
        raise ValueError(f"x: width {x.shape[1]} != expert input width L={l}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"topk_idx: expected [N={x.shape[0]}, k], got {tuple(topk_idx.shape)}")
    if topk_weight.shape != topk_idx.shape:
        raise ValueError(
            f"topk_weight: shape {tuple(topk_weight.shape)} != topk_idx {tuple(topk_idx.shape)}"
        )
    if topk_idx.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"topk_idx: dtype {topk_idx.dtype} is not an integer index type")


def _accum_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for every dtype, except that float64 inputs (test references) stay float64."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _grouped_mm_fits(x: torch.Tensor, w1: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or w1.dtype != x.dtype:
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9:
            return False
        if w1.shape[0] >= _CUDA_MAX_GROUPS:
            return False
    elif x.device.type != "cpu":
        return False
    _, f, l = w1.shape
    align = 16 // x.element_size()
    return f % align == 0 and l % align == 0


def _select_backend(x: torch.Tensor, w1: torch.Tensor, backend: str | None) -> str:
    """The one place a backend is chosen: explicit argument > the override of
    :mod:`openk3.ops.backends` (``use_backend("grouped_mm", name)``, ``OPENK3_GROUPED_MM_BACKEND``)
    > automatic."""
    name = backend if backend is not None else backends.forced_backend("grouped_mm")
    if name is not None:
        backends.check_backend("grouped_mm", name)
        if name == "grouped_mm" and not _grouped_mm_fits(x, w1):
            raise ValueError(
                f"backend='grouped_mm' does not support dtype={x.dtype}, device={x.device.type}, "
                f"F={w1.shape[1]}, L={w1.shape[2]} (needs 16-byte aligned rows)"
            )
        return name
    if torch.compiler.is_compiling():
        return "static"
    return "grouped_mm" if _grouped_mm_fits(x, w1) else "bmm"


def _sort_by_expert(topk_idx: torch.Tensor, num_experts: int):
    """Sorted order of the A assignments, their experts, per-expert counts (no host sync)."""
    flat = cast(topk_idx.reshape(-1), torch.int64)
    order = torch.argsort(flat, stable=True)  # [A]: assignment index at each sorted position
    expert_sorted = flat[order]
    # index_add_ rather than bincount: fixed output size (no sync), and an out-of-range id raises.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    return order, expert_sorted, counts


def _quant(t: torch.Tensor, input_quant: InputQuant) -> torch.Tensor:
    return t if input_quant is None else input_quant(t)


def _ffn_grouped_mm(xs, counts, w1, w3, w2, act, input_quant=None):
    """xs: [A, L] rows sorted by expert (already input-quantized); counts: [E]. Returns [A, L]."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gate = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)  # [A, F]
    up = torch._grouped_mm(xs, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(_quant(act(gate, up), input_quant), w2.transpose(-2, -1), offs=offs)


def _ffn_padded_bmm(xs, expert_sorted, counts, w1, w3, w2, act, input_quant=None):
    """Same contract as :func:`_ffn_grouped_mm`, via a zero-padded [E, M, L] batch."""
    e, _, l = w1.shape
    starts = torch.cumsum(counts, 0) - counts
    slot = (
        torch.arange(xs.shape[0], device=xs.device) - starts[expert_sorted]
    )  # row within its expert
    m = int(counts.max().item()) if xs.shape[0] else 0
    buf = xs.new_zeros(e, m, l).index_put((expert_sorted, slot), xs)
    h = act(torch.bmm(buf, w1.transpose(1, 2)), torch.bmm(buf, w3.transpose(1, 2)))  # [E, M, F]
    # padding rows are zero and stay zero under MX fake-quant (an all-zero block quantizes to 0)
    return torch.bmm(_quant(h, input_quant), w2.transpose(1, 2))[expert_sorted, slot]


def dispatch_combine(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    num_experts: int,
    ffn: ExpertFFN,
) -> torch.Tensor:
    """Sort the N·k assignments by expert, run ``ffn`` on the sorted rows, restore (token, slot)
    order and take the fp32 weighted sum over slots. Shared by every dense and packed backend.

    Args:
        x: [N, L]; topk_idx, topk_weight: [N, k]; num_experts: E.
        ffn: ``(xs [A, L], expert_sorted [A] int64, counts [E] int64) -> ys [A, L]``.
    Returns:
        [N, L] float32 (float64 for float64 x).
    """
    n, k = topk_idx.shape
    order, expert_sorted, counts = _sort_by_expert(topk_idx, num_experts)
    xs = x[torch.div(order, k, rounding_mode="floor")]  # [A, L] token rows, grouped by expert
    ys = ffn(xs, expert_sorted, counts)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    acc = _accum_dtype(x)
    per_slot = cast(ys[inverse], acc).view(n, k, ys.shape[1])  # back to (token, slot) order
    return (per_slot * cast(topk_weight, acc).unsqueeze(-1)).sum(1)


def routed_experts(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    act: GluActivation,
    backend: str | None = None,
    input_quant: InputQuant = None,
) -> torch.Tensor:
    """Weighted sum of each token's routed GLU experts (the single entry point).

    Args:
        x: [N, L] expert inputs (for K3 the latent ``routed_expert_down_proj(x)``).
        topk_idx: [N, k] int64/int32 expert ids in [0, E); repeated ids within a row are allowed
            (each slot is computed separately).
        topk_weight: [N, k] combine weights (used in fp32).
        w1, w3: [E, F, L] gate / up weights; w2: [E, L, F] down weights; same dtype as x.
        act: ``(gate [A, F], up [A, F]) -> [A, F]``, e.g. SiTU-GLU or SwiGLU.
        backend: None (automatic) or one of :data:`BACKENDS`.
        input_quant: optional fake-quantizer applied to the input rows of every expert GEMM (x
            before w1/w3, the GLU output before w2), e.g. MXFP8 QAT (:mod:`openk3.quant.qat`). It
            must act row-wise along the last dim (so quantizing x before the gather is the same).
    Returns:
        [N, L] float32 (float64 for float64 x): ``Σ_j topk_weight[n, j] · E_{topk_idx[n, j]}(x[n])``.
        Differentiable w.r.t. x, topk_weight and the expert weights; deterministic on every backend
        (the combine is a fixed-order sum over k, not a scatter-add).
    Raises:
        ValueError: inconsistent shapes/dtypes, an unknown backend, or ``grouped_mm`` forced where
            it does not apply. An expert id outside [0, E) raises from the index op.
    """
    _check_inputs(x, topk_idx, topk_weight, w1, w3, w2)
    name = _select_backend(x, w1, backend)
    if name == "loop":
        return routed_experts_reference(x, topk_idx, topk_weight, w1, w3, w2, act, input_quant)
    if name == "static":
        return routed_experts_static(x, topk_idx, topk_weight, w1, w3, w2, act, input_quant)
    xq = _quant(x, input_quant)  # row-wise, so once per token rather than once per slot
    if name == "grouped_mm":

        def ffn(xs, expert_sorted, counts):
            return _ffn_grouped_mm(xs, counts, w1, w3, w2, act, input_quant)
    else:

        def ffn(xs, expert_sorted, counts):
            return _ffn_padded_bmm(xs, expert_sorted, counts, w1, w3, w2, act, input_quant)

    return dispatch_combine(xq, topk_idx, topk_weight, w1.shape[0], ffn)


def routed_experts_static(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    act: GluActivation,
    input_quant: InputQuant = None,
) -> torch.Tensor:
    """:func:`routed_experts` (same contract) with every shape fixed by (N, k, E), no host sync
    and no sort: the form a compiled or captured decode step can hold.

    With at least as many assignments as experts (N·k >= E) every expert runs on every token and
    the outputs are combined with a dense [N, E] weight matrix (zero for experts not chosen), so
    each expert's weights are read once, as one [N, E·F] GEMM per input projection; with fewer,
    the k chosen experts' weights are gathered per token and applied by batched matrix-vector
    products (only the chosen experts are read). Decode batches are small, so the extra products
    of the dense form cost less than the sort and scatter of the grouped form.
    """
    n, k = topk_idx.shape
    e, f, l = w1.shape
    acc = _accum_dtype(x)
    xq = _quant(x, input_quant)
    if n * k >= e:
        # repeated ids in a row add their weights, as the per-slot sum does
        comb = torch.zeros(n, e, dtype=acc, device=x.device).scatter_add_(
            1, topk_idx.long(), cast(topk_weight, acc)
        )
        gate = (xq @ w1.reshape(e * f, l).T).view(n, e, f)
        up = (xq @ w3.reshape(e * f, l).T).view(n, e, f)
        h = _quant(act(gate, up), input_quant)  # [N, E, F]
        y = torch.einsum("nef,elf->nel", h, w2)  # [N, E, L]
        return (cast(y, acc) * comb.unsqueeze(-1)).sum(1)
    idx = topk_idx.reshape(-1).long()  # [A], token-major
    xs = xq.unsqueeze(1).expand(n, k, l).reshape(n * k, l, 1)
    gate = torch.bmm(w1[idx], xs)[..., 0]  # [A, F]
    up = torch.bmm(w3[idx], xs)[..., 0]
    h = _quant(act(gate, up), input_quant)
    y = torch.bmm(w2[idx], h.unsqueeze(-1))[..., 0].view(n, k, l)  # [N, k, L]
    return (cast(y, acc) * cast(topk_weight, acc).unsqueeze(-1)).sum(1)


def routed_experts_reference(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    act: GluActivation,
    input_quant: InputQuant = None,
) -> torch.Tensor:
    """Readable reference for :func:`routed_experts` (same contract): loop over experts, run each
    on the tokens that chose it, accumulate in fp32. For tests; never on the hot path."""
    _check_inputs(x, topk_idx, topk_weight, w1, w3, w2)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=_accum_dtype(x), device=x.device)
    for e in range(w1.shape[0]):
        tok, slot = torch.nonzero(topk_idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = _quant(x[tok], input_quant)
        ye = _quant(act(xe @ w1[e].T, xe @ w3[e].T), input_quant) @ w2[e].T
        out = out.index_add(
            0, tok, ye.to(out.dtype) * topk_weight[tok, slot].to(out.dtype).unsqueeze(-1)
        )
    return out
