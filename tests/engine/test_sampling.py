"""Sampling: top-k / top-p masks vs a plain per-row reference, min-p's filtered distribution, constraint masks (bool and packed),
logprobs vs log_softmax, seeded reproducibility in and out of a batch, and a constraint that
binds its own request only."""

from __future__ import annotations

import pytest
import torch

from openk3.engine import Engine, EngineConfig, SamplingParams
from openk3.engine.sampling import apply_min_p, apply_top_k_top_p, constraint_mask, sample, top_logprobs
from tests.conftest import assert_close
from tests.engine.common import full_forward_greedy, greedy, prompts_of, run


def reference_keep(row: torch.Tensor, k: int, p: float) -> set[int]:
    """Plain-Python top-k then top-p on one row of logits."""
    order = sorted(range(len(row)), key=lambda i: -row[i].item())
    if k:
        kth = row[order[k - 1]].item()
        order = [i for i in order if row[i].item() >= kth]
    probs = torch.softmax(row[order], dim=0).tolist()
    keep, mass = [], 0.0
    for i, q in zip(order, probs):
        if mass >= p and p < 1:
            break
        keep.append(i)
        mass += q
    return set(keep)


def test_top_k_top_p_masks_match_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 2
    logits[5, 10] = logits[5, 11] = logits[5].max() + 1  # a tie at the top
    ks = torch.tensor([0, 1, 5, 0, 7, 1])
    ps = torch.tensor([1.0, 1.0, 1.0, 0.5, 0.8, 1.0])
    out = apply_top_k_top_p(logits, ks, ps)
    for r in range(6):
        kept = set(torch.isfinite(out[r]).nonzero().flatten().tolist())
        assert kept == reference_keep(logits[r], int(ks[r]), float(ps[r])), r
        assert_close(out[r][list(kept)], logits[r][list(kept)], atol=0, what="kept logits unchanged")
    assert {10, 11} <= set(torch.isfinite(out[5]).nonzero().flatten().tolist())


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]] * 3)
    logits = probs.log()
    out = apply_min_p(logits, torch.tensor([0.25, 0.0, 1.0]))
    # row 0: threshold 0.25 * 0.5 = 0.125 keeps tokens 0 and 1, renormalised 0.5 / 0.8, 0.3 / 0.8
    assert_close(torch.softmax(out[0], 0), torch.tensor([0.625, 0.375, 0, 0, 0]), atol=1e-6,
                 what="min_p 0.25")
    assert torch.isinf(out[0, 2:]).all() and torch.equal(out[0, :2], logits[0, :2])
    assert torch.equal(out[1], logits[1])  # 0 = off: nothing dropped, nothing changed
    assert torch.isfinite(out[2]).tolist() == [True, False, False, False, False]  # 1: the top only
    tie = torch.tensor([[1.0, 1.0, 0.0]])
    assert torch.isfinite(apply_min_p(tie, torch.tensor([1.0]))).tolist() == [[True, True, False]]


def test_min_p_in_the_sampler_after_temperature_before_top_p():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log().repeat(3, 1)
    params = [SamplingParams(temperature=1.0, min_p=0.6),  # 0.24: tokens 0, 1 (4/7, 3/7)
              SamplingParams(temperature=0.5, min_p=0.6),  # probs 16:9:4:1 / 30, 0.6 * 16 = 9.6: token 0
              SamplingParams(temperature=1.0, min_p=0.7, top_p=0.5)]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    counts = torch.zeros(3, 4)
    for _ in range(2000):
        counts[torch.arange(3), sample(logits, params, gens)] += 1
    freq = counts / 2000
    assert freq[0, 2:].sum() == 0 and abs(freq[0, 0].item() - 4 / 7) < 0.04
    assert freq[1, 0] == 1
    # min-p first (vLLM's order): {0, 1} renormalised 4/7, 3/7, whose nucleus at 0.5 is token 0
    # alone; top-p first would have kept tokens 0 and 1 (0.4 < 0.5).
    assert freq[2, 0] == 1


@pytest.mark.parametrize("value", [1.5, -0.1, float("nan"), "0.1", True, None])
def test_min_p_out_of_range_or_not_a_number_is_refused(value):
    with pytest.raises(ValueError, match=r"min_p=.*: must be a number in \[0, 1\] \(0 = off\)"):
        SamplingParams(min_p=value).validate()


def test_constraint_mask_formats():
    allowed = torch.zeros(70, dtype=torch.bool)
    allowed[[0, 3, 31, 32, 64, 69]] = True
    words = torch.zeros(3, dtype=torch.int32)
    for t in allowed.nonzero().flatten().tolist():
        words[t // 32] |= 1 << (t % 32) if t % 32 != 31 else -(1 << 31)
    for form in (allowed, words):
        m = constraint_mask(form, 80)
        assert m.shape == (80,) and m[:70].tolist() == allowed.tolist() and not m[70:].any()
    assert constraint_mask(allowed, 64).tolist() == allowed[:64].tolist()
    with pytest.raises(ValueError, match="allowed_tokens"):
        constraint_mask(torch.zeros(4, 4, dtype=torch.bool), 16)


def test_sampler_statistics_and_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -9.0]]).repeat(4, 1)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=2),
              SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=0.0)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    counts = torch.zeros(4, 5)
    for _ in range(2000):
        counts[torch.arange(4), sample(logits, params, gens)] += 1
    freq = counts / 2000
    assert_close(freq[0], torch.softmax(logits[0], 0), atol=0.04, what="temperature 1")
    assert_close(freq[1, :2], torch.softmax(logits[1, :2] / 0.5, 0), atol=0.04, what="top-k 2 at T=0.5")
    assert freq[1, 2:].sum() == 0
    assert freq[2, 0] == 1  # softmax(logits)[0] = 0.644 >= 0.6: the nucleus is token 0 alone
    assert freq[3, 0] == 1
    lp = top_logprobs(logits, torch.tensor([1, 0, 2, 3]), [2, None, 0, 5])
    ref = torch.log_softmax(logits[0], 0)
    assert lp[1] is None and lp[2].top == []
    assert lp[0].token_id == 1 and abs(lp[0].logprob - ref[1].item()) < 1e-6
    assert [t for t, _ in lp[0].top] == [0, 1] and abs(lp[0].top[0][1] - ref[0].item()) < 1e-6
    assert [t for t, _ in lp[3].top] == [0, 1, 2, 3, 4]


def test_seeded_sampling_is_reproducible_in_any_batch(model):
    prompt = prompts_of((9,), seed=31)[0]
    others = prompts_of((4, 15), seed=32)

    def draw(seed, with_others):
        eng = Engine(model, EngineConfig(block_size=8, prefill_chunk=8))
        reqs = [(prompt, SamplingParams(max_tokens=8, temperature=1.5, seed=seed))]
        if with_others:
            reqs += [(p, SamplingParams(max_tokens=6, temperature=1.0)) for p in others]
        res = run(eng, reqs)
        return next(iter(res.values()))["tokens"]

    a = draw(123, False)
    assert draw(123, True) == a  # batched with unseeded requests, chunked differently
    assert any(draw(s, False) != a for s in (1, 2, 3))


def test_top_k_1_is_greedy_and_logprobs_match_log_softmax(model):
    prompt = prompts_of((12,), seed=33)[0]
    log: dict = {}
    eng = Engine(model, EngineConfig(block_size=8), on_logits=lambda r, x: log.setdefault(r, []).append(x.clone()))
    res = run(eng, [(prompt, SamplingParams(max_tokens=5, temperature=0.7, top_k=1, logprobs=3, seed=0))])
    (rid, r), = res.items()
    assert r["tokens"] == full_forward_greedy(model, prompt, 5)
    lps = [lp for o in r["outputs"] for lp in (o.logprobs or [])]
    assert len(lps) == 5
    for lp, tok, x in zip(lps, r["tokens"], log[rid]):
        ref = torch.log_softmax(x, -1)
        top = ref.topk(3)
        assert lp.token_id == tok and abs(lp.logprob - ref[tok].item()) < 1e-5
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert_close(torch.tensor([v for _, v in lp.top]), top.values, atol=1e-5, what="top logprobs")


class EvenTokens:
    """Test constraint: only even token ids; finished after ``n`` tokens."""

    def __init__(self, vocab: int, n: int = 100):
        self.mask = torch.arange(vocab) % 2 == 0
        self.n, self.seen = n, []

    def allowed_tokens(self) -> torch.Tensor:
        return self.mask

    def accept(self, token_id: int) -> bool:
        self.seen.append(token_id)
        return token_id % 2 == 0

    def is_finished(self) -> bool:
        return len(self.seen) >= self.n


def test_constraint_binds_only_its_request(model):
    p1, p2 = prompts_of((10, 13), seed=34)
    V = model.config.vocab_size
    even = EvenTokens(V)
    done = EvenTokens(V, n=3)
    eng = Engine(model, EngineConfig(block_size=8))
    r1 = eng.add_request(p1, greedy(6), constraint=even)
    r2 = eng.add_request(p2, greedy(6))
    r3 = eng.add_request(p2, greedy(6), constraint=done)
    res = run(eng)
    assert res[r1]["tokens"] == full_forward_greedy(model, p1, 6, allowed=even.mask) == even.seen
    assert all(t % 2 == 0 for t in res[r1]["tokens"])
    assert res[r2]["tokens"] == full_forward_greedy(model, p2, 6)  # unconstrained neighbour unaffected
    last = res[r3]["outputs"][-1]
    assert len(res[r3]["tokens"]) == 3 and last.finish_reason == "stop" and last.stop_reason == "constraint"
    assert any(t % 2 for t in res[r2]["tokens"])  # the mask really would have mattered
