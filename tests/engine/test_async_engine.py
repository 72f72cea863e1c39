"""AsyncEngine: concurrent generate() streams are correct; abandoning an iterator aborts the
request and frees its slot and blocks; validation errors surface before streaming; shutdown."""

from __future__ import annotations

import asyncio

import pytest

from openk3.engine import AsyncEngine, Engine, EngineConfig, EngineOverloaded
from tests.engine.common import full_forward_greedy, greedy, prompts_of


async def collect(engine: AsyncEngine, prompt, params):
    tokens, outs = [], []
    async for out in engine.generate(prompt, params):
        tokens += out.new_token_ids
        outs.append(out)
    return tokens, outs


def test_concurrent_streams_and_abandoned_iterator(model):
    prompts = prompts_of((7, 16, 3), seed=41)

    async def main():
        aeng = AsyncEngine(Engine(model, EngineConfig(block_size=8, prefill_chunk=8)))
        results = await asyncio.gather(*(collect(aeng, p, greedy(5)) for p in prompts))
        for (tokens, outs), p in zip(results, prompts):
            assert tokens == full_forward_greedy(model, p, 5)
            assert outs[-1].finished and outs[-1].finish_reason == "length"
            assert sum(o.finished for o in outs) == 1
        # abandon a stream after two tokens: the request is aborted and everything freed
        agen = aeng.generate(prompts[1], greedy(200))
        got = [await agen.__anext__(), await agen.__anext__()]
        assert [len(o.new_token_ids) for o in got] == [1, 1]
        assert aeng.engine.stats()["kda_slots"]["used"] == 1
        await agen.aclose()
        for _ in range(400):
            s = aeng.engine.stats()
            if s["kda_slots"]["used"] == 0 and not aeng.engine.has_unfinished():
                break
            await asyncio.sleep(0.005)
        assert s["kda_slots"]["used"] == 0 and s["mla_blocks"]["used"] == 0 and s["mla_blocks"]["reserved"] == 0
        # a consumer task cancelled mid-stream (client disconnect) is aborted too
        task = asyncio.ensure_future(collect(aeng, prompts[0], greedy(200)))
        while aeng.engine.stats()["running"] == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(400):
            if not aeng.engine.has_unfinished():
                break
            await asyncio.sleep(0.005)
        assert aeng.engine.stats()["kda_slots"]["used"] == 0
        # errors before anything is streamed
        with pytest.raises(ValueError, match="prompt_ids"):
            await aeng.generate([], greedy(2)).__anext__()
        await aeng.shutdown()
        with pytest.raises(RuntimeError, match="shutting down"):
            await aeng.generate([1, 2], greedy(2)).__anext__()

    asyncio.run(main())


def test_overload_and_shutdown_without_drain(model):
    async def main():
        aeng = AsyncEngine(Engine(model, EngineConfig(block_size=8, max_waiting=1, max_num_seqs=1)))
        first = aeng.generate([1, 2, 3], greedy(300))
        await first.__anext__()  # running
        second = aeng.generate([4, 5, 6], greedy(2))
        task = asyncio.ensure_future(second.__anext__())  # waiting (max_num_seqs=1)
        await asyncio.sleep(0.05)
        with pytest.raises(EngineOverloaded):
            await aeng.generate([7, 8, 9], greedy(2)).__anext__()
        await aeng.shutdown(drain=False)
        out = await task
        assert out.finished and out.finish_reason == "abort"
        rest = [o async for o in first]
        assert rest[-1].finish_reason == "abort"
        assert not aeng.engine.has_unfinished()

    asyncio.run(main())
