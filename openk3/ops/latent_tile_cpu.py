"""Native CPU kernel for a whole query tile of the blocked latent attention: score product, ``exp2``,
causal zeros, row sums and value product fused per register block (the inner loop of
:mod:`openk3.ops.latent_blocked`, offset-free form).

Shape legend: r query rows of the tile (tokens x heads, token-major), D score width (C + R), C value
width (the latent, 32 here), n keys, s the keys before the tile's own tokens (its "full" keys).

Why native code: the tile loop of :func:`openk3.ops.latent_blocked._tile_fixed` writes a
[r, 256] score block, exponentiates it in a second pass and reads it back for the value product:
three passes over 1 MiB per 256 keys, and two GEMM calls whose operands are short (K = 48) or
narrow (N = 32). Its GEMMs reach ~91 % of the 2048³ rate, the tile as a whole ~67 %. Here six
query rows and 32 keys are one register block: the 6 x 32 scores are accumulated in 12 AVX-512
registers (keys packed 16 to a register, D-major), exponentiated in registers, masked by the
causal limit of their row, added into the row sums and multiplied into the rows' 6 x 32 outputs,
without leaving L1. Keys and values are walked in blocks of ``key_block`` keys for all rows of a
row group (one per thread), so the history is streamed once per group.

``exp2`` is the one of :mod:`openk3.ops.exp2_cpu` (degree-7 polynomial of the fractional part and
``vscalefps``; max relative error 7.0e-8, the same as torch's). Sums run in a different order than
the GEMM-based loop, so results differ from it by float rounding only (~1e-6 relative).

Keys and values are passed packed (:func:`pack_keys`, :func:`pad_values`): the keys [n, D] as
[ceil(n / 32) * 2, D, 16] (16 keys per register, each register's keys D-major), both zero-padded
to a multiple of 32 keys. The kernel is built with :mod:`openk3.native` (``OPENK3_NO_NATIVE=1``
disables it) and is used only with AVX-512F and C = 32; elsewhere :func:`available` is False or
:func:`applies` says no, and the caller keeps its torch tile loop.
"""

from __future__ import annotations

import ctypes

import torch

from openk3 import native

# Keys per block walked for a whole row group (K and V of a block: 64 * (48 + 32) * 4 = 20 KiB for
# the shipped model; 64 and 128 measured alike, 32 ~2 % slower).
KEY_BLOCK = 64
# Value width the kernel is written for (two 16-lane registers per row).
VALUE_WIDTH = 32

_C_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define K3_X86 1
#endif

#define MR 6 /* query rows per register block */

int openk3_latent_tile_simd_level(void) {
#ifdef K3_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") ? 2 : 0;
#else
    return 0;
#endif
}

#ifdef K3_X86
/* 2^f on [0, 1): degree-6 polynomial fitted for minimal relative error (max 1.9e-9 in exact
   arithmetic; measured 6e-8 with fp32 Horner steps, below torch's exp2 error of 7.0e-8) */
#define C0 1.0f
#define C1 0.6931470036506653f
#define C2 0.24022983014583588f
#define C3 0.055483341217041016f
#define C4 0.009678840637207031f
#define C5 0.0012439688434824347f
#define C6 0.00021702254889532924f

/* 2^x = 2^floor(x) * 2^f with f = x - floor(x) (vreduceps, round down) and 2^floor(x) applied by
   vscalefps, which takes the floor of its second operand itself: three instructions besides the
   polynomial. Very negative x gives 0 (gradual underflow), large x inf; an infinite or NaN score
   gives NaN, which the caller's finiteness check sends to its exact fallback. */
__attribute__((target("avx512f,avx512dq"), always_inline))
static inline __m512 exp2_16(__m512 x) {
    const __m512 f = _mm512_reduce_ps(x, 0x09);
    __m512 p = _mm512_set1_ps(C6);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C0));
    return _mm512_scalef_ps(p, x);
}

static inline __mmask16 lanes(int64_t m) {
    if (m <= 0) return 0;
    if (m >= 16) return (__mmask16)0xFFFF;
    return (__mmask16)((1u << m) - 1u);
}

/* mr (<= MR) rows starting at q (row stride D) over keys [k0, k1) (k0, k1 multiples of 32 or k1 the
   padded end): o [mr][32] += exp2(q k^T) v, dacc [mr][16] += the lane-wise row sums. Row i sees keys
   < e[i]; a 32-key step at or past emin masks every row to its own limit. */
__attribute__((target("avx512f,avx512dq"), always_inline))
static inline void block(const int mr, const float* restrict q, int64_t D,
                         const float* restrict kp, const float* restrict vp, int64_t k0, int64_t k1,
                         const int64_t* e, int64_t emin, float* restrict o,
                         float* restrict dacc) {
    float P[MR][32] __attribute__((aligned(64)));
    for (int64_t s = k0; s < k1; s += 32) {
        __m512 S0[MR], S1[MR];
        for (int i = 0; i < mr; ++i) {
            S0[i] = _mm512_setzero_ps();
            S1[i] = _mm512_setzero_ps();
        }
        const float* kb0 = kp + (s / 16) * D * 16;
        const float* kb1 = kb0 + D * 16;
        /* unrolled: the loop's own instructions would otherwise compete with the FMAs (+3-4 %) */
        _Pragma("GCC unroll 8") for (int64_t d = 0; d < D; ++d) {
            const __m512 a = _mm512_loadu_ps(kb0 + d * 16);
            const __m512 b = _mm512_loadu_ps(kb1 + d * 16);
            for (int i = 0; i < mr; ++i) {
                const __m512 x = _mm512_set1_ps(q[i * D + d]);
                S0[i] = _mm512_fmadd_ps(x, a, S0[i]);
                S1[i] = _mm512_fmadd_ps(x, b, S1[i]);
            }
        }
        /* all 2 * mr exponentials first, without branches, so they are scheduled side by side */
        __m512 P0[MR], P1[MR];
        for (int i = 0; i < mr; ++i) {
            P0[i] = exp2_16(S0[i]);
            P1[i] = exp2_16(S1[i]);
        }
        if (s + 32 > emin) {
            for (int i = 0; i < mr; ++i) {
                P0[i] = _mm512_maskz_mov_ps(lanes(e[i] - s), P0[i]);
                P1[i] = _mm512_maskz_mov_ps(lanes(e[i] - s - 16), P1[i]);
            }
        }
        for (int i = 0; i < mr; ++i) {
            _mm512_storeu_ps(dacc + i * 16, _mm512_add_ps(_mm512_loadu_ps(dacc + i * 16),
                                                          _mm512_add_ps(P0[i], P1[i])));
            _mm512_store_ps(P[i], P0[i]);
            _mm512_store_ps(P[i] + 16, P1[i]);
        }
        /* the outputs live in registers only for the value product (the scores need 12 + 9 for
           the polynomial's constants) */
        __m512 O0[MR], O1[MR];
        for (int i = 0; i < mr; ++i) {
            O0[i] = _mm512_loadu_ps(o + i * 32);
            O1[i] = _mm512_loadu_ps(o + i * 32 + 16);
        }
        const float* v = vp + s * 32;
        _Pragma("GCC unroll 8") for (int j = 0; j < 32; ++j) {
            const __m512 a = _mm512_loadu_ps(v + j * 32);
            const __m512 b = _mm512_loadu_ps(v + j * 32 + 16);
            for (int i = 0; i < mr; ++i) {
                const __m512 x = _mm512_set1_ps(P[i][j]);
                O0[i] = _mm512_fmadd_ps(x, a, O0[i]);
                O1[i] = _mm512_fmadd_ps(x, b, O1[i]);
            }
        }
        for (int i = 0; i < mr; ++i) {
            _mm512_storeu_ps(o + i * 32, O0[i]);
            _mm512_storeu_ps(o + i * 32 + 16, O1[i]);
        }
    }
}

__attribute__((target("avx512f,avx512dq")))
static void block_any(int mr, const float* q, int64_t D, const float* kp, const float* vp,
                      int64_t k0, int64_t k1, const int64_t* e, int64_t emin, float* o, float* dacc) {
    switch (mr) {
    case 6: block(6, q, D, kp, vp, k0, k1, e, emin, o, dacc); break;
    case 5: block(5, q, D, kp, vp, k0, k1, e, emin, o, dacc); break;
    case 4: block(4, q, D, kp, vp, k0, k1, e, emin, o, dacc); break;
    case 3: block(3, q, D, kp, vp, k0, k1, e, emin, o, dacc); break;
    case 2: block(2, q, D, kp, vp, k0, k1, e, emin, o, dacc); break;
    default: block(1, q, D, kp, vp, k0, k1, e, emin, o, dacc); break;
    }
}

/* Rows [g0, g1) of the tile: zero their outputs, walk the key blocks, reduce the row sums.
   dacc: scratch for (g1 - g0) x 16 lane sums. */
__attribute__((target("avx512f,avx512dq")))
static void group(const float* q, int64_t g0, int64_t g1, int64_t D, const float* kp,
                  const float* vp, int64_t n_full, int64_t heads, int64_t key_block, float* acc,
                  float* den, float (*dacc)[16]) {
    memset(dacc, 0, (size_t)(g1 - g0) * sizeof(*dacc));
    memset(acc + g0 * 32, 0, (size_t)(g1 - g0) * 32 * sizeof(float));
    const int64_t emax_all = n_full + (g1 - 1) / heads + 1;
    for (int64_t k0 = 0; k0 < emax_all; k0 += key_block) {
        for (int64_t r0 = g0; r0 < g1; r0 += MR) {
            const int mr = (int)(g1 - r0 < MR ? g1 - r0 : MR);
            int64_t e[MR];
            for (int i = 0; i < mr; ++i) e[i] = n_full + (r0 + i) / heads + 1;
            const int64_t emin = e[0], emax = e[mr - 1];
            if (k0 >= emax) continue;
            int64_t k1 = k0 + key_block;
            const int64_t end32 = (emax + 31) / 32 * 32;
            if (k1 > end32) k1 = end32;
            block_any(mr, q + r0 * D, D, kp, vp, k0, k1, e, emin, acc + r0 * 32,
                      dacc[r0 - g0]);
        }
    }
    for (int64_t r = g0; r < g1; ++r) den[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(dacc[r - g0]));
}
#endif

/* acc [r, 32] = sum_j exp2(q_i . k_j) v_j and den [r] = sum_j exp2(q_i . k_j) over the keys j <
   n_full + i / heads + 1 of row i. q [r, D] row-major; kp the packed keys (see the Python side),
   vp [>= padded keys, 32] zero-padded. key_block a positive multiple of 32. 0 on success, 1 without
   AVX-512F/DQ, 2 on bad sizes, 3 out of memory. */
int openk3_latent_tile(const float* q, int64_t r, int64_t D, const float* kp, const float* vp,
                       int64_t n_keys_padded, int64_t n_full, int64_t heads, int64_t key_block,
                       float* acc, float* den, int64_t nthreads) {
    if (r < 0 || D < 1 || heads < 1 || key_block < 32 || key_block % 32 || n_full < 0 ||
        n_keys_padded % 32 || (r > 0 && n_full + (r - 1) / heads + 1 > n_keys_padded))
        return 2;
#ifdef K3_X86
    if (openk3_latent_tile_simd_level() < 2) return 1;
    if (r == 0) return 0;
    /* One row group per thread: every group streams all its keys and values once (from L3 for
       a long history), so fewer, larger groups are faster (1 thread, 1,024 rows x 11K keys:
       one group 137.6 GFLOP/s, 192-row groups 134.9, 48-row groups 124.8). */
    int64_t nt = nthreads < (r + MR - 1) / MR ? nthreads : (r + MR - 1) / MR;
    if (nt < 1) nt = 1;
    const int64_t rows = ((r + nt - 1) / nt + MR - 1) / MR * MR;
    const int64_t groups = (r + rows - 1) / rows;
    float (*dacc)[16] = malloc((size_t)r * sizeof(*dacc));
    if (!dacc) return 3;
    #pragma omp parallel for schedule(static) num_threads((int)nt)
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t g0 = g * rows, g1 = g0 + rows < r ? g0 + rows : r;
        group(q, g0, g1, D, kp, vp, n_full, heads, key_block, acc, den, dacc + g0);
    }
    free(dacc);
    return 0;
#else
    return 1;
#endif
}
"""


def _setup(lib: ctypes.CDLL) -> str | None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.openk3_latent_tile.argtypes = [p, i64, i64, p, p, i64, i64, i64, i64, p, p, i64]
    lib.openk3_latent_tile.restype = ctypes.c_int
    lib.openk3_latent_tile_simd_level.restype = ctypes.c_int
    return None if lib.openk3_latent_tile_simd_level() >= 2 else "this CPU lacks AVX-512F/DQ"


_kernel = native.Kernel(
    "openk3_latent_tile_cpu", _C_SOURCE, "latent attention tile CPU kernel", _setup
)


def available() -> bool:
    """True when the kernel is built (or buildable now), loaded, and this CPU has AVX-512F."""
    return _kernel.available()


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (compiler error, missing AVX-512F, the env switch); else None."""
    return _kernel.unavailable_reason()


def applies(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the kernel handles these operands: float32 CPU, values ``VALUE_WIDTH`` wide."""
    return (
        keys.device.type == "cpu"
        and values.device.type == "cpu"
        and keys.dtype == torch.float32
        and values.dtype == torch.float32
        and values.dim() == 2
        and values.shape[1] == VALUE_WIDTH
    )


def pack_keys(keys: torch.Tensor) -> torch.Tensor:
    """Keys [n, D] float32 -> [ceil(n / 32) * 2, D, 16]: register g holds keys 16g..16g+15, for each of
    the D channels in turn; zero keys pad n to a multiple of 32."""
    n, D = keys.shape
    n32 = -(-n // 32) * 32
    if n == n32:
        padded = keys
    else:
        padded = keys.new_empty(n32, D)
        padded[:n] = keys
        padded[n:] = 0
    return padded.view(n32 // 16, 16, D).transpose(1, 2).contiguous()


def pad_values(values: torch.Tensor) -> torch.Tensor:
    """Values [n, C] -> [ceil(n / 32) * 32, C] float32 contiguous, zero rows after n."""
    n, C = values.shape
    padded = values.new_empty(-(-n // 32) * 32, C)
    padded[:n] = values
    padded[n:] = 0
    return padded


def latent_tile(
    q: torch.Tensor,
    packed_keys: torch.Tensor,
    padded_values: torch.Tensor,
    n_full: int,
    heads: int,
    *,
    key_block: int = KEY_BLOCK,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Un-normalised attention sums of one causal query tile against a packed key cache.

    Row i of ``q`` (token i // heads of the tile) sees keys ``j < n_full + i // heads + 1``;
    ``acc[i] = Σ_j exp2(q_i · k_j) v_j`` and ``den[i] = Σ_j exp2(q_i · k_j)`` over those keys.

    Args:
        q: [r, D] float32 contiguous CPU, base-2 scores' queries (token-major, ``heads`` rows per token).
        packed_keys: :func:`pack_keys` of the keys [n, D]. padded_values: :func:`pad_values` of the
            values [n, 32] (the same n).
        n_full: keys every row sees (the tile's history). heads: rows per query token.
        key_block: keys walked per block (a positive multiple of 32). threads: OpenMP threads (one
            row group each; default ``torch.get_num_threads()``).
    Returns:
        (acc [r, 32], den [r]) float32.
    Raises:
        ValueError: wrong dtype, device, layout or shape, or a row would see beyond the keys.
        RuntimeError: the kernel is not available (check :func:`available` first).
    """
    lib = _kernel.require()
    r, D = q.shape if q.dim() == 2 else (-1, -1)
    n32 = padded_values.shape[0] if padded_values.dim() == 2 else -1
    if (
        q.dim() != 2
        or q.dtype != torch.float32
        or q.device.type != "cpu"
        or not q.is_contiguous()
        or packed_keys.dtype != torch.float32
        or packed_keys.shape != (n32 // 16, D, 16)
        or not packed_keys.is_contiguous()
        or padded_values.dtype != torch.float32
        or tuple(padded_values.shape) != (n32, VALUE_WIDTH)
        or not padded_values.is_contiguous()
        or n32 % 32
    ):
        raise ValueError(
            f"latent_tile: q [r, D], packed_keys [n/16, D, 16], padded_values [n, {VALUE_WIDTH}] "
            f"(n a multiple of 32) contiguous float32 CPU; got {q.dtype} {tuple(q.shape)}, "
            f"{packed_keys.dtype} {tuple(packed_keys.shape)}, {padded_values.dtype} "
            f"{tuple(padded_values.shape)}"
        )
    acc = q.new_empty(r, VALUE_WIDTH)
    den = q.new_empty(r)
    rc = lib.openk3_latent_tile(
        q.data_ptr(),
        r,
        D,
        packed_keys.data_ptr(),
        padded_values.data_ptr(),
        n32,
        n_full,
        heads,
        key_block,
        acc.data_ptr(),
        den.data_ptr(),
        threads or torch.get_num_threads(),
    )
    if rc == 2:
        raise ValueError(
            f"latent_tile: {r} rows x heads {heads} after {n_full} keys exceed the {n32} packed keys, "
            f"or key_block {key_block} is not a positive multiple of 32"
        )
    if rc == 3:
        raise MemoryError(f"latent_tile: no memory for {r} rows' row-sum scratch")
    if rc != 0:
        raise RuntimeError(f"openk3_latent_tile failed with code {rc}")
    return acc, den
