"""B4: KDA kernels — openk3's chunked form (``openk3.ops.kda.kda``, the backend the model runs) vs
its token recurrence (the reference) vs transformers' chunked torch fallback (``transformers.models.kimi_linear.modeling_kimi_linear.chunk_kimi_delta_attention``, what
transformers runs without flash-linear-attention).

Shape legend: B batch rows, T tokens, H heads, K key dim (= value dim V here).

Inputs (fp32, seeded): q, k L2-normalised [B, T, H, K]; v [B, T, H, K]; per-channel log-decay
g = -softplus(N(0,1) - 2) [B, T, H, K] (mean decay ~0.87 per step, a few strong forgets); beta =
sigmoid(N(0,1)) [B, T, H]; scale K^-0.5 (transformers applies it internally); zero initial state;
chunk size 64 everywhere. For every T the three contenders run interleaved, medians of ``reps``.

Asserted: outputs and final states of all three agree (max abs difference <= 1e-4 times the
output scale; the measured differences are reported). Throughput = B*T / median seconds.
Targets (performance.md §6.4, KDA kernels): chunked >= recurrent for every T >= 512; chunked
>= 5x transformers' chunked fallback (every T).
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from openk3.bench.common import check, environment, interleaved, medians, settings, target

FULL = {"T": (64, 128, 256, 512, 1024, 2048, 4096), "H": 4, "K": 64, "B": 1, "reps": 5}
QUICK = {"T": (64, 128), "H": 2, "K": 16, "B": 1, "reps": 1}


def make_inputs(B: int, T: int, H: int, K: int, seed: int) -> tuple:
    """(q, k, v, g, beta) as described in the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen)
    g = -F.softplus(torch.randn(B, T, H, K, generator=gen) - 2.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return q, k, v, g, beta


def _timed(fn) -> tuple[float, tuple]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def run(quick: bool = False, reps: int | None = None, **overrides) -> dict:
    """Run B4; returns the result dict (see the module docstring).

    Raises:
        BenchmarkError: the contenders' outputs or final states disagree.
        ValueError: an unknown override.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    from openk3.ops.kda import kda
    from openk3.ops.kda_reference import kda_recurrent

    p = settings(QUICK if quick else FULL, overrides)
    reps = reps or p["reps"]
    B, H, K = p["B"], p["H"], p["K"]
    scale = K**-0.5
    rows = {}
    targets = {}
    for T in p["T"]:
        q, k, v, g, beta = make_inputs(B, T, H, K, seed=T)
        outs: dict[str, tuple] = {}

        def contender(name: str, fn):
            def go() -> dict:
                with torch.no_grad():
                    dt, out = _timed(fn)
                outs[name] = (out[0].float(), out[1].float())
                return {"seconds": dt}

            return go

        meas = interleaved(
            {
                "openk3_chunk": contender(
                    "openk3_chunk", lambda: kda(q, k, v, g, beta, scale, chunk_size=64)
                ),
                "openk3_recurrent": contender(
                    "openk3_recurrent", lambda: kda_recurrent(q, k, v, g, beta, scale)
                ),
                "transformers_chunk": contender(
                    "transformers_chunk",
                    lambda: hf.chunk_kimi_delta_attention(
                        q,
                        k,
                        v,
                        g,
                        beta,
                        chunk_size=64,
                        initial_state=None,
                        output_final_state=True,
                        use_qk_l2norm_in_kernel=False,
                    ),
                ),
            },
            reps=reps,
            warmup=1,
        )
        ref_o, ref_s = outs["openk3_recurrent"]
        o_scale = max(1.0, float(ref_o.abs().max()))
        diffs = {}
        for name in ("openk3_chunk", "transformers_chunk"):
            o, s = outs[name]
            diffs[name] = {
                "output": float((o - ref_o).abs().max()),
                "state": float((s - ref_s).abs().max()),
            }
            s_scale = max(1.0, float(ref_s.abs().max()))
            check(
                diffs[name]["output"] <= 1e-4 * o_scale and diffs[name]["state"] <= 1e-4 * s_scale,
                f"T={T}: {name} differs from the recurrence by {diffs[name]}",
            )
        m = {n: medians(v) for n, v in meas.items()}
        sec = {n: m[n]["seconds"]["median"] for n in m}
        row = {n: {"seconds": m[n]["seconds"], "tokens_per_s": B * T / sec[n]} for n in m}
        row["max_abs_diff_vs_recurrent"] = diffs
        row["chunk_over_recurrent_speed"] = sec["openk3_recurrent"] / sec["openk3_chunk"]
        row["chunk_over_transformers_speed"] = sec["transformers_chunk"] / sec["openk3_chunk"]
        rows[f"T={T}"] = row
        if T >= 512:
            targets[f"chunk_vs_recurrent_T{T}"] = target(
                row["chunk_over_recurrent_speed"],
                ">=",
                1,
                f"openk3 chunked / recurrent speed at T={T}",
            )
        targets[f"chunk_vs_transformers_T{T}"] = target(
            row["chunk_over_transformers_speed"],
            ">=",
            5,
            f"openk3 chunked / transformers chunked speed at T={T}",
        )
    return {
        "benchmark": "kda",
        "quick": quick,
        "config": {
            "B": B,
            "H": H,
            "K": K,
            "V": K,
            "T": list(p["T"]),
            "chunk_size": 64,
            "dtype": "float32",
            "reps": reps,
            "gate": "g = -softplus(N(0,1) - 2)",
            "peer": "transformers chunk_kimi_delta_attention (torch fallback)",
        },
        "by_T": rows,
        "targets": targets,
        "env": environment(),
    }
