"""Quantization: OCP MX formats (MXFP4 weights, MXFP8 activations), packed checkpoint layout, QAT fake-quant."""

from openk3.quant.mx import (
    SCALE_MODES,
    dequantize_mxfp4,
    dequantize_mxfp8,
    e8m0_to_float,
    fake_quant_mxfp4,
    fake_quant_mxfp8,
    mxfp4_linear_reference,
    mxfp4_weight_from_packed,
    mxfp4_weight_to_packed,
    pack_mxfp4,
    quantize_mxfp4,
    quantize_mxfp8,
    unpack_mxfp4,
)

__all__ = [
    "SCALE_MODES",
    "dequantize_mxfp4",
    "dequantize_mxfp8",
    "e8m0_to_float",
    "fake_quant_mxfp4",
    "fake_quant_mxfp8",
    "mxfp4_linear_reference",
    "mxfp4_weight_from_packed",
    "mxfp4_weight_to_packed",
    "pack_mxfp4",
    "quantize_mxfp4",
    "quantize_mxfp8",
    "unpack_mxfp4",
]
