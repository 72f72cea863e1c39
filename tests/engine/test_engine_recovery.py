"""Failure isolation: an exception while computing a step fails exactly the requests of the failed
work (``finish_reason="error"``), frees their slot, blocks and reservation, leaves every other
request exact, and the engine then serves 100 more requests; the async front recovers from an
exception outside that isolation and stops (``healthy`` False) only on an unrecoverable one."""

from __future__ import annotations

import asyncio

import pytest
import torch

from openk3.engine import AsyncEngine, Engine, EngineConfig
from tests.engine.common import assert_idle, full_forward_greedy, greedy, prompts_of, run

ALLOC_ERROR = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 7680000000 bytes (injected)"


def _poison_forward(engine: Engine, poisoned: set[str], times: int = 1) -> list:
    """Make ``engine``'s forward raise (as a failed allocation does) whenever its batch holds a
    request in ``poisoned``, ``times`` times; returns the list of failed batches' request ids."""
    original = engine.runner.forward
    failed: list = []

    def forward(pieces, need):
        ids = {p.request.request_id for p in pieces}
        if ids & poisoned and len(failed) < times:
            failed.append(sorted(ids))
            raise RuntimeError(ALLOC_ERROR)  # schedule() had allocated the pieces' blocks already
        return original(pieces, need)

    engine.runner.forward = forward
    return failed


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "noprefix"])
def test_failed_forward_fails_exactly_its_requests_then_100_requests_succeed(model, prefix):
    prompts = prompts_of((9, 14, 11), seed=61)
    cfg = EngineConfig(block_size=4, prefill_chunk=32, enable_prefix_cache=prefix, snapshot_interval=8,
                       max_num_seqs=4)
    eng = Engine(model, cfg)
    a = eng.add_request(prompts[0], greedy(6), request_id="a")
    b = eng.add_request(prompts[1], greedy(6), request_id="b")
    outs = eng.step() + eng.step()  # both prefilled and decoding
    failed = _poison_forward(eng, {"p"})
    eng.add_request(prompts[2], greedy(6), request_id="p")  # prefills alone while a and b decode
    res = run(eng)
    assert failed == [["p"]]
    (last,) = res["p"]["outputs"]
    assert last.finished and last.finish_reason == "error" and last.new_token_ids == []
    assert last.error.startswith("RuntimeError: DefaultCPUAllocator")
    for rid, p in ((a, prompts[0]), (b, prompts[1])):
        got = [t for o in outs if o.request_id == rid for t in o.new_token_ids] + res[rid]["tokens"]
        assert got == full_forward_greedy(model, p, 6), rid
    assert eng.check_consistency() == [] and eng.failures == 1
    assert_idle(eng)
    # the same prompt again computes correctly (nothing of the failed work was reused)
    again = run(eng, [(prompts[2], greedy(6))])
    assert next(iter(again.values()))["tokens"] == full_forward_greedy(model, prompts[2], 6)
    # then 100 more requests, 8 at a time, all served
    more = prompts_of([3 + i % 7 for i in range(100)], seed=62)
    served = 0
    for k in range(0, 100, 8):
        batch = run(eng, [(p, greedy(2)) for p in more[k:k + 8]])
        served += sum(r["outputs"][-1].finish_reason == "length" for r in batch.values())
    assert served == 100
    assert_idle(eng)


def test_failed_batch_with_several_requests_and_a_tower_style_failure_mid_prefill(model):
    """A failure in a batched prefill fails the rows of that forward only; their later pieces are
    skipped, the requests of other forwards in the same step finish exact."""
    prompts = prompts_of((30, 30, 5), seed=63)
    cfg = EngineConfig(block_size=4, prefill_chunk=40, max_num_seqs=4, prefill_forward_cost=None)
    eng = Engine(model, cfg)
    eng.add_request(prompts[2], greedy(4), request_id="ok")
    first = eng.step()
    failed = _poison_forward(eng, {"x"})
    eng.add_request(prompts[0], greedy(4), request_id="x")
    eng.add_request(prompts[1], greedy(4), request_id="y")
    outs = eng.step()  # x whole, y its first 9 tokens: one forward (no length groups)
    res = run(eng)
    assert failed == [["x", "y"]]
    for rid in ("x", "y"):
        (o,) = [o for o in outs if o.request_id == rid]
        assert o.finish_reason == "error" and rid not in res  # later pieces skipped, nothing more reported
    ok = [t for o in first + outs if o.request_id == "ok" for t in o.new_token_ids] + res["ok"]["tokens"]
    assert ok == full_forward_greedy(model, prompts[2], 4)
    assert_idle(eng)


class _BrokenConstraint:
    """A constraint whose mask computation raises on its second use."""

    def __init__(self):
        self.calls = 0

    def allowed_tokens(self):
        self.calls += 1
        if self.calls > 1:
            raise MemoryError("injected")
        return torch.ones(512, dtype=torch.bool)

    def accept(self, token_id: int) -> bool:
        return True

    def is_finished(self) -> bool:
        return False


def test_sampling_failure_fails_only_that_request(model):
    prompts = prompts_of((6, 8), seed=64)
    eng = Engine(model, EngineConfig(block_size=4, max_num_seqs=4))
    bad = eng.add_request(prompts[0], greedy(5), _BrokenConstraint())
    good = eng.add_request(prompts[1], greedy(5))
    res = run(eng)
    assert res[bad]["outputs"][-1].finish_reason == "error" and "MemoryError" in res[bad]["outputs"][-1].error
    assert len(res[bad]["tokens"]) == 1
    assert res[good]["tokens"] == full_forward_greedy(model, prompts[1], 5)
    assert_idle(eng)


def test_async_engine_recovers_and_reports_health(model):
    prompts = prompts_of((5, 7, 6), seed=65)

    async def collect(aeng, p, n=3):
        outs = []
        async for o in aeng.generate(p, greedy(n)):
            outs.append(o)
        return outs

    async def main():
        aeng = AsyncEngine(Engine(model, EngineConfig(block_size=4, max_num_seqs=4)))
        sched = aeng.engine.scheduler
        original = sched.schedule
        # the three adds reach the engine thread in any grouping (one step may see only the
        # first): planning fails while a request of this batch is queued, until all three failed
        state = {"left": len(prompts)}

        def schedule():  # an exception outside the isolated work: everything in the engine fails
            if state["left"] > 0 and sched.waiting:
                state["left"] -= len(sched.waiting) + len(sched.running)
                raise RuntimeError("injected planning failure")
            return original()

        sched.schedule = schedule
        first = await asyncio.gather(*(collect(aeng, p) for p in prompts))
        assert all(o[-1].finish_reason == "error" for o in first)
        assert aeng.healthy and aeng.engine.check_consistency() == []
        results = await asyncio.gather(*(collect(aeng, prompts[i % 3]) for i in range(30)))
        for i, outs in enumerate(results):
            assert [t for o in outs for t in o.new_token_ids] == full_forward_greedy(model, prompts[i % 3], 3)
        assert aeng.healthy
        # an unrecoverable failure stops the thread: unhealthy, and new requests are refused

        def fatal():
            raise SystemExit("injected")

        sched.schedule = fatal
        with pytest.raises(RuntimeError, match="engine"):
            await collect(aeng, prompts[0])
        for _ in range(200):
            if not aeng.healthy:
                break
            await asyncio.sleep(0.005)
        assert not aeng.healthy
        with pytest.raises(RuntimeError, match="failed"):
            await aeng.generate(prompts[0], greedy(2)).__anext__()

    asyncio.run(main())
