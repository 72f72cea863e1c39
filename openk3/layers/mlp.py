"""Gated MLPs: SiTU-GLU (Kimi K3), SwiGLU (Kimi Linear) and GeGLU (``hidden_act="gelu"``).

Shape legend: ``*`` any leading dims, D model width (``hidden_size``), I intermediate width.

Sources: architecture.md §8 (SiTU-GLU, exact definition, fp32 evaluation) and §6.1 (the fused
shared experts), config fields ``hidden_act``, ``activation_situ_beta`` (β₁, gate branch) and
``activation_situ_linear_beta`` (β₂, up branch).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from openk3.config import K3Config
from openk3.ops import situ_cpu
from openk3.ops.cast import cast
from openk3.weight_init import init_module

GluActivation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """fp32, or float64 when given float64 (so float64 test references stay exact)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def situ_glu(
    gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float | None
) -> torch.Tensor:
    """SiTU-GLU: ``[β₁ tanh(g/β₁) σ(g)] ⊙ [β₂ tanh(u/β₂)]`` (architecture.md §8).

    Each factor is a soft cap (``β tanh(x/β)``) so ``|out| < β₁β₂`` elementwise, while matching
    SwiGLU to first order near 0. Evaluated in fp32 (float64 stays float64) whatever the input
    dtype, as every re-implementation does, then cast back.

    Args:
        gate, up: [*, I] pre-activations (same shape, any float dtype).
        beta1: positive gate cap (``activation_situ_beta``).
        beta2: positive up cap (``activation_situ_linear_beta``), or None: the up branch is used
            uncapped (the reference's ``SituAndMul`` with ``linear_beta=None``).
    Returns:
        [*, I] in ``gate.dtype``.
    """
    g = _upcast(gate)
    u = _upcast(up)
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        capped_up = u if beta2 is None else beta2 * torch.tanh(u / beta2)
        out = (beta1 * torch.tanh(g / beta1)) * torch.sigmoid(g) * capped_up
        return cast(out, gate.dtype)
    if situ_cpu.fits(g, u):  # one native pass instead of ~7 elementwise ones (fp32 CPU)
        return cast(situ_cpu.situ_glu(g, u, beta1, beta2), gate.dtype)
    # Without autograd: the same product as tanh(g/β₁) σ(g) tanh(u/β₂) · β₁β₂, written in place
    # into one buffer (five temporaries fewer: 0.70-0.75x of the time for [4096, 64] expert and
    # [2048, 384] dense batches, 1 thread; each elementwise pass costs about as much as the tanh).
    out = torch.div(g, beta1).tanh_().mul_(torch.sigmoid(g))
    if beta2 is None:
        return cast(out.mul_(u).mul_(beta1), gate.dtype)
    return cast(out.mul_(torch.div(u, beta2).tanh_()).mul_(beta1 * beta2), gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU ``silu(g) ⊙ u`` (Kimi Linear, ``hidden_act="silu"``), in fp32, cast back.

    Args:
        gate, up: [*, I]. Returns: [*, I] in ``gate.dtype``.
    """
    return cast(F.silu(_upcast(gate)) * _upcast(up), gate.dtype)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GeGLU ``gelu(g) ⊙ u`` (``hidden_act="gelu"``: erf; ``"gelu_pytorch_tanh"``: tanh
    approximation, as transformers' ACT2FN), in fp32, cast back.

    Args:
        gate, up: [*, I]. Returns: [*, I] in ``gate.dtype``.
    """
    return cast(F.gelu(_upcast(gate), approximate=approximate) * _upcast(up), gate.dtype)


def glu_activation(config: K3Config) -> GluActivation:
    """The ``(gate, up) -> hidden`` nonlinearity selected by ``config.hidden_act``.

    Raises:
        ValueError: ``hidden_act`` not one of situ / silu / gelu / gelu_pytorch_tanh, or a
            non-positive SiTU beta.
    """
    if config.hidden_act == "silu":
        return swiglu
    if config.hidden_act == "gelu":
        return geglu
    if config.hidden_act == "gelu_pytorch_tanh":
        return functools.partial(geglu, approximate="tanh")
    if config.hidden_act == "situ":
        b1 = config.activation_situ_beta
        b2 = config.activation_situ_linear_beta
        for name, b in (("activation_situ_beta", b1), ("activation_situ_linear_beta", b2)):
            if b is None and name == "activation_situ_linear_beta":
                continue
            if not (isinstance(b, (int, float)) and b > 0):
                raise ValueError(f"K3Config.{name}={b!r}: SiTU betas must be positive numbers")
        return functools.partial(situ_glu, beta1=float(b1), beta2=None if b2 is None else float(b2))
    raise ValueError(
        f"K3Config.hidden_act={config.hidden_act!r}: must be 'situ' (SiTU-GLU), 'silu' (SwiGLU), "
        "'gelu' or 'gelu_pytorch_tanh'"
    )


class MLP(nn.Module):
    """Gated FFN ``down_proj(act(gate_proj(x), up_proj(x)))``, no biases.

    Used for the dense layer-0 FFN (width ``intermediate_size``, checkpoint prefix ``mlp.``) and
    for the shared experts of a MoE layer, which the checkpoint stores fused as one MLP of width
    ``n_shared_experts * moe_intermediate_size`` (prefix ``shared_experts.``); the sum of several
    GLU experts equals one GLU of the concatenated width.

    Checkpoint tensors: ``gate_proj.weight`` [I, D], ``up_proj.weight`` [I, D],
    ``down_proj.weight`` [D, I].

    Raises:
        ValueError: a non-positive ``hidden_size``, a negative ``intermediate_size`` (0 is the
            zero-width shared MLP of ``num_shared_experts=0``, as the reference builds it), or a bad
            activation config (see :func:`glu_activation`).
    """

    def __init__(self, config: K3Config, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        for name, v, least in (
            ("hidden_size", hidden_size, 1),
            ("intermediate_size", intermediate_size, 0),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ValueError(f"MLP {name}={v!r}: must be an integer >= {least}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.initializer_range = config.initializer_range
        self.act = glu_activation(config)
        with (
            warnings.catch_warnings()
        ):  # torch warns that a zero-size init is a no-op; it is meant here
            warnings.filterwarnings("ignore", "Initializing zero-element tensors")
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
            self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
            self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.init_weights()

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """All three projections ~ N(0, ``initializer_range``) by :mod:`openk3.weight_init`
        (meta-device safe)."""
        init_module(self, self.initializer_range, is_k3=True, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [*, D] -> [*, D] (dtype of the weights' matmul with x)."""
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"
