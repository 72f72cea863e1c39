"""The cache manager owns every cache resource: admission takes all of a request's memory or
nothing, release gives it all back, and the scheduler allocates every block of a step inside
``schedule()`` (in the order the forwards run), so no forward allocates."""

from __future__ import annotations

import torch

from openk3.engine import Engine, EngineConfig
from openk3.engine.cache_manager import CacheManager
from openk3.engine.planner import kda_state_bytes
from openk3.engine.request import Piece, Request
from openk3.engine.sampling import SamplingParams
from tests.engine.common import assert_idle, full_forward_greedy, greedy, prompts_of, run


def _manager(model, L: int = 4) -> CacheManager:
    """Room for two KDA slots; the MLA blocks take the other half of the budget."""
    cfg = model.config
    memory = 4 * kda_state_bytes(cfg, torch.float32)["total"]
    return CacheManager(cfg, memory, block_size=L, max_num_seqs=2, snapshot_interval=None,
                        snapshot_fraction=0.0, enable_prefix_cache=False, device="cpu", dtype=torch.float32)


def _request(rid: str, n: int, max_tokens: int) -> Request:
    prompt = list(range(1, n + 1))
    params = SamplingParams(max_tokens=max_tokens)
    return Request(rid, prompt, params, None, 0, max_tokens, tokens=list(prompt))


def test_admit_takes_everything_or_nothing_and_release_gives_it_back(model):
    cm = _manager(model)
    NB = cm.layout.num_blocks
    assert cm.layout.num_slots == 2 and NB > 5
    a = _request("a", 9, 4)  # positions 0..11: 3 blocks of 4
    assert cm.blocks_needed(a) == 3 and cm.admit(a)
    assert (a.slot, a.blocks, a.reserved, a.num_computed, a.cached_tokens) == (0, [], 3, 0, 0)
    assert cm.check([a]) == []
    big = _request("big", 4 * (NB - 2), 1)  # NB - 2 blocks, NB - 3 left unreserved
    assert cm.blocks_needed(big) == NB - 2 and not cm.admit(big)
    assert (big.slot, big.blocks, big.reserved) == (None, [], 0) and not cm.holds(big)
    cm.allocate(a, 5)  # positions [0, 5): two blocks out of the reservation
    assert (len(a.blocks), a.reserved, cm.blocks.reserved, cm.blocks.num_free) == (2, 1, 1, NB - 2)
    cm.allocate(a, 8)  # already covered: nothing more
    assert len(a.blocks) == 2
    assert cm.check([a]) == [] and cm.check([]) != []
    cm.release(a)
    assert not cm.holds(a) and cm.check([]) == []
    s = cm.stats()
    assert s["mla_blocks"]["free"] == NB and s["mla_blocks"]["reserved"] == 0 and s["kda_slots"]["free"] == 2
    b, c, d = _request("b", 3, 2), _request("c", 3, 2), _request("d", 3, 2)
    assert cm.admit(b) and cm.admit(c)
    assert not cm.admit(d) and not cm.holds(d)  # no KDA slot left
    assert cm.check([b, c]) == []


def test_the_plan_allocates_every_block_before_the_forwards(model):
    """Every block of a step is allocated inside ``schedule()``: every piece a forward runs already
    has its blocks and starts at its request's progress, and the outputs stay exact."""
    prompts = prompts_of((9, 14, 5, 30), seed=21)
    eng = Engine(model, EngineConfig(block_size=4, prefill_chunk=16, snapshot_interval=8, max_num_seqs=4))
    L = eng.cache.block_size
    seen, allocs, planning = [], [], [False]
    allocate, schedule, forward = eng.cache.blocks.allocate, eng.scheduler.schedule, eng.runner.forward

    def counting_allocate():
        allocs.append(planning[0])
        return allocate()

    def spy_schedule():
        planning[0] = True
        try:
            return schedule()
        finally:
            planning[0] = False

    def spy_forward(pieces, need):
        assert all(isinstance(p, Piece) and p.start == p.request.num_computed for p in pieces)
        assert all(len(p.request.blocks) * L >= p.end for p in pieces)
        seen.append(sorted(p.length for p in pieces))
        return forward(pieces, need)

    eng.cache.blocks.allocate = counting_allocate
    eng.scheduler.schedule = spy_schedule
    eng.runner.forward = spy_forward
    res = run(eng, [(p, greedy(6)) for p in prompts])
    for rid, p in zip(res, prompts):
        assert res[rid]["tokens"] == full_forward_greedy(model, p, 6)
    assert len(allocs) >= sum(-(-(len(p) + 5) // L) for p in prompts) and all(allocs)
    assert any(max(s) > 1 for s in seen) and any(max(s) == 1 for s in seen)  # prefill and decode forwards
    assert eng.check_consistency() == []
    assert_idle(eng)
