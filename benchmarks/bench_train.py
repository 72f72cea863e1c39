"""Training throughput: openk3 vs transformers' ``KimiLinearForCausalLM`` on the same weights.

Not a test: run by hand (``python benchmarks/bench_train.py [--out result.json]``). Method
(performance.md §6.1): fp32, fixed threads, identical weights written by openk3's
``save_pretrained`` and read by ``KimiLinearForCausalLM.from_pretrained``, A/B runs interleaved
in one process, medians of ``--reps`` (>= 5) after warm-up, the step-0 losses asserted equal.

Measured:

* ``tokens_per_s``: one optimizer step on B x T tokens.
  - ``openk3``: :func:`openk3.train.trainer.train_step` with K3's optimizer (Per-Head Muon +
    AdamW), Quantile Balancing and QK-Clip, i.e. the real training step;
  - ``openk3_adamw``: the same step with ``torch.optim.AdamW`` (same optimizer as the peer);
  - ``transformers``: forward with labels, backward, ``torch.optim.AdamW`` step (the usual HF loop).
* ``muon_vs_adamw``: ``optimizer.step()`` alone (Muon vs AdamW on the same gradients) and the
  whole-step ratio.
* ``flops``: FLOPs of one openk3 forward+backward counted by ``torch.utils.flop_counter``,
  achieved FLOP/s, and its fraction of the measured fp32 matmul rate (a square matmul of size
  ``--mm-size`` on the same threads).

Shape: ``kimi-linear-tiny`` widened (``--hidden``) so that the step is dominated by matmuls.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from openk3.config import preset  # noqa: E402
from openk3.pretrained import build_model  # noqa: E402
from openk3.train.optim import build_optimizer  # noqa: E402
from openk3.train.trainer import StepConfig, make_balancers, train_step  # noqa: E402


def bench_config(hidden: int):
    """``kimi-linear-tiny`` scaled to ``hidden`` (heads of 64, experts of hidden/2)."""
    heads = max(1, hidden // 64)
    return preset("kimi-linear-tiny").replace(
        vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
        num_key_value_heads=heads, kv_lora_rank=hidden // 4, qk_nope_head_dim=32, qk_rope_head_dim=32,
        v_head_dim=64, linear_num_heads=heads, linear_head_dim=64, moe_intermediate_size=hidden // 2,
    )


def _median_stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def matmul_rate(n: int, reps: int) -> float:
    """Median fp32 FLOP/s of an [n, n] @ [n, n] matmul."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    ts = [_timed(lambda: a @ b) for _ in range(reps)]
    return 2 * n**3 / statistics.median(ts)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mm-size", type=int, default=1024)
    ap.add_argument("--out", help="write the JSON here as well")
    args = ap.parse_args(argv)
    if args.reps < 5:
        ap.error("--reps: at least 5 (medians of >= 5 interleaved runs)")
    torch.set_num_threads(args.threads)
    from transformers import KimiLinearForCausalLM

    cfg = bench_config(args.hidden)
    ours = build_model(cfg, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        ours.save_pretrained(tmp)
        try:
            peer = KimiLinearForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="sdpa")
            attn_impl = "sdpa"
        except (ValueError, ImportError):
            peer = KimiLinearForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager")
            attn_impl = "eager"
    ours_adamw = build_model(cfg, seed=0)
    ours.train(), ours_adamw.train(), peer.train()

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((args.batch, 1), -100)], dim=1)  # openk3: aligned targets
    batch = [{"input_ids": ids, "labels": labels}]
    n_tok = args.batch * args.seq

    with torch.no_grad():
        loss_ours = float(ours(ids, labels=labels).loss)
        loss_peer = float(peer(input_ids=ids, labels=ids).loss)  # transformers shifts internally
    if abs(loss_ours - loss_peer) > 1e-4 * max(1.0, abs(loss_peer)):
        raise AssertionError(f"step-0 loss differs: openk3 {loss_ours} vs transformers {loss_peer}")

    total = args.warmup + args.reps + 1
    step_cfg = StepConfig(total_steps=total, warmup_steps=1, grad_clip=1.0, qk_clip_tau=100.0)
    opt_muon = build_optimizer(ours, cfg, lr=1e-3)
    bal = make_balancers(ours)
    opt_ours_adamw = torch.optim.AdamW(ours_adamw.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    bal_adamw = make_balancers(ours_adamw)
    opt_peer = torch.optim.AdamW(peer.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    step_no = {"ours": 0, "adamw": 0}

    def step_ours():
        train_step(ours, batch, opt_muon, bal, step_cfg, step=min(step_no["ours"], total - 1))
        step_no["ours"] += 1

    def step_ours_adamw():
        train_step(ours_adamw, batch, opt_ours_adamw, bal_adamw, step_cfg, step=min(step_no["adamw"], total - 1))
        step_no["adamw"] += 1

    def step_peer():
        out = peer(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(peer.parameters(), 1.0)
        opt_peer.step()
        opt_peer.zero_grad(set_to_none=True)

    runs = {"openk3": step_ours, "openk3_adamw": step_ours_adamw, "transformers": step_peer}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(args.warmup + args.reps):
        for name, fn in runs.items():  # interleaved A/B/C
            t = _timed(fn)
            if i >= args.warmup:
                times[name].append(t)

    # Optimizer step alone, on the gradients of one backward (kept between the timed steps).
    out = ours(ids, labels=labels)
    out.loss.backward()
    grads = {p: p.grad.clone() for p in ours.parameters() if p.grad is not None}
    adamw_same = torch.optim.AdamW(list(grads), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    opt_times: dict[str, list[float]] = {"muon": [], "adamw": []}
    for i in range(args.warmup + args.reps):
        for name, opt in (("muon", opt_muon), ("adamw", adamw_same)):
            for p, g in grads.items():
                p.grad = g.clone()
            t = _timed(opt.step)
            if i >= args.warmup:
                opt_times[name].append(t)
    opt_muon.zero_grad(set_to_none=True)

    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        ours(ids, labels=labels).loss.backward()
    ours.zero_grad(set_to_none=True)
    flops = fc.get_total_flops()
    mm = matmul_rate(args.mm_size, max(args.reps, 5))

    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "benchmark": "train_step",
        "config": {"hidden": args.hidden, "batch": args.batch, "seq": args.seq, "tokens_per_step": n_tok,
                   "layers": cfg.num_hidden_layers, "experts": cfg.n_routed_experts, "top_k": cfg.num_experts_per_tok,
                   "params": sum(p.numel() for p in ours.parameters()), "transformers_attn": attn_impl},
        "loss_step0": {"openk3": loss_ours, "transformers": loss_peer},
        "step_seconds": {k: _median_stats(v) for k, v in times.items()},
        "tokens_per_s": {k: n_tok / v for k, v in med.items()},
        "speedup_vs_transformers": {"openk3": med["transformers"] / med["openk3"],
                                    "openk3_adamw": med["transformers"] / med["openk3_adamw"]},
        "muon_vs_adamw": {
            "optimizer_step_seconds": {k: _median_stats(v) for k, v in opt_times.items()},
            "optimizer_step_ratio": statistics.median(opt_times["muon"]) / statistics.median(opt_times["adamw"]),
            "train_step_ratio": med["openk3"] / med["openk3_adamw"],
        },
        "flops": {
            "fwd_bwd_flops_per_step": flops,
            "achieved_flops_per_s": flops / med["openk3_adamw"],
            "matmul_fp32_flops_per_s": mm,
            "fraction_of_matmul_rate": flops / med["openk3_adamw"] / mm,
            "note": "forward+backward FLOPs over the openk3+AdamW step time (the optimizer adds no counted matmuls)",
        },
        "env": {"torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version(),
                "machine": platform.machine(), "loadavg": os.getloadavg()},
    }
    try:
        import transformers

        result["env"]["transformers"] = transformers.__version__
    except ImportError:
        pass
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
