"""OCP Microscaling (MX v1.0) formats as K3 uses them: MXFP4 (E2M1) expert weights, MXFP8 (E4M3) expert
GEMM inputs, E8M0 block scales, and the compressed-tensors ``mxfp4-pack-quantized`` nibble layout.

Shape legend:
    ``*``  any other dims (kept as they are)
    N      length of the blocked axis (``axis``): the GEMM reduction dim K
    B      block length (``block``, 32 in the spec)
    G      N / B, number of E8M0 scales along the blocked axis
    O, K   a weight's out / in features (``[O, K]``, blocked along K); T the tokens of a GEMM input [T, K]

Sources: architecture.md §10 (E2M1 / E4M3 elements, E8M0 scales, blocks of 32 along K, FLOOR default
and RCEIL option); k3-release-notes.md §1.9 (``weight_packed`` uint8 [O, K/2], ``weight_scale`` uint8
[O, K/32], scale = 2^(s-127), no global scale); OCP MX v1.0 §5.4.1 (E8M0) and §6.3 (conversion).

Numerics (every step is exact apart from the element rounding itself):
    * E8M0 byte s in 0..254 means X = 2^(s-127); s = 255 is NaN and makes the whole block NaN.
    * FLOOR (spec): e = floor(log2(amax)) - emax, emax = 2 (E2M1) / 8 (E4M3), computed on the exponent
      bits (subnormal amax included). RCEIL (cuBLAS "round the descale up"): e = ceil(log2(d)) with
      d = fp32(amax / elem_max), elem_max = 6 / 448, also exact on the bits. Both clamp e to [-127, 127];
      all-zero blocks (and blocks too small for any other scale) get s = 0, X = 2^-127, codes zero.
    * Elements: RNE(x / X) in the element format (ties to the even code), saturated to +-6 / +-448.
      x / X is exact in fp32 because X is a power of two. The sign bit is ``signbit(x)``, so -0.0 and
      negatives that round to zero encode as -0 (E2M1 code 8), as torchao and compressed-tensors do.
      MXFP4 elements are returned as uint8 codes 0..15; MXFP8 elements as ``torch.float8_e4m3fn``
      (``.view(torch.uint8)`` is the OCP E4M3 byte).
    * Non-finite input: a block holding a NaN or +-Inf gets s = 255 (NaN) and zero element codes, so it
      dequantizes to NaN. E8M0, E2M1 and E4M3FN have no Inf, so NaN is the only outcome that does not
      turn an Inf into a made-up finite number (microxcaling does the same: exponent overflow -> NaN).
      torchao agrees on NaN blocks (s = 255) but gives Inf blocks a finite scale (FLOOR 2^(128-emax),
      RCEIL 2^127) with the Inf saturated; we deliberately differ there.
    * Where torchao 0.18's eager ``to_mx`` departs from the spec we follow the spec (the tests pin each
      case): FLOOR blocks with s = 0 are divided by 2^-126 there (its min-normal clamp) but decoded with
      2^-127; RCEIL blocks with s = 0 are multiplied by 1 instead of 2^127 (flushed); and its RCEIL
      takes ceil(log2(d)) in fp32, which rounds log2 of a d a few ulp above a power of two down to the
      integer and so picks half the cuBLAS scale (e.g. amax = nextafter(6 * 2^10) gives s = 137, not 138).

Packed layout (verified against compressed-tensors ``pack_fp4_to_uint8`` / ``unpack_fp4_from_uint8``):
an E2M1 code is ``sign << 3 | index`` with sign = bit 3 and index the position of |v| in
(0, 0.5, 1, 1.5, 2, 3, 4, 6) (the bit pattern E E M); two consecutive elements of the last dim share a
byte, element 2j in the LOW nibble and 2j+1 in the HIGH nibble. torchao's ``pack_uint4`` uses the same
order. Scales are the raw E8M0 byte (compressed-tensors writes 127 + floor(log2(scale))).
"""

from __future__ import annotations

from typing import Callable, Literal

import torch

ScaleMode = Literal["floor", "rceil"]
SCALE_MODES = ("floor", "rceil")

E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_MAX = 6.0
E2M1_EMAX = 2
E4M3_MAX = 448.0
E4M3_EMAX = 8

# Value of each E2M1 code 0..15 (sign bit 3, then the magnitude index); ``_E2M1_MIDPOINTS[k]`` is the
# halfway point between magnitudes k and k+1, used for round-to-nearest with ties to the even code.
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FP32_2_POW_M127_BITS = 0x00400000  # 2^-127 is an fp32 subnormal, not expressible as s << 23


# --------------------------------------------------------------------------- helpers


def _check_block_axis(x: torch.Tensor, block: int, axis: int, fn: str, arg: str) -> int:
    """Validates ``block``/``axis`` and the blocked length; returns the non-negative axis."""
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"{fn}: block must be a positive int, got {block!r}")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"{fn}: axis={axis} is out of range for {arg} with shape {tuple(x.shape)}")
    axis = axis % x.dim()
    n = x.shape[axis]
    if n % block != 0:
        raise ValueError(
            f"{fn}: {arg} dim {axis} has size {n}, which is not a multiple of block={block} "
            f"(MX blocks run along the reduction dim, architecture.md §10); shape {tuple(x.shape)}"
        )
    return axis


def _to_blocks(x: torch.Tensor, block: int, axis: int) -> torch.Tensor:
    """[*, N, *] -> [*, *, G, B] with the blocked axis moved last."""
    xm = x.movedim(axis, -1)
    return xm.reshape(*xm.shape[:-1], xm.shape[-1] // block, block)


def _from_blocks(xb: torch.Tensor, axis: int) -> torch.Tensor:
    """[*, *, G, B] -> [*, N, *], inverse of ``_to_blocks``."""
    return xb.reshape(*xb.shape[:-2], xb.shape[-2] * xb.shape[-1]).movedim(-1, axis)


def _check_float(x: torch.Tensor, fn: str) -> None:
    # float64 is refused rather than cast: the cast to fp32 would round twice (a value just above a
    # tie lands on the tie) and overflow beyond fp32's range.
    if (
        not isinstance(x, torch.Tensor)
        or not x.is_floating_point()
        or x.dtype
        in (
            torch.float8_e4m3fn,
            torch.float8_e5m2,
            torch.float64,
        )
    ):
        raise ValueError(
            f"{fn}: x must be a float32/bfloat16/float16 tensor, got {getattr(x, 'dtype', type(x))}"
        )


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """Decodes E8M0 bytes (OCP MX §5.4.1): s -> 2^(s-127) exactly, 255 -> NaN.

    Args:
        scales: [*] uint8.
    Returns:
        [*] float32 (s = 0 is the subnormal 2^-127).
    Raises:
        ValueError: if ``scales`` is not uint8.
    """
    if scales.dtype != torch.uint8:
        raise ValueError(f"e8m0_to_float: scales must be uint8 E8M0 bytes, got {scales.dtype}")
    s = scales.to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, _FP32_2_POW_M127_BITS), s << 23)
    return torch.where(s == E8M0_NAN, torch.full_like(s, 0x7FC00000), bits).view(torch.float32)


def _block_scales(amax: torch.Tensor, emax: int, elem_max: float, scale_mode: str) -> torch.Tensor:
    """E8M0 byte per block from its fp32 absolute maximum; see the module docstring for the rules."""
    finite = torch.isfinite(amax)
    a = torch.where(finite, amax, torch.zeros_like(amax))
    if scale_mode == "floor":
        mant, ex = torch.frexp(a)  # a = mant * 2^ex, mant in [0.5, 1): floor(log2 a) = ex - 1
        e = ex - 1 - emax
        zero = a == 0
    else:
        d = a / elem_max  # fp32 division: the descale that cuBLAS / torchao round up
        mant, ex = torch.frexp(d)
        e = torch.where(mant == 0.5, ex - 1, ex)  # exact powers of two need no rounding up
        zero = d == 0
    e = torch.where(zero, torch.full_like(e, -E8M0_BIAS), e).clamp(-E8M0_BIAS, E8M0_BIAS)
    s = (e + E8M0_BIAS).to(torch.uint8)
    return torch.where(finite, s, torch.full_like(s, E8M0_NAN))


def _scaled_blocks(
    x: torch.Tensor, block: int, axis: int, emax: int, elem_max: float, scale_mode: str, fn: str
):
    """Shared front half of quantization: validated blocks, E8M0 bytes and x / X (0 in NaN blocks)."""
    _check_float(x, fn)
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"{fn}: scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    axis = _check_block_axis(x, block, axis, fn, "x")
    xb = _to_blocks(x.float(), block, axis)  # [*, G, B]
    scales = _block_scales(
        xb.abs().amax(-1), emax, elem_max, scale_mode
    )  # NaN propagates through amax
    ok = (scales != E8M0_NAN).unsqueeze(-1)
    v = torch.where(ok, xb / e8m0_to_float(scales).unsqueeze(-1), torch.zeros_like(xb))
    return axis, scales, v


def _check_codes_scales(
    codes: torch.Tensor, scales: torch.Tensor, block: int, axis: int, fn: str, name: str
) -> int:
    axis = _check_block_axis(codes, block, axis, fn, name)
    if scales.dtype != torch.uint8:
        raise ValueError(f"{fn}: scales must be uint8 E8M0 bytes, got {scales.dtype}")
    want = list(codes.shape)
    want[axis] //= block
    if list(scales.shape) != want:
        raise ValueError(
            f"{fn}: scales shape {tuple(scales.shape)} does not match {name} shape "
            f"{tuple(codes.shape)} with block={block} along axis {axis} (expected {tuple(want)})"
        )
    return axis


# --------------------------------------------------------------------------- MXFP4 (E2M1)


def quantize_mxfp4(
    x: torch.Tensor, block: int = 32, axis: int = -1, scale_mode: ScaleMode = "floor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 quantization (architecture.md §10, OCP MX v1.0 §6.3): E2M1 codes plus E8M0 block scales.

    Args:
        x: [*, N, *] float32 / bfloat16 / float16 (math in fp32), blocked along ``axis`` (default the
            last dim, the K of a weight [O, K]).
        block: elements per scale (32 in the spec). axis: the reduction dim.
        scale_mode: "floor" (spec default) or "rceil"; see the module docstring.
    Returns:
        codes: [*, N, *] uint8, one E2M1 code 0..15 per element (unpacked; see ``pack_mxfp4``).
        scales: x's shape with N replaced by G = N / block, uint8 E8M0 (255 = NaN block).
    Raises:
        ValueError: non-float x, N not a multiple of ``block``, bad ``block`` / ``axis`` / ``scale_mode``.
    """
    axis, scales, v = _scaled_blocks(
        x, block, axis, E2M1_EMAX, E2M1_MAX, scale_mode, "quantize_mxfp4"
    )
    mag = v.abs()
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=mag.dtype, device=mag.device)
    idx = torch.bucketize(
        mag, mids
    )  # mag == mids[k] -> k (lower neighbour); mag > 5 -> 7 (6.0, saturation)
    last = len(_E2M1_MIDPOINTS) - 1
    tie_to_odd = (idx <= last) & (mag == mids[idx.clamp(max=last)]) & (idx % 2 == 1)
    idx = idx + tie_to_odd.to(
        idx.dtype
    )  # an odd code is an odd mantissa: ties move up to the even one
    codes = (idx | (torch.signbit(v).to(idx.dtype) << 3)).to(torch.uint8)
    return _from_blocks(codes, axis), scales.movedim(-1, axis)


def dequantize_mxfp4(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: int = 32,
    axis: int = -1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """E2M1 code * 2^(s-127) per element (exact in fp32; NaN where s = 255, Inf past the fp32 range).

    Args:
        codes: [*, N, *] uint8 codes 0..15 (unpacked). scales: same shape with N -> G, uint8 E8M0.
        block, axis: as in ``quantize_mxfp4``. dtype: output dtype.
    Returns:
        [*, N, *] in ``dtype``.
    Raises:
        ValueError: wrong dtypes, codes > 15, or shapes that do not match ``block`` / ``axis``.
    """
    fn = "dequantize_mxfp4"
    if codes.dtype != torch.uint8:
        raise ValueError(f"{fn}: codes must be uint8 E2M1 codes, got {codes.dtype}")
    axis = _check_codes_scales(codes, scales, block, axis, fn, "codes")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"{fn}: codes must be 0..15, got max {int(codes.max())}")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    vb = _to_blocks(lut[codes.long()], block, axis)
    out = vb * e8m0_to_float(scales.movedim(axis, -1)).unsqueeze(-1)
    return _from_blocks(out, axis).to(dtype)


def pack_mxfp4(codes: torch.Tensor) -> torch.Tensor:
    """Two E2M1 codes per byte along the last dim, element 2j in the low nibble (k3-release-notes §1.9).

    Args:
        codes: [*, N] uint8 codes 0..15, N even.
    Returns:
        [*, N/2] uint8 (``weight_packed`` layout for a weight [O, K]: [O, K/2]).
    Raises:
        ValueError: non-uint8 codes, codes > 15, 0-dim input or an odd last dim.
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_mxfp4: codes must be uint8, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2 != 0:
        raise ValueError(
            f"pack_mxfp4: the last dim must have even size, got shape {tuple(codes.shape)}"
        )
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"pack_mxfp4: codes must be 0..15, got max {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_mxfp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_mxfp4``.

    Args:
        packed: [*, M] uint8.
    Returns:
        [*, 2M] uint8 codes 0..15.
    Raises:
        ValueError: non-uint8 or 0-dim input.
    """
    if packed.dtype != torch.uint8 or packed.dim() == 0:
        raise ValueError(
            f"unpack_mxfp4: packed must be a uint8 tensor with >= 1 dim, got {packed.dtype} {tuple(packed.shape)}"
        )
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(
        *packed.shape[:-1], 2 * packed.shape[-1]
    )


def mxfp4_weight_to_packed(
    weight: torch.Tensor, scale_mode: ScaleMode = "floor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [O, K] (or stacked [E, O, K]) to the checkpoint pair (k3-release-notes §1.9).

    Returns:
        weight_packed: [*, O, K/2] uint8. weight_scale: [*, O, K/32] uint8 E8M0.
    Raises:
        ValueError: as ``quantize_mxfp4`` (K not a multiple of 32).
    """
    codes, scales = quantize_mxfp4(weight, 32, -1, scale_mode)
    return pack_mxfp4(codes), scales


def mxfp4_weight_from_packed(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Checkpoint pair -> dense weight [*, O, K] in ``dtype`` (exact). Raises ValueError on bad shapes/dtypes."""
    return dequantize_mxfp4(unpack_mxfp4(weight_packed), weight_scale, 32, -1, dtype)


def mxfp4_linear_reference(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Readable dequantize-then-matmul for a packed MXFP4 weight: ``x @ W.T (+ bias)`` in fp32.

    The ground truth a fused packed GEMM must match.
    Args:
        x: [*, K] any float dtype. weight_packed: [O, K/2] uint8. weight_scale: [O, K/32] uint8.
        bias: [O] or None.
    Returns:
        [*, O] float32.
    Raises:
        ValueError: x's last dim is not 2 * weight_packed.shape[-1], or bad packed shapes/dtypes.
    """
    if weight_packed.dim() != 2:
        raise ValueError(
            f"mxfp4_linear_reference: weight_packed must be [O, K/2], got {tuple(weight_packed.shape)}"
        )
    k = 2 * weight_packed.shape[1]
    if x.shape[-1] != k:
        raise ValueError(
            f"mxfp4_linear_reference: x last dim {x.shape[-1]} != K = {k} from weight_packed"
        )
    w = mxfp4_weight_from_packed(weight_packed, weight_scale)
    y = x.float() @ w.T
    return y if bias is None else y + bias.float()


# --------------------------------------------------------------------------- MXFP8 (E4M3)


def quantize_mxfp8(
    x: torch.Tensor, block: int = 32, axis: int = -1, scale_mode: ScaleMode = "floor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 quantization with E4M3 elements (architecture.md §10, OCP MX v1.0 §6.3).

    Args / raises: as ``quantize_mxfp4``.
    Returns:
        elements: [*, N, *] ``torch.float8_e4m3fn`` (RNE, saturated to +-448; 0 in NaN blocks).
        scales: x's shape with N replaced by G, uint8 E8M0.
    """
    axis, scales, v = _scaled_blocks(
        x, block, axis, E4M3_EMAX, E4M3_MAX, scale_mode, "quantize_mxfp8"
    )
    elems = v.clamp(-E4M3_MAX, E4M3_MAX).to(
        torch.float8_e4m3fn
    )  # clamp keeps -0.0; the cast is RNE
    return _from_blocks(elems, axis), scales.movedim(-1, axis)


def dequantize_mxfp8(
    elements: torch.Tensor,
    scales: torch.Tensor,
    block: int = 32,
    axis: int = -1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """E4M3 element * 2^(s-127), exact in fp32 (NaN where s = 255).

    Args:
        elements: [*, N, *] float8_e4m3fn. scales: same shape with N -> G, uint8. dtype: output dtype.
    Returns:
        [*, N, *] in ``dtype``.
    Raises:
        ValueError: wrong dtypes or shapes that do not match ``block`` / ``axis``.
    """
    fn = "dequantize_mxfp8"
    if elements.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{fn}: elements must be float8_e4m3fn, got {elements.dtype}")
    axis = _check_codes_scales(elements, scales, block, axis, fn, "elements")
    vb = _to_blocks(elements.float(), block, axis)
    out = vb * e8m0_to_float(scales.movedim(axis, -1)).unsqueeze(-1)
    return _from_blocks(out, axis).to(dtype)


# --------------------------------------------------------------------------- QAT fake-quant


class _StraightThrough(torch.autograd.Function):
    """Forward: ``fn(x)``; backward: identity (STE, Bengio et al. 2013; architecture.md §10 QAT)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return fn(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def fake_quant_mxfp4(
    w: torch.Tensor, block: int = 32, axis: int = -1, scale_mode: ScaleMode = "floor"
) -> torch.Tensor:
    """``dequantize(quantize(w))`` in MXFP4 with a straight-through gradient, for QAT of expert weights.

    The master ``w`` is not modified; the result is exactly the value a packed checkpoint decodes to.
    Args:
        w: [*, N, *] float (fp32 master weights), blocked along ``axis`` (K of [O, K]).
    Returns:
        [*, N, *] in ``w.dtype``; d(out)/d(w) is the identity.
    Raises:
        ValueError: as ``quantize_mxfp4``.
    """

    def fq(t: torch.Tensor) -> torch.Tensor:
        codes, scales = quantize_mxfp4(t, block, axis, scale_mode)
        return dequantize_mxfp4(codes, scales, block, axis, t.dtype)

    return _StraightThrough.apply(w, fq)


def fake_quant_mxfp8(
    x: torch.Tensor, block: int = 32, axis: int = -1, scale_mode: ScaleMode = "floor"
) -> torch.Tensor:
    """``dequantize(quantize(x))`` in MXFP8 (E4M3) with a straight-through gradient, for expert GEMM inputs.

    Args:
        x: [*, N, *] float activations, blocked along ``axis`` (K of the GEMM input [T, K]).
    Returns:
        [*, N, *] in ``x.dtype``; d(out)/d(x) is the identity.
    Raises:
        ValueError: as ``quantize_mxfp8``.
    """

    def fq(t: torch.Tensor) -> torch.Tensor:
        elems, scales = quantize_mxfp8(t, block, axis, scale_mode)
        return dequantize_mxfp8(elems, scales, block, axis, t.dtype)

    return _StraightThrough.apply(x, fq)
