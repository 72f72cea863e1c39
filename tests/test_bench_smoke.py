"""Smoke runs of the ``openk3 bench`` suite: every benchmark runs end to end in ``--quick`` mode (tiny
sizes, one repetition) and its correctness assertions hold (openk3 and its peer computed the same
thing). No timing is asserted anywhere: the numbers are only checked to be present and positive."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from openk3.bench import BENCHMARKS, run_benchmark  # noqa: E402
from openk3.bench.common import BenchmarkError  # noqa: E402



def _targets_are_numbers(result: dict) -> None:
    assert result["targets"], "a benchmark reports at least one target"
    for name, t in result["targets"].items():
        assert isinstance(t["measured"], (int, float)) and math.isfinite(t["measured"]), (name, t)
        assert t["target"].startswith(("<=", ">=")) and isinstance(t["met"], bool), (name, t)
    assert result["env"]["torch"] == torch.__version__


def test_vs_transformers_quick():
    pytest.importorskip("transformers")
    r = run_benchmark("vs-transformers", quick=True)
    _targets_are_numbers(r)
    for row in r["batches"].values():
        assert row["tokens_identical"] is True
        assert row["openk3"]["decode_tok_per_s"] > 0 and row["transformers"]["decode_tok_per_s"] > 0
        assert row["gemv_floor"]["products"] > 0 and row["gemv_floor"]["ms_per_step"] > 0
        assert row["decode_vs_floor"] == pytest.approx(
            row["openk3"]["decode_ms_per_step"] / row["gemv_floor"]["ms_per_step"]
        )


def test_prefix_cache_quick():
    r = run_benchmark("prefix-cache", quick=True)
    _targets_are_numbers(r)
    assert r["ttft"]["hit_logits_max_abs_diff"] <= 1e-5 * max(1.0, r["ttft"]["logits_scale"])
    s = r["session"]
    assert s["tokens_identical"] and s["per_turn_cached"][0] == 0
    assert all(c > 0 for c in s["per_turn_cached"][1:])  # every later turn resumes from a snapshot
    assert s["cached_tokens"] == sum(s["per_turn_cached"])


def test_batching_quick():
    r = run_benchmark("batching", quick=True)
    _targets_are_numbers(r)
    assert r["throughput"]["tokens_identical"]
    ov = r["scheduler_overhead"]["all_steps"]
    assert ov["steps"] > 0 and 0 <= ov["share_of_total_time"] < 1


def test_kda_quick_and_its_equality_check_bites(monkeypatch):
    pytest.importorskip("transformers")
    r = run_benchmark("kda", quick=True)
    _targets_are_numbers(r)
    for row in r["by_T"].values():
        assert row["max_abs_diff_vs_recurrent"]["openk3_chunk"]["output"] < 1e-5
    # a contender that is slightly wrong must stop the benchmark
    import openk3.ops.kda as kda_ops

    real = kda_ops.kda
    monkeypatch.setattr(kda_ops, "kda", lambda *a, **k: (lambda o, s: (o * 1.01, s))(*real(*a, **k)))
    with pytest.raises(BenchmarkError, match="openk3_chunk differs"):
        run_benchmark("kda", quick=True, T=(64,))


def test_attn_res_quick():
    r = run_benchmark("attn-res", quick=True)
    _targets_are_numbers(r)
    assert all(b["tokens_checked"] for b in r["batches"].values())
    assert r["config"]["params_attn_res_extra"] > 0


def test_memory_quick_through_the_cli(tmp_path):
    from openk3.cli import main

    out = tmp_path / "memory.json"
    assert main(["bench", "memory", "--quick", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == "memory"
    _targets_are_numbers(r)
    bench = r["results"]["bench"]
    assert bench["real_request"]["bytes_in_use"] == bench["real_request"]["planner_bytes"]
    for row in bench["by_T"].values():  # T are block multiples: the pools hold exactly the planner's bytes
        assert row["hybrid"]["relative_error"] == 0 and row["all_mla"]["relative_error"] == 0
    assert bench["by_T"]["T=4096"]["hybrid_over_all_mla"] < 1  # past the crossover the hybrid is smaller


def test_server_quick():
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    r = run_benchmark("server", quick=True)
    _targets_are_numbers(r)
    assert r["outputs_identical"]
    assert r["latency"]["server"]["ttft_ms"]["n"] == r["config"]["requests_per_side"]


def test_registry_and_bad_input():
    assert set(BENCHMARKS) == {"vs-transformers", "prefix-cache", "batching", "kda", "attn-res", "memory", "server",
                               "long-prefill", "decode-profile"}
    with pytest.raises(ValueError, match="unknown"):
        run_benchmark("nope")
    with pytest.raises(ValueError, match="unknown settings"):
        run_benchmark("memory", quick=True, hidden=3)
    with pytest.raises(ValueError, match="setting T='x'"):
        run_benchmark("memory", quick=True, T="x")
    with pytest.raises(ValueError, match="reps"):
        run_benchmark("memory", reps=0)


def test_batching_quick_in_bfloat16_and_fp32_only_benchmarks_refuse_other_dtypes():
    r = run_benchmark("batching", quick=True, dtype=torch.bfloat16)
    assert (r["device"], r["dtype"], r["config"]["dtype"]) == ("cpu", "bfloat16", "bfloat16")
    assert r["throughput"]["tokens_identical"] is True  # concurrent == serial tokens held in bf16 too
    _targets_are_numbers(r)
    assert run_benchmark("memory", quick=True)["dtype"] == "float32"  # the default placement is recorded
    with pytest.raises(ValueError, match="'kda' runs on cpu in float32 only.*batching, server take --device"):
        run_benchmark("kda", quick=True, dtype=torch.bfloat16)


def test_long_prefill_quick_and_its_equality_check_bites(monkeypatch):
    pytest.importorskip("transformers")
    r = run_benchmark("long-prefill", quick=True)
    _targets_are_numbers(r)
    c = r["checks"]
    assert c["greedy_tokens_equal"] and c["k3_vs_full_forward_max_abs"] <= 1e-4 * max(1.0, c["k3_logits_scale"])
    assert c["turn2_cached_tokens"] >= r["config"]["prompt_tokens"] - r["config"]["block_size"]
    assert r["k3"]["prefill_tok_per_s"] > 0 and r["kimi_linear"]["transformers_tok_per_s"] > 0
    assert r["measured"]["matmul_gflops"]["median"] > 0
    assert r["k3"]["cpu_time"]["fraction_of_matmul_rate"] > 0 and r["kimi_linear"]["speedup_cpu_time"] > 0
    # a chunked prefill that is slightly wrong must stop the benchmark
    import openk3.ops.attention as attention

    real = attention.latent_attention_blocked
    monkeypatch.setattr(attention, "latent_attention_blocked", lambda *a, **k: real(*a, **k) * 1.01)
    with pytest.raises(BenchmarkError, match="chunked prefill"):
        run_benchmark("long-prefill", quick=True, peer=False)


def test_prefill_flops_of_the_shipped_config_by_hand():
    from openk3.bench.long_prefill import prefill_flops
    from openk3.config import preset

    cfg = preset("openk3-tiny")
    # multiply-adds per token (D 128, KDA P 128 K 32 H 4; MLA Q 64, C 32, N 32, R 16, V 32, H 4;
    # dense I 384; MoE E 16, latent 64, F 64, top-2, one shared expert of 64)
    kda = 4 * 128 * 128 + 128 * 32 + 32 * 128 + 128 * 4 + 128 * 128
    mla = 128 * 64 + 64 * 4 * 48 + 128 * 48 + 32 * 4 * 64 + 128 * 128 + 128 * 128
    dense = 3 * 128 * 384
    moe_rest, experts = 128 * 16 + 128 * 64 + 64 * 128 + 3 * 128 * 64, 2 * 3 * 64 * 64
    T, past = 100, 50
    f = prefill_flops(cfg, T, past)
    assert f["projections"] == 2 * T * (6 * kda + 2 * mla + dense + 7 * moe_rest)
    assert f["experts"] == 2 * T * 7 * experts
    pairs = sum(past + t + 1 for t in range(T))
    assert f["attention"] == 2 * 4 * 2 * (32 + 16 + 32) * pairs
    assert f["kda_state"] == 6 * 4 * 7 * 32 * 32 * T and f["lm_head"] == 2 * 128 * 8192
    assert f["total"] == sum(v for k, v in f.items() if k not in ("total", "per_token"))


def test_decode_profile_quick_counts_calls_and_host_syncs():
    from openk3.bench.decode_profile import _Counter, _ModuleStack

    r = run_benchmark("decode-profile", quick=True)
    _targets_are_numbers(r)
    for row in r["batches"].values():
        assert row["aten_calls_per_step"] == sum(m["aten_calls"] for m in row["by_module"].values()) > 0
        assert row["host_syncs_per_step"] == sum(row["sync_sites"].values())
        assert all(site.startswith("openk3/") for site in row["sync_sites"])
        assert row["gemv_floor_ms"] > 0 and row["step_ms"] > 0
        assert {"self_attn (KimiDeltaAttention)", "self_attn (GatedMLA)", "lm_head"} <= set(row["by_module"])

    # the counter sees each kind of sync once, with or without autograd keys
    lin = torch.nn.Linear(2, 2)
    for ctx in (torch.no_grad, torch.inference_mode):
        stack = _ModuleStack(lin)
        counter = _Counter(stack)
        x = torch.arange(4.0)
        with ctx(), counter:
            bool((x > 1).any())  # _local_scalar_dense / is_nonzero
            int(x.max())  # item
            x[x > 1]  # boolean-mask indexing
            lin(x[:2])  # no sync
        stack.remove()
        assert sum(counter.syncs.values()) == 3, (ctx, counter.ops)
        assert counter.calls["engine"] > 0 and counter.calls.total() >= 7
