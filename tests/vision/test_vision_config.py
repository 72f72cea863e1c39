"""VisionConfig: official round trip (released config and the fixture's save_pretrained dict) and
validation errors that name the field."""

from __future__ import annotations

import json

import pytest

from openk3.vision import VisionConfig, vision_preset
from tests.conftest import shared_path


def test_released_vision_config_round_trips():
    d = json.loads(shared_path("k3", "config.json").read_text())["vision_config"]
    cfg = VisionConfig.from_dict(d)
    assert cfg.to_dict() == d
    assert cfg == vision_preset("kimi-k3")
    assert (cfg.head_dim, cfg.merged_hidden_size, cfg.merge_kernel_size) == (128, 4096, (2, 2))


def test_fixture_vision_config_round_trips_with_extras():
    d = json.loads(shared_path("fixtures", "k3-ref-tiny-a", "config.json").read_text())["vision_config"]
    cfg = VisionConfig.from_dict(d)
    assert cfg.to_dict() == d
    assert "id2label" in cfg.extra and cfg.vt_hidden_size == 16


@pytest.mark.parametrize("field,value,match", [
    ("qkv_hidden_size", 100, "qkv_hidden_size"),           # not divisible by 12 heads
    ("qkv_hidden_size", 12 * 6, "divisible by 4"),         # head dim 6: no 2D rope
    ("mm_hidden_size", 512, "mm_hidden_size"),
    ("merge_type", "sd2", "merge_type"),
    ("activation_func", "relu", "activation_func"),
    ("pos_emb_interpolation_mode", "nearest", "pos_emb_interpolation_mode"),
    ("patch_size", 0, "patch_size"),
    ("merge_kernel_size", [2, 2, 2], "merge_kernel_size"),
    ("attn_bias", "no", "attn_bias"),
])
def test_bad_values_name_the_field(field, value, match):
    d = vision_preset("kimi-k3").to_dict()
    d[field] = value
    with pytest.raises(ValueError, match=match):
        VisionConfig.from_dict(d)


def test_not_a_dict_and_unknown_preset():
    with pytest.raises(ValueError, match="vision_config"):
        VisionConfig.from_dict([1, 2])
    with pytest.raises(ValueError, match="unknown name"):
        vision_preset("huge")
