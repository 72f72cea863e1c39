"""The engine's decode step: no device->host sync inside it (what a captured or compiled step
needs), with the tokens still those of the independent full-forward reference."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import openk3
from openk3.bench.decode_profile import BOOL_INDEX_OPS, SYNC_OPS
from openk3.engine import Engine, EngineConfig
from openk3.engine.decode_step import StaticDecodeStep, bucket
from openk3.pretrained import build_model
from tests.conftest import assert_close, perturb
from tests.engine.common import full_forward_greedy, greedy, prompts_of


class HostSyncs(TorchDispatchMode):
    """Records every aten call that makes the host wait for a tensor's values (``item`` /
    ``bool(t)`` / ``int(t)``, value-dependent output shapes, boolean-mask indexing)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func.overloadpacket.__name__
        indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
        bool_index = op in BOOL_INDEX_OPS and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices
        )
        if op in SYNC_OPS or bool_index:
            self.seen.append(op)
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def _steps_chosen_here(monkeypatch):
    """Each test here builds its eager reference and its compiled step explicitly; the
    environment's backend switch (``OPENK3_DECODE_BACKEND=compiled``, which reruns the engine
    suite on the compiled step) must not turn the references into compiled steps too.
    test_one_switch_chooses_the_decode_step sets it itself."""
    monkeypatch.delenv("OPENK3_DECODE_BACKEND", raising=False)


@pytest.fixture(scope="module")
def kimi_linear_model():
    """kimi-linear-tiny (KDA + MLA without AttnRes, softplus gate, low-rank output gate)."""
    return perturb(build_model(openk3.preset("kimi-linear-tiny"), seed=2), 1.0).eval()


@pytest.mark.parametrize("which", ["k3", "kimi-linear"])
@pytest.mark.parametrize("batch", [1, 3])
def test_engine_decode_step_makes_no_host_sync(model, kimi_linear_model, which, batch):
    m = model if which == "k3" else kimi_linear_model
    prompts = prompts_of((9, 21, 14)[:batch], seed=11, vocab=m.config.vocab_size)
    n_new = 5
    eng = Engine(m, EngineConfig(block_size=8, enable_prefix_cache=False))
    ids = [eng.add_request(p, greedy(n_new)) for p in prompts]
    tokens = {rid: [] for rid in ids}
    for out in eng.step():  # the prefill step (it may sync: rows of different lengths)
        tokens[out.request_id] += out.new_token_ids
    assert all(len(t) == 1 for t in tokens.values())
    syncs = []
    for _ in range(n_new - 2):  # decode steps that cross block boundaries (block_size 8)
        guard = HostSyncs()
        with guard:
            outs = eng.step()
        syncs.append(guard.seen)
        assert len(outs) == batch and all(len(o.new_token_ids) == 1 for o in outs)
        for out in outs:
            tokens[out.request_id] += out.new_token_ids
    assert syncs == [[]] * (n_new - 2), f"host syncs per decode step: {syncs}"
    for out in eng.step():
        tokens[out.request_id] += out.new_token_ids
    for rid, p in zip(ids, prompts):
        assert tokens[rid] == full_forward_greedy(m, p, n_new)


def test_the_guard_sees_host_syncs():
    """The guard is not blind: ``bool(t)``, ``int(t)`` and a boolean-mask gather register."""
    x = torch.arange(6.0)
    guard = HostSyncs()
    with guard:
        bool((x > 2).any())
        int(x.max())
        x[x > 2]
    assert len(guard.seen) == 3, guard.seen


def _greedy_run(eng: Engine, prompts, n_new: int, logits: dict) -> dict:
    ids = [eng.add_request(p, greedy(n_new)) for p in prompts]
    tokens = {rid: [] for rid in ids}
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[rid] for rid in ids]


def test_bucketed_decode_rows_equal_the_eager_step(model):
    """The fixed-shape step (rows padded by repeating the last one, block tables padded to a
    power of two), run eagerly, gives the eager step's tokens, and its logits up to the rounding
    of reductions over a different number of (masked) cache positions."""
    prompts = prompts_of((9, 21, 14), seed=12)
    ref_logits, got_logits = {}, {}
    ref = Engine(
        model,
        EngineConfig(block_size=8, enable_prefix_cache=False),
        on_logits=lambda rid, x: ref_logits.setdefault(rid, []).append(x.clone()),
    )
    eng = Engine(
        model,
        EngineConfig(block_size=8, enable_prefix_cache=False),
        on_logits=lambda rid, x: got_logits.setdefault(rid, []).append(x.clone()),
    )
    eng.runner.decode_step = StaticDecodeStep(
        model,
        eng.cache.blocks,
        eng.cache.slots,
        eng.runner.layer_pools,
        max_batch=16,
        max_blocks=64,
        compile=False,
    )
    assert _greedy_run(eng, prompts, 6, got_logits) == _greedy_run(ref, prompts, 6, ref_logits)
    assert eng.runner.decode_step.shapes == {(4, 4)}  # 3 rows -> 4, 2-4 blocks -> 4
    for a, b in zip(ref_logits.values(), got_logits.values()):
        for x, y in zip(a, b):
            assert_close(y, x, atol=1e-5, rtol=0, what="bucketed decode logits")


def test_buckets_are_powers_of_two_within_the_cap():
    assert [bucket(n, 16) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert bucket(12, 10) == 12 and bucket(7, 6) == 7  # never below n


@pytest.mark.parametrize("which", ["k3", "kimi-linear"])
def test_compiled_decode_step_equals_eager_without_recompiles(model, kimi_linear_model, which):
    """``EngineConfig(compile=True)``: one Inductor graph for the (4 rows, 4 blocks) bucket serves
    every decode step (no recompilation after the first), greedy tokens equal the eager engine's
    and every sampled row's logits agree within 1e-5 (fp32; 2e-5 with AttnRes). k3-test-tiny has
    Block AttnRes (the compiled step's direct per-site mixtures against the eager two-phase form,
    whose logits, |x| <= 2.8 here, differ by up to 1.3e-5: the compiled two-phase form alone,
    with Inductor's reassociated reductions, already differs by 9.8e-6), kimi-linear-tiny the
    plain residual stream."""
    from torch._dynamo.utils import counters

    m = model if which == "k3" else kimi_linear_model
    prompts = prompts_of((9, 21, 14), seed=13, vocab=m.config.vocab_size)
    n_new = 8
    cfg = dict(block_size=8, enable_prefix_cache=False, max_num_seqs=4)
    ref_logits, got_logits = {}, {}
    ref = Engine(
        m,
        EngineConfig(**cfg),
        on_logits=lambda rid, x: ref_logits.setdefault(rid, []).append(x.clone()),
    )
    ref_tokens = _greedy_run(ref, prompts, n_new, ref_logits)

    torch._dynamo.reset()
    counters.clear()
    eng = Engine(
        m,
        EngineConfig(**cfg, compile=True),
        on_logits=lambda rid, x: got_logits.setdefault(rid, []).append(x.clone()),
    )
    ids = [eng.add_request(p, greedy(n_new)) for p in prompts]
    tokens = {rid: [] for rid in ids}
    graphs = []
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
        graphs.append(counters["stats"]["unique_graphs"])
    assert [tokens[rid] for rid in ids] == ref_tokens
    assert eng.runner.decode_step.shapes == {(4, 4)}
    # step 1 prefills (eager), step 2 compiles the bucket, the remaining decode steps reuse it
    assert graphs == [0] + [1] * (n_new - 1), graphs
    assert counters["recompiles"] == {} and not counters["graph_break"]
    for a, b in zip(ref_logits.values(), got_logits.values()):
        assert len(a) == len(b) == n_new
        for x, y in zip(a, b):
            assert_close(
                y, x, atol=2e-5 if which == "k3" else 1e-5, rtol=0, what="compiled decode logits"
            )


def _changing_batch_run(eng: Engine, prompts, logits: dict, buckets: list | None = None) -> list:
    """Greedy decode where the batch shrinks and grows again: three requests, the first finishes
    after 3 tokens, then a fourth joins; ``buckets`` collects each decode step's (Bp, MB)."""
    if buckets is not None:
        run = eng.runner.decode_step._run
        eng.runner.decode_step._run = lambda shape, *a: (buckets.append(shape), run(shape, *a))[1]
    ids = [eng.add_request(p, greedy(n)) for p, n in zip(prompts[:3], (3, 12, 12))]
    tokens = {rid: [] for rid in ids}
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            if out.request_id == ids[0] and out.finished:
                ids.append(eng.add_request(prompts[3], greedy(9)))
                tokens[ids[-1]] = []
    return [tokens[rid] for rid in ids]


def test_compiled_decode_step_follows_the_batch_bucket(kimi_linear_model):
    """After a bucket's first step the compiled step skips Dynamo's full guard check; a batch
    that shrinks to a new bucket still compiles its own graph, and one that grows back runs the
    first bucket's graph again: tokens equal the eager engine's, logits within 1e-5 (fp32)."""
    m = kimi_linear_model
    prompts = prompts_of((9, 21, 14, 10), seed=14, vocab=m.config.vocab_size)
    cfg = dict(block_size=8, enable_prefix_cache=False, max_num_seqs=4)
    ref_logits, got_logits = {}, {}
    ref = Engine(
        m,
        EngineConfig(**cfg),
        on_logits=lambda rid, x: ref_logits.setdefault(rid, []).append(x.clone()),
    )
    ref_tokens = _changing_batch_run(ref, prompts, ref_logits)
    torch._dynamo.reset()
    eng = Engine(
        m,
        EngineConfig(**cfg, compile=True),
        on_logits=lambda rid, x: got_logits.setdefault(rid, []).append(x.clone()),
    )
    buckets: list = []
    assert _changing_batch_run(eng, prompts, got_logits, buckets) == ref_tokens
    rows = [bp for bp, _ in buckets]
    # 3 rows (bucket 4), 2 rows (bucket 2), then 3 rows again: bucket 4 after bucket 2
    assert rows[:2] == [4, 4] and 2 in rows and 4 in rows[rows.index(2) :], rows
    assert {k[0] for k in eng.runner.decode_step.checked} == set(buckets)
    for a, b in zip(ref_logits.values(), got_logits.values()):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_close(y, x, atol=1e-5, rtol=0, what="compiled decode logits")


def test_one_switch_chooses_the_decode_step(model, monkeypatch, caplog):
    """``decode_backend``: the override (``use_backend`` > ``OPENK3_DECODE_BACKEND``) wins over
    ``EngineConfig.compile``; a compile request without a compiler falls back to the reference
    with a warning, a forced ``compiled`` without one is an error naming the variable."""
    from openk3.engine import decode_step
    from openk3.ops.backends import use_backend

    cpu = torch.device("cpu")
    monkeypatch.delenv("OPENK3_DECODE_BACKEND", raising=False)
    monkeypatch.setattr(decode_step, "compiler_missing", lambda device: None)
    assert [decode_step.decode_backend(c, cpu) for c in (False, True)] == ["reference", "compiled"]
    monkeypatch.setenv("OPENK3_DECODE_BACKEND", "reference")
    assert decode_step.decode_backend(True, cpu) == "reference"
    # the engine follows the switch: compile=True but the environment forces the reference
    assert Engine(model, EngineConfig(block_size=8, compile=True)).runner.decode_step is None
    monkeypatch.setenv("OPENK3_DECODE_BACKEND", "compiled")
    assert decode_step.decode_backend(False, cpu) == "compiled"
    with use_backend("decode", "reference"):
        assert decode_step.decode_backend(True, cpu) == "reference"
    monkeypatch.setenv("OPENK3_DECODE_BACKEND", "fast")
    with pytest.raises(
        ValueError,
        match=r"OPENK3_DECODE_BACKEND='fast': unknown; known: \['compiled', 'reference'\]",
    ):
        Engine(model, EngineConfig(block_size=8))

    monkeypatch.setattr(
        decode_step, "compiler_missing", lambda device: "no C++ compiler for Inductor (test)"
    )
    monkeypatch.delenv("OPENK3_DECODE_BACKEND")
    with caplog.at_level("WARNING", logger="openk3.engine"):
        assert decode_step.decode_backend(True, cpu) == "reference"
    assert (
        "compile=True: no C++ compiler for Inductor (test); decode steps run the eager reference"
        in caplog.text
    )
    monkeypatch.setenv("OPENK3_DECODE_BACKEND", "compiled")
    with pytest.raises(
        ValueError, match=r"OPENK3_DECODE_BACKEND=compiled \(or use_backend\): no C\+\+ compiler"
    ):
        decode_step.decode_backend(False, cpu)


def test_this_machine_can_compile():
    """The compiled-step tests above need Inductor's C++ compiler; say so plainly when it is gone."""
    from openk3.engine.decode_step import compiler_missing

    assert compiler_missing(torch.device("cpu")) is None


def test_site_queries_follow_in_place_weight_changes(model):
    """The decode step's cached AttnRes pseudo-queries are the model's own, are reused while the
    weights stay, and are recomputed after an in-place write to one of them."""
    m = perturb(build_model(model.config, seed=3), 1.0).eval()  # AttnRes projections start at 0
    assert m.config.use_attn_res
    step = StaticDecodeStep(m, None, None, [], max_batch=1, max_blocks=1, compile=False)
    first = step.site_queries()
    assert torch.equal(first, m.model._site_queries())
    assert step.site_queries() is first
    w = m.model.layers[1].mlp_res_norm.weight
    with torch.no_grad():
        w.mul_(2.0)
    again = step.site_queries()
    assert again is not first
    assert torch.equal(again, m.model._site_queries())
    assert not torch.allclose(again[3], first[3])  # row 2l+1 = layer 1's FFN site
