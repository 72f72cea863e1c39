"""Stable LatentMoE (Kimi K3) and the full-width MoE of Kimi Linear: router, stacked routed
experts, latent projections with the post-aggregation RMSNorm, fused shared experts.

Shape legend: N tokens (flattened B·T), D model width (``hidden_size``), L expert width
(``moe_latent_size``: ``routed_expert_hidden_size`` for K3, ``hidden_size`` for Kimi Linear),
F expert FFN width (``moe_intermediate_size``), E routed experts (``n_routed_experts``),
k experts per token (``num_experts_per_tok``), G expert groups (``n_group``).

Sources: architecture.md §6 (equations, checkpoint names), k3-release-notes.md §1.7, the
conventions of ``shared/fixtures/k3-ref-tiny-a/README.md``, and for the Kimi Linear variant the
DeepSeek-V3 ``noaux_tc`` grouped top-k as in transformers' ``KimiLinearTopkRouter``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from openk3.config import K3Config
from openk3.layers.mlp import MLP, glu_activation
from openk3.layers.norm import RMSNorm
from openk3.ops.cast import cast, fp32
from openk3.ops.grouped_mm import routed_experts
from openk3.weight_init import init_module, init_tensor

# Renormalisation guard of the reference (``sum + 1e-20``), not a tunable.
_RENORM_EPS = 1e-20


@dataclass
class RouterOutput:
    """What the router decided for N tokens.

    Attributes:
        topk_idx: [N, k] int64 chosen experts, ordered by biased score, highest first.
        topk_weight: [N, k] fp32 combine weights (unbiased scores, renormalised, scaled).
        scores: [N, E] fp32 unbiased router scores σ(W_r x) (what Quantile Balancing reads).
    """

    topk_idx: torch.Tensor
    topk_weight: torch.Tensor
    scores: torch.Tensor


def select_topk(
    biased: torch.Tensor, k: int, n_group: int = 1, topk_group: int = 1
) -> torch.Tensor:
    """DeepSeek-V3 ``noaux_tc`` expert choice on biased scores.

    With ``n_group > 1`` the E experts form G contiguous groups; a group's score is the sum of its
    two largest biased scores (its one score when groups have a single expert), only the best
    ``topk_group`` groups stay eligible, then top-k runs over the eligible experts. Excluded experts
    are masked with -inf, so they are never chosen (the official Kimi code fills 0.0, which differs
    only if every eligible biased score is negative). ``n_group == 1`` is plain top-k.

    Args:
        biased: [N, E] fp32 selection scores (``scores + e_score_correction_bias``).
        k: experts per token, ``1 <= k <= topk_group * E / n_group``.
        n_group, topk_group: ``n_group`` divides E, ``1 <= topk_group <= n_group``.
    Returns:
        [N, k] int64 expert ids, highest biased score first (ties: any valid top-k).
    Raises:
        ValueError: the constraints above.
    """
    n, e = biased.shape
    if n_group < 1 or e % n_group:
        raise ValueError(f"n_group={n_group}: must be >= 1 and divide E={e}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group}: must be in [1, n_group={n_group}]")
    per_group = e // n_group
    if not 1 <= k <= topk_group * per_group:
        raise ValueError(f"k={k}: must be in [1, topk_group*E/n_group={topk_group * per_group}]")
    if topk_group < n_group:
        grouped = biased.view(n, n_group, per_group)
        group_score = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)  # [N, G]
        keep = group_score.topk(topk_group, dim=-1).indices
        eligible = torch.zeros(n, n_group, dtype=torch.bool, device=biased.device).scatter(
            1, keep, True
        )
        biased = grouped.masked_fill(~eligible.unsqueeze(-1), float("-inf")).view(n, e)
    return biased.topk(k, dim=-1, sorted=True).indices


class Router(nn.Module):
    """Sigmoid router with an aux-loss-free selection bias (checkpoint prefix ``gate.``).

    ``s = σ(W_r x)`` in fp32 on the full-width x; experts chosen by top-k of ``s + b`` (grouped
    when ``n_group > 1``); weights are the chosen *unbiased* scores, divided by their sum + 1e-20
    when ``norm_topk_prob`` and k > 1 (as the official gate; with k = 1 the raw score is kept),
    times ``routed_scaling_factor``. ``moe_router_activation_func="softmax"`` replaces σ by a
    softmax over experts.

    Checkpoint tensors: ``weight`` [E, D] fp32 Parameter; ``e_score_correction_bias`` [E] fp32
    persistent buffer (trained by Quantile Balancing outside autograd, frozen at inference).

    Raises:
    Grouping follows ``n_group`` / ``topk_group`` alone: the official gates read neither
    ``use_grouped_topk`` nor ``topk_method`` (see :mod:`openk3.config_fields`).

    Raises:
        ValueError: k / group settings that cannot be satisfied.
    """

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        if config.moe_router_activation_func not in ("sigmoid", "softmax"):
            raise ValueError(
                f"K3Config.moe_router_activation_func={config.moe_router_activation_func!r}: "
                "must be 'sigmoid' or 'softmax'"
            )
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.activation = config.moe_router_activation_func
        self.initializer_range = config.initializer_range
        select_topk(
            torch.zeros(1, self.num_experts), self.top_k, self.n_group, self.topk_group
        )  # validates
        self.weight = nn.Parameter(
            torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32)
        )
        self.register_buffer(
            "e_score_correction_bias",
            torch.zeros(self.num_experts, dtype=torch.float32),
            persistent=True,
        )
        self.init_weights()

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """``weight`` ~ N(0, ``initializer_range``), ``e_score_correction_bias`` = 0
        (:mod:`openk3.weight_init`)."""
        init_module(self, self.initializer_range, is_k3=True, generator=generator)

    def forward(self, x: torch.Tensor, force_topk_idx: torch.Tensor | None = None) -> RouterOutput:
        """Route N tokens.

        Args:
            x: [N, D] full-width (normed) FFN input, any float dtype (logits are fp32).
            force_topk_idx: optional [N, k] expert ids to use instead of the biased top-k
                (forced routing for parity tests); weights are still computed from the scores.
        Returns:
            :class:`RouterOutput`.
        Raises:
            ValueError: x not [N, D]; ``force_topk_idx`` of the wrong shape or out of range.
        """
        if x.dim() != 2 or x.shape[1] != self.weight.shape[1]:
            raise ValueError(f"x: expected [N, D={self.weight.shape[1]}], got {tuple(x.shape)}")
        logits = F.linear(fp32(x), fp32(self.weight))
        scores = (
            torch.sigmoid(logits) if self.activation == "sigmoid" else torch.softmax(logits, dim=-1)
        )
        if force_topk_idx is None:
            with torch.no_grad():
                biased = scores + fp32(self.e_score_correction_bias)
                topk_idx = select_topk(biased, self.top_k, self.n_group, self.topk_group)
        else:
            topk_idx = self._check_forced(force_topk_idx, x.shape[0])
        weight = scores.gather(1, topk_idx)
        if self.norm_topk_prob and self.top_k > 1:
            weight = weight / (weight.sum(-1, keepdim=True) + _RENORM_EPS)
        return RouterOutput(topk_idx, weight * self.routed_scaling_factor, scores)

    def _check_forced(self, idx: torch.Tensor, n: int) -> torch.Tensor:
        if tuple(idx.shape) != (n, self.top_k):
            raise ValueError(
                f"force_topk_idx: expected shape [{n}, {self.top_k}], got {tuple(idx.shape)}"
            )
        idx = idx.to(device=self.weight.device, dtype=torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_experts):
            raise ValueError(f"force_topk_idx: ids must lie in [0, {self.num_experts})")
        return idx

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, n_group={self.n_group}, "
            f"topk_group={self.topk_group}, scaling={self.routed_scaling_factor}"
        )


class Experts(nn.Module):
    """E routed GLU experts at width L with hidden F, stored stacked.

    Parameters ``w1`` [E, F, L] (gate), ``w3`` [E, F, L] (up), ``w2`` [E, L, F] (down): the
    checkpoint's per-expert ``experts.{e}.w{1,2,3}.weight`` stacked along dim 0 (the checkpoint
    adapter splits/stacks them).

    ``qat``: None (default) or a :class:`openk3.quant.qat.QuantScheme`; when set, every GEMM uses
    fake-quantized weights (MXFP4 along its K) and inputs (MXFP8) with straight-through gradients
    (architecture.md §10). Switch it with :func:`openk3.quant.qat.model_qat`. Inference from packed
    weights uses :class:`openk3.quant.packed.PackedExperts` instead of this module. All three
    routed-expert classes are :class:`openk3.quant.qat.RoutedExperts`.
    """

    qat = None  # class default: QAT off; model_qat sets an instance attribute

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        e = config.n_routed_experts
        f = config.moe_intermediate_size
        l = config.moe_latent_size
        self.initializer_range = config.initializer_range
        self.act = glu_activation(config)
        self.w1 = nn.Parameter(torch.empty(e, f, l))
        self.w3 = nn.Parameter(torch.empty(e, f, l))
        self.w2 = nn.Parameter(torch.empty(e, l, f))
        self.init_weights()

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """``w1``, ``w2``, ``w3`` ~ N(0, ``initializer_range``) (:mod:`openk3.weight_init`), drawn
        in that order: the expert-parallel module draws its full-size tensors the same way."""
        for name in ("w1", "w2", "w3"):
            init_tensor(
                name, getattr(self, name), self.initializer_range, is_k3=True, generator=generator
            )

    def forward(
        self,
        z: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weight: torch.Tensor,
        backend: str | None = None,
    ) -> torch.Tensor:
        """z: [N, L]; topk_idx, topk_weight: [N, k] -> [N, L] fp32 weighted sum of expert outputs.

        See :func:`openk3.ops.grouped_mm.routed_experts` (errors, backends)."""
        q = self.qat
        if q is None:
            return routed_experts(
                z, topk_idx, topk_weight, self.w1, self.w3, self.w2, self.act, backend=backend
            )
        w1, w3, w2 = (q.fake_quant_weight(w) for w in (self.w1, self.w3, self.w2))
        return routed_experts(
            z,
            topk_idx,
            topk_weight,
            w1,
            w3,
            w2,
            self.act,
            backend=backend,
            input_quant=q.input_quant,
        )

    def extra_repr(self) -> str:
        e, f, l = self.w1.shape
        qat = f", qat={self.qat.name}" if self.qat is not None else ""
        return f"experts={e}, width={l}, hidden={f}{qat}"


class LatentMoE(nn.Module):
    """One MoE FFN (checkpoint prefix ``block_sparse_moe.``).

    K3 (``routed_expert_hidden_size`` set; architecture.md §6.1)::

        r = Router(x)                                        # full width, fp32
        z = routed_expert_down_proj(x)                       # D -> L, once per token
        u = Σ_j w_j E_j(z)                                   # fp32 accumulation
        y = routed_expert_up_proj(routed_expert_norm(u)) + shared_experts(x)

    Kimi Linear (``routed_expert_hidden_size=None``): no projections and no norm, experts at
    width D, ``y = u + shared_experts(x)``. ``routed_expert_norm`` exists only when
    ``latent_moe_use_norm``; ``shared_experts`` (one MLP of width ``n_shared_experts *
    moe_intermediate_size``) whenever ``n_shared_experts`` is not None, so ``n_shared_experts=0``
    gives a zero-width MLP (zero-size tensors that add nothing) exactly as the reference builds it.
    """

    def __init__(self, config: K3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.initializer_range = config.initializer_range
        self.gate = Router(config)
        self.experts = Experts(config)
        self.is_latent = config.routed_expert_hidden_size is not None
        if self.is_latent:
            d = config.hidden_size
            l = config.routed_expert_hidden_size
            self.routed_expert_down_proj = nn.Linear(d, l, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(l, eps=config.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(l, d, bias=False)
        if config.n_shared_experts is not None:
            self.shared_experts = MLP(
                config, config.hidden_size, config.n_shared_experts * config.moe_intermediate_size
            )
        self.init_weights(recurse=False)

    def init_weights(self, recurse: bool = True, generator: torch.Generator | None = None) -> None:
        """Latent projections ~ N(0, ``initializer_range``), norm weight = 1; with ``recurse`` also
        the router, experts and shared experts (each of which initialises itself on construction).
        Rules: :mod:`openk3.weight_init`."""
        for name in ("routed_expert_down_proj", "routed_expert_norm", "routed_expert_up_proj"):
            if hasattr(self, name):
                init_tensor(
                    f"{name}.weight",
                    getattr(self, name).weight,
                    self.initializer_range,
                    is_k3=True,
                    generator=generator,
                )
        if recurse:
            self.gate.init_weights(generator)
            self.experts.init_weights(generator)
            if hasattr(self, "shared_experts"):
                self.shared_experts.init_weights(generator)

    def forward(
        self,
        x: torch.Tensor,
        routing_sink: list | None = None,
        force_topk_idx: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Apply the MoE FFN.

        Args:
            x: [B, T, D] or [N, D], the ``post_attention_layernorm`` output.
            routing_sink: if a list, the :class:`RouterOutput` (token rows flattened batch-major)
                is appended to it (Quantile Balancing and parity tests read it).
            force_topk_idx: optional [N, k] forced expert choice (see :meth:`Router.forward`).
        Returns:
            Same shape and dtype as x.
        Raises:
            ValueError: last dim of x is not D; see also :meth:`Router.forward`.
        """
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        route = self.gate(h, force_topk_idx=force_topk_idx)
        if routing_sink is not None:
            routing_sink.append(route)
        z = self.routed_expert_down_proj(h) if self.is_latent else h
        u = self.experts(z, route.topk_idx, route.topk_weight)  # [N, L] fp32
        if hasattr(self, "routed_expert_norm"):
            u = self.routed_expert_norm(u)
        y = cast(u, x.dtype)
        if self.is_latent:
            y = self.routed_expert_up_proj(y)
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(h)
        return y.reshape(shape)
