"""KDA-aware prefix cache: a hit gives the same logits as no cache (<= 1e-5) and reports the
reused length as cached_tokens — at block multiples, below one block, diverging mid-block,
multi-turn, concurrent sharers and after eviction under pool pressure."""

from __future__ import annotations

import torch

from openk3.engine import Engine, EngineConfig
from openk3.engine.prefix_cache import extend_keys
from openk3.engine.planner import kda_state_bytes, kv_bytes_per_token, snapshot_bytes
from tests.conftest import assert_close
from tests.engine.common import assert_idle, greedy, prompts_of, run

N_NEW = 4


def logged_engine(model, **cfg):
    log: dict = {}
    eng = Engine(model, EngineConfig(**cfg), on_logits=lambda rid, x: log.setdefault(rid, []).append(x.clone()))
    return eng, log


def generate(eng, log, prompt, n=N_NEW):
    res = run(eng, [(prompt, greedy(n))])
    (rid,) = res
    return res[rid]["tokens"], res[rid]["outputs"][-1].usage.cached_tokens, torch.stack(log[rid])


def cold(model, prompt, n=N_NEW):
    eng, log = logged_engine(model, block_size=8, enable_prefix_cache=False)
    return generate(eng, log, prompt, n)


def check_hit(model, eng, log, prompt, expect_cached, n=N_NEW):
    toks, cached, logits = generate(eng, log, prompt, n)
    ref_toks, ref_cached, ref_logits = cold(model, prompt, n)
    assert ref_cached == 0
    assert cached == expect_cached, f"cached_tokens {cached} != {expect_cached}"
    assert toks == ref_toks  # (cold engine == full-forward greedy: test_engine_greedy.py)
    assert_close(logits, ref_logits, atol=1e-5, what=f"logits with a {cached}-token hit")
    return toks


def test_block_multiple_prompts(mild_model):
    model = mild_model
    eng, log = logged_engine(model, block_size=8, snapshot_interval=8)
    a = prompts_of((16,), seed=1)[0]
    check_hit(model, eng, log, a, 0)
    before = eng.stats()["prefix_cache"]
    check_hit(model, eng, log, a, 16)  # identical: served from the prompt-end snapshot + stored logits
    check_hit(model, eng, log, a + [7, 8, 9, 10, 11], 16)  # extension resumes exactly at the boundary
    after = eng.stats()["prefix_cache"]
    assert after["kda"]["hits"] - before["kda"]["hits"] == 2
    assert after["mla"]["hits"] - before["mla"]["hits"] == 16 + 16
    assert after["mla"]["queries"] - before["mla"]["queries"] == 16 + 21
    assert_idle(eng)


def test_prompts_shorter_than_one_block(mild_model):
    model = mild_model
    eng, log = logged_engine(model, block_size=8, snapshot_interval=8)
    a = prompts_of((5,), seed=2)[0]
    check_hit(model, eng, log, a, 0)
    check_hit(model, eng, log, a, 5)
    check_hit(model, eng, log, a + [1, 2, 3, 4, 5, 6], 5)  # tail latents copied into a private block
    check_hit(model, eng, log, a[:3] + [9, 9], 0)  # diverges inside the first block: no snapshot fits
    assert_idle(eng)


def test_diverging_mid_block_resumes_at_deepest_snapshot(mild_model):
    model = mild_model
    # interval 16 with blocks of 8: the MLA match can be deeper than the deepest snapshot
    eng, log = logged_engine(model, block_size=8, snapshot_interval=16)
    a = prompts_of((40,), seed=3)[0]
    check_hit(model, eng, log, a, 0)  # snapshots at 16, 32 (interval) and 40 (prompt end)
    check_hit(model, eng, log, a[:37] + [1, 2, 3], 32)  # MLA matches 4 blocks; snapshot at 32
    check_hit(model, eng, log, a[:28] + [4, 5, 6, 7], 16)  # MLA matches 3 blocks; deepest snapshot 16
    check_hit(model, eng, log, a[:13] + [4, 5, 6, 7], 0)  # MLA matches 1 block; no snapshot <= 8
    s = eng.stats()["prefix_cache"]
    assert s["kda"]["hit_tokens"] == 32 + 16 and s["kda"]["hits"] == 2
    assert_idle(eng)


def test_multi_turn_resumes_from_sequence_end(mild_model):
    model = mild_model
    eng, log = logged_engine(model, block_size=8, snapshot_interval=64)
    turn1 = prompts_of((11,), seed=4)[0]
    out1 = check_hit(model, eng, log, turn1, 0, n=5)
    # the last sampled token was never fed: the sequence-end state covers 11 + 5 - 1 tokens
    check_hit(model, eng, log, turn1 + out1 + [3, 1, 4], 11 + 5 - 1)
    assert_idle(eng)


def test_concurrent_sharers_and_copy_on_write(mild_model):
    model = mild_model
    eng, log = logged_engine(model, block_size=4, snapshot_interval=4, prefill_chunk=6)
    base = prompts_of((18,), seed=6)[0]
    run(eng, [(base, greedy(1))])
    prompts = [base + [1, 2], base + [3], base[:14] + [5, 6, 7], base]
    res = run(eng, [(p, greedy(N_NEW)) for p in prompts])
    for (rid, r), p in zip(res.items(), prompts):
        ref_toks, _, ref = cold(model, p)
        assert r["tokens"] == ref_toks
        assert_close(torch.stack(log[rid]), ref, atol=1e-5, what="logits of a concurrent sharer")
    assert [r["outputs"][-1].usage.cached_tokens for r in res.values()] == [18, 18, 12, 18]
    assert_idle(eng)


def evict_block(pool, block: int) -> None:
    """Drive the pool's own eviction path until ``block`` (cached, unreferenced) is evicted."""
    pool._evictable.move_to_end(block, last=False)  # make it the LRU victim
    taken = []
    while block in pool.key_of:
        pool.reserve(1)
        taken.append(pool.allocate())
    for b in taken:
        pool.decref(b)


def test_eviction_under_pool_pressure(mild_model):
    model = mild_model
    cfg = model.config
    L = 8
    snap_b = snapshot_bytes(cfg, L, torch.float32)
    slot_b = kda_state_bytes(cfg, torch.float32)["total"]
    block_b = L * kv_bytes_per_token(cfg, torch.float32)
    # 3 snapshots, 1 slot, 17 blocks: a few prompts are enough to evict from both pools
    memory = 3 * snap_b + slot_b + 17 * block_b
    eng, log = logged_engine(model, block_size=L, snapshot_interval=8, max_num_seqs=4, cache_memory=memory,
                             max_model_len=17 * L, snapshot_fraction=3 * snap_b / memory + 1e-9)
    assert (eng.cache.layout.num_snapshots, eng.cache.layout.num_slots, eng.cache.layout.num_blocks) == (3, 1, 17)
    a = prompts_of((24,), seed=7)[0]
    check_hit(model, eng, log, a, 0)
    check_hit(model, eng, log, a, 24)
    for p in prompts_of((30, 30, 30, 30), seed=8):
        check_hit(model, eng, log, p, 0)
    s = eng.stats()
    assert s["kda_snapshots"]["evictions"] > 0 and s["mla_blocks"]["evictions"] > 0
    check_hit(model, eng, log, a, 0)  # every trace of `a` is gone: a miss, still exact
    # blocks evicted while snapshots survive: the hit shrinks to the deepest snapshot below the
    # MLA match, never beyond it
    b = prompts_of((16,), seed=9)[0]
    check_hit(model, eng, log, b, 0)
    keys = []
    extend_keys(keys, b, L)
    evict_block(eng.cache.blocks, eng.cache.blocks.lookup(keys[1]))
    assert eng.cache.snapshots.get(keys[1]) is not None  # the 16-token snapshot is still stored
    check_hit(model, eng, log, b + [1], 8)
    evict_block(eng.cache.blocks, eng.cache.blocks.lookup(keys[0]))
    check_hit(model, eng, log, b + [2], 0)
    assert_idle(eng)


def test_the_logits_gate_detects_a_wrong_kda_state(mild_model):
    """Negative control: the comparison above would catch a snapshot that restores the wrong state
    (sglang #31474) — perturbing the stored recurrent state or conv tails moves the logits by far
    more than 1e-5."""
    model = mild_model
    a = prompts_of((16,), seed=12)[0]
    ext = a + [7, 8, 9]
    ref = cold(model, ext)[2]
    for part in ("recurrent", "conv"):
        eng, log = logged_engine(model, block_size=8, snapshot_interval=8)
        generate(eng, log, a, 1)
        stored = getattr(eng.cache.snapshots, part)
        stored.add_(1e-3 * torch.randn_like(stored))
        _, cached, logits = generate(eng, log, ext)
        assert cached == 16
        assert (logits - ref).abs().max() > 1e-4, part


def test_many_short_prompts_share_one_parent(mild_model):
    """Regression (seen under server load): different tails of the same length after the same full
    blocks coexist in the snapshot index, stay findable, and evict in any order."""
    model = mild_model
    cfg = model.config
    snap_b = snapshot_bytes(cfg, 8, torch.float32)
    memory = 4 * snap_b + kda_state_bytes(cfg, torch.float32)["total"] * 2 + 60 * 8 * kv_bytes_per_token(cfg, torch.float32)
    eng, log = logged_engine(model, block_size=8, snapshot_interval=8, cache_memory=memory, max_num_seqs=1,
                             max_model_len=480, snapshot_fraction=4 * snap_b / memory + 1e-9)
    assert eng.cache.layout.num_snapshots == 4
    shared = prompts_of((8,), seed=13)[0]
    ta, tb, *more = prompts_of((5, 5, 5, 5, 5, 5), seed=14)
    for t in (ta, tb):  # one snapshot at 8 (shared), one tail of 5 tokens each
        check_hit(model, eng, log, shared + t, 8 if t is tb else 0, n=1)
    check_hit(model, eng, log, shared + ta + [3], 13, n=1)  # the older same-length tail is still found
    for i, t in enumerate(more):  # churn: other tails and other parents, evicting in mixed order
        check_hit(model, eng, log, shared + t, 8, n=1)
        check_hit(model, eng, log, t + shared, 0, n=1)
    assert eng.stats()["kda_snapshots"]["evictions"] >= 6
    snaps = eng.cache.snapshots
    indexed = {k for tails in snaps._tails.values() for k in tails}
    assert indexed == {k for k, v in snaps._index.items() if v.parent is not None}
    assert_idle(eng)


def _snapshot_state(eng, prompt, position):
    """(conv, recurrent) of every KDA layer in the snapshot stored after ``position`` tokens of
    ``prompt`` (a multiple of the block size)."""
    keys: list = []
    extend_keys(keys, prompt, eng.cache.block_size)
    snap = eng.cache.snapshots.get(keys[position // eng.cache.block_size - 1])
    assert snap is not None and snap.position == position, f"no snapshot at {position}"
    return eng.cache.snapshots.conv[:, snap.row].clone(), eng.cache.snapshots.recurrent[:, snap.row].clone()


def _forwards(eng):
    """Record (start, end, marks) of every prefill row the engine's forwards run."""
    seen = []
    forward = eng.runner.forward

    def spy(pieces, need):
        seen.extend((p.start, p.end, p.marks) for p in pieces if p.length > 1)
        return forward(pieces, need)

    eng.runner.forward = spy
    return seen


def test_forwards_spanning_snapshot_points_equal_forwards_cut_there(mild_model):
    # A prefill forward of 256 tokens runs past the snapshot points at 64, 128 and 192 and captures
    # the KDA state there; the engine that cuts every forward at those points (64-token budget)
    # gets the same logits, and both store the same snapshots. A later request that diverges
    # after 200 tokens resumes from the snapshot at 192 (taken inside a forward) and generates the
    # same greedy tokens as a cold run.
    model = mild_model
    prompt = prompts_of((300,), seed=41)[0]
    span, span_log = logged_engine(model, block_size=16, snapshot_interval=64, prefill_chunk=256)
    cut, cut_log = logged_engine(model, block_size=16, snapshot_interval=64, prefill_chunk=64)
    span_rows, cut_rows = _forwards(span), _forwards(cut)
    toks_span, _, logits_span = generate(span, span_log, prompt)
    toks_cut, _, logits_cut = generate(cut, cut_log, prompt)
    assert span_rows == [(0, 256, (64, 128, 192)), (256, 300, ())]
    assert all(m == () and e - s <= 64 for s, e, m in cut_rows)
    assert toks_span == toks_cut
    assert_close(logits_span, logits_cut, atol=1e-5, what="logits, 256-token vs 64-token forwards")
    for position in (64, 128, 192, 256):
        conv_span, rec_span = _snapshot_state(span, prompt, position)
        conv_cut, rec_cut = _snapshot_state(cut, prompt, position)
        assert_close(conv_span, conv_cut, atol=1e-6, what=f"conv tails at {position}")
        assert_close(rec_span, rec_cut, atol=1e-6, what=f"recurrent state at {position}")
    follow = prompt[:200] + prompts_of((37,), seed=42)[0]
    check_hit(model, span, span_log, follow, 192)
    assert_idle(span)
    assert_idle(cut)


def test_a_forward_is_cut_where_a_snapshot_point_is_off_the_chunk_grid(mild_model):
    # Resumed at 40 tokens (a tail snapshot), the next snapshot point (64) is 24 tokens into the
    # forward, off the KDA chunk grid: the forward ends there; from 64 on the points 128 and 192
    # are 64 and 128 tokens into the next forward and become its marks.
    model = mild_model
    eng, log = logged_engine(model, block_size=16, snapshot_interval=64, prefill_chunk=256)
    prompt = prompts_of((240,), seed=43)[0]
    check_hit(model, eng, log, prompt[:40], 0)
    rows = _forwards(eng)
    check_hit(model, eng, log, prompt, 40)
    assert rows[:2] == [(40, 64, ()), (64, 240, (128, 192))]
    check_hit(model, eng, log, prompt[:150] + [1, 2, 3], 128)
    assert_idle(eng)


def test_batched_rows_capture_their_own_snapshot_points(mild_model):
    # Two prompts prefilled in one forward (padded rows of 300 and 200 tokens, marks at 64, 128,
    # 192 and 256 / 64, 128 and 192): each row's captured states equal those of an engine that cuts
    # every forward at the points, and each prompt's logits agree.
    model = mild_model
    prompts = prompts_of((300, 200), seed=44)
    span, span_log = logged_engine(
        model, block_size=16, snapshot_interval=64, prefill_chunk=512, prefill_forward_cost=None
    )
    cut, cut_log = logged_engine(model, block_size=16, snapshot_interval=64, prefill_chunk=64)
    forwards = []
    forward = span.runner.forward

    def spy(pieces, need):
        forwards.append(sorted((p.start, p.end, p.marks) for p in pieces))
        return forward(pieces, need)

    span.runner.forward = spy
    got = run(span, [(p, greedy(2)) for p in prompts])
    want = run(cut, [(p, greedy(2)) for p in prompts])
    assert forwards[0] == [(0, 200, (64, 128, 192)), (0, 300, (64, 128, 192, 256))]
    for g, w in zip(got.values(), want.values()):
        assert g["tokens"] == w["tokens"]
    for a, b in zip(span_log.values(), cut_log.values()):
        assert_close(torch.stack(a), torch.stack(b), atol=1e-5, what="logits, batched spanning forward")
    for prompt in prompts:
        for position in range(64, len(prompt), 64):
            conv_span, rec_span = _snapshot_state(span, prompt, position)
            conv_cut, rec_cut = _snapshot_state(cut, prompt, position)
            assert_close(conv_span, conv_cut, atol=1e-6, what=f"conv tails at {position}")
            assert_close(rec_span, rec_cut, atol=1e-6, what=f"recurrent state at {position}")
    assert_idle(span)
