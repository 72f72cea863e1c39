"""B3: continuous batching — aggregate throughput at 8 concurrent requests vs 1, and the share of
an engine step spent outside the model forward.

Setup: the K3-shaped model of :func:`~openk3.bench.common.k3_config` (default hidden 256, 8 layers,
fp32), prefix cache off. Workload: ``n_requests`` requests with mixed prompt lengths
(``prompt_lens``, cycled) and ``new_tokens`` greedy tokens each, all submitted at once.

* ``concurrent``: one engine with ``max_num_seqs = n_requests`` (all run together: batched
  prefill, then one batched decode forward per step);
* ``serial``: the same engine settings with ``max_num_seqs = 1`` (one request at a time).

Aggregate tokens/s = generated tokens / wall time of the whole workload (prefill included), and
the same over the decode-only steps (no prefill piece, no admission: tokens they produced / their
time), medians over interleaved repetitions. Scheduler overhead: forward hooks time ``model.model`` +
``lm_head``; the rest of each ``Engine.step`` (admission, planning, block tables, cache views,
sampling, stop checks, bookkeeping) is overhead; reported over all steps and over the pure decode
steps with every request running. Asserted: each request's tokens are identical in both runs.

Targets (performance.md §6.4, continuous batching): concurrent / serial aggregate tokens/s >= 4;
overhead <= 10% of step time.
"""

from __future__ import annotations

import time

import torch

from openk3.bench.common import (
    ForwardTimer,
    check,
    drive,
    environment,
    interleaved,
    k3_config,
    medians,
    random_prompts,
    settings,
    summary,
    target,
)

FULL = {
    "hidden": 256,
    "layers": 8,
    "n_requests": 8,
    "prompt_lens": (32, 64, 96, 128),
    "new_tokens": 48,
    "reps": 5,
}
QUICK = {
    "hidden": 64,
    "layers": 4,
    "n_requests": 3,
    "prompt_lens": (8, 12),
    "new_tokens": 4,
    "reps": 1,
}


PLACEABLE = True  # takes device / dtype (openk3 bench --device / --dtype)


def run(
    quick: bool = False,
    reps: int | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> dict:
    """Run B3 with the model on `device` in `dtype`; returns the result dict (see the module docstring).

    Raises:
        BenchmarkError: a request generated different tokens concurrently and alone.
        ValueError: an unknown override.
    """
    from openk3.engine import Engine, EngineConfig, SamplingParams
    from openk3.pretrained import build_model

    p = settings(QUICK if quick else FULL, overrides)
    reps = reps or p["reps"]
    cfg = k3_config(p["hidden"], p["layers"])
    model = build_model(cfg, seed=0).eval().to(device=device, dtype=dtype)
    n = p["n_requests"]
    N = p["new_tokens"]
    lens = [p["prompt_lens"][i % len(p["prompt_lens"])] for i in range(n)]
    prompts = [random_prompts(1, L, cfg.vocab_size, seed=40 + i)[0] for i, L in enumerate(lens)]
    params = SamplingParams(max_tokens=N, temperature=0.0)
    max_len = max(lens) + N + 16
    engines = {
        name: Engine(
            model,
            EngineConfig(
                max_num_seqs=k,
                enable_prefix_cache=False,
                max_model_len=max_len,
                prefill_chunk=512,
                cache_memory=None,
            ),
        )
        for name, k in (("concurrent", n), ("serial", 1))
    }
    check(
        engines["concurrent"].scheduler.max_num_seqs == n,
        f"the default cache budget gives {engines['concurrent'].scheduler.max_num_seqs} slots, not {n}",
    )
    got: dict[str, list] = {}
    steps: dict[str, list] = {"all": [], "decode_full": []}  # (step seconds, forward seconds)

    def runner(name: str):
        engine = engines[name]

        def go() -> dict:
            timer = ForwardTimer(model)
            log = []  # per step: (seconds, forward seconds, decode rows, pure decode?, tokens out)
            plans = []

            def schedule(orig=engine.scheduler.schedule):
                plan = orig()
                plans.append((len(plan.decode), not plan.prefill and not plan.ready))
                return plan

            def step(orig=engine.step):
                f0 = timer.total
                t0 = time.perf_counter()
                outs = orig()
                rows, pure = plans[-1]
                log.append(
                    (
                        time.perf_counter() - t0,
                        timer.total - f0,
                        rows,
                        pure,
                        sum(len(o.new_token_ids) for o in outs),
                    )
                )
                return outs

            engine.step = step
            engine.scheduler.schedule = schedule
            try:
                traces, wall = drive(engine, [(pr, params) for pr in prompts])
            finally:
                del engine.step, engine.scheduler.schedule
                timer.remove()
            got[name] = [t.tokens for t in traces]
            if name == "concurrent":
                steps["all"] += [(s, f) for s, f, *_ in log]
                steps["decode_full"] += [
                    (s, f) for s, f, rows, pure, _ in log if rows == n and pure
                ]
            produced = sum(len(t.tokens) for t in traces)
            dec_s = sum(s for s, _, _, pure, _ in log if pure)
            dec_tok = sum(k for _, _, _, pure, k in log if pure)
            return {
                "wall_s": wall,
                "tokens_per_s": produced / wall,
                "decode_tokens_per_s": dec_tok / dec_s,
                "steps": len(log),
            }

        return go

    meas = interleaved(
        {"concurrent": runner("concurrent"), "serial": runner("serial")}, reps=reps, warmup=1
    )
    check(
        got["concurrent"] == got["serial"],
        "tokens differ between the concurrent and the serial run",
    )
    m = {k: medians(v) for k, v in meas.items()}
    ratio = m["concurrent"]["tokens_per_s"]["median"] / m["serial"]["tokens_per_s"]["median"]
    ratio_dec = (
        m["concurrent"]["decode_tokens_per_s"]["median"]
        / m["serial"]["decode_tokens_per_s"]["median"]
    )

    def overhead(rows: list) -> dict:
        if not rows:
            return {"steps": 0}
        shares = [(s - f) / s for s, f in rows]
        return {
            "steps": len(rows),
            "step_ms": summary([1e3 * s for s, _ in rows]),
            "outside_forward_ms": summary([1e3 * (s - f) for s, f in rows]),
            "share_outside_forward": summary(shares),
            "share_of_total_time": sum(s - f for s, f in rows) / sum(s for s, _ in rows),
        }

    ov_all = overhead(steps["all"])
    ov_dec = overhead(steps["decode_full"])
    share = ov_dec.get("share_of_total_time", ov_all.get("share_of_total_time"))
    return {
        "benchmark": "batching",
        "quick": quick,
        "config": {
            "model": "k3-test-tiny scaled",
            "hidden": cfg.hidden_size,
            "layers": cfg.num_hidden_layers,
            "params": sum(t.numel() for t in model.parameters()),
            "dtype": str(dtype).removeprefix("torch."),
            "n_requests": n,
            "prompt_lens": lens,
            "new_tokens": N,
            "reps": reps,
            "prefix_cache": False,
            "prefill_chunk": 512,
        },
        "throughput": {
            "concurrent": m["concurrent"],
            "serial": m["serial"],
            "concurrent_over_serial": ratio,
            "decode_concurrent_over_serial": ratio_dec,
            "tokens_identical": True,
        },
        "scheduler_overhead": {"all_steps": ov_all, f"decode_steps_{n}_running": ov_dec},
        "targets": {
            "batching_speedup": target(
                ratio, ">=", 4, f"aggregate tokens/s incl. prefill, {n} concurrent / 1 at a time"
            ),
            "batching_speedup_decode": target(
                ratio_dec,
                ">=",
                4,
                f"aggregate tokens/s of decode-only steps, {n} concurrent / 1 at a time",
            ),
            "scheduler_overhead": target(
                share,
                "<=",
                0.10,
                f"time outside model forward / step time (decode steps, {n} running)",
            ),
        },
        "env": environment(),
    }
