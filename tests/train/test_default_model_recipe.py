"""The ``default-model`` recipe end to end at toy sizes: corpus -> tokenizer -> pretraining ->
SFT with MXFP4 QAT, resumed mid-SFT; and the ``openk3-tiny`` preset's K3 structure."""

from __future__ import annotations

import json
import os

import pytest
import torch

from openk3.config import KDA, MLA, preset
from openk3.params import count_parameters
from openk3.recipes import get_recipe, synthetic_document
from openk3.train.trainer import train


def test_openk3_tiny_preset_has_every_k3_component():
    cfg = preset("openk3-tiny")
    n = cfg.num_hidden_layers
    assert cfg.layer_types == [MLA if (i + 1) % 4 == 0 or i == n - 1 else KDA for i in range(n)]
    assert cfg.layer_types[-1] == MLA and KDA in cfg.layer_types
    assert cfg.mlp_layer_types[0] == "dense" and set(cfg.mlp_layer_types[1:]) == {"sparse"}
    assert cfg.is_k3 and cfg.use_full_rank_gate and cfg.mla_use_output_gate and cfg.hidden_act == "situ"
    assert cfg.use_attn_res and n // cfg.attn_res_block_size >= 3
    assert cfg.n_shared_experts >= 1 and cfg.routed_expert_hidden_size < cfg.hidden_size  # LatentMoE
    assert cfg.moe_intermediate_size % 32 == 0 and cfg.routed_expert_hidden_size % 32 == 0  # MXFP4
    assert cfg.vocab_size == 8192 and cfg.bos_token_id == 8192 - 256 and cfg.pad_token_id == 8191
    counts = count_parameters(cfg)
    from openk3.recipes import default_model

    assert f"{counts['total']:,}" in default_model.__doc__ and f"{counts['active']:,}" in default_model.__doc__
    assert cfg.max_position_embeddings >= 262_144  # agent prompts fit the declared context


def _toy_corpus_dir(root) -> str:
    d = root / "texts"
    d.mkdir()
    for i in range(24):
        (d / f"doc{i:02d}.txt").write_text(" ".join(synthetic_document(3, i * 7 + j) for j in range(6)))
    return str(d)


def test_default_model_pipeline_runs_every_stage_and_resumes(tmp_path):
    torch.set_num_threads(1)
    extra = {
        "corpus_dir": str(tmp_path / "corpus"), "corpus_sources": [f"toy:MIT:{_toy_corpus_dir(tmp_path)}"],
        "tokenizer_dir": str(tmp_path / "tok"), "vocab_size": 600, "cache_dir": str(tmp_path / "cache"),
        "model_overrides": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
                            "moe_intermediate_size": 32, "routed_expert_hidden_size": 32, "n_routed_experts": 4,
                            "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                            "v_head_dim": 16, "linear_head_dim": 16},
        "pretrain_steps": 2, "pretrain_seq_len": 64, "pretrain_eval_every": 2, "sft_items": 12,
        "sft_eval_items": 1, "tokenizer_sft_items": 30, "pretrain_sft_share": 0.5, "induction_items": 20,
        "pretrain_copy_narrow_steps": 1, "pretrain_copy_steps": 0, "pretrain_copy_items": 20,
        "mid_steps": 2, "mid_facts_items": 4,
    }
    run = get_recipe("default-model", total_steps=2, seq_len=256, eval_every=2, eval_batches=1, ckpt_every=1,
                     extra=extra)
    assert run.qat == "mxfp4" and run.prepare is not None
    out = tmp_path / "run"
    first = train(run, out, max_steps=1, progress=False)  # stages 1-3, then one SFT step
    assert first.step == 1
    assert json.load(open(tmp_path / "corpus" / "manifest.json"))["totals"]["documents"] == 24
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    from openk3.tokenizer import load_tokenizer as _load

    assert len(_load(tmp_path / "tok").encode_text("12345")) == 5  # numbers split into digits
    pre = [json.loads(line) for line in open(out / "pretrain" / "metrics.jsonl")]
    assert [r["step"] for r in pre if r["kind"] == "train"] == [1, 2]
    assert any(r["kind"] == "eval" for r in pre)
    assert (out / "pretrain" / "DONE").is_file()
    pre_state = json.load(open(os.path.join((out / "pretrain" / "DONE").read_text().strip(), "trainer_state.json")))
    assert (pre_state["run"]["schedule"], pre_state["run"]["decay_fraction"]) == ("wsd", 0.2)  # the recipe's default
    # Mid-training (stage 3b) started from the pretraining checkpoint, on its own data and LR.
    mid = [json.loads(line) for line in open(out / "mid" / "metrics.jsonl")]
    assert [r["step"] for r in mid if r["kind"] == "train"] == [1, 2]
    mid_ckpt = (out / "mid" / "DONE").read_text().strip()
    mid_state = json.load(open(os.path.join(mid_ckpt, "trainer_state.json")))
    assert mid_state["run"]["init_from"] == (out / "pretrain" / "DONE").read_text().strip()
    assert (mid_state["run"]["lr"], mid_state["run"]["qat"], mid_state["run"]["total_steps"]) == (3e-3, None, 2)
    # Resume: the finished stages are reused (pretraining and mid-training untouched), SFT continues at step 2.
    mtime = os.path.getmtime(out / "pretrain" / "metrics.jsonl")
    mid_mtime = os.path.getmtime(out / "mid" / "metrics.jsonl")
    second = train(run, out, resume=True, progress=False)
    assert second.step == 2 and os.path.getmtime(out / "pretrain" / "metrics.jsonl") == mtime
    assert os.path.getmtime(out / "mid" / "metrics.jsonl") == mid_mtime
    sft = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in sft if r["kind"] == "train"] == [1, 2]
    assert all(r["loss"] == r["loss"] for r in sft if r["kind"] == "train")  # finite
    # The SFT run started from the pretrained weights and trained with MXFP4 QAT.
    from openk3.train.checkpointing import STATE_JSON

    record = json.load(open(os.path.join(second.checkpoint, STATE_JSON)))
    assert record["run"]["qat"] == "mxfp4" and record["run"]["prepare"] is None
    assert record["run"]["init_from"] == mid_ckpt
    from openk3.tokenizer import load_tokenizer

    assert record["run"]["model"]["vocab_size"] == load_tokenizer(tmp_path / "tok").vocab_size  # from the BPE
    assert any(f.endswith(".safetensors") for f in os.listdir(second.checkpoint))
    # The BPE's inputs are recorded; a later run whose tokenizer inputs differ (here: other
    # synthetic conversations) refuses the stale directory instead of training on its ids.
    inputs = json.load(open(tmp_path / "tok" / "tokenizer_training.json"))
    docs = json.load(open(tmp_path / "corpus" / "manifest.json"))["totals"]["train_documents"]
    assert inputs["documents"] == docs + 30 and len(inputs["sha256"]) == 64  # corpus + conversations
    changed = get_recipe("default-model", total_steps=2, seq_len=256, extra={**extra, "tokenizer_sft_items": 31})
    with pytest.raises(ValueError, match=r"extra.tokenizer_dir=.*documents: recorded \d+, now \d+"):
        train(changed, tmp_path / "run-changed", progress=False)


def test_default_model_rejects_unknown_extra_key():
    from openk3.recipes.default_model import settings

    with pytest.raises(ValueError, match="RunConfig.extra: unknown key 'pretrain_stepz'"):
        get_recipe("default-model", extra={"pretrain_stepz": 3})
    with pytest.raises(ValueError, match="extra.pretrain_steps='3': must be an integer"):
        get_recipe("default-model", pretrain_steps="3")  # a settings field by its own name (--set KEY=VALUE)
    assert settings(get_recipe("default-model", pretrain_steps=3)).pretrain_steps == 3


def test_cli_lists_the_recipe_and_rejects_bad_extra(capsys):
    from openk3.cli import main

    assert main(["train", "--list"]) == 0
    assert "default-model" in capsys.readouterr().out
    run = get_recipe("default-model", extra={"pretrain_steps": 5})
    assert run.to_dict()["prepare"] == "openk3.recipes.default_model:prepare_default_model"
    from openk3.recipes.default_model import settings

    assert settings(run).pretrain_steps == 5 and settings(run).vocab_size == 8192  # merged over defaults


def test_long_rows_and_pretraining_share_mix_deterministically(monkeypatch):
    from openk3.recipes import default_model
    from openk3.train.data import DocumentStore, PackedLoader, document_from_ids
    from openk3.train.mixed_data import MixedLoader
    from openk3.train.tokenizer_train import train_tokenizer

    tok = train_tokenizer([synthetic_document(5, i) for i in range(60)], 700, split_digits=True)
    monkeypatch.setattr(default_model, "_tokenizer", lambda run: tok)
    corpus = lambda run, split: PackedLoader(  # noqa: E731
        DocumentStore.from_documents([document_from_ids([9000 + i % 50 for i in range(400)])] * 4), run.seq_len, 1)
    monkeypatch.setattr(default_model, "corpus_data", corpus)
    run = get_recipe("default-model", seq_len=512, extra={"sft_items": 30, "long_share": 0.25, "long_seq_len": 6000,
                                                          "long_items": 8})
    data = default_model.sft_data(run, "train")
    assert isinstance(data, MixedLoader)
    rows = [data.next_batch()["input_ids"].shape[1] for _ in range(80)]
    assert set(rows) == {512, 6000} and 0.1 < rows.count(6000) / 80 < 0.45
    again = default_model.sft_data(run, "train")
    assert [again.next_batch()["input_ids"].shape[1] for _ in range(80)] == rows
    no_copy = {"pretrain_copy_narrow_steps": 0, "pretrain_copy_steps": 0}
    pre = default_model.pretrain_data(run.replace(extra={"sft_items": 30, "pretrain_sft_share": 0.5,
                                                        "pretrain_induction_share": 0.0, **no_copy}), "train")
    ids = [pre.next_batch()["input_ids"] for _ in range(40)]
    corpus_rows = sum(bool((x >= 9000).all()) for x in ids)
    assert 8 < corpus_rows < 32  # about half corpus, half SFT conversations
    with pytest.raises(ValueError, match="extra.long_share"):
        default_model.settings(run.replace(extra={"long_share": 1.5}))
    from openk3.train.mixed_data import CurriculumLoader

    cur = default_model.pretrain_data(run.replace(extra={"sft_items": 30, "pretrain_induction_share": 0.0,
                                                        "pretrain_copy_steps": 3, "pretrain_copy_items": 50,
                                                        "pretrain_copy_span": [2, 5], "pretrain_copy_narrow_steps": 2,
                                                        "pretrain_copy_narrow_ids": 16,
                                                        "pretrain_copy_narrow_span": [6, 6]}), "train")
    assert isinstance(cur, CurriculumLoader)
    rows = [cur.next_batch()["input_ids"] for _ in range(7)]
    # narrow copy docs, then copy docs over every ordinary id, then corpus
    assert [bool((x >= 9000).all()) for x in rows] == [False] * 5 + [True] * 2
    ordinary = min(tok.special_ids)
    for i, row in enumerate(rows[:5]):
        marks = set(row[row >= ordinary].tolist())
        assert marks <= {tok.bos_id, tok.eos_id, run.model_config().pad_token_id}
        assert int(row[0, 0]) == tok.bos_id or i not in (0, 2)  # each stage's first row starts a document
        spans = row[(row < ordinary)]
        assert bool((spans >= 256).all()) and (bool((spans < 256 + 16).all()) if i < 2 else int(spans.max()) >= 272)
    first = rows[0][0].tolist()
    assert first[:14] == [tok.bos_id, *first[1:7], *first[1:7], tok.eos_id]  # [BOS] span span [EOS], L = 6
    kept = default_model.pretrain_data(run.replace(extra={"sft_items": 30, "pretrain_induction_share": 0.0,
                                                         "pretrain_copy_share": 0.5, "pretrain_copy_items": 50,
                                                         "pretrain_copy_span": [2, 5], **no_copy}), "train")
    rows = [kept.next_batch()["input_ids"] for _ in range(40)]
    copy_rows = [x for x in rows if not bool((x >= 9000).all())]
    assert 8 < len(copy_rows) < 32  # about half the mixture's rows stay copy documents
    for row in copy_rows:  # [BOS] span span [EOS] documents over every ordinary id, nothing else
        assert set(row[row >= ordinary].tolist()) <= {tok.bos_id, tok.eos_id, run.model_config().pad_token_id}
        assert bool((row[row < ordinary] >= 256).all())
    assert int(max(int(x[x < ordinary].max()) for x in copy_rows)) >= 272
    with pytest.raises(ValueError, match="extra.pretrain_copy_share=1.0"):
        default_model.settings(run.replace(extra={"pretrain_copy_share": 1.0}))
    with pytest.raises(ValueError, match=r"extra.pretrain_copy_span=\[3, 2\]"):
        default_model.settings(run.replace(extra={"pretrain_copy_span": [3, 2]}))
    with pytest.raises(ValueError, match=r"extra.pretrain_copy_narrow_span=\[0, 2\]"):
        default_model.settings(run.replace(extra={"pretrain_copy_narrow_span": [0, 2]}))
    with pytest.raises(ValueError, match="extra.pretrain_copy_narrow_ids=1: must be an integer >= 2"):
        default_model.settings(run.replace(extra={"pretrain_copy_narrow_ids": 1}))
    with pytest.raises(ValueError, match="extra.pretrain_copy_steps=-2"):
        default_model.settings(run.replace(extra={"pretrain_copy_steps": -2}))
    with pytest.raises(ValueError, match="extra.long_seq_len=2047: must be an integer >= 2048"):
        default_model.settings(run.replace(extra={"long_seq_len": 2047}))
    assert default_model.settings(run.replace(extra={"long_seq_len": 2048})).long_seq_len == 2048
    with pytest.raises(ValueError, match="extra.pretrain_schedule='step': must be one of cosine, wsd"):
        default_model.settings(run.replace(extra={"pretrain_schedule": "step"}))
    with pytest.raises(ValueError, match="extra.pretrain_decay_fraction=1.5"):
        default_model.settings(run.replace(extra={"pretrain_decay_fraction": 1.5}))


def test_mid_training_mixes_column_fact_documents(monkeypatch):
    from openk3.recipes import default_model
    from openk3.train.data import DocumentStore, PackedLoader, document_from_ids
    from openk3.train.tokenizer_train import train_tokenizer

    tok = train_tokenizer([synthetic_document(5, i) for i in range(60)], 700, split_digits=True)
    monkeypatch.setattr(default_model, "_tokenizer", lambda run: tok)
    corpus = lambda run, split: PackedLoader(  # noqa: E731
        DocumentStore.from_documents([document_from_ids([9000 + i % 50 for i in range(400)])] * 4), run.seq_len, 1)
    monkeypatch.setattr(default_model, "corpus_data", corpus)
    extra = {"pretrain_induction_share": 0.0, "pretrain_copy_share": 0.0, "mid_facts_share": 0.6,
             "mid_facts_items": 30}
    run = get_recipe("default-model", seq_len=256, extra=extra)
    data = default_model.mid_data(run, "train")
    rows = [data.next_batch()["input_ids"] for _ in range(60)]
    facts = [x for x in rows if not bool((x >= 9000).all())]
    assert 24 < len(facts) < 48  # about 0.6 of the rows
    text = tok.decode(facts[0][0].tolist())
    assert " = " in text and ("tens: " in text or "ones: " in text)
    again = default_model.mid_data(run, "train")
    assert all(torch.equal(again.next_batch()["input_ids"], x) for x in rows)  # deterministic
    assert isinstance(default_model.mid_data(run, "eval"), PackedLoader)  # the corpus val split
    with pytest.raises(ValueError, match="split='dev'"):
        default_model.mid_data(run, "dev")
    with pytest.raises(ValueError, match="split='dev'"):
        default_model.pretrain_data(run, "dev")
    sft = default_model.sft_data(run.replace(extra={**extra, "sft_items": 30, "sft_facts_share": 0.5}), "train")
    rows = [sft.next_batch() for _ in range(40)]
    text = lambda r: tok.decode([i for i in r["input_ids"][0].tolist() if i < tok.vocab_size])  # noqa: E731
    pad = run.model_config().pad_token_id
    # drill rows: column lines, and a target on every real token (SFT rows mask their prompts)
    drill = [r for r in rows if ("ones: " in text(r) or "tens: " in text(r))
             and bool((r["labels"][0][r["input_ids"][0] != pad][:-1] != -100).all())]
    assert 10 < len(drill) < 30  # about half the SFT rows
    sft = default_model.sft_data(run.replace(extra={**extra, "sft_items": 30, "sft_facts_share": 0.0,
                                                     "sft_copy_share": 0.5, "pretrain_copy_items": 50}), "train")
    copies = 0
    ordinary = set(range(256, min(tok.special_ids))) | {tok.bos_id, tok.eos_id}
    for _ in range(40):
        r = sft.next_batch()
        ids, labels = r["input_ids"][0].tolist(), r["labels"][0].tolist()
        targets = sum(t != -100 for t in labels)
        # span-copy rows: ordinary ids only (no chat tokens), a target on every token but EOS's
        copies += set(ids) <= ordinary and targets >= len(ids) - ids.count(tok.eos_id) - 1
    assert 10 < copies < 30  # about half the SFT rows
    with pytest.raises(ValueError, match="extra.sft_copy_share=1.0"):
        default_model.settings(run.replace(extra={"sft_copy_share": 1.0}))
    with pytest.raises(ValueError, match="extra.sft_facts_share=1.0"):
        default_model.settings(run.replace(extra={"sft_facts_share": 1.0}))
    with pytest.raises(ValueError, match="extra.mid_facts_share=1.0"):
        default_model.settings(run.replace(extra={"mid_facts_share": 1.0}))
    with pytest.raises(ValueError, match="extra.mid_steps=-1"):
        default_model.settings(run.replace(extra={"mid_steps": -1}))


def test_sft_tool_reasoning_reaches_the_sft_rows(monkeypatch):
    from openk3.datasets import sft_data
    from openk3.recipes import default_model

    seen = []
    real = sft_data.sft_conversations
    monkeypatch.setattr(
        sft_data, "sft_conversations", lambda *a, **kw: seen.append(kw) or real(*a, **kw)
    )
    monkeypatch.setattr(default_model, "_tokenizer", lambda run: None)
    run = get_recipe("default-model", seq_len=256)
    assert default_model.settings(run).sft_tool_reasoning == "restate"  # the shipped model's data
    from openk3.train import data as train_data

    monkeypatch.setattr(
        train_data.DocumentStore, "from_conversations", classmethod(lambda cls, c, tok: c)
    )
    monkeypatch.setattr(train_data, "PackedLoader", lambda store, *a, **kw: store)
    named = run.replace(extra={"sft_items": 40, "sft_tool_reasoning": "name"})
    convs = default_model._sft_loader(named, default_model.settings(named), None, 256)
    assert seen[-1]["tool_reasoning"] == "name"
    calls = [
        m
        for c in convs
        for m in c["messages"]
        if m.get("tool_calls") and m.get("reasoning_content")
    ]
    assert calls and all(m["reasoning_content"].startswith("I will call ") for m in calls)
    with pytest.raises(ValueError, match="extra.sft_tool_reasoning"):
        default_model.settings(run.replace(extra={"sft_tool_reasoning": "prose"}))
