"""K3's optimizer setup: parameter groups chosen by checkpoint name, and the LR schedule.

Shape legend: E experts, F expert FFN width, L latent width, D hidden, H heads, K KDA head dim.

Sources: architecture.md §9 (Muon for matrices, AdamW with betas (0.9, 0.95), eps 1e-8 for
embeddings, head, norms and vectors; cosine schedule with 1 % linear warmup; weight decay 0.1),
the K3 report §3.3 (training recipe). The warmup-stable-decay schedule (:func:`wsd_with_warmup`) is
the one the Kimi K2 technical report used for K2's pretraining (a constant LR for most of the
tokens, then a decay to a tenth); architecture.md §9 lists cosine for K3, so cosine stays the default. Parameter names are the official checkpoint names
(``model.layers.{l}.self_attn.q_proj.weight``, ``...block_sparse_moe.experts.w1`` [E, F, L], ...).
"""

from __future__ import annotations

import functools
import math
import re
import typing
from collections.abc import Mapping
from typing import Literal

import torch
from torch import nn

from openk3.config import KDA, MLA, K3Config
from openk3.train.muon import HeadBlocks, Muon

_ATTN_WEIGHT = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(\w+)\.weight$")

ADAMW_NAME_PARTS = ("embed_tokens", "lm_head", "conv1d", "A_log", "dt_bias")
"""Name fragments that always go to AdamW whatever their shape: embeddings and the LM head
(lookup tables / the output layer, not hidden-layer matrices), the depthwise short-conv filters
([P, 1, W]: per-channel, not a matrix) and the KDA decay parameters."""


def classify_parameter(
    name: str, param: torch.Tensor, config: K3Config, *, per_head: bool = True
) -> tuple[str, HeadBlocks | None]:
    """The optimizer group of one parameter.

    Rules, in order:

    1. ``e_score_correction_bias`` -> ``"skip"`` (set by Quantile Balancing, not by gradients).
    2. AdamW (``"adamw"``): tensors with fewer than 2 dims (norm weights, ``A_log``,
       ``dt_bias``, biases), names containing :data:`ADAMW_NAME_PARTS`, and 2-D tensors with a
       dimension of 1 (AttnRes ``*_res_proj`` [1, D]: a pseudo-query vector, for which
       orthogonalisation would only normalise it), and >= 3-D tensors that are not stacked
       experts.
    3. Muon, per-head blocks (``"muon_kda_qkv"``, ``"muon_mla_q"``, ``"muon_mla_kv"``) for the
       Q/K/V projections named in :class:`~openk3.train.muon.Muon`'s docstring, when
       ``per_head`` is True.
    4. Muon, full matrix (``"muon"``): every other 2-D weight (including the router
       ``gate.weight`` [E, D], ``g_proj``, ``o_proj``, ``b_proj``, ``f_a/f_b_proj``, shared and
       dense MLPs, latent projections), and stacked experts ``...experts.w1`` [E, F, L]
       (orthogonalised expert by expert).

    Returns:
        ``(group_name, head_blocks)``; ``head_blocks`` is None except for per-head groups.
    Raises:
        ValueError: a per-head projection whose row count does not match the config (names the
            parameter, its shape and the expected rows).
    """
    if name.endswith("e_score_correction_bias"):
        return "skip", None
    if param.ndim < 2 or any(part in name for part in ADAMW_NAME_PARTS):
        return "adamw", None
    if param.ndim == 2 and min(param.shape) == 1:
        return "adamw", None
    if param.ndim >= 3:
        return ("muon", None) if param.ndim == 3 and ".experts." in name else ("adamw", None)
    hit = _ATTN_WEIGHT.search(name)
    if not per_head or hit is None or "vision" in name:
        return "muon", None
    idx = int(hit.group(1))
    proj = hit.group(2)
    if idx >= len(config.layer_types):
        return "muon", None  # e.g. an MTP layer beyond num_hidden_layers
    kind = config.layer_types[idx]
    group = "muon"
    blocks = None
    if kind == KDA and proj in ("q_proj", "k_proj", "v_proj"):
        group = "muon_kda_qkv"
        blocks = (config.linear_num_heads, (config.linear_head_dim,))
    elif kind == MLA and proj in ("q_b_proj", "q_proj"):
        group = "muon_mla_q"
        blocks = (config.num_attention_heads, (config.qk_head_dim,))
    elif kind == MLA and proj == "kv_b_proj":
        group = "muon_mla_kv"
        blocks = (config.num_attention_heads, (config.qk_nope_head_dim, config.v_head_dim))
    if blocks is not None and param.shape[0] != blocks[0] * sum(blocks[1]):
        raise ValueError(
            f"{name}: shape {tuple(param.shape)} does not hold {blocks[0]} heads of {sum(blocks[1])} rows "
            f"(config layer_types[{idx}]={kind!r})"
        )
    return group, blocks


def check_lr_scales(scales: Mapping[str, float], what: str = "lr_scales") -> None:
    """Every multiplier of an ``lr_scales`` mapping (:func:`param_groups`) is a finite number > 0.

    Raises:
        ValueError: ``<what>['<prefix>']=<value>: must be a finite number > 0``.
    """
    for prefix, scale in scales.items():
        if (
            not isinstance(scale, (int, float))
            or isinstance(scale, bool)
            or not math.isfinite(scale)
            or not scale > 0
        ):
            raise ValueError(f"{what}[{prefix!r}]={scale!r}: must be a finite number > 0")


def param_groups(
    model: nn.Module,
    config: K3Config,
    *,
    weight_decay: float = 0.1,
    adamw_weight_decay: float = 0.0,
    adamw_lr: float | None = None,
    per_head: bool = True,
    lr: float | None = None,
    lr_scales: Mapping[str, float] | None = None,
) -> list[dict]:
    """Split ``model``'s trainable parameters into :class:`~openk3.train.muon.Muon` groups.

    Args:
        lr: the peak LR (needed only with ``lr_scales``: a scaled group carries its own ``lr``).
        lr_scales: parameter-name prefix -> LR multiplier; a parameter takes the first prefix
            (in mapping order) its name starts with, ``""`` matches every name, unmatched
            parameters keep 1.0. A group splits into one group per multiplier (a vision stage
            that trains the language model slower than its fresh tower:
            ``{"vision_tower.": 1, "mm_projector.": 1, "": 0.2}``).
    Returns:
        Non-empty groups in a fixed order (kind, then multiplier in ``lr_scales`` order), each
        ``{"name", "params", "param_names", "use_muon", "head_blocks", "weight_decay"}``
        (+ ``"lr"`` on the AdamW group if ``adamw_lr`` is set, and on every group whose
        multiplier is not 1; its name then ends in ``@<multiplier>``).
        AdamW parameters get ``adamw_weight_decay`` (0 by default: the issue asks for no decay on
        embeddings, head, norms, vectors, ``A_log`` and ``dt_bias``).
    Raises:
        ValueError: from :func:`classify_parameter`; a multiplier that is not a finite number
            > 0, or ``lr_scales`` without ``lr``.
    """
    scales = dict(lr_scales or {})
    check_lr_scales(scales)
    if scales and lr is None:
        raise ValueError("lr_scales: needs lr (the peak LR the multipliers scale)")
    scale_order = {s: i for i, s in enumerate(dict.fromkeys([1.0, *map(float, scales.values())]))}

    def scale_of(name: str) -> float:
        return next((float(s) for p, s in scales.items() if name.startswith(p)), 1.0)

    order = ("muon", "muon_kda_qkv", "muon_mla_q", "muon_mla_kv", "adamw")
    buckets: dict[tuple[str, float], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        group, blocks = classify_parameter(name, p, config, per_head=per_head)
        if group == "skip":
            continue
        scale = scale_of(name)
        key = (group, scale)
        if key not in buckets:
            g = {
                "name": group if scale == 1.0 else f"{group}@{scale:g}",
                "params": [],
                "param_names": [],
                "use_muon": group != "adamw",
                "head_blocks": blocks,
                "weight_decay": weight_decay if group != "adamw" else adamw_weight_decay,
            }
            base = adamw_lr if group == "adamw" and adamw_lr is not None else lr
            if group == "adamw" and adamw_lr is not None:
                g["lr"] = adamw_lr
            if scale != 1.0:
                g["lr"] = base * scale
            buckets[key] = g
        buckets[key]["params"].append(p)
        buckets[key]["param_names"].append(name)
    keys = sorted(buckets, key=lambda k: (order.index(k[0]), scale_order[k[1]]))
    return [buckets[k] for k in keys]


def build_optimizer(
    model: nn.Module,
    config: K3Config,
    lr: float,
    weight_decay: float = 0.1,
    *,
    adamw_lr: float | None = None,
    adamw_weight_decay: float = 0.0,
    momentum: float = 0.95,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    ns_dtype: torch.dtype = torch.float32,
    per_head: bool = True,
    lr_scales: Mapping[str, float] | None = None,
) -> Muon:
    """K3's optimizer: Per-Head Muon for hidden-layer matrices, AdamW for everything else.

    Args:
        model: any module with official parameter names (``K3ForCausalLM``).
        config: its :class:`~openk3.config.K3Config` (head counts and dims, ``layer_types``).
        lr: peak learning rate of both halves (Muon's RMS matching makes AdamW's LR reusable);
            ``adamw_lr`` overrides it for the AdamW group.
        weight_decay: decoupled decay of the Muon groups (K3: 0.1).
        adamw_weight_decay: decay of the AdamW group (default 0).
        momentum: Muon's Nesterov momentum (0.95). betas, eps: AdamW's (0.9, 0.95), 1e-8.
        ns_dtype: Newton-Schulz arithmetic (fp32; bf16 for speed on GPUs).
        per_head: False gives plain full-matrix Muon on Q/K/V too.
        lr_scales: LR multipliers by parameter-name prefix (:func:`param_groups`).
    Returns:
        A :class:`~openk3.train.muon.Muon` whose ``param_groups`` carry ``name`` and
        ``param_names`` for logging.
    Raises:
        ValueError: bad hyperparameters, or a model with no trainable parameters.
    """
    groups = param_groups(
        model,
        config,
        weight_decay=weight_decay,
        adamw_weight_decay=adamw_weight_decay,
        adamw_lr=adamw_lr,
        per_head=per_head,
        lr=lr,
        lr_scales=lr_scales,
    )
    if not groups:
        raise ValueError("model: no trainable parameters")
    return Muon(
        groups,
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=True,
        ns_dtype=ns_dtype,
        betas=betas,
        eps=eps,
    )


# ------------------------------------------------------------------------------- schedule
def cosine_with_warmup(step: int, total: int, warmup: int, min_ratio: float = 0.0) -> float:
    """LR multiplier: linear warmup, then cosine decay to ``min_ratio`` (architecture.md §9).

    ``(step + 1) / warmup`` for ``step < warmup`` (the first step already trains), then
    ``min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2`` with
    ``p = (step - warmup) / (total - warmup)`` clipped to [0, 1]; ``min_ratio`` from ``total`` on.
    Use with ``torch.optim.lr_scheduler.LambdaLR`` via :func:`lr_lambda`.

    Raises:
        ValueError: ``total`` < 1, ``warmup`` outside [0, total], ``min_ratio`` outside [0, 1]
            or ``step`` < 0.
    """
    if not isinstance(total, int) or total < 1:
        raise ValueError(f"total={total!r}: must be a positive integer")
    if not isinstance(warmup, int) or not 0 <= warmup <= total:
        raise ValueError(f"warmup={warmup!r}: must be an integer in [0, total={total}]")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio={min_ratio!r}: must be in [0, 1]")
    if step < 0:
        raise ValueError(f"step={step!r}: must be >= 0")
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def wsd_with_warmup(
    step: int, total: int, warmup: int, decay: int, min_ratio: float = 0.0
) -> float:
    """LR multiplier, warmup-stable-decay: linear warmup, a constant phase at the peak, then a
    cosine decay to ``min_ratio`` over the last ``decay`` steps.

    ``(step + 1) / warmup`` for ``step < warmup``; 1.0 up to ``total - decay``; then
    ``min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2`` with
    ``p = (step - (total - decay)) / decay`` clipped to [0, 1]; ``min_ratio`` from ``total`` on
    (and at once when ``decay`` is 0). Why beside cosine: a small model learns to copy (an
    induction circuit) only after a long loss plateau; cosine has already lowered the LR when the
    plateau ends, WSD keeps the peak LR until the last ``decay`` steps.

    Raises:
        ValueError: ``total`` < 1, ``warmup`` outside [0, total], ``decay`` outside
            [0, total - warmup], ``min_ratio`` outside [0, 1] or ``step`` < 0.
    """
    cosine_with_warmup(0, total, warmup, min_ratio)  # the shared checks of total, warmup, min_ratio
    if isinstance(decay, bool) or not isinstance(decay, int) or not 0 <= decay <= total - warmup:
        raise ValueError(
            f"decay={decay!r}: must be an integer in [0, total - warmup = {total - warmup}]"
        )
    if step < 0:
        raise ValueError(f"step={step!r}: must be >= 0")
    if step < warmup:
        return (step + 1) / warmup
    start = total - decay
    if step < start:
        return 1.0
    if decay == 0:
        return min_ratio
    progress = min(1.0, (step - start) / decay)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


Schedule = Literal["cosine", "wsd"]
"""An LR schedule's name: :func:`cosine_with_warmup`, :func:`wsd_with_warmup`."""
SCHEDULES: tuple[str, ...] = typing.get_args(Schedule)
"""LR schedule names (``RunConfig.schedule``), in the order of :data:`Schedule`."""


def decay_steps(total: int, warmup: int, fraction: float) -> int:
    """The WSD decay length: ``fraction`` of ``total`` steps, rounded, at most ``total - warmup``.

    Raises:
        ValueError: ``fraction`` not a number in [0, 1].
    """
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, (int, float))
        or not 0.0 <= fraction <= 1.0
    ):
        raise ValueError(f"decay_fraction={fraction!r}: must be a number in [0, 1]")
    return max(0, min(total - warmup, round(fraction * total)))


def default_warmup(total: int, fraction: float = 0.01) -> int:
    """K3's warmup length: ``fraction`` (1 %) of ``total`` steps, at least 1."""
    return max(1, round(fraction * total))


def lr_lambda(total: int, warmup: int | None = None, min_ratio: float = 0.0):
    """A picklable ``LambdaLR`` function ``step -> multiplier`` (warmup defaults to 1 %)."""
    warmup = default_warmup(total) if warmup is None else warmup
    cosine_with_warmup(0, total, warmup, min_ratio)  # validate now, not at the first step
    return functools.partial(cosine_with_warmup, total=total, warmup=warmup, min_ratio=min_ratio)


def cosine_scheduler(
    optimizer: torch.optim.Optimizer, total: int, warmup: int | None = None, min_ratio: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` over every param group with :func:`cosine_with_warmup`."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total, warmup, min_ratio))
