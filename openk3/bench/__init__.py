"""``openk3 bench``: the benchmark suite of the engine and the server (performance.md §6).

Each benchmark is a module with ``run(quick=False, reps=None, **overrides) -> dict``; it measures
openk3 and its peer side by side in one process, interleaved, reports medians of >= 5 repetitions,
asserts that both computed the same result, and returns a JSON-ready dict with a ``targets``
section (measured value, target, met). Timings are never asserted.

Usage: ``openk3 bench NAME [--out FILE.json] [--quick] [--reps N] [--set KEY=VALUE]``.
"""

from __future__ import annotations

import importlib

BENCHMARKS = {
    "vs-transformers": (
        "openk3.bench.vs_transformers",
        "engine vs transformers KimiLinear generate (decode, TTFT)",
    ),
    "prefix-cache": (
        "openk3.bench.prefix_cache",
        "prefix-cache hit TTFT vs cold, multi-turn hit rate",
    ),
    "batching": (
        "openk3.bench.batching",
        "continuous batching: 8 concurrent vs 1, scheduler overhead",
    ),
    "kda": ("openk3.bench.kda", "chunked vs recurrent KDA vs transformers' chunked fallback"),
    "attn-res": ("openk3.bench.attn_res", "decode/prefill time with vs without Block AttnRes"),
    "memory": ("openk3.bench.memory", "cache bytes per sequence vs planner, hybrid vs all-MLA"),
    "server": ("openk3.bench.server", "openk3 serve streaming overhead vs in-process AsyncEngine"),
    "decode-profile": (
        "openk3.bench.decode_profile",
        "one decode step: aten calls, host syncs and op time by module, vs its weight-product floor",
    ),
    "long-prefill": (
        "openk3.bench.long_prefill",
        "24K-token agent prompt: prefill vs matmul rate, turn 2 via prefix cache, vs transformers",
    ),
}


def run_benchmark(
    name: str, quick: bool = False, reps: int | None = None, *, device=None, dtype=None, **overrides
) -> dict:
    """Run benchmark ``name`` (a key of :data:`BENCHMARKS`) and return its result dict.

    Args:
        device, dtype: where openk3's side computes (None: CPU, float32). Benchmarks whose module
            sets ``PLACEABLE = True`` take them; the others compare fp32 CPU kernels and refuse
            anything else. The result records both (``"device"``, ``"dtype"``).
    Raises:
        ValueError: unknown name or setting, or a device/dtype the benchmark does not support.
        BenchmarkError: a correctness assertion failed.
    """
    import torch

    if name not in BENCHMARKS:
        raise ValueError(f"benchmark {name!r}: unknown; known: {', '.join(BENCHMARKS)}")
    if reps is not None and reps < 1:
        raise ValueError(f"reps={reps}: must be >= 1")
    module = importlib.import_module(BENCHMARKS[name][0])
    device = torch.device(device or "cpu")
    dtype = dtype or torch.float32
    if getattr(module, "PLACEABLE", False):
        result = module.run(quick=quick, reps=reps, device=device, dtype=dtype, **overrides)
    elif device.type != "cpu" or dtype != torch.float32:
        placeable = [
            n
            for n, (m, _) in BENCHMARKS.items()
            if getattr(importlib.import_module(m), "PLACEABLE", False)
        ]
        raise ValueError(
            f"benchmark {name!r} runs on cpu in float32 only (got {device}, {dtype}); "
            f"{', '.join(placeable)} take --device / --dtype"
        )
    else:
        result = module.run(quick=quick, reps=reps, **overrides)
    result.setdefault("device", str(device))
    result.setdefault("dtype", str(dtype).removeprefix("torch."))
    return result


def format_targets(result: dict) -> str:
    """One line per target: ``name  measured  target  met/MISSED``."""
    lines = [f"{result.get('benchmark')}:"]
    for key, t in result.get("targets", {}).items():
        m = t["measured"]
        ms = f"{m:.4g}" if isinstance(m, (int, float)) else str(m)
        lines.append(
            f"  {key:<34} {ms:>10}  (target {t['target']})  {'met' if t['met'] else 'MISSED'}  - {t['what']}"
        )
    return "\n".join(lines)
