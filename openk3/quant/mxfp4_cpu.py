"""Native CPU kernel for GEMMs on packed MXFP4 weights (the fast path of :mod:`openk3.quant.packed`).

Shape legend: A rows of the expert-sorted input (tokens x slots), E experts, O output features,
K reduction features (K % 32 == 0), NB = K / 32 blocks per row.

Why native code: eager PyTorch needs ~10 passes over a weight to decode E2M1 nibbles (measured 20-60x
slower than an fp32 GEMV on this project's CPUs), and torch.compile's CPU code for the decode was no
better. A small C kernel that decodes each 32-element block in registers and feeds it straight into
FMAs reads 4.25 bits per weight from DRAM instead of 32, which is the whole point of MXFP4 decode.

The kernel is compiled once with the system C compiler and loaded with ctypes (:mod:`openk3.native`:
cache directory, ``OPENK3_NO_NATIVE=1`` disables it). When it cannot be built,
:func:`available` is False and callers use the PyTorch path (same results; it is the reference).

Numerics: each weight is formed exactly as :func:`openk3.quant.mx.dequantize_mxfp4` forms it
(``E2M1 value * 2^(s-127)`` in fp32, NaN for s = 255), so only the fp32 summation order differs from
dequantize-then-matmul. x86 CPUs use an intrinsics path (AVX-512F: the 16 signed E2M1 values in one register, one
``vpermps`` decodes 16 codes; AVX2+FMA: an 8-entry magnitude table plus a sign xor), everything else
a portable scalar loop; the choice is made at run time.
Sources: architecture.md §10, k3-release-notes.md §1.9 (nibble order: element 2j in the low nibble).
"""

from __future__ import annotations

import ctypes

import torch

from openk3 import native

_C_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define K3_X86 1
#endif

#define MAXM 8  /* token tile of the scalar loop */
#define GRAIN 262144  /* weights per thread (128 KiB packed) below which a call stays single-threaded */

static const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                               -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
static float SCALE[256];

static void init_scales(void) {
    for (int s = 0; s < 256; ++s) {
        uint32_t bits = s == 255 ? 0x7FC00000u : (s == 0 ? 0x00400000u : ((uint32_t)s << 23));
        memcpy(&SCALE[s], &bits, 4);
    }
}

/* y[t*ldy] = sum_k W[o,k] x[t,k] for t < m; p: row o packed [K/2], sc: its scales [NB];
   xp: m rows of permuted x (per block: the 16 even elements, then the 16 odd ones), row stride K. */
static void row_scalar(const uint8_t* p, const uint8_t* sc, int64_t nb, const float* xp, int64_t K,
                       int64_t m, float* y, int64_t ldy) {
    float w[32], acc[MAXM];
    for (int64_t t = 0; t < m; ++t) acc[t] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
        const float s = SCALE[sc[b]];
        for (int j = 0; j < 16; ++j) {
            w[j] = E2M1[p[16 * b + j] & 15] * s;
            w[16 + j] = E2M1[p[16 * b + j] >> 4] * s;
        }
        for (int64_t t = 0; t < m; ++t) {
            const float* xb = xp + t * K + 32 * b;
            float d = 0.f;
            for (int i = 0; i < 32; ++i) d += w[i] * xb[i];
            acc[t] += d;
        }
    }
    for (int64_t t = 0; t < m; ++t) y[t * ldy] = acc[t];
}

#ifdef K3_X86
/* The SIMD rows take a compile-time token count M (1, 2 or 4) so that the M x 4 accumulators live in
   registers; 4 independent FMA chains per token keep a single-token (decode) row from being bound by
   FMA latency. */
#define K3_512 __attribute__((target("avx512f"), always_inline)) static inline
#define K3_256 __attribute__((target("avx2,fma"), always_inline)) static inline
#define ROW_ARGS const uint8_t *p, const uint8_t *sc, int64_t nb, const float *xp, int64_t K, float *y, int64_t ldy

/* AVX-512: all 16 signed E2M1 values fit one register; one vpermps decodes 16 codes. A block's 16
   bytes give wl (low nibbles: even elements) and wh (high nibbles: odd elements). */
K3_512 void row512(ROW_ARGS, const int M) {
    const __m512 lut = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                      -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
    const __m512i low4 = _mm512_set1_epi32(15);
    __m512 acc[4][4];
    for (int t = 0; t < M; ++t)
        for (int c = 0; c < 4; ++c) acc[t][c] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) { /* two blocks per step: chains 0,1 for block b, 2,3 for b+1 */
        __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 16 * b)));
        __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 16 * b + 16)));
        __m512 s0 = _mm512_set1_ps(SCALE[sc[b]]), s1 = _mm512_set1_ps(SCALE[sc[b + 1]]);
        __m512 w0 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(v0, low4), lut), s0);
        __m512 w1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), lut), s0);
        __m512 w2 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(v1, low4), lut), s1);
        __m512 w3 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), lut), s1);
        for (int t = 0; t < M; ++t) {
            const float* xb = xp + t * K + 32 * b;
            acc[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc[t][0]);
            acc[t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), acc[t][1]);
            acc[t][2] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xb + 32), acc[t][2]);
            acc[t][3] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xb + 48), acc[t][3]);
        }
    }
    if (b < nb) {
        __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 16 * b)));
        __m512 s0 = _mm512_set1_ps(SCALE[sc[b]]);
        __m512 w0 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(v0, low4), lut), s0);
        __m512 w1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), lut), s0);
        for (int t = 0; t < M; ++t) {
            const float* xb = xp + t * K + 32 * b;
            acc[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc[t][0]);
            acc[t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), acc[t][1]);
        }
    }
    for (int t = 0; t < M; ++t)
        y[t * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]),
                                                        _mm512_add_ps(acc[t][2], acc[t][3])));
}

/* AVX2: an 8-entry magnitude table per vpermps plus the sign bit xor'ed in. */
K3_256 __m256 dec8(__m256i c, __m256 lut, __m256 s) {
    __m256 mag = _mm256_permutevar8x32_ps(lut, c); /* uses the low 3 bits: the magnitude index */
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(8)), 28);
    return _mm256_mul_ps(_mm256_xor_ps(mag, _mm256_castsi256_ps(sign)), s);
}

K3_256 void row256(ROW_ARGS, const int M) {
    const __m256 lut = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
    const __m256i low4 = _mm256_set1_epi32(15);
    __m256 acc[2][4];
    for (int t = 0; t < M; ++t)
        for (int c = 0; c < 4; ++c) acc[t][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m128i by = _mm_loadu_si128((const __m128i*)(p + 16 * b));
        __m256i v0 = _mm256_cvtepu8_epi32(by);
        __m256i v1 = _mm256_cvtepu8_epi32(_mm_srli_si128(by, 8));
        __m256 s = _mm256_set1_ps(SCALE[sc[b]]);
        __m256 w[4] = {dec8(_mm256_and_si256(v0, low4), lut, s),  /* elements 0,2,..,14 */
                       dec8(_mm256_and_si256(v1, low4), lut, s),  /* 16,18,..,30 */
                       dec8(_mm256_srli_epi32(v0, 4), lut, s),    /* 1,3,..,15 */
                       dec8(_mm256_srli_epi32(v1, 4), lut, s)};   /* 17,..,31 */
        for (int t = 0; t < M; ++t)
            for (int c = 0; c < 4; ++c)
                acc[t][c] = _mm256_fmadd_ps(w[c], _mm256_loadu_ps(xp + t * K + 32 * b + 8 * c), acc[t][c]);
    }
    for (int t = 0; t < M; ++t) {
        __m256 v = _mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]), _mm256_add_ps(acc[t][2], acc[t][3]));
        __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        a = _mm_add_ps(a, _mm_movehl_ps(a, a));
        a = _mm_add_ss(a, _mm_movehdup_ps(a));
        y[t * ldy] = _mm_cvtss_f32(a);
    }
}

__attribute__((target("avx512f"))) static void row512_1(ROW_ARGS) { row512(p, sc, nb, xp, K, y, ldy, 1); }
__attribute__((target("avx512f"))) static void row512_2(ROW_ARGS) { row512(p, sc, nb, xp, K, y, ldy, 2); }
__attribute__((target("avx512f"))) static void row512_4(ROW_ARGS) { row512(p, sc, nb, xp, K, y, ldy, 4); }
__attribute__((target("avx2,fma"))) static void row256_1(ROW_ARGS) { row256(p, sc, nb, xp, K, y, ldy, 1); }
__attribute__((target("avx2,fma"))) static void row256_2(ROW_ARGS) { row256(p, sc, nb, xp, K, y, ldy, 2); }

/* m tokens of one output row, in register tiles of 4 / 2 / 1 tokens. */
static void rows_simd(int level, const uint8_t* p, const uint8_t* sc, int64_t nb, const float* xp, int64_t K,
                      int64_t m, float* y, int64_t ldy) {
    while (m > 0) {
        int step = m >= 4 && level == 2 ? 4 : (m >= 2 ? 2 : 1);
        if (level == 2) (step == 4 ? row512_4 : step == 2 ? row512_2 : row512_1)(p, sc, nb, xp, K, y, ldy);
        else (step == 2 ? row256_2 : row256_1)(p, sc, nb, xp, K, y, ldy);
        xp += step * K;
        y += step * ldy;
        m -= step;
    }
}
#endif

/* 2: AVX-512F, 1: AVX2+FMA, 0: portable scalar loop */
static int simd_level(void) {
#ifdef K3_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 2;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

int openk3_mxfp4_simd_level(void) { return simd_level(); }

/* Grouped GEMM over experts: rows offs[e]..offs[e+1] of xp (permuted, [A, K]) use expert e's packed
   weight [O, K/2] and scales [O, NB]; y is [A, O]. simd: the highest SIMD level to use (2 AVX-512F, 1 AVX2, 0 scalar). */
int openk3_mxfp4_grouped_gemm(const float* xp, const int64_t* offs, int64_t E, const uint8_t* packed,
                              const uint8_t* scales, int64_t O, int64_t K, float* y, int64_t nthreads,
                              int64_t simd) {
    if (K % 32 != 0 || E < 0 || O < 0) return 1;
    if (SCALE[1] == 0.f) init_scales();
    const int64_t nb = K / 32;
    int64_t* active = (int64_t*)malloc(sizeof(int64_t) * (size_t)(E > 0 ? E : 1));
    if (!active) return 2;
    int64_t na = 0;
    for (int64_t e = 0; e < E; ++e)
        if (offs[e + 1] > offs[e]) active[na++] = e;
    const int64_t items = na * O;
    /* threads only pay off for real work: a barrier with a descheduled thread costs milliseconds */
    int64_t nt = (items * K) / GRAIN;
    if (nt > nthreads) nt = nthreads;
    if (nt < 1) nt = 1;
    int level = simd_level();
    if (simd < level) level = (int)simd;
    #pragma omp parallel for schedule(static) num_threads((int)nt)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t e = active[it / O], o = it % O;
        const uint8_t* p = packed + (e * O + o) * (K / 2);
        const uint8_t* sc = scales + (e * O + o) * nb;
#ifdef K3_X86
        if (level > 0) {
            rows_simd(level, p, sc, nb, xp + offs[e] * K, K, offs[e + 1] - offs[e], y + offs[e] * O + o, O);
            continue;
        }
#endif
        for (int64_t r = offs[e]; r < offs[e + 1]; r += MAXM) {
            int64_t m = offs[e + 1] - r;
            if (m > MAXM) m = MAXM;
            row_scalar(p, sc, nb, xp + r * K, K, m, y + r * O + o, O);
        }
    }
    free(active);
    return 0;
}

/* out[r, k] = E2M1[code(r, k)] * 2^(s-127) for rows r < R of a packed [R, K/2] weight (natural order). */
int openk3_mxfp4_dequant(const uint8_t* packed, const uint8_t* scales, int64_t R, int64_t K, float* out,
                         int64_t nthreads) {
    if (K % 32 != 0) return 1;
    if (SCALE[1] == 0.f) init_scales();
    const int64_t nb = K / 32;
    int64_t nt = (R * K) / GRAIN;
    if (nt > nthreads) nt = nthreads;
    if (nt < 1) nt = 1;
    #pragma omp parallel for schedule(static) num_threads((int)nt)
    for (int64_t r = 0; r < R; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            const float s = SCALE[scales[r * nb + b]];
            const uint8_t* p = packed + r * (K / 2) + 16 * b;
            float* o = out + r * K + 32 * b;
            for (int j = 0; j < 16; ++j) {
                o[2 * j] = E2M1[p[j] & 15] * s;
                o[2 * j + 1] = E2M1[p[j] >> 4] * s;
            }
        }
    }
    return 0;
}
"""


def _setup(lib: ctypes.CDLL) -> None:
    """Declare the functions; None: the kernel has a portable scalar path, every CPU can use it."""
    p = ctypes.c_void_p
    i64 = ctypes.c_int64
    lib.openk3_mxfp4_grouped_gemm.argtypes = [p, p, i64, p, p, i64, i64, p, i64, i64]
    lib.openk3_mxfp4_grouped_gemm.restype = ctypes.c_int
    lib.openk3_mxfp4_dequant.argtypes = [p, p, i64, i64, p, i64]
    lib.openk3_mxfp4_dequant.restype = ctypes.c_int
    lib.openk3_mxfp4_simd_level.restype = ctypes.c_int


_kernel = native.Kernel("openk3_mxfp4_cpu", _C_SOURCE, "MXFP4 CPU kernel", _setup)


def available() -> bool:
    """True when the native kernel is built (or buildable now) and loaded; builds it on first call."""
    return _kernel.available()


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (compiler error text, or the env switch); None when available."""
    return _kernel.unavailable_reason()


def simd_level() -> int:
    """The widest path this CPU runs: 2 AVX-512F, 1 AVX2+FMA, 0 portable scalar (-1: no kernel)."""
    lib = _kernel.load()
    return -1 if lib is None else int(lib.openk3_mxfp4_simd_level())


def permute_blocks(x: torch.Tensor) -> torch.Tensor:
    """[A, K] -> [A, K] with each 32-block reordered as (even elements, odd elements), the order in
    which the kernel decodes a block's 16 bytes (low nibbles, then high nibbles)."""
    a, k = x.shape
    return x.reshape(a, k // 32, 16, 2).transpose(2, 3).reshape(a, k)


def _check(packed: torch.Tensor, scales: torch.Tensor, fn: str) -> tuple[int, int, int]:
    if (
        packed.dtype != torch.uint8
        or scales.dtype != torch.uint8
        or packed.dim() != 3
        or scales.dim() != 3
    ):
        raise ValueError(
            f"{fn}: packed/scales must be uint8 [E, O, K/2] / [E, O, K/32], got "
            f"{packed.dtype} {tuple(packed.shape)} and {scales.dtype} {tuple(scales.shape)}"
        )
    e, o, half = packed.shape
    k = 2 * half
    if k % 32 or tuple(scales.shape) != (e, o, k // 32):
        raise ValueError(
            f"{fn}: scales shape {tuple(scales.shape)} does not fit packed {tuple(packed.shape)} (K={k})"
        )
    if packed.device.type != "cpu" or not packed.is_contiguous() or not scales.is_contiguous():
        raise ValueError(f"{fn}: packed weights must be contiguous CPU tensors")
    return e, o, k


def grouped_gemm(
    xs: torch.Tensor,
    counts: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    simd: int = 2,
    threads: int | None = None,
) -> torch.Tensor:
    """``ys[r] = W_e @ xs[r]`` for the rows r of expert e (rows sorted by expert, ``counts`` per expert).

    Args:
        xs: [A, K] float32 CPU rows, grouped by expert. counts: [E] int rows per expert (sum A).
        packed: [E, O, K/2] uint8 (``weight_packed`` stacked). scales: [E, O, K/32] uint8 E8M0.
        simd: the widest SIMD path allowed (2 AVX-512F, 1 AVX2, 0 scalar; tests pin each path).
        threads: OpenMP threads (default ``torch.get_num_threads()``).
    Returns:
        [A, O] float32.
    Raises:
        ValueError: bad shapes/dtypes/devices. RuntimeError: the kernel is not available.
    """
    lib = _kernel.require()
    e, o, k = _check(packed, scales, "grouped_gemm")
    if xs.dtype != torch.float32 or xs.dim() != 2 or xs.shape[1] != k or xs.device.type != "cpu":
        raise ValueError(
            f"grouped_gemm: xs must be float32 CPU [A, K={k}], got {xs.dtype} {tuple(xs.shape)}"
        )
    if counts.numel() != e or int(counts.sum()) != xs.shape[0] or bool((counts < 0).any()):
        raise ValueError(
            f"grouped_gemm: counts must have E={e} non-negative entries summing to A={xs.shape[0]}"
        )
    offs = torch.zeros(e + 1, dtype=torch.int64)
    torch.cumsum(counts.to(torch.int64).cpu(), 0, out=offs[1:])
    xp = permute_blocks(xs).contiguous()
    y = torch.empty(xs.shape[0], o, dtype=torch.float32)
    rc = lib.openk3_mxfp4_grouped_gemm(
        xp.data_ptr(),
        offs.data_ptr(),
        e,
        packed.data_ptr(),
        scales.data_ptr(),
        o,
        k,
        y.data_ptr(),
        threads or torch.get_num_threads(),
        int(simd),
    )
    if rc != 0:
        raise RuntimeError(f"openk3_mxfp4_grouped_gemm failed with code {rc}")
    return y


def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Native twin of :func:`openk3.quant.mx.mxfp4_weight_from_packed` (bit-identical).

    Args:
        packed: [R, K/2] uint8 contiguous CPU. scales: [R, K/32] uint8.
    Returns:
        [R, K] float32.
    Raises:
        ValueError: bad shapes/dtypes. RuntimeError: the kernel is not available.
    """
    lib = _kernel.require()
    _, r, k = _check(packed.unsqueeze(0), scales.unsqueeze(0), "dequantize")
    out = torch.empty(r, k, dtype=torch.float32)
    rc = lib.openk3_mxfp4_dequant(
        packed.data_ptr(), scales.data_ptr(), r, k, out.data_ptr(), torch.get_num_threads()
    )
    if rc != 0:
        raise RuntimeError(f"openk3_mxfp4_dequant failed with code {rc}")
    return out
