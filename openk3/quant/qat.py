"""Quantization schemes for K3's routed experts, and quantization-aware training (QAT) with them.

This module is the one place a quantization choice is made: a name (``"mxfp4"``, a recipe's
``qat: mxfp4``, ``save_pretrained(quantization="mxfp4")``) resolves to a frozen :class:`QuantScheme`
here, and every consumer (expert forward, checkpoint writer/reader, packed inference) asks the scheme
instead of testing strings.

Shape legend: E routed experts, F expert FFN width (``moe_intermediate_size``), L expert input width
(``moe_latent_size``), O / K a weight's out / in (reduction) features, T rows of a GEMM input.

What QAT does (architecture.md §10, "QAT mechanics"): in the forward pass every routed-expert GEMM
uses ``dequant(quant(W))`` with W in MXFP4 (blocks of 32 along the GEMM's reduction dim: w1/w3
[E, F, L] along L, w2 [E, L, F] along F — the last dim of each, i.e. the ``[out, in]`` checkpoint
layout) and ``dequant(quant(A))`` of its input rows in MXFP8 E4M3 (blocked along the same K: z before
w1/w3, the GLU output h before w2). The backward pass is straight-through (identity) into the
full-precision master weights, which are never modified. Only the routed experts are quantized;
attention, latent projections, shared experts, the dense FFN, router, embeddings and LM head stay in
high precision (§10 scope; the released ignore list).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch import nn

from openk3.quant.mx import SCALE_MODES, fake_quant_mxfp4, fake_quant_mxfp8

MX_BLOCK = 32  # OCP MX v1.0 block size, architecture.md §10


@dataclass(frozen=True)
class QuantScheme:
    """How routed experts are quantized (weights, GEMM inputs, checkpoint format).

    Attributes:
        name: the recipe / API name.
        weights: element format of expert weights ("mxfp4").
        inputs: element format of expert GEMM inputs during QAT ("mxfp8"), or None (weight-only).
        scale_mode: E8M0 scale rounding, "floor" (spec) or "rceil" (see :mod:`openk3.quant.mx`).
        checkpoint_format: compressed-tensors ``format`` written for the weights.
    """

    name: str
    weights: str = "mxfp4"
    inputs: str | None = "mxfp8"
    scale_mode: str = "floor"
    checkpoint_format: str = "mxfp4-pack-quantized"

    def __post_init__(self) -> None:
        if self.weights != "mxfp4":
            raise ValueError(f"QuantScheme.weights={self.weights!r}: only 'mxfp4' is implemented")
        if self.inputs not in (None, "mxfp8"):
            raise ValueError(f"QuantScheme.inputs={self.inputs!r}: must be 'mxfp8' or None")
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(
                f"QuantScheme.scale_mode={self.scale_mode!r}: must be one of {SCALE_MODES}"
            )

    def fake_quant_weight(self, w: torch.Tensor) -> torch.Tensor:
        """MXFP4 fake-quant of a weight [*, O, K] along K with a straight-through gradient.

        Returns: [*, O, K] in ``w.dtype`` (exactly what a packed checkpoint decodes to).
        Raises: ValueError if K is not a multiple of 32.
        """
        return fake_quant_mxfp4(w, MX_BLOCK, -1, self.scale_mode)

    def fake_quant_input(self, x: torch.Tensor) -> torch.Tensor:
        """MXFP8 (E4M3) fake-quant of GEMM input rows [T, K] along K, straight-through gradient;
        the identity for a weight-only scheme.

        Raises: ValueError if K is not a multiple of 32.
        """
        if self.inputs is None:
            return x
        return fake_quant_mxfp8(x, MX_BLOCK, -1, self.scale_mode)

    @property
    def input_quant(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The row-wise input fake-quantizer for :func:`openk3.ops.grouped_mm.routed_experts`, or
        None for a weight-only scheme."""
        return None if self.inputs is None else self.fake_quant_input

    def check_expert_widths(self, latent: int, hidden: int) -> None:
        """Both reduction dims of an expert must hold whole MX blocks.

        Raises:
            ValueError: naming ``moe_latent_size`` (L, K of w1/w3) or ``moe_intermediate_size``
                (F, K of w2) when it is not a multiple of 32.
        """
        for field, k in (("moe_latent_size", latent), ("moe_intermediate_size", hidden)):
            if k % MX_BLOCK:
                raise ValueError(
                    f"quantization {self.name!r}: K3Config.{field}={k} is not a multiple of {MX_BLOCK}; MX blocks "
                    "run along each expert GEMM's reduction dim (architecture.md §10)"
                )


# The released recipe: MXFP4 weights with MXFP8 inputs in QAT; weight-only keeps activations exact
# (what inference from the released checkpoint does, whose config has ``input_activations: null``).
SCHEMES: dict[str, QuantScheme] = {
    "mxfp4": QuantScheme("mxfp4"),
    "mxfp4-weight-only": QuantScheme("mxfp4-weight-only", inputs=None),
}
_OFF = (None, "none", "off", "false", False)


def resolve_scheme(quantization: str | QuantScheme | None | bool) -> QuantScheme | None:
    """Name (or scheme) -> :class:`QuantScheme`; None / "none" / "off" / False -> None (no quantization).

    Raises:
        ValueError: an unknown name (the message lists :data:`SCHEMES`).
    """
    if isinstance(quantization, QuantScheme):
        return quantization
    if quantization in _OFF:
        return None
    if isinstance(quantization, str) and quantization in SCHEMES:
        return SCHEMES[quantization]
    raise ValueError(f"quantization={quantization!r}: must be one of {sorted(SCHEMES)} or None")


@runtime_checkable
class RoutedExperts(Protocol):
    """What QAT and the packed-checkpoint code need from a routed-expert module.

    Implemented by the dense :class:`~openk3.layers.moe.Experts`, the packed
    :class:`~openk3.quant.packed.PackedExperts` and the expert-parallel
    :class:`~openk3.train.distributed.expert_parallel.ExpertParallelExperts`. The protocol lives
    here, not with any of them, because all three import their schemes from this module.

    Attributes:
        w1, w3: gate and up weights [E, F, L] (a parameter, or an ``MXFP4Weight`` with that
            ``shape``); w2: down weight [E, L, F]. L and F are the GEMM reduction dims of MX blocks.
        qat: the :class:`QuantScheme` every expert GEMM applies, or None (full precision).
    """

    w1: Any
    w3: Any
    w2: Any
    qat: QuantScheme | None


def _expert_modules(model: nn.Module) -> list[RoutedExperts]:
    """The :class:`RoutedExperts` modules of ``model`` (``model`` included), in module order."""
    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


def model_qat(model: nn.Module, mode: str | QuantScheme | None) -> int:
    """Switch QAT on (``mode="mxfp4"``, the recipe's ``qat: mxfp4``) or off (None) for every routed-
    expert module in ``model`` (dense :class:`~openk3.layers.moe.Experts`, expert-parallel
    :class:`~openk3.train.distributed.expert_parallel.ExpertParallelExperts` and
    :class:`~openk3.quant.packed.PackedExperts`; the latter already hold quantized weights, so only
    the input fake-quant applies). Parameters are not touched: master weights stay as they are.

    Args:
        model: any module (a whole ``K3ForCausalLM``, a layer, or one ``Experts``).
        mode: a scheme name from :data:`SCHEMES`, a :class:`QuantScheme`, or None / "none" to turn off.
    Returns:
        How many expert modules were switched.
    Raises:
        ValueError: unknown mode, or expert widths that are not multiples of 32 (named config field).
    """
    scheme = resolve_scheme(mode)
    mods = _expert_modules(model)
    if scheme is not None:
        for m in mods:
            _, f, l = m.w1.shape
            scheme.check_expert_widths(l, f)
    for m in mods:
        m.qat = scheme
    return len(mods)


def qat_scheme(model: nn.Module) -> QuantScheme | None:
    """The QAT scheme the routed experts of ``model`` use (None when off or there are none).

    Raises:
        ValueError: if its expert modules disagree (a partly switched model).
    """
    schemes = {m.qat for m in _expert_modules(model)}
    if len(schemes) > 1:
        raise ValueError(f"model has expert modules with different QAT schemes: {schemes}")
    return schemes.pop() if schemes else None
