"""Vision stage of the default model: synthetic image data, image batches, the recipe end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import openk3

from openk3.datasets.vision_data import (QUESTION_TYPES, eval_image_items, image_items, is_held_out_image,
                                      normalise_answer, score_image)
from openk3.train.vision_loader import ImageSFTLoader, image_chat_document

TOK = str(Path(openk3.__file__).parent / "shipped" / "openk3-tiny")  # the shipped tokenizer
TINY_LM = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "moe_intermediate_size": 32,
           "routed_expert_hidden_size": 32, "n_routed_experts": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
           "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "linear_head_dim": 16}
TINY_VIT = {"vt_num_hidden_layers": 1, "vt_hidden_size": 32, "mm_hidden_size": 32, "vt_intermediate_size": 64,
            "qkv_hidden_size": 32}


def _tok():
    from openk3.tokenizer import load_tokenizer

    return load_tokenizer(TOK)


def test_generator_is_deterministic_and_held_out_is_disjoint():
    a, b = image_items(5, 40), image_items(5, 40)
    assert [json.dumps(x.request) for x in a] == [json.dumps(x.request) for x in b]
    assert json.dumps(image_items(6, 5)[0].request) != json.dumps(a[0].request)
    ev = eval_image_items(0, 12)
    assert all(is_held_out_image(e) for e in ev) and not any(is_held_out_image(x) for x in a)
    assert not {e.expected["key"] for e in ev} & {x.expected["key"] for x in image_items(0, 300)}
    assert [e.expected["type"] for e in ev] == list(QUESTION_TYPES) * 2
    for it in a + ev:  # the reference answers score 100 %, a damaged one 0
        assert score_image(it, it.reference)["correct"]
        assert not score_image(it, {"content": it.reference["content"] + "x"})["correct"]
    assert normalise_answer(" Red.\n") == "red"


def test_image_rows_pads_labels_and_image_order():
    from openk3.chat_format import render_assistant_output
    from openk3.vision.preprocess import process_image

    tok = _tok()
    items = image_items(3, 9)
    docs = [image_chat_document(it.conversation(), tok) for it in items]
    loader = ImageSFTLoader(docs, 400, shuffle=False, pad_id=tok.pad_id)
    row = loader.next_batch()
    ids, labels, cu = row["input_ids"][0], row["labels"][0], row["cu_seqlens"]
    k = 0
    while sum(len(d.ids) for d in docs[:k + 1]) <= 400:
        k += 1
    starts = [0]
    for d in docs[:k]:
        starts.append(starts[-1] + len(d.ids))
    assert cu.tolist() == (starts + [400] if starts[-1] < 400 else starts)
    grid = row["grid_thws"]
    assert grid.shape == (k, 3) and int((ids == tok.media_pad_id).sum()) == int((grid[:, 1] * grid[:, 2] // 4).sum())
    want = torch.cat([process_image(d.images[0]).pixel_values for d in docs[:k]])
    assert torch.equal(row["pixel_values"], want)  # images in pad order
    for j, (d, it) in enumerate(zip(docs[:k], items[:k])):
        seg_ids, seg_lab = ids[starts[j]:starts[j + 1]], labels[starts[j]:starts[j + 1]]
        pads = (seg_ids == tok.media_pad_id).nonzero().flatten()
        assert len(pads) == 16 and int(pads[-1] - pads[0]) == 15  # one contiguous run per image
        assert bool((seg_lab[pads] == -100).all())
        ref = render_assistant_output(it.reference, tok, thinking="reasoning_content" in it.reference)
        assert seg_lab[seg_lab != -100].tolist() == ref  # loss exactly on the assistant output
    assert bool((labels[starts[k]:] == -100).all()) and bool((ids[starts[k]:] == tok.pad_id).all())


def test_image_loader_resume_is_exact():
    tok = _tok()
    docs = [image_chat_document(it.conversation(), tok) for it in image_items(4, 10)]
    a = ImageSFTLoader(docs, 400, seed=1, pad_id=tok.pad_id)
    for _ in range(7):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    b = ImageSFTLoader(docs, 400, seed=1, pad_id=tok.pad_id)
    b.load_state_dict(state)
    for _ in range(3):
        x, y = a.next_batch(), b.next_batch()
        assert x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x)


def _text_ckpt(tmp_path, **overrides) -> str:
    from openk3.pretrained import build_model
    from openk3.recipes import RunConfig
    from openk3.recipes.default_model_vision import VisionStageSettings, vision_model_config

    run = RunConfig("t", "openk3-tiny", lambda run, split: None, 1,
                    settings=VisionStageSettings(tokenizer_dir=TOK, model_overrides={**TINY_LM, **overrides}))
    cfg = vision_model_config(run)
    cfg.wrapper = None  # the text model of the same LM
    model = build_model(cfg, seed=5)
    model.save_pretrained(str(tmp_path / "text"))
    return str(tmp_path / "text")


def test_vision_stage_trains_from_text_ckpt_exports_and_resumes(tmp_path):
    from openk3.export import _quantized_reference, export_model
    from openk3.pretrained import load_pretrained
    from openk3.recipes import get_recipe
    from openk3.train.trainer import train

    torch.set_num_threads(1)
    text = _text_ckpt(tmp_path)
    extra = {"text_ckpt": text, "tokenizer_dir": TOK, "model_overrides": TINY_LM, "vision": TINY_VIT,
             "image_items": 6, "sft_items": 6, "eval_items": 2, "text_share": 0.5}
    run = get_recipe("default-model-vision", total_steps=3, warmup_steps=1, seq_len=256, eval_every=3, eval_batches=1,
                     ckpt_every=1, extra=extra)
    prepared = run.prepare(run, str(tmp_path / "x"), False)
    model, _, _ = prepared.build()
    src = load_pretrained(text)
    assert torch.equal(model.model.embed_tokens.weight, src.model.embed_tokens.weight)  # text weights loaded
    assert hasattr(model, "vision_tower") and model.config.media_placeholder_token_id == _tok().media_pad_id

    straight = train(run, tmp_path / "a", progress=False)
    train(run, tmp_path / "b", max_steps=2, progress=False)
    resumed = train(run, tmp_path / "b", resume=True, progress=False)
    wa, wb = load_pretrained(straight.checkpoint), load_pretrained(resumed.checkpoint)
    for (n, p), q in zip(wa.state_dict().items(), wb.state_dict().values()):
        assert torch.equal(p, q), n  # resume is exact, vision tower included

    info = export_model(straight.checkpoint, tmp_path / "export", tokenizer=TOK)
    exported = load_pretrained(info["out"], dtype=torch.float32)
    assert type(exported).__name__ == "K3ForConditionalGeneration"
    batch = ImageSFTLoader([image_chat_document(it.conversation(), _tok()) for it in eval_image_items(0, 2)], 256,
                           shuffle=False).next_batch()
    ref = _quantized_reference(wa, "mxfp4")
    with torch.no_grad():
        want = ref(batch["input_ids"], pixel_values=batch["pixel_values"], grid_thws=batch["grid_thws"]).logits
        got = exported(batch["input_ids"], pixel_values=batch["pixel_values"], grid_thws=batch["grid_thws"]).logits
    assert float((got - want).abs().max()) <= 1e-4


def test_vision_stage_takes_the_lm_shape_from_the_text_checkpoint(tmp_path):
    """A text run trained with ``model_overrides`` (here kv_lora_rank 24, not TINY_LM's 16) needs
    no repeat of them in the vision stage: the LM is the checkpoint's config, and its weights load."""
    from openk3.recipes import get_recipe

    text = _text_ckpt(tmp_path, kv_lora_rank=24)
    extra = {"text_ckpt": text, "tokenizer_dir": TOK, "vision": TINY_VIT, "image_items": 2, "sft_items": 2,
             "eval_items": 1}
    run = get_recipe("default-model-vision", total_steps=1, warmup_steps=0, seq_len=256, extra=extra)
    prepared = run.prepare(run, str(tmp_path / "x"), False)
    model, _, _ = prepared.build()
    cfg = model.config
    assert (cfg.kv_lora_rank, cfg.hidden_size, cfg.num_hidden_layers) == (24, 64, 4)
    assert model.config.media_placeholder_token_id == _tok().media_pad_id
    assert model.model.layers[-1].self_attn.kv_a_proj_with_mqa.weight.shape[0] == 24 + 8


def test_bad_text_ckpt_is_named_before_anything_runs(tmp_path, capsys):
    from openk3.cli import main

    for value in (None, "runs/does-not-exist", 5):
        rc = main(["train", "--recipe", "default-model-vision", "--out", str(tmp_path / "o"), "--no-progress",
                   "--set", "extra=" + json.dumps({"text_ckpt": value})])
        err = capsys.readouterr().err
        assert rc == 2 and "extra.text_ckpt" in err, (value, err)
    assert not (tmp_path / "o" / "checkpoints").exists()


def test_text_rows_carry_column_fact_drills(tmp_path):
    """``facts_share`` of the text rows are drill documents (every real token a target, column
    lines); ``facts_share`` 0 serves none; out-of-range values name the field."""
    from openk3.recipes import get_recipe
    from openk3.recipes.default_model_vision import settings, vision_data

    extra = {"text_ckpt": "unused", "tokenizer_dir": TOK, "model_overrides": TINY_LM, "vision": TINY_VIT,
             "image_items": 6, "sft_items": 12, "eval_items": 2, "text_share": 0.9, "facts_share": 0.5,
             "facts_items": 20}
    tok = _tok()

    def drills(extra, n=40):
        run = get_recipe("default-model-vision", seq_len=256, extra=extra)
        pad = run.model_config().pad_token_id
        data = vision_data(run, "train")
        out = 0
        for _ in range(n):
            b = data.next_batch()
            ids, labels = b["input_ids"][0], b["labels"][0]
            text = tok.decode([i for i in ids.tolist() if i < tok.vocab_size])
            out += ("ones: " in text or "tens: " in text) and bool((labels[ids != pad][:-1] != -100).all())
        return out

    assert 8 < drills(extra) < 28  # about 0.9 * 0.5 of 40 rows
    assert drills({**extra, "facts_share": 0.0}) == 0
    for field, bad in (("facts_share", 1.0), ("facts_items", 0)):
        with pytest.raises(ValueError, match=f"extra.{field}={bad}"):
            settings(get_recipe("default-model-vision", extra={**extra, field: bad}))


def test_text_rows_carry_long_harness_prompt_rows(tmp_path):
    """``long_share`` of the text rows are ``long_seq_len``-token rows: SFT conversations behind a
    harness system prompt, loss on assistant tokens only, the same rows on a rebuild; 0 serves
    none; out-of-range values name the field."""
    from openk3.datasets.harness import _SECTIONS
    from openk3.recipes import get_recipe
    from openk3.recipes.default_model_vision import settings, vision_data

    extra = {"text_ckpt": "unused", "tokenizer_dir": TOK, "model_overrides": TINY_LM, "vision": TINY_VIT,
             "image_items": 6, "sft_items": 12, "eval_items": 2, "text_share": 0.9, "facts_share": 0.0,
             "long_share": 0.5, "long_seq_len": 3000, "long_items": 6}
    tok = _tok()

    def rows(extra, n=40):
        run = get_recipe("default-model-vision", seq_len=256, extra=extra)
        pad = run.model_config().pad_token_id
        data = vision_data(run, "train")
        out = []
        for _ in range(n):
            b = data.next_batch()
            ids, labels = b["input_ids"][0], b["labels"][0]
            out.append(ids.shape[0])
            if ids.shape[0] == 3000:
                text = tok.decode([i for i in ids.tolist() if i < tok.vocab_size])
                assert any(s in text for s in _SECTIONS) and len(text) > 4000, text[:200]  # the harness prose
                real = labels[ids != pad]
                assert 0 < int((real != -100).sum()) < 0.2 * real.numel()  # assistant turns only
        return out

    got = rows(extra)
    assert set(got) == {256, 3000} and 8 < got.count(3000) < 30  # about 0.9 * 0.5 of 40 rows
    assert rows(extra) == got
    assert 3000 not in rows({**extra, "long_share": 0.0})
    for field, bad in (("long_share", 1.0), ("long_items", 0), ("long_seq_len", 2047)):
        with pytest.raises(ValueError, match=f"extra.{field}={bad}"):
            settings(get_recipe("default-model-vision", extra={**extra, field: bad}))


def test_lm_lr_scale_trains_the_language_model_slower_than_the_tower(tmp_path):
    """``lm_lr_scale`` 0.1: the tower and projector keep the peak LR, every language-model
    parameter (embeddings and head included) is in a group at a tenth of it; 1 (the shipped run)
    leaves one LR; values outside (0, 1] name the field."""
    from openk3.recipes import get_recipe
    from openk3.recipes.default_model_vision import settings

    text = _text_ckpt(tmp_path)
    extra = {"text_ckpt": text, "tokenizer_dir": TOK, "model_overrides": TINY_LM, "vision": TINY_VIT,
             "image_items": 2, "sft_items": 2, "eval_items": 1}

    def groups(scale):
        run = get_recipe("default-model-vision", total_steps=1, warmup_steps=0, seq_len=256,
                         extra={**extra, "lm_lr_scale": scale})
        _, opt, _ = run.prepare(run, str(tmp_path / "x"), False).build()
        return {n: g.get("lr", opt.defaults["lr"]) for g in opt.param_groups for n in g["param_names"]}

    lr = get_recipe("default-model-vision").lr
    slow = groups(0.1)
    assert slow["model.embed_tokens.weight"] == pytest.approx(lr * 0.1)
    assert slow["model.layers.0.self_attn.q_proj.weight"] == pytest.approx(lr * 0.1)
    assert slow["lm_head.weight"] == pytest.approx(lr * 0.1)
    tower = [n for n in slow if n.startswith(("vision_tower.", "mm_projector."))]
    assert tower and all(slow[n] == lr for n in tower)
    assert sum(v == lr for v in slow.values()) == len(tower)
    assert set(groups(1.0).values()) == {lr}
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=f"extra.lm_lr_scale={bad}"):
            settings(get_recipe("default-model-vision", extra={**extra, "lm_lr_scale": bad}))


def test_repeated_set_extra_merges_so_a_script_and_a_user_can_both_give_keys():
    """scripts/train_shipped_model.sh passes ``--set extra={"text_ckpt": ...}`` and then the
    user's VISION_ARGS (``--set extra={"lm_lr_scale": 0.2}``): both keys reach the recipe, the
    later value wins on a shared key, and any other field is still replaced whole."""
    from openk3.cli import _parse_overrides
    from openk3.recipes import get_recipe
    from openk3.recipes.default_model_vision import settings

    got = _parse_overrides(['extra={"text_ckpt": "a", "image_seed": 5}', 'extra={"lm_lr_scale": 0.2, "image_seed": 7}',
                            "lr=0.1", "lr=0.2"])
    assert got == {"extra": {"text_ckpt": "a", "image_seed": 7, "lm_lr_scale": 0.2}, "lr": 0.2}
    x = settings(get_recipe("default-model-vision", **got))
    assert (x.text_ckpt, x.image_seed, x.lm_lr_scale) == ("a", 7, 0.2)


def test_long_stage_continues_from_a_vision_checkpoint_with_long_rows(tmp_path):
    """``default-model-long`` (scripts/train_shipped_model.sh stage 3) starts from the vision
    stage's checkpoint: every tensor, tower and projector included, is the checkpoint's, not a
    fresh init; its text rows carry long harness-prompt rows by default, and a script's
    ``extra={"text_ckpt": ...}`` keeps them."""
    from openk3.pretrained import load_pretrained
    from openk3.recipes import get_recipe
    from openk3.recipes.default_model_vision import settings, vision_data
    from openk3.train.trainer import train

    torch.set_num_threads(1)
    small = {"tokenizer_dir": TOK, "model_overrides": TINY_LM, "vision": TINY_VIT, "image_items": 4,
             "sft_items": 4, "eval_items": 1}
    vision = train(get_recipe("default-model-vision", total_steps=2, warmup_steps=0, seq_len=256, eval_every=2,
                              eval_batches=1, extra={**small, "text_ckpt": _text_ckpt(tmp_path)}),
                   tmp_path / "vision", progress=False)

    run = get_recipe("default-model-long", extra={"text_ckpt": vision.checkpoint})
    x = settings(run)
    # the settings the shipped weights were trained with (MODEL_CARD.md, recipe step 7)
    assert (run.name, run.total_steps, run.lr, run.qat, run.seq_len) == ("default-model-long", 400, 1e-3, "mxfp4",
                                                                         1024)
    assert (x.text_ckpt, x.long_share, x.long_seq_len, x.text_share) == (vision.checkpoint, 0.25, 8192, 0.5)

    run = get_recipe("default-model-long", total_steps=1, warmup_steps=0, seq_len=256,
                     extra={**small, "text_ckpt": vision.checkpoint, "text_share": 0.9, "long_share": 0.5,
                            "long_seq_len": 3000, "long_items": 4})
    model, _, _ = run.prepare(run, str(tmp_path / "x"), False).build()
    src = load_pretrained(vision.checkpoint)
    got, want = model.state_dict(), src.state_dict()
    assert got.keys() == want.keys() and any(k.startswith("vision_tower.") for k in got)
    for k in want:
        assert torch.equal(got[k], want[k]), k  # the tower continues, it is not re-initialised
    data = vision_data(run, "train")
    lengths = [data.next_batch()["input_ids"].shape[1] for _ in range(30)]
    assert set(lengths) == {256, 3000}
