"""K3Config: official config round trip, 1-based layer lists, presets, validation errors."""

import json
import re

import pytest

from openk3.config import KDA, MLA, PRESETS, K3Config, preset
from tests.conftest import shared_path


def _load(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("rel", [("k3", "config.json"), ("fixtures", "k3-ref-tiny-a", "config.json")])
def test_official_config_round_trip_preserves_every_field(rel, tmp_path):
    original = _load(shared_path(*rel))
    cfg = K3Config.from_dict(original)
    assert cfg.to_dict() == original
    cfg.save_pretrained(tmp_path)
    again = K3Config.from_pretrained(tmp_path)
    assert again.to_dict() == original
    assert again.layer_types == cfg.layer_types


def test_released_layer_schedule_is_converted_once_to_zero_based():
    cfg = K3Config.from_pretrained(shared_path("k3"))
    mla = [i for i, t in enumerate(cfg.layer_types) if t == MLA]
    # 1-based full_attn_layers 4, 8, ..., 92, 93 -> 0-based 3, 7, ..., 91, 92
    assert mla == list(range(3, 92, 4)) + [92]
    assert cfg.layer_types.count(KDA) == 69 and len(mla) == 24
    assert cfg.mlp_layer_types[0] == "dense" and set(cfg.mlp_layer_types[1:]) == {"sparse"}
    # official spellings land on the DeepSeek-V3 names
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (896, 16, 2)
    assert cfg.routed_expert_hidden_size == 3584 and cfg.moe_intermediate_size == 3072
    assert cfg.gate_lower_bound == -5.0 and cfg.linear_num_heads == 96 and cfg.linear_head_dim == 128
    assert cfg.attn_res_block_size == 12 and cfg.norm_topk_prob is True


def test_preset_kimi_k3_equals_release():
    released = K3Config.from_pretrained(shared_path("k3"))
    mine = preset("kimi-k3")
    for name in ("hidden_size", "num_hidden_layers", "layer_types", "mlp_layer_types", "q_lora_rank",
                 "kv_lora_rank", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "routed_expert_hidden_size", "intermediate_size", "vocab_size", "attn_res_block_size",
                 "linear_num_heads", "linear_head_dim", "gate_lower_bound", "activation_situ_beta",
                 "activation_situ_linear_beta", "routed_scaling_factor"):
        assert getattr(mine, name) == getattr(released, name), name
    assert mine.wrapper["vision_config"] == released.wrapper["vision_config"]


def test_every_branch_preset():
    cfg = preset("k3-test-tiny")
    assert {KDA, MLA} <= set(cfg.layer_types)
    assert {"dense", "sparse"} <= set(cfg.mlp_layer_types)
    assert cfg.q_lora_rank is not None and preset("k3-test-tiny-noqlora").q_lora_rank is None
    assert cfg.num_hidden_layers / cfg.attn_res_block_size >= 3  # several AttnRes blocks
    for name in PRESETS:
        preset(name).validate()


def test_kimi_linear_flags_round_trip():
    cfg = preset("kimi-linear-tiny")
    d = cfg.to_dict()
    assert d["model_type"] == "kimi_linear" and "gate_lower_bound" not in d["linear_attn_config"]
    back = K3Config.from_dict(d)
    assert back.gate_lower_bound is None and back.attn_res_block_size is None
    assert back.routed_expert_hidden_size is None and back.hidden_act == "silu"
    assert back.layer_types == cfg.layer_types


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"num_experts_per_tok": 99}, "num_experts_per_tok"),
        ({"layer_types": ["linear_attention"] * 5 + ["mamba"]}, "layer_types[5]"),
        ({"layer_types": ["linear_attention"] * 2}, "layer_types"),
        ({"gate_lower_bound": 1.0}, "gate_lower_bound"),
        ({"attn_res_block_size": 0}, "attn_res_block_size"),
        ({"q_lora_rank": -3}, "q_lora_rank"),
    ],
)
def test_validation_names_field_and_value(changes, field):
    with pytest.raises(ValueError) as e:
        preset("k3-test-tiny").replace(**changes)
    assert field in str(e.value)
    value = list(changes.values())[0]
    if not isinstance(value, list):
        assert repr(value) in str(e.value)


def test_bad_layer_lists_are_rejected():
    d = preset("k3-test-tiny").to_dict()
    d["linear_attn_config"]["kda_layers"] = [0, 1]  # 0 is not a 1-based layer
    with pytest.raises(ValueError, match="kda_layers"):
        K3Config.from_dict(d)
    with pytest.raises(ValueError, match="unknown preset"):
        preset("nope")


@pytest.mark.parametrize(
    "key, value, field",
    [
        ("num_hidden_layers", "7", "num_hidden_layers"),
        ("rms_norm_eps", "1e-5", "rms_norm_eps"),
        ("rms_norm_eps", None, "rms_norm_eps"),
        ("num_experts_per_token", 2.5, "num_experts_per_tok"),
        ("moe_intermediate_size", "24", "moe_intermediate_size"),
        ("num_expert_group", 0, "n_group"),
        ("moe_layer_freq", 0, "moe_layer_freq"),
        ("initializer_range", "x", "initializer_range"),
        ("routed_scaling_factor", -1.0, "routed_scaling_factor"),
        ("num_key_value_heads", -3, "num_key_value_heads"),
        ("max_position_embeddings", -1, "max_position_embeddings"),
        ("vocab_size", 100, "bos_token_id"),
        ("moe_renormalize", "no", "norm_topk_prob"),
        ("tie_word_embeddings", "yes", "tie_word_embeddings"),
        ("hidden_act", "relu", "hidden_act"),
        ("hidden_act", None, "hidden_act"),
        ("num_expert_group", None, "num_expert_group"),
        ("mla_use_nope", False, "mla_use_nope"),
        ("attention_bias", True, "attention_bias"),
        ("activation_situ_beta", 0.0, "activation_situ_beta"),
    ],
)
def test_malformed_official_configs_raise_value_error_naming_the_field(key, value, field):
    d = _load(shared_path("fixtures", "k3-ref-tiny-a", "config.json"))
    d["text_config"][key] = value
    with pytest.raises(ValueError, match=field):
        K3Config.from_dict(d)


def test_missing_core_field_means_the_official_class_default():
    # KimiLinearConfig(hidden_size=4096): a file without the key means 4096, not the 2.78T release value
    d = _load(shared_path("fixtures", "k3-ref-tiny-a", "config.json"))
    del d["text_config"]["hidden_size"]
    assert K3Config.from_dict(d).hidden_size == 4096
    d = _load(shared_path("fixtures", "k3-ref-tiny-a", "config.json"))
    d["text_config"]["linear_attn_config"]["kda_layers"] = 3
    with pytest.raises(ValueError, match="kda_layers"):
        K3Config.from_dict(d)


@pytest.mark.parametrize("key", ["kda_layers", "full_attn_layers"])
@pytest.mark.parametrize("how", ["null", "absent"])
def test_linear_attn_config_needs_both_layer_lists(key, how):
    # KimiLinearConfig asserts linear_attn_config["kda_layers"] / ["full_attn_layers"] are not None
    # (a missing key is a KeyError there): refused, never read as "every layer MLA".
    d = _load(shared_path("fixtures", "k3-ref-tiny-a", "config.json"))
    lin = d["text_config"]["linear_attn_config"]
    if how == "null":
        lin[key] = None
    else:
        del lin[key]
    with pytest.raises(ValueError, match=rf"linear_attn_config\.{key}=None: a list of 1-based layer numbers"):
        K3Config.from_dict(d)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("vocab_size", 10**30, r"K3Config\.vocab_size=10{30}: too large \(beyond int64\)"),
        ("num_attention_heads", -(2**64), r"num_attention_heads=-18446744073709551616: too large"),
        ("rms_norm_eps", float("nan"), r"K3Config\.rms_norm_eps=nan: must be a finite number"),
        ("routed_scaling_factor", float("inf"), r"routed_scaling_factor=inf: must be a finite number"),
    ],
)
def test_out_of_range_numbers_name_the_field(key, value, message):
    d = _load(shared_path("fixtures", "k3-ref-tiny-a", "config.json"))
    d["text_config"][key] = value
    with pytest.raises(ValueError, match=message):
        K3Config.from_dict(d)


def test_a_wrapper_of_another_model_type_is_refused():
    d = _load(shared_path("fixtures", "k3-ref-tiny-a", "config.json"))
    d["model_type"] = "kimi_vl"
    with pytest.raises(ValueError, match=r"config\.model_type='kimi_vl': expected 'kimi_k3'"):
        K3Config.from_dict(d)
    del d["model_type"]  # a wrapper that omits model_type is still read as kimi_k3
    assert K3Config.from_dict(d).to_dict()["model_type"] == "kimi_k3"


@pytest.mark.parametrize(
    "vision, message",
    [
        ("x", "vision_config must be a JSON object, got str"),
        ([], "vision_config must be a JSON object, got list"),
        ({"vt_hidden_size": "1152"}, r"vision_config\.vt_hidden_size: must be a positive integer \(got '1152'\)"),
    ],
)
def test_cli_info_names_a_bad_vision_config_in_one_line(vision, message, tmp_path, capsys):
    from openk3.cli import main

    d = _load(shared_path("fixtures", "k3-ref-tiny-a", "config.json"))
    d["vision_config"] = vision if not isinstance(vision, dict) else {**d["vision_config"], **vision}
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("openk3 info: ")
    assert re.search(message, err), err
