"""Native CPU kernel for the attention tiles' ``exp2`` and row sums (the blocked latent attention's
inner step, :mod:`openk3.ops.latent_blocked`).

Shape legend: r score rows (query tokens x heads), s keys of a tile.

Why native code: per tile the blocked attention makes one score product, one ``exp2`` pass, one row
sum and one value product. The two products run at ~88 % of the fp32 GEMM rate; torch's ``exp2_``
and ``sum`` are two more passes over the [r, s] scores and took ~25 % of a tile (1,024 x 256 tile,
1 thread, AVX-512: 64 + 12 us against 139 + 91 us for the products). One pass that exponentiates
16 scores per register and adds them into the row's running sums takes 40 us, and it also writes
the causal zeros of a diagonal tile, so no mask tensor is built.

``exp2`` here: x = n + f with n = round(x), |f| <= 1/2; 2^f by the degree-7 Taylor polynomial of
e^(f ln 2) (truncation < 6e-9 relative, Horner in fp32: measured max 7.0e-8 relative over
[-150, 100], the same as torch's ``exp2``), times 2^n by ``vscalefps`` (gradual underflow to
subnormals and zero, overflow to inf). x is clamped below at -160 first (exp2 of -inf is 0);
NaN stays NaN. Row sums add 32 terms per step in two 16-lane accumulators, then across lanes, so
they differ from torch's ``sum`` by float rounding only (~1e-7 relative).

The kernel is built with :mod:`openk3.native` (``OPENK3_NO_NATIVE=1`` disables it) and used only
where AVX-512F is present; elsewhere :func:`available` is False and the caller keeps torch's ops.
"""

from __future__ import annotations

import ctypes

import torch

from openk3 import native

_C_SOURCE = r"""
#include <stdint.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define K3_X86 1
#endif

#define GRAIN 65536  /* scores per thread below which a call stays single-threaded */

int openk3_exp2_simd_level(void) {
#ifdef K3_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? 2 : 0;
#else
    return 0;
#endif
}

#ifdef K3_X86
/* ln(2)^k / k!, k = 1..7 */
#define C1 0.6931471805599453f
#define C2 0.2402265069591007f
#define C3 0.05550410866482158f
#define C4 0.009618129107628477f
#define C5 0.0013333558146428443f
#define C6 0.00015403530393381606f
#define C7 1.525273380405984e-05f

__attribute__((target("avx512f")))
static inline __m512 exp2_16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-160.f), x);  /* vmaxps returns its second operand on NaN */
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(C7);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* Row r of p [rows, cols] (row stride cols): p = exp2(p) over its first vis columns, 0 after them,
   den[r] = the row's sum. vis = cols, or r / heads + 1 for a diagonal tile. */
__attribute__((target("avx512f")))
static void exp2_row(float* row, int64_t vis, int64_t cols, float* den) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= vis; j += 32) {
        __m512 a = exp2_16(_mm512_loadu_ps(row + j));
        __m512 b = exp2_16(_mm512_loadu_ps(row + j + 16));
        _mm512_storeu_ps(row + j, a);
        _mm512_storeu_ps(row + j + 16, b);
        s0 = _mm512_add_ps(s0, a);
        s1 = _mm512_add_ps(s1, b);
    }
    for (; j < vis; j += 16) {
        const int64_t m = vis - j < 16 ? vis - j : 16;
        const __mmask16 k = (__mmask16)((1u << m) - 1u);
        __m512 a = _mm512_maskz_mov_ps(k, exp2_16(_mm512_maskz_loadu_ps(k, row + j)));
        _mm512_mask_storeu_ps(row + j, k, a);
        s0 = _mm512_add_ps(s0, a);
    }
    for (j = vis; j < cols; ++j) row[j] = 0.f;
    *den = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}
#endif

/* 0 on success, 1 when this CPU lacks AVX-512F (nothing written), 2 on bad sizes. */
int openk3_exp2_rowsum(float* p, int64_t rows, int64_t cols, float* den, int64_t heads,
                       int64_t diagonal, int64_t nthreads) {
    if (rows < 0 || cols < 0 || heads < 1 || (diagonal && rows > cols * heads)) return 2;
#ifdef K3_X86
    if (openk3_exp2_simd_level() < 2) return 1;
    int64_t nt = rows * cols / GRAIN;
    if (nt > nthreads) nt = nthreads;
    if (nt < 1) nt = 1;
    #pragma omp parallel for schedule(static) num_threads((int)nt)
    for (int64_t r = 0; r < rows; ++r)
        exp2_row(p + r * cols, diagonal ? r / heads + 1 : cols, cols, den + r);
    return 0;
#else
    return 1;
#endif
}
"""


def _setup(lib: ctypes.CDLL) -> str | None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.openk3_exp2_rowsum.argtypes = [p, i64, i64, p, i64, i64, i64]
    lib.openk3_exp2_rowsum.restype = ctypes.c_int
    lib.openk3_exp2_simd_level.restype = ctypes.c_int
    return None if lib.openk3_exp2_simd_level() >= 2 else "this CPU has no AVX-512F"


_kernel = native.Kernel("openk3_exp2_cpu", _C_SOURCE, "exp2 row-sum CPU kernel", _setup)


def available() -> bool:
    """True when the kernel is built (or buildable now), loaded, and this CPU has AVX-512F."""
    return _kernel.available()


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (compiler error, missing AVX-512F, the env switch); else None."""
    return _kernel.unavailable_reason()


def exp2_rowsum_(
    scores: torch.Tensor,
    den: torch.Tensor,
    *,
    heads: int = 1,
    diagonal: bool = False,
    threads: int | None = None,
) -> None:
    """In place: ``scores = exp2(scores)`` and ``den = scores.sum(1)``; with ``diagonal``, row i sees
    only its first ``i // heads + 1`` columns (the causal square of a tile whose query rows are
    token-major, ``heads`` rows per token) and the rest become 0.

    Args:
        scores: [r, s] float32 contiguous CPU (base-2 logits). den: [r] float32 contiguous CPU.
        heads: rows per query token (diagonal tiles only). threads: OpenMP threads (default
            ``torch.get_num_threads()``; a call below 65,536 scores per thread uses fewer).
    Raises:
        ValueError: wrong dtype, device, layout or shape (``diagonal`` needs r <= s * heads).
        RuntimeError: the kernel is not available (check :func:`available` first).
    """
    lib = _kernel.require()
    if (
        scores.dtype != torch.float32
        or den.dtype != torch.float32
        or scores.dim() != 2
        or den.shape != scores.shape[:1]
        or scores.device.type != "cpu"
        or den.device.type != "cpu"
        or not scores.is_contiguous()
        or not den.is_contiguous()
    ):
        raise ValueError(
            f"exp2_rowsum_: scores/den must be contiguous float32 CPU [r, s] / [r], got "
            f"{scores.dtype} {tuple(scores.shape)} on {scores.device} and {den.dtype} "
            f"{tuple(den.shape)} on {den.device}"
        )
    r, s = scores.shape
    rc = lib.openk3_exp2_rowsum(
        scores.data_ptr(),
        r,
        s,
        den.data_ptr(),
        heads,
        int(diagonal),
        threads or torch.get_num_threads(),
    )
    if rc == 2:
        raise ValueError(
            f"exp2_rowsum_: rows {r} > columns {s} x heads {heads} for a diagonal tile"
        )
    if rc != 0:
        raise RuntimeError(f"openk3_exp2_rowsum failed with code {rc}")
