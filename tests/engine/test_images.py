"""Image requests in the engine: the prefill feeds the projected features at the pad positions
(chunked prefill may split a pad run) and equals an uncached full forward of the multimodal model;
prefix-cache keys include the image content, so identical ids with different images never share
image positions while the same image is reused."""

from __future__ import annotations

from collections import deque

import pytest
import torch

import openk3
from openk3.engine import Engine, EngineConfig, ImageInput
from openk3.pretrained import build_model
from openk3.vision import vision_preset
from tests.conftest import assert_close
from tests.engine.common import assert_idle, greedy
from tests.conftest import perturb

PAD = 277  # k3-test-tiny media_placeholder_token_id
GRID = (1, 4, 6)  # 24 patches -> 6 image tokens
START, N_IMG = 10, 6


@pytest.fixture(scope="module")
def mm_model():
    cfg = openk3.preset("k3-test-tiny").as_k3_wrapper()
    cfg.wrapper["vision_config"] = vision_preset("tiny").to_dict()
    return perturb(build_model(cfg, seed=1), 1.0).eval()


def prompt(n=27, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (n,), generator=g).tolist()  # never the pad id
    ids[START:START + N_IMG] = [PAD] * N_IMG
    return ids


def pixels(seed):
    return torch.randn(24, 3, 14, 14, generator=torch.Generator().manual_seed(100 + seed))


def image(seed):
    return ImageInput(range(START, START + N_IMG), f"image-{seed}", pixels(seed), GRID)


@torch.no_grad()
def reference(model, ids, seed, n):
    """Greedy tokens and per-step logits [n, V] from uncached full forwards with the image."""
    seq, toks, logits = list(ids), [], []
    for _ in range(n):
        x = model(torch.tensor([seq]), pixel_values=pixels(seed), grid_thws=[GRID]).logits[0, -1].float()
        logits.append(x)
        toks.append(int(x.argmax()))
        seq.append(toks[-1])
    return toks, torch.stack(logits)


def generate(eng, ids, im, n=4):
    log: list = []
    eng.on_logits = lambda rid, x: log.append(x.clone())
    rid = eng.add_request(ids, greedy(n), mm_inputs=[im])
    toks, last = [], None
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id == rid
            toks += out.new_token_ids
            last = out
    return toks, last.usage, torch.stack(log)


@pytest.mark.parametrize("chunk,prefix", [(512, False), (4, False), (3, True)])
def test_prefill_with_image_matches_full_forward(mm_model, chunk, prefix):
    # chunk 4 / 3: the 6-pad run at 10..15 is split across prefill steps (and snapshot cuts)
    ids = prompt()
    want_toks, want_logits = reference(mm_model, ids, 0, 4)
    eng = Engine(mm_model, EngineConfig(block_size=4, prefill_chunk=chunk, snapshot_interval=4,
                                        enable_prefix_cache=prefix, max_num_seqs=2))
    toks, usage, logits = generate(eng, ids, image(0))
    assert toks == want_toks
    assert usage.prompt_tokens == len(ids) and usage.cached_tokens == 0
    assert_close(logits, want_logits, atol=1e-5, what=f"logits, prefill chunk {chunk}")
    # precomputed features instead of pixels: the same computation without the tower
    with torch.no_grad():
        feats = mm_model.encode_images(pixels(0), [GRID])
    pre = ImageInput(range(START, START + N_IMG), "image-0-features", features=feats)
    toks2, _, logits2 = generate(eng, ids, pre)
    assert toks2 == want_toks
    assert_close(logits2, want_logits, atol=1e-5, what="logits from precomputed features")
    assert_idle(eng)


def test_prefix_cache_never_shares_image_positions(mm_model):
    ids = prompt(seed=1)
    eng = Engine(mm_model, EngineConfig(block_size=4, snapshot_interval=4, max_num_seqs=2))
    _, u0, _ = generate(eng, ids, image(0))
    assert u0.cached_tokens == 0
    before = eng.stats()["prefix_cache"]["mla"]["hits"]
    # same ids, another image: only the blocks wholly before the pad run (positions < 8) are reused
    toks, u1, logits = generate(eng, ids, image(1))
    assert u1.cached_tokens == 8
    assert eng.stats()["prefix_cache"]["mla"]["hits"] - before == 8  # block [8, 12) holds pads: no match
    want_toks, want_logits = reference(mm_model, ids, 1, 4)
    assert toks == want_toks
    assert_close(logits, want_logits, atol=1e-5, what="logits after a text-only prefix hit")
    # the same image again: the whole prompt is served from the cache (prompt-end snapshot)
    toks, u2, logits = generate(eng, ids, image(0))
    assert u2.cached_tokens == len(ids)
    want_toks, want_logits = reference(mm_model, ids, 0, 4)
    assert toks == want_toks
    assert_close(logits, want_logits, atol=1e-5, what="logits after a full image hit")
    # same pixels under another content hash: treated as another image (no reuse of its blocks)
    _, u3, _ = generate(eng, ids, ImageInput(range(START, START + N_IMG), "other-name", pixels(0), GRID))
    assert u3.cached_tokens == 8
    assert_idle(eng)


def test_text_only_requests_are_unaffected_by_image_entries(mm_model):
    # identical ids without image input (pads as plain tokens) must not hit the image entries
    ids = prompt(seed=2)
    eng = Engine(mm_model, EngineConfig(block_size=4, snapshot_interval=4, max_num_seqs=2))
    generate(eng, ids, image(0))
    rid = eng.add_request(ids, greedy(1))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].request_id == rid and outs[-1].usage.cached_tokens == 8


def test_image_input_validation(mm_model):
    eng = Engine(mm_model, EngineConfig(block_size=4))
    ids = prompt()
    cases = [
        ([ImageInput(range(START - 1, START + N_IMG - 1), "h", pixels(0), GRID)], "media pad id"),
        ([ImageInput(range(START, START + N_IMG), "h", pixels(0), (1, 4, 4))], "pixel_values"),
        ([ImageInput(range(START, START + 4), "h", pixels(0)[:4], (1, 2, 2))], "image tokens"),
        ([ImageInput(range(START, START + N_IMG), "h", features=torch.zeros(6, 3))], "features"),
        ([ImageInput(range(START, START + N_IMG), "", pixels(0), GRID)], "content_hash"),
        ([image(0), image(1)], "overlaps"),
        ([ImageInput(range(20, 40), "h", features=torch.zeros(20, 64))], "outside"),
    ]
    for mm, needle in cases:
        with pytest.raises(ValueError, match=needle):
            eng.add_request(ids, greedy(1), mm_inputs=mm)
    text = Engine(build_model(openk3.preset("k3-test-tiny")), EngineConfig(block_size=4))
    with pytest.raises(ValueError, match="no vision tower"):
        text.add_request(ids, greedy(1), mm_inputs=[image(0)])
    assert not eng.has_unfinished() and not text.has_unfinished()


BIG = (1, 24, 32)  # 768 patches -> 192 image tokens: many tower pieces under a small budget
BIG_N = 192


def big_request(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (BIG_N + 12,), generator=g).tolist()
    ids[4:4 + BIG_N] = [PAD] * BIG_N
    pv = torch.randn(24 * 32, 3, 14, 14, generator=torch.Generator().manual_seed(200 + seed))
    return ids, ImageInput(range(4, 4 + BIG_N), f"big-{seed}", pv, BIG)


def test_decodes_proceed_while_a_large_image_is_encoded(mm_model):
    """The tower runs in pieces between steps: while a large image is being encoded (its request
    in the encoding queue, holding no cache blocks), a decoding request gets one token every
    step; the image request's tokens equal those of an engine that encodes in one piece."""
    ids, im = big_request()
    whole = Engine(mm_model, EngineConfig(block_size=4, max_num_seqs=2, encoder_step_flops=2**60))
    rid = whole.add_request(ids, greedy(3), mm_inputs=[im])
    want = []
    steps_whole = 0
    while whole.has_unfinished():
        steps_whole += 1
        want += [t for o in whole.step() for t in o.new_token_ids]
    eng = Engine(mm_model, EngineConfig(block_size=4, max_num_seqs=2, encoder_step_flops=2**20))
    text = eng.add_request(prompt(seed=3)[:8], greedy(200))
    eng.step()  # the text request is prefilled and decoding
    rid = eng.add_request(ids, greedy(3), mm_inputs=[im])
    encoding_steps, got = 0, []
    while eng.stats()["encoding"]:
        assert eng.check_consistency() == []
        outs = {o.request_id: o for o in eng.step()}
        encoding_steps += 1
        assert len(outs[text].new_token_ids) == 1 and rid not in outs
    assert encoding_steps >= 10
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                got += o.new_token_ids
                if o.finished:
                    eng.abort(text)
    assert got == want and steps_whole <= 4
    assert_idle(eng)


@pytest.mark.parametrize("how", ["abort", "tower error"])
def test_abort_or_failure_during_encoding_frees_everything(mm_model, how):
    ids, im = big_request(1)
    eng = Engine(mm_model, EngineConfig(block_size=4, max_num_seqs=2, encoder_step_flops=2**20))
    text = eng.add_request(prompt(seed=4)[:8], greedy(30))
    rid = eng.add_request(ids, greedy(3), mm_inputs=[im])
    eng.step()
    eng.step()
    req = eng._requests[rid]
    assert req.tower_job is not None and eng.stats()["encoding"] == 1  # partially encoded
    if how == "abort":
        eng.abort(rid)
    else:
        mlp = mm_model.vision_tower.encoder.blocks[1].mlp

        def boom(*_):
            raise RuntimeError("injected tower failure")
        hook = mlp.register_forward_pre_hook(boom)
    try:
        outs = []
        while eng.has_unfinished():
            outs += eng.step()
            assert eng.check_consistency() == []
    finally:
        if how != "abort":
            hook.remove()
    final = {o.request_id: o for o in outs if o.finished}
    assert final[rid].finish_reason == ("abort" if how == "abort" else "error")
    assert how == "abort" or "injected tower failure" in final[rid].error
    assert final[text].finish_reason == "length" and final[text].usage.completion_tokens == 30
    assert req.tower_job is None and req.images == [] and eng.stats()["encoding"] == 0
    assert eng._encoding == deque() and eng.check_consistency() == []
    assert_idle(eng)
