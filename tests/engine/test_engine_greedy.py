"""Greedy engine output == independent full-forward argmax decoding, token for token, across
batching, chunked prefill, prefix caching, requests joining/leaving mid-run, and stop rules."""

from __future__ import annotations

import pytest

from openk3.engine import Engine, EngineConfig
from tests.engine.common import assert_idle, full_forward_greedy, greedy, prompts_of, run

LENGTHS = (5, 17, 33, 40, 1)
N_NEW = 6


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "noprefix"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_batch_of_mixed_prompts_matches_full_forward(model, prefix, chunked):
    prompts = prompts_of(LENGTHS)
    refs = [full_forward_greedy(model, p, N_NEW) for p in prompts]
    # prefill_chunk 12 forces several chunks per prompt and decodes sharing steps with prefills.
    eng = Engine(model, EngineConfig(block_size=8, prefill_chunk=12, chunked_prefill=chunked,
                                     enable_prefix_cache=prefix, snapshot_interval=16))
    ids = [eng.add_request(p, greedy(N_NEW)) for p in prompts]
    widths: list[set] = []  # per step: the T of every forward it ran
    forward, decode, step = eng.runner.forward, eng.runner.decode, eng.step

    def spy_forward(pieces, need):
        widths[-1].add(max(p.length for p in pieces))
        return forward(pieces, need)

    def spy_decode(reqs):  # the compiled decode step bypasses runner.forward: T = 1 either way
        widths[-1].add(1)
        return decode(reqs)

    def spy_step():
        widths.append(set())
        return step()

    eng.runner.forward, eng.runner.decode, eng.step = spy_forward, spy_decode, spy_step
    res = run(eng)
    for rid, ref, p in zip(ids, refs, prompts):
        assert res[rid]["tokens"] == ref, f"prompt of {len(p)} tokens"
        last = res[rid]["outputs"][-1]
        assert last.finished and last.finish_reason == "length"
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(p), N_NEW)
    # decodes and prefill chunks really shared steps; chunks respected the budget
    assert any(1 in w and max(w) > 1 for w in widths)
    if chunked:
        assert max(max(w, default=0) for w in widths) <= 12
    assert_idle(eng)


def test_requests_join_and_leave_mid_run(model):
    prompts = prompts_of((9, 30, 3, 21, 14), seed=11)
    n_new = [7, 3, 8, 5, 6]
    refs = [full_forward_greedy(model, p, n) for p, n in zip(prompts, n_new)]
    eng = Engine(model, EngineConfig(block_size=4, prefill_chunk=10, snapshot_interval=8, max_num_seqs=3))
    joined = {}

    def on_step(i, engine):
        new = []
        for j, at in enumerate((0, 0, 2, 4, 5)):
            if at == i:
                joined[j] = engine.add_request(prompts[j], greedy(n_new[j]))
                new.append(joined[j])
        if i == 6:  # leaves early: request 3 is aborted mid-decode / mid-prefill
            engine.abort(joined[3])
        assert engine.stats()["running"] <= 3
        return new

    res = run(eng, on_step=on_step)
    for j in (0, 1, 2, 4):
        assert res[joined[j]]["tokens"] == refs[j], f"request {j}"
    aborted = res[joined[3]]
    assert aborted["outputs"][-1].finish_reason == "abort"
    assert aborted["tokens"] == refs[3][: len(aborted["tokens"])]
    assert_idle(eng)


def test_stop_token_stop_string_and_length(model):
    prompt = prompts_of((12,), seed=3)[0]
    ref = full_forward_greedy(model, prompt, 8)
    eng = Engine(model, EngineConfig(block_size=8), detokenize=lambda ids: "".join(f"<{t}>" for t in ids))
    # stop token: the first occurrence of ref[3] ends the request; it is counted, not returned
    k = ref.index(ref[3])
    res = run(eng, [(prompt, greedy(8, stop_token_ids=[ref[3]]))])
    (out,) = res.values()
    last = out["outputs"][-1]
    assert out["tokens"] == ref[:k] and last.finish_reason == "stop" and last.stop_reason == ref[3]
    assert last.usage.completion_tokens == k + 1
    # stop string spanning two tokens: returned up to and including the completing token
    s = f"{ref[4]}><{ref[5]}"
    first = next(i for i in range(1, 8) if s in "".join(f"<{t}>" for t in ref[: i + 1]))
    res = run(eng, [(prompt, greedy(8, stop=[s]))])
    (out,) = res.values()
    assert out["tokens"] == ref[: first + 1]
    assert out["outputs"][-1].finish_reason == "stop" and out["outputs"][-1].stop_reason == s
    # max_tokens
    res = run(eng, [(prompt, greedy(2))])
    (out,) = res.values()
    assert out["tokens"] == ref[:2] and out["outputs"][-1].finish_reason == "length"
    assert_idle(eng)
