"""The ``images`` suite of ``openk3 eval``: scoring, per-type table, skip note, in-process path."""

from __future__ import annotations

from pathlib import Path

import torch

import openk3

from openk3.eval import IMAGE_SUITE, OracleModel, format_table, run_eval, run_image_eval
from openk3.datasets.vision_data import QUESTION_TYPES, eval_image_items

TOK = str(Path(openk3.__file__).parent / "shipped" / "openk3-tiny")  # the shipped tokenizer


class _Wrong:
    supports_images = True

    def chat(self, requests):
        return [{"role": "assistant", "content": "zebra"} for _ in requests]


class _TextOnly(_Wrong):
    supports_images = False

    def chat(self, requests):
        raise AssertionError("a text-only model must not get image requests")


def test_oracle_scores_100_wrong_scores_0_and_text_only_is_skipped():
    items = eval_image_items(0, 12)
    good = run_image_eval(OracleModel(items), n=2)  # n per question type
    assert good["n"] == 12 and good["accuracy"]["rate"] == 1.0 and good["accuracy"]["k"] == 12
    assert list(good["by_type"]) == list(QUESTION_TYPES) and {r["rate"] for r in good["by_type"].values()} == {1.0}
    assert all(r["n"] == 2 for r in good["by_type"].values())
    bad = run_image_eval(_Wrong(), n=1)
    assert bad["accuracy"]["rate"] == 0.0 and len(bad["by_type"]) == 6
    table = run_eval(_TextOnly(), n=6, suites=(IMAGE_SUITE,))
    assert "skipped" in table[IMAGE_SUITE] and "images           skipped" in format_table(table)
    assert "images           all           100.0% [75.8, 100.0] (12/12)" in format_table({IMAGE_SUITE: good})


def test_in_process_vision_checkpoint_returns_per_type_table(tmp_path):
    from openk3.eval import InProcessModel
    from openk3.pretrained import build_model
    from openk3.tokenizer import load_tokenizer
    from openk3.recipes import RunConfig
    from openk3.recipes.default_model_vision import VisionStageSettings, vision_model_config

    torch.set_num_threads(1)
    lm = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "moe_intermediate_size": 32,
          "routed_expert_hidden_size": 32, "n_routed_experts": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
          "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "linear_head_dim": 16}
    vit = {"vt_num_hidden_layers": 1, "vt_hidden_size": 32, "mm_hidden_size": 32, "vt_intermediate_size": 64,
           "qkv_hidden_size": 32}
    run = RunConfig("t", "openk3-tiny", lambda run, split: None, 1,
                    settings=VisionStageSettings(tokenizer_dir=TOK, model_overrides=lm, vision=vit))
    model = build_model(vision_model_config(run), seed=0)
    model.save_pretrained(str(tmp_path / "m"))
    load_tokenizer(TOK).save_pretrained(tmp_path / "m")
    m = InProcessModel(str(tmp_path / "m"), max_tokens=4)
    assert m.supports_images
    row = run_image_eval(m, n=1)
    assert row["n"] == 6 and list(row["by_type"]) == list(QUESTION_TYPES)
    assert 0.0 <= row["accuracy"]["rate"] <= 1.0
    # the same LM without a vision_config: a text-only model skips the suite
    from openk3.config import preset

    build_model(preset("openk3-tiny").replace(**lm), seed=0).save_pretrained(str(tmp_path / "text"))
    load_tokenizer(TOK).save_pretrained(tmp_path / "text")
    text = InProcessModel(str(tmp_path / "text"), max_tokens=4)
    assert not text.supports_images and "skipped" in run_image_eval(text, n=6)
