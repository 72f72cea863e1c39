"""B6: decode-state memory per sequence — the engine's pools vs the planner's formula, and the
hybrid (3 KDA : 1 MLA) model vs the same model with every layer MLA.

For each configuration and context length T, an :class:`~openk3.engine.Engine` is built with
``cache_memory = planner.sequence_bytes(config, T)`` (the planner's claim: one sequence of T tokens
fits) and ``max_num_seqs = 1``; the *measured* bytes per sequence are read off the allocated pool
tensors: ``slots.nbytes / num_slots + ceil(T / L) * blocks.nbytes / num_blocks``. Asserted: the
pools really hold T tokens (``num_blocks * L >= T``). Nothing runs 64K tokens: the pools are only
allocated.

* ``bench``: :func:`~openk3.bench.common.k3_config` (hidden 256, 8 layers, fp32 model and pools),
  allocated on the CPU; plus one real request of ``run_tokens`` tokens whose blocks and slot in use
  after prefill are counted from the pool counters.
* ``kimi-k3``: the released configuration, pools in BF16 (KDA recurrent state fp32, as the
  engine always keeps it), allocated on the ``meta`` device (sizes without memory).

All-MLA = ``layer_types`` all ``full_attention``, everything else equal. Targets
(performance.md §6.4, memory vs context): measured within 2% of the planner; hybrid / all-MLA
<= 0.30 at 64K tokens.
"""

from __future__ import annotations

import torch

from openk3.bench.common import check, environment, k3_config, settings, target
from openk3.config import MLA

FULL = {"T": (256, 1024, 4096, 16384, 65536), "run_tokens": 1024, "kimi_k3": True}
QUICK = {"T": (256, 4096), "run_tokens": 64, "kimi_k3": False}


def _engine(model, tokens: int):
    from openk3.engine import Engine, EngineConfig
    from openk3.engine.planner import sequence_bytes

    mc = model.config
    budget = sequence_bytes(mc, tokens, model.lm_head.weight.dtype)
    return Engine(
        model,
        EngineConfig(
            max_num_seqs=1, enable_prefix_cache=False, cache_memory=budget, max_model_len=tokens + 1
        ),
    ), budget


def measure(model, tokens: int) -> dict:
    """Planner bytes vs bytes of the pools an engine allocates for one ``tokens``-token sequence."""
    eng, planned = _engine(model, tokens)
    lay = eng.cache.layout
    L = eng.cache.layout.block_size
    blocks = eng.cache.blocks
    slots = eng.cache.slots
    check(
        blocks.num_blocks * L >= tokens and slots.n >= 1,
        f"T={tokens}: the planner's budget gives {blocks.num_blocks} blocks x {L} and {slots.n} slots",
    )
    per_block = blocks.nbytes / blocks.num_blocks
    per_slot = slots.nbytes / slots.n
    check(
        per_block == lay.block_bytes and per_slot == lay.slot_bytes,
        f"T={tokens}: pool tensors ({per_block}, {per_slot} B) differ from the layout "
        f"({lay.block_bytes}, {lay.slot_bytes} B)",
    )
    measured = per_slot + -(-tokens // L) * per_block
    return {
        "tokens": tokens,
        "planner_bytes": planned,
        "measured_bytes": int(measured),
        "relative_error": abs(measured - planned) / planned,
        "kda_slot_bytes": int(per_slot),
        "mla_bytes_per_token": per_block / L,
    }


def _sweep(model, all_mla, Ts) -> dict:
    rows = {}
    for T in Ts:
        h = measure(model, T)
        a = measure(all_mla, T)
        rows[f"T={T}"] = {
            "hybrid": h,
            "all_mla": a,
            "hybrid_over_all_mla": h["measured_bytes"] / a["measured_bytes"],
        }
    h0 = rows[f"T={Ts[0]}"]
    S = h0["hybrid"]["kda_slot_bytes"]
    a_tok = h0["hybrid"]["mla_bytes_per_token"]
    b_tok = h0["all_mla"]["mla_bytes_per_token"]
    return {
        "by_T": rows,
        "crossover_tokens": S / (b_tok - a_tok) if b_tok > a_tok else None,
        "tokens_for_ratio_0.30": S / (0.30 * b_tok - a_tok) if 0.30 * b_tok > a_tok else None,
    }


@torch.no_grad()
def run(quick: bool = False, reps: int | None = None, **overrides) -> dict:
    """Run B6; returns the result dict (see the module docstring). ``reps`` is unused (no timing).

    Raises:
        BenchmarkError: pools smaller than the planner promises, or pool tensors that differ from
            the layout's byte counts.
        ValueError: an unknown override.
    """
    from openk3.engine import SamplingParams
    from openk3.model import K3ForCausalLM
    from openk3.pretrained import build_model

    p = settings(QUICK if quick else FULL, overrides)
    Ts = list(p["T"])
    cfg = k3_config().replace(max_position_embeddings=1 << 20)
    model = build_model(cfg, seed=0).eval()
    all_mla = build_model(cfg.replace(layer_types=[MLA] * cfg.num_hidden_layers), seed=0).eval()
    results = {"bench": _sweep(model, all_mla, Ts)}

    # One real request: blocks and slots in use after its prefill.
    n = p["run_tokens"]
    eng, _ = _engine(model, n + 16)  # room for the prompt plus the one block the decode will need
    eng.add_request(
        torch.randint(0, cfg.vocab_size, (n,)).tolist(),
        SamplingParams(max_tokens=2, temperature=0.0),
    )
    while not any(o.new_token_ids for o in eng.step()):  # chunked prefill: until the first token
        pass
    used_blocks = eng.cache.blocks.num_used
    used_slots = eng.cache.slots.num_used
    lay = eng.cache.layout
    real = used_slots * lay.slot_bytes + used_blocks * lay.block_bytes
    planned = lay.slot_bytes + -(-n // lay.block_size) * lay.block_bytes
    eng.abort_all()
    results["bench"]["real_request"] = {
        "tokens": n,
        "blocks_used": used_blocks,
        "slots_used": used_slots,
        "bytes_in_use": real,
        "planner_bytes": planned,
    }
    check(real == planned, f"a {n}-token request holds {real} B, the planner says {planned} B")

    if p["kimi_k3"]:
        from openk3.config import preset

        k3 = preset("kimi-k3")
        with torch.device("meta"):
            hybrid_meta = K3ForCausalLM(k3).to(torch.bfloat16)
            mla_meta = K3ForCausalLM(k3.replace(layer_types=[MLA] * k3.num_hidden_layers)).to(
                torch.bfloat16
            )
        results["kimi-k3"] = _sweep(hybrid_meta, mla_meta, Ts)

    targets = {}
    for name, res in results.items():
        worst = max(
            r[k]["relative_error"] for r in res["by_T"].values() for k in ("hybrid", "all_mla")
        )
        targets[f"planner_error_{name}"] = target(
            worst, "<=", 0.02, f"{name}: max |measured - planner| / planner over T"
        )
        last = max(Ts)
        ratio = res["by_T"][f"T={last}"]["hybrid_over_all_mla"]
        targets[f"hybrid_vs_all_mla_{name}_T{last}"] = target(
            ratio, "<=", 0.30, f"{name}: hybrid / all-MLA bytes per sequence at T={last}"
        )
    return {
        "benchmark": "memory",
        "quick": quick,
        "config": {
            "T": Ts,
            "bench_model": {
                "hidden": cfg.hidden_size,
                "layers": cfg.num_hidden_layers,
                "layer_types": cfg.layer_types,
                "dtype": "float32",
            },
            "kimi_k3": "released config, BF16 pools (KDA recurrent fp32), meta device"
            if p["kimi_k3"]
            else None,
        },
        "results": results,
        "targets": targets,
        "env": environment(),
    }
