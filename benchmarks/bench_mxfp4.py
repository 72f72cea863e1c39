"""Benchmark (not a test): routed-expert decode on packed MXFP4 weights vs fp32 weights (issue 7).

Usage:
    .venv/bin/python benchmarks/bench_mxfp4.py OUT.json [--experts 16 --topk 4 --latent 3584
        --hidden 3072 --batch 1 --steps 12 --repeats 7 --threads N]

Setup: one MoE layer with the released K3 expert shape (w1/w3 [3072, 3584], w2 [3584, 3072]) and
E experts. The packed weights are random E2M1 codes with E8M0 scales 2^-9..2^-5; the fp32 weights are
their exact dequantization, so both paths compute the same function. Each decode step routes
``batch`` tokens to ``topk`` experts chosen among those the previous step did not use, so every
step streams its experts from DRAM (packed total ~17.5 MB per expert vs ~132 MB fp32; the script
reads the L3 size and refuses configs whose packed weights fit in it).

Measured: ``routed_experts`` (fp32, the model's default backend) vs ``packed_routed_experts``
(automatic implementation: the native kernel on CPU), the same routing and inputs, interleaved
repeats with alternating order, medians. Outputs are asserted equal (max abs error <= 1e-5 times
the largest output; only the fp32 summation order differs). Reported: tokens/s of each and their ratio, expert-weight bytes and the process's resident
memory growth for each representation, and their ratios. JSON goes to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from openk3.config import preset  # noqa: E402
from openk3.layers.mlp import glu_activation  # noqa: E402
from openk3.ops.grouped_mm import routed_experts  # noqa: E402
from openk3.quant import mxfp4_cpu  # noqa: E402
from openk3.quant.packed import MXFP4Weight, packed_routed_experts  # noqa: E402


def l3_bytes() -> int | None:
    """Total L3 size from lscpu (falls back to sysfs); None if unknown."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        m = re.search(r"L3 cache:\s*([\d.]+)\s*([KMG]i?B)", out)
        if m:
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)[0]]
            return int(float(m.group(1)) * unit)
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size", encoding="utf-8") as f:
            s = f.read().strip()
        return int(s[:-1]) * (1 << 10) if s.endswith("K") else int(s)
    except (OSError, ValueError):
        return None


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="utf-8") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def random_packed(e: int, o: int, k: int, gen: torch.Generator) -> MXFP4Weight:
    """Random bytes are two random E2M1 codes each; filled in place, so no temporaries distort the
    resident-memory measurement."""
    w = MXFP4Weight(e, o, k)
    w.weight_packed.random_(0, 256, generator=gen)
    w.weight_scale.random_(118, 123, generator=gen)
    return w


def routing(steps: int, batch: int, e: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Per step [batch, k] distinct expert ids, avoiding the previous step's experts (so the
    previous step's reads do not leave this step's experts in cache)."""
    if e - batch * k < k:
        raise ValueError(f"--experts {e} too small for --batch {batch} x --topk {k} with fresh experts per step")
    out, prev = [], set()
    for _ in range(steps):
        avail = torch.tensor([i for i in range(e) if i not in prev])
        idx = torch.stack([avail[torch.randperm(len(avail), generator=gen)[:k]] for _ in range(batch)])
        prev = set(idx.flatten().tolist())
        out.append(idx)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="path of the JSON result")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--latent", type=int, default=3584, help="L (K3: routed_expert_hidden_size)")
    ap.add_argument("--hidden", type=int, default=3072, help="F (K3: moe_intermediate_size)")
    ap.add_argument("--batch", type=int, default=1, help="tokens per decode step")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch / kernel threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.repeats < 5:
        raise SystemExit("--repeats must be >= 5 (medians of at least 5)")
    e, l, f, k, b = args.experts, args.latent, args.hidden, args.topk, args.batch
    gen = torch.Generator().manual_seed(0)
    act = glu_activation(preset("kimi-k3"))  # SiTU-GLU with the released betas

    l3 = l3_bytes()
    rss0 = rss_bytes()
    w1, w3, w2 = random_packed(e, f, l, gen), random_packed(e, f, l, gen), random_packed(e, l, f, gen)
    rss1 = rss_bytes()
    dense = [w.dequantize() for w in (w1, w3, w2)]
    rss2 = rss_bytes()
    packed_bytes = sum(t.numel() * t.element_size() for w in (w1, w3, w2) for t in w.buffers())
    dense_bytes = sum(t.numel() * t.element_size() for t in dense)
    if l3 is not None and packed_bytes < 4 * l3:
        raise SystemExit(f"packed weights ({packed_bytes >> 20} MiB) are not >> L3 ({l3 >> 20} MiB): raise --experts")

    routes = routing(args.steps, b, e, k, gen)
    zs = [torch.randn(b, l, generator=gen) for _ in range(args.steps)]
    wts = [torch.rand(b, k, generator=gen) for _ in range(args.steps)]

    def run_fp32():
        return [routed_experts(z, i, w, *dense, act) for z, i, w in zip(zs, routes, wts)]

    def run_packed():
        return [packed_routed_experts(z, i, w, w1, w3, w2, act) for z, i, w in zip(zs, routes, wts)]

    with torch.inference_mode():
        ref, got = run_fp32(), run_packed()  # warm-up (kernel build / load) and correctness
        max_err = max((g - r).abs().max().item() for g, r in zip(got, ref))
        scale = max(r.abs().max().item() for r in ref)
        # fp32 sums of ~3k terms in another order: compare relative to the output scale
        if not max_err <= 1e-5 * scale:
            raise AssertionError(f"packed vs fp32 outputs differ: max abs err {max_err:.3e} > 1e-5 * {scale:.3e}")
        times = {"fp32": [], "mxfp4": []}
        for rep in range(args.repeats):
            order = [("fp32", run_fp32), ("mxfp4", run_packed)]
            for name, fn in order if rep % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)

    tokens = args.steps * b
    med = {n: statistics.median(t) for n, t in times.items()}
    tps = {n: tokens / m for n, m in med.items()}
    result = {
        "config": {"experts": e, "topk": k, "latent_L": l, "hidden_F": f, "batch": b, "steps": args.steps,
                   "repeats": args.repeats, "threads": torch.get_num_threads()},
        "machine": {"cpu": platform.processor() or platform.machine(), "l3_bytes": l3, "torch": torch.__version__,
                    "cores": os.cpu_count(), "loadavg_1min_at_end": os.getloadavg()[0],
                    "native_kernel": mxfp4_cpu.available(), "simd_level": mxfp4_cpu.simd_level()},
        "expert_weight_bytes": {"fp32": dense_bytes, "mxfp4": packed_bytes, "ratio": dense_bytes / packed_bytes},
        "resident_growth_bytes": {"fp32": rss2 - rss1, "mxfp4": rss1 - rss0,
                                  "ratio": (rss2 - rss1) / max(rss1 - rss0, 1)},
        "bytes_read_per_token": {"fp32": 3 * k * f * l * 4, "mxfp4": 3 * k * f * l * 4.25 / 8},
        "seconds": times,
        "median_seconds": med,
        "tokens_per_s": tps,
        "speedup_tokens_per_s": tps["mxfp4"] / tps["fp32"],
        "max_abs_err": max_err,
        "max_abs_ref": scale,
    }
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    print(f"L3 {l3 and l3 >> 20} MiB; expert weights fp32 {dense_bytes / 2**20:.0f} MiB, "
          f"mxfp4 {packed_bytes / 2**20:.0f} MiB ({result['expert_weight_bytes']['ratio']:.2f}x); "
          f"resident growth ratio {result['resident_growth_bytes']['ratio']:.2f}x")
    print(f"decode tokens/s: fp32 {tps['fp32']:.1f}, mxfp4 {tps['mxfp4']:.1f} -> {result['speedup_tokens_per_s']:.2f}x "
          f"(median of {args.repeats}, {torch.get_num_threads()} threads, max abs err {max_err:.2e} on |y| <= {scale:.2f}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
