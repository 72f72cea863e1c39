"""B5: the cost of Block Attention Residuals — the same K3 model with and without AttnRes.

Setup: :func:`~openk3.bench.common.k3_config` (default hidden 256, 8 layers, fp32) twice:
``attn_res_block_size=2`` (AttnRes on: depth mixes over the block summaries before every mixer and
FFN and at the output) and ``None`` (plain residual stream). Every tensor the two share is
identical (the plain model is loaded from the AttnRes model's state dict); they differ only by the
AttnRes norms and pseudo-queries. Both run through their own engine (prefix cache off).

Measured, interleaved, medians: decode ms/step (``new_tokens`` greedy tokens after a
``prompt_len``-token prompt, B = 1 and B = ``batch``), and prefill time of the prompt (TTFT).
Ratio = with / without, per round: the two engines run back to back in every round (the order
alternating), so each round gives one paired ratio, and the reported ratio is the median of those
(``decode_ratio``; the ratio of the two medians is ``decode_ratio_of_medians``). Pairing cancels
what drifts between rounds on a shared machine (other tenants of the host's caches and memory
bandwidth moved both engines' step times by up to 30 % within one run, 2026-12-04), which a ratio
of separately taken medians does not. Asserted: each engine's greedy tokens equal an independent full-forward
argmax decode of its own model (no cache), so neither path is wrong.
Target (performance.md §6.4, AttnRes overhead): AttnRes adds <= 5% to decode time.
``--set compile=true`` runs both engines' decode steps compiled (``EngineConfig(compile=True)``,
where Inductor fuses each site's merge with its neighbours; the unmeasured warm-up repetition
compiles each (batch, block-table) bucket, so choose ``prompt_len + new_tokens`` within one
block-table bucket, e.g. ``prompt_len=96``: 6-8 blocks of 16).
"""

from __future__ import annotations

import statistics

import torch

from openk3.bench.common import (
    check,
    drive,
    environment,
    interleaved,
    k3_config,
    medians,
    random_prompts,
    settings,
    target,
)

FULL = {
    "hidden": 256,
    "layers": 8,
    "block": 2,
    "prompt_len": 128,
    "new_tokens": 32,
    "batch": 8,
    "reps": 5,
    "compile": False,
}
QUICK = {
    "hidden": 64,
    "layers": 4,
    "block": 2,
    "prompt_len": 8,
    "new_tokens": 3,
    "batch": 2,
    "reps": 1,
    "compile": False,
}


@torch.no_grad()
def full_forward_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Argmax decoding by re-running the whole sequence without a cache (independent reference)."""
    seq = list(prompt)
    out = []
    for _ in range(n):
        tok = int(model(torch.tensor([seq])).logits[0, -1].argmax())
        out.append(tok)
        seq.append(tok)
    return out


def run(quick: bool = False, reps: int | None = None, **overrides) -> dict:
    """Run B5; returns the result dict (see the module docstring).

    Raises:
        BenchmarkError: an engine's tokens differ from its model's full-forward greedy decode.
        ValueError: an unknown override.
    """
    from openk3.engine import Engine, EngineConfig, SamplingParams
    from openk3.pretrained import build_model

    p = settings(QUICK if quick else FULL, overrides)
    reps = reps or p["reps"]
    cfg_on = k3_config(p["hidden"], p["layers"], attn_res_block_size=p["block"])
    cfg_off = cfg_on.replace(attn_res_block_size=None)
    with_ar = build_model(cfg_on, seed=0).eval()
    plain = build_model(cfg_off, seed=0).eval()
    shared = {k: v for k, v in with_ar.state_dict().items() if k in plain.state_dict()}
    plain.load_state_dict(shared, strict=True)
    extra = sum(t.numel() for k, t in with_ar.state_dict().items() if k not in shared)
    P = p["prompt_len"]
    N = p["new_tokens"]
    Bmax = p["batch"]
    models = {"attn_res": with_ar, "plain": plain}
    result: dict = {
        "benchmark": "attn-res",
        "quick": quick,
        "config": {
            "model": "k3-test-tiny scaled",
            "hidden": cfg_on.hidden_size,
            "layers": cfg_on.num_hidden_layers,
            "attn_res_block_size": p["block"],
            "attn_res_blocks": -(-cfg_on.num_hidden_layers // p["block"]),
            "params_plain": sum(t.numel() for t in plain.parameters()),
            "params_attn_res_extra": extra,
            "dtype": "float32",
            "prompt_len": P,
            "new_tokens": N,
            "reps": reps,
            "decode": "compiled" if p["compile"] else "eager",
        },
        "batches": {},
        "targets": {},
    }
    refs: dict[tuple, list[int]] = {}
    for B in (1, Bmax):
        prompts = random_prompts(B, P, cfg_on.vocab_size, seed=500 + B)
        engines = {
            name: Engine(
                m,
                EngineConfig(
                    max_num_seqs=B,
                    enable_prefix_cache=False,
                    max_model_len=P + N + 16,
                    prefill_chunk=max(512, B * P),
                    compile=p["compile"],
                ),
            )
            for name, m in models.items()
        }
        got: dict[str, list] = {}

        def runner(name: str):
            def go() -> dict:
                params = SamplingParams(max_tokens=N, temperature=0.0)
                traces, _ = drive(engines[name], [(pr, params) for pr in prompts])
                got[name] = [t.tokens for t in traces]
                first = max(t.times[0] for t in traces)
                last = max(t.times[-1] for t in traces)
                return {
                    "prefill_s": first,
                    "decode_ms_per_step": 1e3 * (last - first) / max(N - 1, 1),
                }

            return go

        meas = interleaved({n: runner(n) for n in models}, reps=reps, warmup=1)
        for name, m in models.items():
            key = (name, tuple(prompts[0]))
            if key not in refs:
                refs[key] = full_forward_greedy(m, prompts[0], N)
            check(
                got[name][0] == refs[key],
                f"{name}, B={B}: engine tokens differ from full-forward greedy decode",
            )
        med = {n: medians(v) for n, v in meas.items()}

        def paired(key: str) -> list[float]:
            return [a / b for a, b in zip(meas["attn_res"][key], meas["plain"][key])]

        dec_pairs = paired("decode_ms_per_step")
        dec = statistics.median(dec_pairs)
        pre = statistics.median(paired("prefill_s"))
        result["batches"][f"B={B}"] = {
            **med,
            "decode_ratio": dec,
            "decode_ratio_rounds": dec_pairs,
            "decode_ratio_of_medians": (
                med["attn_res"]["decode_ms_per_step"]["median"]
                / med["plain"]["decode_ms_per_step"]["median"]
            ),
            "prefill_ratio": pre,
            "tokens_checked": True,
        }
        result["targets"][f"decode_overhead_B{B}"] = target(
            dec - 1,
            "<=",
            0.05,
            f"decode time with AttnRes / without - 1 (median of paired rounds), B={B}",
        )
    result["env"] = environment()
    return result
