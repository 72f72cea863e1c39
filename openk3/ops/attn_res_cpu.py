"""Native CPU kernel for one Block AttnRes depth mixture (the direct form of
:func:`openk3.ops.attn_res_decode.direct_mix`), one pass over the sources per token.

Shape legend: T tokens (all leading dims flattened), D hidden size, N candidate sources.

Per token, over its N source rows v_j [D] and the site's pseudo-query q [D] (fp32):

    z_j = (v_j · q) / sqrt(mean(v_j²) + eps)      a = softmax_j(z)      out = Σ_j a_j v_j

Why native code: in eager PyTorch a site is ~5 ops per source plus the softmax and the weighted
sum, each a pass over a [T, D] tensor (or the reference's two-phase form: block statistics as
batched products over [S, N, T, D] when a block opens, an online-softmax merge per site); a
2,048-token prefill spent ~1-2 ms per site, ~0.27 CPU-s of a 21,850-token prefill on the shipped
model. Here each token's N rows are read once for the dot products and squared norms (in cache)
and once for the weighted sum.

Accuracy: sums in fp32 in a different order than torch's (16 lanes, then across lanes), ``expf``
from libm; results agree with :func:`~openk3.ops.attn_res_decode.direct_mix` to ~1e-6 relative.
The kernel is built with :mod:`openk3.native` (``OPENK3_NO_NATIVE=1`` disables it); it needs
AVX-512F (elsewhere :func:`available` is False and callers keep the torch form).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from openk3 import native

# Most sources one call takes (a site sees at most 1 + L / block size; the shipped model 5).
MAX_SOURCES = 64

_C_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define K3_X86 1
#endif

#define MAXN 64
#define GRAIN 256 /* tokens per thread below which a call stays single-threaded */

int openk3_attn_res_simd_level(void) {
#ifdef K3_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? 2 : 0;
#else
    return 0;
#endif
}

#ifdef K3_X86
__attribute__((target("avx512f")))
static void mix_token(const float* const* src, int64_t n, int64_t t, int64_t D, const float* q,
                      float eps, float* out) {
    float z[MAXN];
    const int64_t body = D - D % 16;
    const __mmask16 tail = (__mmask16)((1u << (D % 16)) - 1u);
    for (int64_t j = 0; j < n; ++j) {
        const float* v = src[j] + t * D;
        __m512 dot = _mm512_setzero_ps(), ss = _mm512_setzero_ps();
        for (int64_t d = 0; d < body; d += 16) {
            const __m512 x = _mm512_loadu_ps(v + d);
            dot = _mm512_fmadd_ps(x, _mm512_loadu_ps(q + d), dot);
            ss = _mm512_fmadd_ps(x, x, ss);
        }
        if (tail) {
            const __m512 x = _mm512_maskz_loadu_ps(tail, v + body);
            dot = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(tail, q + body), dot);
            ss = _mm512_fmadd_ps(x, x, ss);
        }
        z[j] = _mm512_reduce_add_ps(dot) / sqrtf(_mm512_reduce_add_ps(ss) / (float)D + eps);
    }
    float m = z[0];
    for (int64_t j = 1; j < n; ++j) m = z[j] > m ? z[j] : m;
    float den = 0.f;
    for (int64_t j = 0; j < n; ++j) {
        z[j] = expf(z[j] - m);
        den += z[j];
    }
    float* o = out + t * D;
    const __m512 dv = _mm512_set1_ps(den);
    for (int64_t d = 0; d < body; d += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; ++j)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(z[j]), _mm512_loadu_ps(src[j] + t * D + d), acc);
        _mm512_storeu_ps(o + d, _mm512_div_ps(acc, dv));
    }
    if (tail) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; ++j)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(z[j]),
                                  _mm512_maskz_loadu_ps(tail, src[j] + t * D + body), acc);
        _mm512_mask_storeu_ps(o + body, tail, _mm512_div_ps(acc, dv));
    }
}
#endif

/* out [T, D] = the mixture of the n sources src[j] [T, D] (row-major) at query q [D].
   0 on success, 1 without AVX-512F, 2 on bad sizes. */
int openk3_attn_res_mix(const float* const* src, int64_t n, int64_t T, int64_t D, const float* q,
                        float eps, float* out, int64_t nthreads) {
    if (n < 1 || n > MAXN || T < 0 || D < 1) return 2;
#ifdef K3_X86
    if (openk3_attn_res_simd_level() < 2) return 1;
    int64_t nt = T / GRAIN;
    if (nt > nthreads) nt = nthreads;
    if (nt < 1) nt = 1;
    #pragma omp parallel for schedule(static) num_threads((int)nt)
    for (int64_t t = 0; t < T; ++t) mix_token(src, n, t, D, q, eps, out);
    return 0;
#else
    return 1;
#endif
}
"""


def _setup(lib: ctypes.CDLL) -> str | None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.openk3_attn_res_mix.argtypes = [p, i64, i64, i64, p, ctypes.c_float, p, i64]
    lib.openk3_attn_res_mix.restype = ctypes.c_int
    lib.openk3_attn_res_simd_level.restype = ctypes.c_int
    return None if lib.openk3_attn_res_simd_level() >= 2 else "this CPU has no AVX-512F"


_kernel = native.Kernel("openk3_attn_res_cpu", _C_SOURCE, "AttnRes mixture CPU kernel", _setup)


def available() -> bool:
    """True when the kernel is built (or buildable now), loaded, and this CPU has AVX-512F."""
    return _kernel.available()


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (compiler error, missing AVX-512F, the env switch); else None."""
    return _kernel.unavailable_reason()


def applies(sources: Sequence[torch.Tensor], query: torch.Tensor) -> bool:
    """Whether :func:`mix` takes these operands: 1..MAX_SOURCES contiguous float32 CPU tensors of
    one shape [*, D], a float32 CPU query [D], no gradient needed, not under ``torch.compile``
    tracing, and the kernel available."""
    if not 1 <= len(sources) <= MAX_SOURCES or torch.compiler.is_compiling():
        return False
    shape = sources[0].shape
    if len(shape) == 0 or query.shape != shape[-1:] or query.dtype != torch.float32:
        return False
    grad = torch.is_grad_enabled() and (
        query.requires_grad or any(s.requires_grad for s in sources)
    )
    return (
        not grad
        and query.device.type == "cpu"
        and all(
            s.shape == shape and s.dtype == torch.float32 and s.device.type == "cpu"
            for s in sources
        )
        and available()
    )


def mix(
    sources: Sequence[torch.Tensor], query: torch.Tensor, eps: float, threads: int | None = None
) -> torch.Tensor:
    """Softmax mixture over depth candidates at one site (same function as
    :func:`openk3.ops.attn_res_decode.direct_mix`).

    Args:
        sources: N tensors [*, D] float32 CPU of one shape (made contiguous if they are not).
        query: [D] float32 pseudo-query. eps: the key RMSNorm's eps.
        threads: OpenMP threads (default ``torch.get_num_threads()``; calls under 256 tokens per
            thread use fewer).
    Returns:
        [*, D] float32.
    Raises:
        ValueError: operands :func:`applies` rejects (other than availability).
        RuntimeError: the kernel is not available.
    """
    lib = _kernel.require()
    if not 1 <= len(sources) <= MAX_SOURCES:
        raise ValueError(f"mix: 1..{MAX_SOURCES} sources, got {len(sources)}")
    shape = sources[0].shape
    if (
        len(shape) == 0
        or query.shape != shape[-1:]
        or query.dtype != torch.float32
        or query.device.type != "cpu"
        or any(
            s.shape != shape or s.dtype != torch.float32 or s.device.type != "cpu" for s in sources
        )
    ):
        raise ValueError(
            f"mix: sources of one shape [*, D] float32 CPU and a query [D] float32; got "
            f"{[tuple(s.shape) for s in sources]} {[s.dtype for s in sources]}, query "
            f"{tuple(query.shape)} {query.dtype}"
        )
    srcs = [s.contiguous() for s in sources]  # kept alive for the call
    q = query.contiguous()
    D = shape[-1]
    T = srcs[0].numel() // D if D else 0
    out = torch.empty(shape, dtype=torch.float32)
    if T == 0:
        return out
    ptrs = (ctypes.c_void_p * len(srcs))(*[s.data_ptr() for s in srcs])
    rc = lib.openk3_attn_res_mix(
        ptrs, len(srcs), T, D, q.data_ptr(), eps, out.data_ptr(), threads or torch.get_num_threads()
    )
    if rc != 0:
        raise RuntimeError(f"openk3_attn_res_mix failed with code {rc}")
    return out
