"""The one initialisation of fresh K3 / Kimi Linear weights, chosen from each tensor's name.

Every construction path uses it: ``K3ForCausalLM(config)`` (built on the meta device, then
materialised and initialised once), :func:`openk3.pretrained.build_model` (same, with a seeded
generator) and each layer's own ``init_weights`` when a layer is built on its own. Draws follow
``named_parameters()`` order, so ``torch.manual_seed(s); K3ForCausalLM(config)`` and
``build_model(config, seed=s)`` give identical weights on the CPU.

Rules (first match wins; ``name`` is the parameter's dotted name inside the module initialised):

* ``*_res_proj.weight`` (Block AttnRes pseudo-query projections): zeros, so every site starts as
  the uniform average over depth (AttnRes paper §5).
* ``A_log``: 0 for K3 (lower-bounded gate, report §2.2); log U[1, 16] for Kimi Linear.
* ``dt_bias``: inverse softplus of dt = exp(U[ln 1e-3, ln 1e-1]) clamped >= 1e-4, so
  ``softplus(dt_bias) == dt`` (architecture.md §3.3).
* any other 1-D ``weight`` (RMSNorm / gated RMSNorm scales): ones.
* everything else (linears, embeddings, short-conv kernels, stacked experts, the router):
  N(0, ``initializer_range``) (the recipe is not public for K3, architecture.md §16; this is the
  DeepSeek / transformers default).
* buffer ``e_score_correction_bias``: zeros (Quantile Balancing moves it during training).

Vision towers built alone (:class:`openk3.vision.VisionModel`) keep their own
:func:`openk3.vision.init_vision_weights`; inside ``K3ForConditionalGeneration`` the rules above
cover the tower and projector too.
"""

from __future__ import annotations

import math
import torch
from torch import nn


@torch.no_grad()
def init_tensor(
    name: str, p: torch.Tensor, std: float, *, is_k3: bool, generator: torch.Generator | None = None
) -> None:
    """Initialise one parameter in place by the rule its ``name`` selects (see the module docstring).

    Args:
        name: dotted parameter name (only its ending matters).
        p: the parameter, any shape and device; a meta tensor is left as it is.
        std: ``K3Config.initializer_range``.
        is_k3: ``K3Config.is_k3`` (selects the ``A_log`` rule).
        generator: random source (None = the default generator of ``p``'s device).
    """
    if p.is_meta:
        return
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("_res_proj.weight"):
        p.zero_()
    elif leaf == "A_log":
        if is_k3:
            p.zero_()
        else:
            p.copy_(torch.empty_like(p).uniform_(1, 16, generator=generator).log())
    elif leaf == "dt_bias":
        dt = torch.exp(
            torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1), generator=generator)
        )
        dt = dt.clamp_min(1e-4)
        p.copy_(dt + torch.log(-torch.expm1(-dt)))
    elif p.ndim == 1 and leaf == "weight":
        p.fill_(1.0)
    else:
        p.normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_module(
    module: nn.Module, std: float, *, is_k3: bool, generator: torch.Generator | None = None
) -> None:
    """Initialise every parameter and the ``e_score_correction_bias`` buffers of ``module`` (a whole
    model or one layer), in ``named_parameters()`` order, by :func:`init_tensor`. Meta tensors are
    skipped."""
    for name, p in module.named_parameters():
        init_tensor(name, p, std, is_k3=is_k3, generator=generator)
    for name, b in module.named_buffers():
        if name.endswith("e_score_correction_bias") and not b.is_meta:
            b.zero_()
