"""Long prompts through the engine equal the plain full forward (fp32 correctness gate of the fast
prefill path: 2,048-token forwards that capture the KDA state at the 512-token snapshot points they
run past, the tiled latent attention over the paged pool, the KDA chunk form and its in-place state
pass), on the shipped model with an agent-shaped prompt well past 8K tokens."""

from __future__ import annotations

import pytest
import torch

from openk3.bench.agent_prompt import claude_code_like_request, next_turn, prompt_ids
from openk3.engine import Engine, EngineConfig, SamplingParams
from openk3.engine.prefix_cache import extend_keys
from tests.conftest import assert_close
from tests.engine.common import full_forward_logits


@pytest.fixture(scope="module")
def shipped():
    from openk3.pretrained import load_pretrained
    from openk3.tokenizer import load_tokenizer

    return load_pretrained("openk3-tiny", dtype=torch.float32).eval(), load_tokenizer("openk3-tiny")


def _first_logits(engine: Engine, prompts: list[list[int]]) -> tuple[dict, dict]:
    logits: dict = {}
    engine.on_logits = lambda rid, x: logits.setdefault(rid, x.clone())
    ids = [engine.add_request(p, SamplingParams(max_tokens=1, temperature=0.0)) for p in prompts]
    usage = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                usage[o.request_id] = o.usage
    return [logits[r] for r in ids], [usage[r] for r in ids]


def _assert_equal_logits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert err <= 2e-5 * max(1.0, scale), f"{what}: max abs err {err:.3g} (logits scale {scale:.3g})"
    assert int(got.argmax()) == int(want.argmax()), what


def test_agent_prompt_prefill_equals_the_full_forward(shipped):
    model, tok = shipped
    request = claude_code_like_request(scale=0.45)
    ids = prompt_ids(request, tok)
    assert len(ids) > 9000  # past the old 8,192-token context, many chunks and key tiles
    eng = Engine(model, EngineConfig(max_num_seqs=2))
    (got,), (usage,) = _first_logits(eng, [ids])
    assert usage.prompt_tokens == len(ids) and usage.cached_tokens == 0
    _assert_equal_logits(got, full_forward_logits(model, ids), "cold chunked prefill")
    # The next turn of the session resumes from the prompt-end snapshot and computes only the rest.
    ids2 = prompt_ids(next_turn(request, "Hello! What should I do?", "List the files."), tok)
    assert ids2[: len(ids)] == ids
    (got2,), (usage2,) = _first_logits(eng, [ids2])
    assert usage2.cached_tokens == len(ids)
    _assert_equal_logits(got2, full_forward_logits(model, ids2), "second turn through the prefix cache")


def test_batched_rows_of_different_lengths_equal_the_full_forward(shipped):
    # Two long prompts prefilled together (padded rows: different lengths and histories per row).
    model, _ = shipped
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 7900, (n,), generator=g).tolist() for n in (3000, 1777)]
    eng = Engine(model, EngineConfig(max_num_seqs=2, prefill_chunk=1024, enable_prefix_cache=False))
    got, _ = _first_logits(eng, prompts)
    for p, x in zip(prompts, got):
        _assert_equal_logits(x, full_forward_logits(model, p), f"{len(p)}-token row of a batched prefill")


def test_2048_token_forwards_equal_512_token_forwards(shipped):
    # The default 2,048-token forwards against forwards cut at every 512-token snapshot point:
    # the same prompt-end logits and the same stored snapshots (KDA state and conv tails at
    # 512, 1024, 1536 and 2560 captured inside the forwards), and a prompt that shares 1,700 tokens
    # resumes from the snapshot at 1,536 with the logits of the full forward.
    model, _ = shipped
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 7900, (2600,), generator=g).tolist()
    wide = Engine(model, EngineConfig(max_num_seqs=2))
    narrow = Engine(model, EngineConfig(max_num_seqs=2, prefill_chunk=512))
    assert wide.config.prefill_chunk == 2048 and wide.cache.prefix.interval == 512
    rows, forward = [], wide.runner.forward
    wide.runner.forward = lambda pieces, need: rows.extend((p.start, p.end, p.marks) for p in pieces) or forward(
        pieces, need
    )
    (got,), _ = _first_logits(wide, [prompt])
    assert rows == [(0, 2048, (512, 1024, 1536)), (2048, 2600, (2560,))]
    wide.runner.forward = forward
    (want,), _ = _first_logits(narrow, [prompt])
    _assert_equal_logits(got, want, "2,048- vs 512-token forwards")
    keys: list = []
    extend_keys(keys, prompt, wide.cache.block_size)
    for position in (512, 1024, 1536, 2048, 2560):
        a, b = (e.cache.snapshots.get(keys[position // e.cache.block_size - 1]) for e in (wide, narrow))
        assert a is not None and b is not None, f"snapshot at {position}"
        for pool in ("conv", "recurrent"):
            x = getattr(wide.cache.snapshots, pool)[:, a.row]
            y = getattr(narrow.cache.snapshots, pool)[:, b.row]
            # The layers below ran as GEMMs of other shapes (2,048 vs 512 rows), so the states differ
            # by fp32 rounding only, which scales with the states' size: with the shipped weights
            # (|state| up to ~14) measured up to 1.7e-5, 1.6e-6 of the largest value; a wrong chunk
            # index or row mapping gives errors of the states' own size.
            scale = float(y.abs().max())
            assert_close(x, y, atol=1e-5 * scale, rtol=1e-5, what=f"{pool} state at {position}")
    follow = prompt[:1700] + torch.randint(0, 7900, (50,), generator=g).tolist()
    (got,), (usage,) = _first_logits(wide, [follow])
    assert usage.cached_tokens == 1536
    _assert_equal_logits(got, full_forward_logits(model, follow), "resumed at a captured snapshot")
