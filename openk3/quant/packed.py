"""Packed MXFP4 routed experts: the checkpoint layout held in memory and GEMMs that read it directly.

Shape legend: N tokens, k experts per token, A = N·k assignments, E routed experts, F expert FFN
width (``moe_intermediate_size``), L expert input width (``moe_latent_size``), O / K a weight's out /
in (reduction) features, K % 32 == 0.

Layout (k3-release-notes.md §1.9, compressed-tensors ``mxfp4-pack-quantized``): a weight [O, K] is
``weight_packed`` uint8 [O, K/2] (two E2M1 codes per byte, element 2j in the low nibble) plus
``weight_scale`` uint8 [O, K/32] (E8M0, scale 2^(s-127)); 4.25 bits per weight. In memory the E
experts of a layer are stacked: :class:`MXFP4Weight` holds [E, O, K/2] and [E, O, K/32], so the
state-dict names ``...experts.w1.weight_packed`` map 1:1 onto the file's per-expert
``...experts.{e}.w1.weight_packed`` (:mod:`openk3.checkpoint` splits/stacks them).

Inference: :class:`PackedExperts` is a drop-in for
:class:`openk3.layers.moe.Experts`. Its grouped matmul never materialises the dense expert stack:

* ``"native"`` (CPU, float inputs, no autograd): :mod:`openk3.quant.mxfp4_cpu`, which decodes each
  32-element block in registers and feeds it into FMAs, so decode reads 4.25 bits per weight;
* ``"torch"`` (any device, differentiable w.r.t. x): dequantize one expert at a time into a small
  fp32 buffer and matmul its rows;

both equal dequantize-then-matmul (:func:`packed_routed_experts_reference`) up to fp32 summation
order. The choice is made in :func:`_select_impl` only (``impl=``, or the one backend switch of
:mod:`openk3.ops.backends`: ``use_backend("mxfp4", name)`` / ``OPENK3_MXFP4_BACKEND``). With QAT on (``qat`` scheme with MXFP8
inputs) the GEMM inputs are fake-quantized exactly as in :class:`~openk3.layers.moe.Experts`.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.config import K3Config
from openk3.ops import backends
from openk3.ops.grouped_mm import (
    GluActivation,
    InputQuant,
    dispatch_combine,
    routed_experts_reference,
)
from openk3.quant import mxfp4_cpu
from openk3.quant.mx import mxfp4_weight_from_packed, mxfp4_weight_to_packed
from openk3.quant.qat import MX_BLOCK, SCHEMES, QuantScheme, resolve_scheme

PACKED_IMPLS = tuple(backends.BACKENDS["mxfp4"])
PACKED_SUFFIXES = ("weight_packed", "weight_scale")


def compressed_tensors_config(scheme: QuantScheme | str = "mxfp4") -> dict:
    """The ``text_config.quantization_config`` of an MXFP4 checkpoint, as the K3 release writes it
    (k3-release-notes.md §1.9: compressed-tensors, weights only, E2M1 in groups of 32 along K, uint8
    E8M0 scales, symmetric, no global scale; ignore list of architecture.md §10).

    Raises:
        ValueError: an unknown scheme name, or a scheme that is not checkpointable as MXFP4.
    """
    scheme = resolve_scheme(scheme)
    if scheme is None or scheme.checkpoint_format != "mxfp4-pack-quantized":
        raise ValueError(f"quantization={scheme!r}: no compressed-tensors MXFP4 layout for it")
    weights = {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": MX_BLOCK,
        "num_bits": 4,
        "observer": "minmax",
        "observer_kwargs": {},
        "scale_dtype": "torch.uint8",
        "strategy": "group",
        "symmetric": True,
        "type": "float",
        "zp_dtype": None,
    }
    group = {
        "format": scheme.checkpoint_format,
        "input_activations": None,
        "output_activations": None,
        "targets": ["Linear"],
        "weights": weights,
    }
    ignore = [
        "self_attn",
        "shared_experts",
        r"mlp\.(gate|up|gate_up|down)_proj",
        "lm_head",
        "vision_tower",
        "mm_projector",
    ]
    return {
        "config_groups": {"group_0": group},
        "format": scheme.checkpoint_format,
        "global_compression_ratio": None,
        "ignore": [f"re:.*{pat}.*" for pat in ignore],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


class MXFP4Weight(nn.Module):
    """E stacked MXFP4 weights [E, O, K] in the checkpoint layout (persistent uint8 buffers).

    Buffers: ``weight_packed`` [E, O, K/2] uint8, ``weight_scale`` [E, O, K/32] uint8 (E8M0).

    Raises:
        ValueError: K not a positive multiple of 32.
    """

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        if in_features <= 0 or in_features % MX_BLOCK:
            raise ValueError(
                f"in_features={in_features}: must be a positive multiple of {MX_BLOCK}"
            )
        e = num_experts
        o = out_features
        k = in_features
        self.register_buffer("weight_packed", torch.zeros(e, o, k // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.zeros(e, o, k // MX_BLOCK, dtype=torch.uint8))

    @classmethod
    def from_float(cls, w: torch.Tensor, scale_mode: str = "floor") -> "MXFP4Weight":
        """Quantize a dense stack w [E, O, K] (any float dtype; math in fp32). A meta ``w`` gives an
        uninitialised meta module (model skeletons for loading)."""
        if w.dim() != 3:
            raise ValueError(f"w: expected [E, O, K], got {tuple(w.shape)}")
        if w.is_meta:
            with torch.device("meta"):
                return cls(*w.shape)
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        packed, scale = mxfp4_weight_to_packed(w.detach(), scale_mode)
        m.register_buffer("weight_packed", packed)
        m.register_buffer("weight_scale", scale)
        return m

    @property
    def shape(self) -> torch.Size:
        """(E, O, K) of the dense weight this holds."""
        e, o, half = self.weight_packed.shape
        return torch.Size((e, o, 2 * half))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The exact dense stack [E, O, K] in ``dtype`` (native decoder on CPU when available)."""
        p = self.weight_packed
        s = self.weight_scale
        if p.device.type == "cpu" and mxfp4_cpu.available():
            e, o, k = self.shape
            dense = mxfp4_cpu.dequantize(
                p.reshape(e * o, -1).contiguous(), s.reshape(e * o, -1).contiguous()
            )
            return dense.view(e, o, k).to(dtype)
        return mxfp4_weight_from_packed(p, s, dtype)

    def dequantize_expert(self, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert ``e``'s dense weight [O, K] (the per-expert buffer of the ``"torch"`` path)."""
        return mxfp4_weight_from_packed(self.weight_packed[e], self.weight_scale[e], dtype)

    def extra_repr(self) -> str:
        e, o, k = self.shape
        return f"experts={e}, out={o}, in={k}, format=mxfp4"


class PackedExperts(nn.Module):
    """Drop-in for :class:`openk3.layers.moe.Experts` holding MXFP4-packed weights.

    Submodules ``w1``, ``w3`` (:class:`MXFP4Weight` [E, F, L]) and ``w2`` ([E, L, F]); state-dict
    names ``w1.weight_packed`` etc. ``qat``: None or a :class:`~openk3.quant.qat.QuantScheme`
    whose input format (MXFP8) is then applied to every GEMM input, as in QAT training. A
    :class:`~openk3.quant.qat.RoutedExperts`, like ``Experts``.

    Raises:
        ValueError: L or F not a multiple of 32 (naming the config field).
    """

    qat = None

    def __init__(self, num_experts: int, hidden: int, latent: int, act: GluActivation) -> None:
        super().__init__()
        SCHEMES["mxfp4"].check_expert_widths(latent, hidden)
        self.act = act
        self.w1 = MXFP4Weight(num_experts, hidden, latent)
        self.w3 = MXFP4Weight(num_experts, hidden, latent)
        self.w2 = MXFP4Weight(num_experts, latent, hidden)

    @classmethod
    def from_config(cls, config: K3Config) -> "PackedExperts":
        """Zero-filled packed experts for ``config`` (shapes of :class:`~openk3.layers.moe.Experts`)."""
        from openk3.layers.mlp import glu_activation

        return cls(
            config.n_routed_experts,
            config.moe_intermediate_size,
            config.moe_latent_size,
            glu_activation(config),
        )

    @classmethod
    def from_experts(cls, experts: nn.Module, scale_mode: str = "floor") -> "PackedExperts":
        """Quantize a dense ``Experts`` (its fp32 master weights) to MXFP4; keeps its ``act`` and
        ``qat``. Meta weights give a meta skeleton."""
        e, f, l = experts.w1.shape
        SCHEMES["mxfp4"].check_expert_widths(l, f)
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.act = experts.act
        for name in ("w1", "w3", "w2"):
            setattr(m, name, MXFP4Weight.from_float(getattr(experts, name), scale_mode))
        if experts.qat is not None:
            m.qat = experts.qat
        return m

    def to_experts(self, config: K3Config) -> nn.Module:
        """A dense :class:`~openk3.layers.moe.Experts` with the exact dequantized weights (fp32)."""
        from openk3.layers.moe import Experts

        with torch.device("meta"):
            dense = Experts(config)
        for name in ("w1", "w3", "w2"):
            setattr(dense, name, nn.Parameter(getattr(self, name).dequantize()))
        if self.qat is not None:
            dense.qat = self.qat
        return dense

    def init_weights(self) -> None:
        """Packed weights come from a checkpoint or :func:`pack_experts`, never from random init.

        Raises:
            ValueError: always (initialise a dense model, then pack it).
        """
        raise ValueError(
            "PackedExperts holds quantized weights; initialise dense Experts and pack_experts() them"
        )

    @property
    def num_weights(self) -> int:
        """Dense weights represented (3·E·F·L)."""
        return sum(getattr(self, n).shape.numel() for n in ("w1", "w3", "w2"))

    def forward(
        self,
        z: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weight: torch.Tensor,
        backend: str | None = None,
    ) -> torch.Tensor:
        """z: [N, L]; topk_idx, topk_weight: [N, k] -> [N, L] fp32. ``backend``: None or one of
        :data:`PACKED_IMPLS`. See :func:`packed_routed_experts`."""
        q = self.qat
        return packed_routed_experts(
            z,
            topk_idx,
            topk_weight,
            self.w1,
            self.w3,
            self.w2,
            self.act,
            input_quant=None if q is None else q.input_quant,
            impl=backend,
        )

    def extra_repr(self) -> str:
        e, f, l = self.w1.shape
        qat = f", qat={self.qat.name}" if self.qat is not None else ""
        return f"experts={e}, width={l}, hidden={f}, format=mxfp4{qat}"


# --------------------------------------------------------------------------- grouped matmul


def _native_fits(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and not (torch.is_grad_enabled() and x.requires_grad)
        and mxfp4_cpu.available()
    )


def _select_impl(x: torch.Tensor, impl: str | None) -> str:
    """The one place the packed GEMM implementation is chosen: explicit ``impl`` > the override of
    :mod:`openk3.ops.backends` (``use_backend("mxfp4", name)``, ``OPENK3_MXFP4_BACKEND``) > automatic."""
    if impl is None:
        impl = backends.forced_backend("mxfp4")
    if impl is None:
        return "native" if _native_fits(x) else "torch"
    if impl not in PACKED_IMPLS:
        raise ValueError(f"impl={impl!r}: must be one of {PACKED_IMPLS} or None")
    if impl == "native" and not _native_fits(x):
        why = (
            mxfp4_cpu.unavailable_reason()
            or f"needs float CPU input without autograd, got {x.dtype} on {x.device}"
        )
        raise ValueError(f"impl='native' does not apply: {why}")
    return impl


def _check(x, topk_idx, topk_weight, w1, w3, w2) -> None:
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        if not isinstance(w, MXFP4Weight):
            raise ValueError(f"{name}: expected an MXFP4Weight, got {type(w).__name__}")
    e, f, l = w1.shape
    if w3.shape != w1.shape or w2.shape != (e, l, f):
        raise ValueError(
            f"packed experts: w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)} "
            "are not [E, F, L], [E, F, L], [E, L, F]"
        )
    if x.dim() != 2 or x.shape[1] != l:
        raise ValueError(f"x: expected [N, L={l}], got {tuple(x.shape)}")
    if (
        topk_idx.dim() != 2
        or topk_idx.shape[0] != x.shape[0]
        or topk_weight.shape != topk_idx.shape
    ):
        raise ValueError(
            f"topk_idx/topk_weight: expected equal [N={x.shape[0]}, k], got "
            f"{tuple(topk_idx.shape)} and {tuple(topk_weight.shape)}"
        )


def _quant(t: torch.Tensor, input_quant: InputQuant) -> torch.Tensor:
    return t if input_quant is None else input_quant(t)


def packed_routed_experts(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    w1: MXFP4Weight,
    w3: MXFP4Weight,
    w2: MXFP4Weight,
    act: GluActivation,
    input_quant: InputQuant = None,
    impl: str | None = None,
) -> torch.Tensor:
    """Routed GLU experts on packed MXFP4 weights (same contract as
    :func:`openk3.ops.grouped_mm.routed_experts` with dense weights = the exact dequantization).

    Args:
        x: [N, L] float; topk_idx: [N, k] int; topk_weight: [N, k].
        w1, w3: [E, F, L] and w2: [E, L, F] as :class:`MXFP4Weight`.
        act: GLU nonlinearity. input_quant: optional row-wise fake-quantizer of GEMM inputs (QAT).
        impl: None (automatic) or one of :data:`PACKED_IMPLS`.
    Returns:
        [N, L] float32 (float64 for float64 x on the torch path).
    Raises:
        ValueError: inconsistent shapes, an unknown impl, or ``"native"`` where it does not apply.
    """
    _check(x, topk_idx, topk_weight, w1, w3, w2)
    name = _select_impl(x, impl)
    xq = _quant(x, input_quant)
    if name == "native":

        def ffn(xs, expert_sorted, counts):
            xs = xs.float().contiguous()
            gate = mxfp4_cpu.grouped_gemm(xs, counts, w1.weight_packed, w1.weight_scale)
            up = mxfp4_cpu.grouped_gemm(xs, counts, w3.weight_packed, w3.weight_scale)
            h = _quant(act(gate, up), input_quant).contiguous()
            return mxfp4_cpu.grouped_gemm(h, counts, w2.weight_packed, w2.weight_scale)
    else:

        def ffn(xs, expert_sorted, counts):
            dt = torch.float64 if xs.dtype == torch.float64 else torch.float32
            xs = xs.to(dt)
            ys = xs.new_empty(xs.shape[0], w2.shape[1])
            start = 0
            for e, c in enumerate(counts.tolist()):  # one small per-expert buffer at a time
                if c == 0:
                    continue
                xe = xs[start : start + c]
                h = act(xe @ w1.dequantize_expert(e, dt).T, xe @ w3.dequantize_expert(e, dt).T)
                ys[start : start + c] = _quant(h, input_quant) @ w2.dequantize_expert(e, dt).T
                start += c
            return ys

    return dispatch_combine(xq, topk_idx, topk_weight, w1.shape[0], ffn)


def packed_routed_experts_reference(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    w1: MXFP4Weight,
    w3: MXFP4Weight,
    w2: MXFP4Weight,
    act: GluActivation,
    input_quant: InputQuant = None,
) -> torch.Tensor:
    """Dequantize-then-matmul ground truth: the whole dense stacks, then the loop reference."""
    _check(x, topk_idx, topk_weight, w1, w3, w2)
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    dense = [mxfp4_weight_from_packed(w.weight_packed, w.weight_scale, dt) for w in (w1, w3, w2)]
    return routed_experts_reference(x.to(dt), topk_idx, topk_weight, *dense, act, input_quant)


# --------------------------------------------------------------------------- model conversion


def _replace_children(model: nn.Module, kind: type, convert) -> int:
    if isinstance(model, kind):
        raise ValueError(
            f"model: pass the module that contains the {kind.__name__}, not the module itself"
        )
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, kind):
                setattr(parent, name, convert(child))
                n += 1
    return n


def pack_experts(model: nn.Module, quantization: str | QuantScheme = "mxfp4") -> int:
    """Replace every dense ``Experts`` in ``model`` by :class:`PackedExperts` (in place), quantizing
    the weights with the scheme's scale mode; meta weights give meta skeletons (for loading).

    Returns: the number of modules replaced.
    Raises: ValueError for an unknown / non-MXFP4 scheme or widths that are not multiples of 32.
    """
    from openk3.layers.moe import Experts

    scheme = resolve_scheme(quantization)
    if scheme is None:
        raise ValueError("quantization=None: pack_experts needs a scheme such as 'mxfp4'")
    return _replace_children(
        model, Experts, lambda ex: PackedExperts.from_experts(ex, scheme.scale_mode)
    )


def unpack_experts(model: nn.Module, config: K3Config | None = None) -> int:
    """Replace every :class:`PackedExperts` by a dense ``Experts`` with the exactly dequantized
    weights (fp32). ``config`` defaults to ``model.config``. Returns the number replaced."""
    cfg = config if config is not None else getattr(model, "config", None)
    if cfg is None:
        raise ValueError("config: needed to rebuild dense experts (model has no .config)")
    return _replace_children(model, PackedExperts, lambda px: px.to_experts(cfg))


def expert_storage(model: nn.Module) -> dict:
    """Routed-expert weights and the bytes holding them (dense parameters or packed buffers).

    Returns: ``{"weights": int, "bytes": int, "bits_per_weight": float}`` (4.25 when fully packed).
    """
    from openk3.layers.moe import Experts

    weights = nbytes = 0
    for m in model.modules():
        if isinstance(m, (Experts, PackedExperts)):
            for t in list(m.parameters(recurse=True)) + list(m.buffers(recurse=True)):
                nbytes += t.numel() * t.element_size()
            weights += (
                m.num_weights
                if isinstance(m, PackedExperts)
                else sum(p.numel() for p in m.parameters())
            )
    return {
        "weights": weights,
        "bytes": nbytes,
        "bits_per_weight": 8 * nbytes / weights if weights else 0.0,
    }


__all__ = [
    "PACKED_IMPLS",
    "PACKED_SUFFIXES",
    "MXFP4Weight",
    "PackedExperts",
    "compressed_tensors_config",
    "expert_storage",
    "pack_experts",
    "packed_routed_experts",
    "packed_routed_experts_reference",
    "unpack_experts",
]
