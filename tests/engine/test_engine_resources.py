"""Resources: abort at any point frees everything at once; admission control under a tiny budget
(FCFS waiting, never out of memory); requests that can never fit are rejected; the queue bound;
the engine's allocations equal the planner's formulas."""

from __future__ import annotations

import pytest
import torch

from openk3.engine import Engine, EngineConfig, EngineOverloaded, SamplingParams
from openk3.engine.planner import kda_state_bytes, kv_bytes_per_token, snapshot_bytes
from tests.engine.common import assert_idle, full_forward_greedy, greedy, prompts_of, run


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "noprefix"])
def test_abort_at_every_point_returns_all_blocks_and_slots(model, prefix):
    prompts = prompts_of((13, 5, 10), seed=21)
    cfg = EngineConfig(block_size=4, prefill_chunk=6, enable_prefix_cache=prefix, snapshot_interval=8, max_num_seqs=2)
    probe = Engine(model, cfg)
    start = probe.stats()
    ids = [probe.add_request(p, greedy(3)) for p in prompts]
    total = 0
    while probe.has_unfinished():
        probe.step()
        total += 1
    for k in range(total + 1):  # abort after k steps: waiting, mid-prefill, decoding, finished
        eng = Engine(model, cfg)
        ids = [eng.add_request(p, greedy(3)) for p in prompts]
        for _ in range(k):
            eng.step()
        for rid in ids:
            eng.abort(rid)
        s = eng.stats()
        assert s["mla_blocks"]["used"] == 0 and s["mla_blocks"]["reserved"] == 0, (k, s["mla_blocks"])
        assert s["kda_slots"]["used"] == 0 and s["running"] == 0 and s["waiting"] == 0, (k, s)
        outs = eng.step()  # the aborts are reported once
        assert all(o.finished and o.finish_reason == "abort" for o in outs)
        assert {o.request_id for o in outs} <= set(ids)
        assert not eng.has_unfinished()
        assert_idle(eng)
        if not prefix:
            assert eng.stats()["mla_blocks"] == start["mla_blocks"]
    # aborting one request mid-run leaves the others exact
    eng = Engine(model, cfg)
    ids = [eng.add_request(p, greedy(3)) for p in prompts]
    eng.step()
    eng.step()
    eng.abort(ids[0])
    res = run(eng)
    for rid, p in zip(ids[1:], prompts[1:]):
        assert res[rid]["tokens"] == full_forward_greedy(model, p, 3)
    assert_idle(eng)


def tiny_budget(model, n_slots: int, n_blocks: int, block_size: int) -> int:
    cfg = model.config
    return n_slots * kda_state_bytes(cfg, torch.float32)["total"] + n_blocks * block_size * kv_bytes_per_token(cfg, torch.float32)


def test_admission_control_under_a_tiny_budget(model):
    # 2 slots and 34 blocks of 8 tokens (max_model_len 272); each long request reserves
    # ceil((20 + 130 - 1) / 8) = 19 blocks for its lifetime, so only one fits at a time.
    memory = tiny_budget(model, 2, 34, 8)
    eng = Engine(model, EngineConfig(block_size=8, cache_memory=memory, enable_prefix_cache=False, max_num_seqs=2,
                                     max_model_len=272))
    assert (eng.cache.layout.num_slots, eng.cache.layout.num_blocks, eng.max_model_len) == (2, 34, 272)
    assert eng.cache.layout.total_bytes <= memory
    long_a, long_b, short_c = prompts_of((20, 20, 5), seed=22)
    ref_a, ref_b, ref_c = (full_forward_greedy(model, p, 4) for p in (long_a, long_b, short_c))
    # the long requests may run 130 tokens, but stop early on their 3rd greedy token
    ra = eng.add_request(long_a, greedy(130, stop_token_ids=[ref_a[2]]))
    rb = eng.add_request(long_b, greedy(130, stop_token_ids=[ref_b[2]]))
    rc = eng.add_request(short_c, greedy(3))  # would fit next to A, but FCFS keeps it behind B
    order = []

    def on_step(i, engine):
        s = engine.stats()
        assert s["mla_blocks"]["used"] + s["mla_blocks"]["reserved"] <= s["mla_blocks"]["total"]
        running = {r.request_id for r in engine.scheduler.running}
        order.append(running)
        assert not ({ra, rb} <= running), "both long requests admitted: over budget"
        assert not (rc in running and rb not in running and ra in running), "C overtook B"

    res = run(eng, on_step=on_step)
    assert res[ra]["tokens"] == ref_a[: ref_a.index(ref_a[2])]
    assert res[rb]["tokens"] == ref_b[: ref_b.index(ref_b[2])]
    assert res[rc]["tokens"] == ref_c[:3]
    assert any(rb in s for s in order) and any(ra in s for s in order)
    first_b = next(i for i, s in enumerate(order) if rb in s)
    assert all(ra not in s for s in order[first_b:]), "B started while A still held its reservation"
    assert_idle(eng)


def test_requests_that_can_never_fit_are_rejected(model):
    eng = Engine(model, EngineConfig(block_size=8, cache_memory=tiny_budget(model, 2, 34, 8),
                                     enable_prefix_cache=False, max_num_seqs=2, max_model_len=272))
    with pytest.raises(ValueError, match="max_model_len=272"):
        eng.add_request(list(range(272)), greedy(1))
    # a long max_tokens is capped to the room left, not rejected
    rid = eng.add_request(list(range(260)), greedy(1000))
    assert eng.scheduler.waiting[0].max_tokens == 12 and rid
    eng.abort(rid)
    with pytest.raises(ValueError, match="cache_memory"):
        Engine(model, EngineConfig(block_size=8, cache_memory=1000))
    for bad, match in (([], "prompt_ids"), ([1, 99999], "prompt_ids"), ([1], "max_tokens")):
        with pytest.raises(ValueError, match=match):
            eng.add_request(bad, SamplingParams(max_tokens=0) if match == "max_tokens" else greedy(1))
    with pytest.raises(ValueError, match="detokenize"):
        eng.add_request([1, 2], greedy(2, stop=["x"]))


def test_waiting_queue_bound(model):
    eng = Engine(model, EngineConfig(block_size=8, max_waiting=2))
    eng.add_request([1, 2, 3], greedy(2))
    eng.add_request([4, 5, 6], greedy(2))
    with pytest.raises(EngineOverloaded):
        eng.add_request([7, 8, 9], greedy(2))
    eng.abort_all()
    assert_idle(eng)


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "noprefix"])
@pytest.mark.parametrize("max_len,seqs", [(8, 1), (24, 8), (64, 5), (3000, 3)])
def test_default_budget_gives_every_sequence_a_slot_and_its_tokens(model, prefix, max_len, seqs):
    # Short contexts: the KDA state outweighs the latent tokens, and the layout only grants
    # max_num_seqs slots when they take at most half the (non-snapshot) budget.
    eng = Engine(model, EngineConfig(block_size=8, max_num_seqs=seqs, max_model_len=max_len,
                                     enable_prefix_cache=prefix))
    assert eng.cache.layout.num_slots == seqs and eng.scheduler.max_num_seqs == seqs
    assert eng.cache.layout.num_blocks * 8 >= seqs * max_len
    assert eng.max_model_len == max_len


def test_allocations_equal_the_planner_formulas(model):
    eng = Engine(model, EngineConfig(block_size=8, cache_memory=4_000_000, max_model_len=1024))
    cfg, lay = model.config, eng.cache.layout
    assert lay.block_bytes == 8 * kv_bytes_per_token(cfg, torch.float32)
    assert lay.slot_bytes == kda_state_bytes(cfg, torch.float32)["total"]
    assert lay.snapshot_bytes == snapshot_bytes(cfg, 8, torch.float32)
    assert eng.cache.blocks.nbytes == lay.num_blocks * lay.block_bytes
    assert eng.cache.slots.nbytes == lay.num_slots * lay.slot_bytes
    assert eng.cache.snapshots.nbytes == lay.num_snapshots * lay.snapshot_bytes
    assert lay.total_bytes <= 4_000_000
    # and the formula itself, from the config: 2 MLA layers x (16 + 8) values x 4 bytes per token
    assert kv_bytes_per_token(cfg, torch.float32) == 2 * (16 + 8) * 4
    assert kda_state_bytes(cfg, torch.float32) == {"recurrent": 4 * 4 * 16 * 16 * 4, "conv": 4 * 3 * 64 * 3 * 4,
                                                   "total": 4 * 4 * 16 * 16 * 4 + 4 * 3 * 64 * 3 * 4}


def test_max_model_len_is_honoured_or_refused_never_capped(model):
    budget = tiny_budget(model, 2, 34, 8)  # the MLA pool holds 272 tokens for one sequence
    eng = Engine(model, EngineConfig(block_size=8, cache_memory=budget, enable_prefix_cache=False, max_num_seqs=2,
                                     max_model_len=200))
    assert eng.max_model_len == 200 and eng.stats()["max_model_len"] == 200
    # 272 cached tokens serve sequences of 273 (the last sampled token is never cached) ...
    eng = Engine(model, EngineConfig(block_size=8, cache_memory=budget, enable_prefix_cache=False, max_num_seqs=2,
                                     max_model_len=273))
    rid = eng.add_request(list(range(100)), greedy(1000))
    assert eng.scheduler.waiting[0].max_tokens == 173 and eng.cache.blocks_needed(eng.scheduler.waiting[0]) == 34
    eng.abort(rid)
    with pytest.raises(ValueError) as e:  # ... and one token more does not fit
        Engine(model, EngineConfig(block_size=8, cache_memory=budget, enable_prefix_cache=False, max_num_seqs=2,
                                   max_model_len=274))
    assert str(e.value).startswith(f"max_model_len=274: cache_memory={budget} bytes holds sequences of up to 273 "
                                   "tokens (34 MLA blocks of 8 tokens)")
    with pytest.raises(ValueError) as e:  # no max_model_len: the model's context must fit as well
        Engine(model, EngineConfig(block_size=8, cache_memory=budget, enable_prefix_cache=False, max_num_seqs=2))
    ctx = model.config.max_position_embeddings
    assert f"max_model_len={ctx} (the model's max_position_embeddings): cache_memory={budget} bytes holds " \
        "sequences of up to 273" in str(e.value)
    with pytest.raises(ValueError, match=f"max_model_len={ctx + 1}: exceeds the model's context "
                                         rf"\(max_position_embeddings={ctx}\)"):
        Engine(model, EngineConfig(block_size=8, max_model_len=ctx + 1))


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "noprefix"])
def test_default_budget_holds_one_sequence_of_a_million_tokens(model, prefix):
    # K3's context: the default budget is sized for one sequence of the whole context besides the
    # batch (CPU pools are committed lazily, so this costs no resident memory up front).
    cfg = model.config.replace(max_position_embeddings=1 << 20)
    big = type(model)(cfg)
    big.load_state_dict(model.state_dict())
    eng = Engine(big.eval(), EngineConfig(block_size=16, max_num_seqs=4, enable_prefix_cache=prefix))
    assert eng.max_model_len == 1 << 20
    assert eng.cache.layout.num_blocks * 16 >= 1 << 20 and eng.cache.layout.num_slots == 4
    # a prompt far past the old 8K limit is accepted with its output budget capped by the room left
    rid = eng.add_request([i % 500 for i in range(20_000)], greedy(1 << 30))
    assert eng.scheduler.waiting[0].max_tokens == (1 << 20) - 20_000
    eng.abort(rid)


def test_pool_zeros_are_zero_in_every_dtype():
    from openk3.engine.kv_pool import pool_zeros

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = pool_zeros(3, 5, device="cpu", dtype=dtype)
        assert t.dtype == dtype and t.shape == (3, 5) and not t.any()
        t[1, 2] = 1.5  # writable, and writes land where they are addressed
        assert float(t.sum()) == 1.5 and float(t[1, 2]) == 1.5


@pytest.mark.parametrize("changes, message", [
    ({"max_num_seqs": 0}, "max_num_seqs=0: must be an integer >= 1"),
    ({"max_num_seqs": True}, "max_num_seqs=True: must be an integer >= 1"),  # a bool is not a count
    ({"cache_memory": "1GB"}, "cache_memory='1GB': must be a positive number of bytes"),
    ({"enable_prefix_cache": "yes"}, "enable_prefix_cache='yes': must be a boolean"),
    ({"seed": 1.5}, "seed=1.5: must be an integer or null"),
    ({"snapshot_fraction": "a"}, r"snapshot_fraction='a': must be a number in \[0, 1\)"),
    ({"snapshot_fraction": 1.0}, r"snapshot_fraction=1.0: must lie in \[0, 1\)"),
    ({"snapshot_interval": 24}, "snapshot_interval=24: must be a positive multiple of block_size=16"),
])
def test_engine_config_errors_name_the_field_and_value(changes, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**changes).validate()
    EngineConfig().validate()  # the defaults are valid
