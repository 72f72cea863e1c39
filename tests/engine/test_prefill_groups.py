"""Prefill length groups: the grouping is the optimum of its cost model (brute force over every
partition), and grouped prefill gives the same greedy tokens as one padded forward and as an
independent full-forward decode."""

from __future__ import annotations

import random

import pytest

from openk3.engine import Engine, EngineConfig
from openk3.engine.scheduler import length_groups
from tests.engine.common import assert_idle, full_forward_greedy, greedy, prompts_of, run


def _partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


def _cost(groups, lengths, f):
    return sum(f + len(g) * max(lengths[i] for i in g) for g in groups)


@pytest.mark.parametrize("seed", range(40))
def test_length_groups_is_optimal(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    lengths = [rng.choice([1, 3, 8, 9, 16, 32, 33]) for _ in range(n)]
    f = rng.choice([0, 1, 5, 16, 100])
    groups = length_groups(lengths, f)
    assert sorted(i for g in groups for i in g) == list(range(n))
    best = min(_cost(p, lengths, f) for p in _partitions(list(range(n))))
    assert _cost(groups, lengths, f) == best


def test_length_groups_extremes():
    lengths = [32, 64, 96, 128, 32, 64, 96]
    assert length_groups(lengths, 0) == [[3], [2, 6], [1, 5], [0, 4]]  # no padding at all
    assert length_groups(lengths, 10_000) == [[3, 2, 6, 1, 5, 0, 4]]  # one forward
    assert length_groups([5, 5, 5], 0) == [[0, 1, 2]]
    assert length_groups([], 3) == []
    with pytest.raises(ValueError, match="forward_cost"):
        length_groups([1, 2], -1)


@pytest.mark.parametrize("cost", [0, 16, None], ids=["no-padding", "default-ish", "one-forward"])
def test_grouped_prefill_matches_full_forward(model, cost):
    lengths = (5, 17, 33, 40, 1, 17, 9)
    prompts = prompts_of(lengths, seed=3)
    refs = [full_forward_greedy(model, p, 5) for p in prompts]
    eng = Engine(model, EngineConfig(block_size=8, prefill_chunk=256, enable_prefix_cache=False,
                                     prefill_forward_cost=cost))
    ids = [eng.add_request(p, greedy(5)) for p in prompts]
    shapes = []
    forward = eng.runner.forward

    def spy(pieces, need):
        shapes.append(sorted(p.length for p in pieces))
        return forward(pieces, need)

    eng.runner.forward = spy
    res = run(eng)
    for rid, ref in zip(ids, refs):
        assert res[rid]["tokens"] == ref
    prefill = [s for s in shapes if max(s) > 1]
    assert sorted(n for s in prefill for n in s) == sorted(n for n in lengths if n > 1)
    if cost == 0:
        assert all(len(set(s)) == 1 for s in prefill)  # every forward is padding-free
    if cost is None:
        assert len(prefill) == 1
    assert_idle(eng)


def test_prefill_forward_cost_is_validated():
    with pytest.raises(ValueError, match="prefill_forward_cost"):
        EngineConfig(prefill_forward_cost=-1).validate()
