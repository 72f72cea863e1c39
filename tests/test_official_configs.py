"""Every config the official code, the real releases and other tools write loads with the meaning
it has there, and what openk3 writes is what the official loaders require.

Oracles: the 17 checkpoints the official K3 reference classes wrote after one config change each
(``../shared/fixtures/official-config-matrix``: config, weights, the reference's logits and layer
structure), ``k3-ref-tiny-a`` (a ``kimi_k3`` wrapper with vision), the released K3 config and tensor
index (``../shared/k3``), the public Kimi-Linear-48B-A3B-Instruct ``config.json``
(``tests/data``), transformers' ``KimiLinearForCausalLM``, and
:func:`tests.reference_shapes.reference_shapes` (the reference loader's names and shapes, itself
checked against every reference-written file first).
"""

from __future__ import annotations

import copy
import gzip
import json
import logging
import math
import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers: no hub kernels, its torch fallbacks

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from openk3.checkpoint import read_safetensors, to_hf_state_dict, write_checkpoint
from openk3.config import KDA, SPARSE, K3Config, preset
from openk3.config_fields import REFUSED, TEXT_FIELDS, fields_markdown
from openk3.model import K3ForCausalLM
from openk3.params import count_parameters
from openk3.pretrained import build_model, load_pretrained
from openk3.vision.config import vision_preset
from tests.conftest import REPO, assert_close, shared_path
from tests.reference_shapes import reference_shapes
from tests.test_model import sharp

MATRIX_CASES = (
    "first_k_dense_omitted", "full_rank_gate_null", "grouped_4_2", "hidden_act_gelu", "k3_like",
    "k3_situ_omitted_betas", "kl_base", "kl_base_situ_keys_dropped", "mla_output_gate_omitted", "moe_layer_freq_2",
    "mtp_1_layer", "rms_norm_eps_omitted", "router_softmax", "shared_experts_0", "situ_null_betas",
    "tie_word_embeddings", "topk_method_greedy",
)
# The largest disagreement between two correct fp32 runs the fixtures document is 1.8e-3.
REF_ATOL = 2e-3
KIMI_LINEAR_48B = REPO / "tests" / "data" / "kimi_linear_48b_a3b_instruct_config.json"
VISION = ("vision_tower.", "mm_projector.")


def _json(p) -> dict:
    return json.loads(Path(p).read_text())


def _file_tensors(path) -> dict[str, tuple[tuple, torch.dtype]]:
    """name -> (shape, dtype) of every tensor of a checkpoint directory (one file or shards)."""
    return {k: (tuple(v.shape), v.dtype) for k, v in read_safetensors(str(path)).items()}


def _counted(model: torch.nn.Module) -> int:
    """Parameters as the reference counts them: its e_score_correction_bias is a Parameter."""
    return sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))


# ----------------------------------------------------------------------------- the oracle itself
def test_reference_shape_statement_matches_every_reference_written_checkpoint():
    """reference_shapes() reproduces, name for name and shape for shape, the 17 matrix checkpoints,
    the text tensors of k3-ref-tiny-a and the 497,052 text names of the released K3 index (MXFP4
    experts). Only then is it used to judge openk3's own files below."""
    for case in MATRIX_CASES:
        root = shared_path("fixtures", "official-config-matrix", case)
        got = {k: s for k, (s, _) in _file_tensors(root).items()}
        assert reference_shapes(_json(root / "config.json")) == got, case
    root = shared_path("fixtures", "k3-ref-tiny-a")
    got = {k: s for k, (s, _) in _file_tensors(root).items() if not k.startswith(VISION)}
    assert reference_shapes(_json(root / "config.json")) == got
    with gzip.open(shared_path("k3", "model.safetensors.index.json.gz"), "rt", encoding="utf-8") as f:
        released = {n for n in json.load(f)["weight_map"] if not n.startswith(VISION)}
    assert set(reference_shapes(_json(shared_path("k3", "config.json")), mxfp4=True)) == released


# ----------------------------------------------------------------------------- official -> openk3
@pytest.mark.parametrize("case", MATRIX_CASES)
def test_matrix_checkpoint_loads_with_the_reference_meaning(case):
    """Layer kinds, parameter count, logits (<= 2e-3, the reference's own spread) and greedy ids of
    each checkpoint the reference classes wrote. ``k3_situ_omitted_betas``: see the next test."""
    root = shared_path("fixtures", "official-config-matrix", case)
    summary = _json(root.parent / "ref_summary.json")[case]
    model = load_pretrained(root)
    cfg = model.config
    assert ["kda" if t == KDA else "mla" for t in cfg.layer_types] == summary["ref_mixers"]
    assert ["moe" if t == SPARSE else "dense" for t in cfg.mlp_layer_types] == summary["ref_mlp_kinds"]
    assert _counted(model) == summary["ref_param_count"]
    if case == "k3_situ_omitted_betas":
        return
    ref = load_file(str(root / "ref_logits.safetensors"))
    with torch.no_grad():
        got = model(ref["input_ids"]).logits
    assert_close(got, ref["logits"], atol=REF_ATOL, what=f"{case} logits vs the reference")
    assert torch.equal(got.argmax(-1), ref["logits"].argmax(-1))


def test_omitted_situ_betas_mean_the_class_defaults():
    """``k3_situ_omitted_betas``: config.json has hidden_act situ and no betas. KimiLinearConfig
    defaults both to None and the reference's SituAndMul uses ``beta or 1.0`` and no up cap for
    ``linear_beta=None``, so the file means beta1 = 1, beta2 = none, and openk3 reads exactly that.
    The recorded logits of this case equal a model run with the betas 4.0 / 25.0 the generator
    passed before dropping the keys (checked here: weights and structure load right); they are not
    what the written config.json means, so they are not the oracle for the activation."""
    root = shared_path("fixtures", "official-config-matrix", "k3_situ_omitted_betas")
    model = load_pretrained(root)
    assert (model.config.activation_situ_beta, model.config.activation_situ_linear_beta) == (1.0, None)
    ref = load_file(str(root / "ref_logits.safetensors"))
    as_generated = K3ForCausalLM(model.config.replace(activation_situ_beta=4.0, activation_situ_linear_beta=25.0))
    as_generated.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert_close(as_generated.eval()(ref["input_ids"]).logits, ref["logits"], atol=REF_ATOL, what="betas 4/25")
        assert (model(ref["input_ids"]).logits - ref["logits"]).abs().max() > 1.0  # the betas do matter


@pytest.mark.parametrize("case", MATRIX_CASES)
def test_matrix_checkpoint_round_trips_to_what_the_reference_wrote(case, tmp_path):
    """openk3 -> official: loading a reference checkpoint and saving it writes the same config.json
    (nulls, omissions and unknown keys kept) and the same tensor names, shapes and dtypes
    (``A_log`` stays [H] as the K3 reference wrote it), and the copy computes the same logits."""
    root = shared_path("fixtures", "official-config-matrix", case)
    original = _json(root / "config.json")
    assert K3Config.from_dict(original).to_dict() == original
    model = load_pretrained(root)
    model.save_pretrained(tmp_path)
    assert _json(tmp_path / "config.json") == original
    assert _file_tensors(tmp_path) == _file_tensors(root)
    ids = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path)(ids).logits, model(ids).logits)


def test_k3_wrapper_with_vision_round_trips_to_what_the_reference_wrote(tmp_path):
    """The ``kimi_k3`` wrapper with a vision tower (k3-ref-tiny-a, the released layout): config and
    every tensor (text under ``language_model.``, ``vision_tower.*``, ``mm_projector.*``) come back
    with the reference's names, shapes and dtypes."""
    root = shared_path("fixtures", "k3-ref-tiny-a")
    load_pretrained(root).save_pretrained(tmp_path)
    assert _json(tmp_path / "config.json") == _json(root / "config.json")
    assert _file_tensors(tmp_path) == _file_tensors(root)


def test_released_k3_config_builds_with_the_release_parameter_count():
    """../shared/k3/config.json: 2,779,484,476,000 text parameters (architecture.md §12), built on
    the meta device, equal to the reference's shapes summed (MXFP4 experts counted unpacked)."""
    d = _json(shared_path("k3", "config.json"))
    cfg = K3Config.from_dict(d)
    total = count_parameters(cfg)["total"]
    assert total == 2_779_484_476_000
    assert total == sum(math.prod(s) for s in reference_shapes(d).values())
    assert cfg.to_dict() == d


def test_kimi_linear_48b_config_loads_with_the_release_meaning():
    """The public Kimi-Linear-48B-A3B-Instruct config.json: no mla_use_output_gate (no MLA gate, as
    its modeling_kimi.py has none), softplus KDA gate with low-rank output gate, plain residual,
    full-width experts, `model_max_length` as the context limit; 49,122,681,728 parameters, the
    count of its published weights; openk3's file names and shapes for it are the ones its weights
    have (``A_log`` [1, 1, 32, 1], written for Kimi Linear's own code)."""
    d = _json(KIMI_LINEAR_48B)
    cfg = K3Config.from_dict(d)
    assert not cfg.mla_use_output_gate and not cfg.use_full_rank_gate and cfg.gate_lower_bound is None
    assert cfg.attn_res_block_size is None and cfg.routed_expert_hidden_size is None and cfg.hidden_act == "silu"
    assert cfg.max_position_embeddings == 1_048_576 and cfg.rms_norm_eps == 1e-5 and cfg.n_shared_experts == 1
    assert [i for i, t in enumerate(cfg.layer_types) if t != KDA] == [3, 7, 11, 15, 19, 23, 26]
    assert cfg.mlp_layer_types == ["dense"] + ["sparse"] * 26
    assert count_parameters(cfg)["total"] == 49_122_681_728
    assert cfg.to_dict() == d
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    ours = {k: tuple(v.shape) for k, v in to_hf_state_dict(model.state_dict(), cfg).items()}
    assert ours == reference_shapes(d, a_log="unsqueezed")
    assert ours["model.layers.0.self_attn.A_log"] == (1, 1, 32, 1)


def _tiny_kimi_linear_48b() -> dict:
    """The Kimi-Linear-48B-A3B config.json with every key kept and only sizes shrunk."""
    d = _json(KIMI_LINEAR_48B)
    d.update(hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_experts=8, num_experts_per_token=2,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=16, kv_lora_rank=16,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=512, bos_token_id=256,
             eos_token_id=258, pad_token_id=511, model_max_length=4096, dtype="float32")
    d["linear_attn_config"].update(full_attn_layers=[4], kda_layers=[1, 2, 3], num_heads=4, head_dim=16)
    return d


@pytest.mark.parametrize("T", [9, 70])
def test_kimi_linear_48b_key_set_matches_transformers(tmp_path, T):
    """A checkpoint with the real Kimi-Linear-48B-A3B key set at tiny sizes: openk3 writes it back
    key for key (A_log [1, 1, H, 1]) and transformers' KimiLinearForCausalLM computes the same logits
    (<= 1e-4, fp32); T = 70 crosses a 64-token KDA chunk. transformers rewrites the config with its
    own keys (layer_types, mlp_layer_types, linear_* at the top level); openk3 reads that back with
    the same meaning."""
    transformers = pytest.importorskip("transformers")
    d = _tiny_kimi_linear_48b()
    assert set(d) == set(_json(KIMI_LINEAR_48B))
    model = sharp(build_model(K3Config.from_dict(d), seed=11), seed=12).eval()
    model.save_pretrained(tmp_path)
    assert _json(tmp_path / "config.json") == d
    assert _file_tensors(tmp_path)["model.layers.0.self_attn.A_log"] == ((1, 1, 4, 1), torch.float32)
    ref = transformers.KimiLinearForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    ids = torch.randint(0, 512, (2, T))
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids).logits
    assert want.abs().max() > 1.0
    assert_close(got, want, atol=1e-4, what="logits vs transformers KimiLinearForCausalLM")
    written = ref.config.to_dict()
    again = K3Config.from_dict(json.loads(json.dumps(written)))
    for name in ("layer_types", "mlp_layer_types", "linear_num_heads", "n_shared_experts", "mla_use_output_gate",
                 "gate_lower_bound", "use_full_rank_gate", "rms_norm_eps", "routed_scaling_factor",
                 "max_position_embeddings", "hidden_act", "n_routed_experts", "num_experts_per_tok"):
        assert getattr(again, name) == getattr(model.config, name), name


def test_mtp_layers_are_skipped_with_a_warning(tmp_path, caplog):
    """num_nextn_predict_layers = 1 (mtp_1_layer): the reference builds no MTP module; openk3 warns,
    loads the main model, and skips MTP tensors (``model.layers.{L}.*``, the DeepSeek-V3 layout) if a
    file has them. Logits equal the reference's."""
    root = shared_path("fixtures", "official-config-matrix", "mtp_1_layer")
    tensors = read_safetensors(str(root))
    L = _json(root / "config.json")["num_hidden_layers"]
    for name, t in list(tensors.items()):
        if name.startswith(f"model.layers.{L - 1}."):
            tensors[name.replace(f"model.layers.{L - 1}.", f"model.layers.{L}.")] = t.clone()
    cfg = K3Config.from_pretrained(root)
    with caplog.at_level(logging.WARNING):
        write_checkpoint(str(tmp_path), tensors, cfg)
        model = load_pretrained(tmp_path)
    assert any("num_nextn_predict_layers=1" in r.message and "MTP" in r.message for r in caplog.records)
    assert any(re.search(r"\b\d+ MTP tensor\(s\) skipped", r.message) and " 0 MTP" not in r.message
               for r in caplog.records)
    ref = load_file(str(root / "ref_logits.safetensors"))
    with torch.no_grad():
        assert_close(model(ref["input_ids"]).logits, ref["logits"], atol=REF_ATOL, what="mtp_1_layer")


# ----------------------------------------------------------------------------- openk3 -> official
def _variants():
    def vision(cfg):
        cfg = cfg.as_k3_wrapper()
        cfg.wrapper["vision_config"] = vision_preset("tiny").to_dict()
        return cfg

    f32 = preset("k3-test-tiny").replace(moe_intermediate_size=32)  # MXFP4 needs whole 32-blocks
    return {
        "k3": (preset("k3-test-tiny"), None),
        "k3-noqlora": (preset("k3-test-tiny-noqlora"), None),
        "kimi-linear": (preset("kimi-linear-tiny"), None),
        "text-only-wrapper": (preset("k3-test-tiny").as_k3_wrapper(), None),
        "kimi-linear-wrapper": (vision(preset("kimi-linear-tiny")), None),
        "mxfp4": (vision(f32), "mxfp4"),
        "mxfp4-bare": (f32, "mxfp4"),
        "with-vision": (vision(preset("k3-test-tiny")), None),
    }


@pytest.mark.parametrize("name", list(_variants()))
def test_written_checkpoint_is_what_the_reference_loader_requires(name, tmp_path, caplog):
    """openk3's files for each preset: the written config.json, read as KimiLinearConfig /
    KimiK3Config read it, asks for exactly the tensors in the file (names and shapes from
    reference_shapes: A_log [H] for kimi_k3 or a K3 gate, [1, 1, H, 1] for a bare Kimi Linear;
    MXFP4 experts as uint8 weight_packed [O, K/2] + weight_scale [O, K/32]); floating tensors fp32.
    A kimi_k3 wrapper without vision_config (which KimiK3ForConditionalGeneration cannot build) is
    written as the bare kimi_linear text config, with a warning. Vision tensors carry the
    reference's names (those of k3-ref-tiny-a)."""
    cfg, quantization = _variants()[name]
    model = build_model(cfg, seed=3)
    with caplog.at_level(logging.WARNING):
        model.save_pretrained(tmp_path, quantization=quantization)
    written = _json(tmp_path / "config.json")
    files = _file_tensors(tmp_path)
    if name == "text-only-wrapper":
        assert written["model_type"] == "kimi_linear" and not any(k.startswith("language_model.") for k in files)
        assert any("without vision_config" in r.message for r in caplog.records)
    text = written.get("text_config", written)
    bare_kimi_linear = written["model_type"] == "kimi_linear" and "gate_lower_bound" not in text["linear_attn_config"]
    want = reference_shapes(written, a_log="unsqueezed" if bare_kimi_linear else "per_head",
                            mxfp4=quantization is not None)
    assert {k: s for k, (s, _) in files.items() if not k.startswith(VISION)} == want
    for k, (_, dtype) in files.items():
        packed = k.endswith(("weight_packed", "weight_scale"))
        assert dtype == (torch.uint8 if packed else torch.float32), k
    if "vision_config" in written:
        fixture = shared_path("fixtures", "k3-ref-tiny-a")
        def pattern(names):
            return {re.sub(r"\.\d+\.", ".N.", n) for n in names if n.startswith(VISION)}
        assert pattern(files) == pattern(_file_tensors(fixture))
    back = load_pretrained(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (1, 7))
    if quantization is None:
        with torch.no_grad():
            assert torch.equal(back(ids).logits, model(ids).logits)


def test_text_only_wrapper_checkpoints_written_before_still_load(tmp_path):
    """Files openk3 wrote before (a kimi_k3 wrapper without vision_config, language_model. names)
    load as they did, with the same logits."""
    cfg = preset("k3-test-tiny").as_k3_wrapper()
    model = build_model(cfg, seed=5)
    write_checkpoint(str(tmp_path), to_hf_state_dict(model.state_dict(), cfg), cfg)
    assert "language_model.lm_head.weight" in read_safetensors(str(tmp_path))
    back = load_pretrained(tmp_path)
    assert back.config.wrapper is not None
    ids = torch.randint(0, 512, (1, 8))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


# ----------------------------------------------------------------------------- the table
def _class_defaults() -> dict:
    """What ``KimiLinearConfig()`` of the K3 reference writes for its own fields (its __init__
    defaults; PretrainedConfig bookkeeping left out): hidden 4096, 32 layers of 32 heads, SwiGLU
    (silu), rms_norm_eps 1e-6, pad/bos/eos 0/1/2, no experts, no KDA (linear_attn_config None), no
    MLA widths, mla_use_nope / mla_use_output_gate false, first_k_dense_replace 0, max 4096."""
    return {
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 4096, "head_dim": 128,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "moe_intermediate_size": None, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "num_experts": None, "num_experts_per_token": None,
        "num_shared_experts": 0, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0, "moe_layer_freq": 1,
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "q_lora_rank": None, "kv_lora_rank": None,
        "qk_nope_head_dim": None, "qk_rope_head_dim": None, "v_head_dim": None, "mla_use_nope": False,
        "mla_use_output_gate": False, "num_nextn_predict_layers": 0, "linear_attn_config": None,
        "attn_res_block_size": None, "latent_moe_use_norm": False, "activation_situ_beta": None,
        "activation_situ_linear_beta": None, "max_position_embeddings": 4096, "routed_expert_hidden_size": None,
        "topk_method": "noaux_tc",
    }


def test_configs_the_official_class_writes_by_default_and_with_every_optional_field_null():
    """KimiLinearConfig() builds no model in the reference either (no KDA, no MLA widths: its
    decoder raises NotImplementedError); openk3 refuses it naming kv_lora_rank. Given MLA widths
    (and mla_use_nope, which its MLA asserts), the defaults mean: all MLA, all dense, rms eps 1e-6,
    no output gate; the model built on the meta device has the reference's parameter count. The
    same with every Optional argument null: the same meaning. Omitting every key means the same
    as writing the defaults."""
    d = _class_defaults()
    with pytest.raises(ValueError, match="kv_lora_rank"):
        K3Config.from_dict(d)
    d.update(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True)
    cfg = K3Config.from_dict(d)
    assert set(cfg.layer_types) == {"full_attention"} and set(cfg.mlp_layer_types) == {"dense"}
    assert cfg.rms_norm_eps == 1e-6 and not cfg.mla_use_output_gate and cfg.max_position_embeddings == 4096
    want = sum(math.prod(s) for s in reference_shapes(d).values())
    assert count_parameters(cfg)["total"] == want
    assert cfg.to_dict() == dict(sorted({**d, "architectures": ["KimiLinearForCausalLM"]}.items()))
    nulls = {k: (None if k in ("num_key_value_heads", "moe_intermediate_size", "num_experts", "num_experts_per_token",
                               "q_lora_rank", "linear_attn_config", "attn_res_block_size", "activation_situ_beta",
                               "activation_situ_linear_beta", "routed_expert_hidden_size", "head_dim",
                               "mla_use_output_gate") else v) for k, v in d.items()}
    same = K3Config.from_dict(nulls)
    for f in TEXT_FIELDS:
        if f.attr and f.attr not in ("num_key_value_heads", "activation_situ_beta"):
            assert getattr(same, f.attr) == getattr(cfg, f.attr), f.attr
    assert count_parameters(same)["total"] == want
    minimal = {k: d[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    assert count_parameters(K3Config.from_dict(minimal))["total"] == want


@pytest.mark.parametrize("field", [f for f in TEXT_FIELDS if f.attr and f.attr not in ("layer_types",
                                                                                        "mlp_layer_types")],
                         ids=lambda f: f.attr)
def test_null_and_absence_mean_what_the_table_says(field):
    """For each honoured field of k3_like (every K3 branch on): null reads as the table's null
    meaning (or is refused naming the key), absence as the official class default (or, for a
    width the model needs, is refused naming the field)."""
    base = _json(shared_path("fixtures", "official-config-matrix", "k3_like", "config.json"))
    key = field.key
    for raw, meaning in ((None, field.null), ("absent", field.absent)):
        d = copy.deepcopy(base)
        container, sub = (d["linear_attn_config"], key.split(".", 1)[1]) if "." in key else (d, key)
        if raw == "absent":
            container.pop(sub, None)
        else:
            container[sub] = None
        if meaning is REFUSED:
            with pytest.raises(ValueError, match=re.escape(key)):
                K3Config.from_dict(d)
            continue
        try:
            cfg = K3Config.from_dict(d)
        except ValueError as e:
            assert field.attr in str(e) or key in str(e), str(e)  # a width the model needs
            continue
        assert getattr(cfg, field.attr) == meaning, (raw, field.attr)
        assert cfg.to_dict() == d  # written back as the file had it


def test_every_config_attribute_is_in_the_table():
    names = {f.name for f in K3Config.__dataclass_fields__.values()} - {"extra_text_config", "wrapper", "source"}
    from openk3.config_fields import WRAPPER_FIELDS

    tabled = {f.attr for f in TEXT_FIELDS + WRAPPER_FIELDS if f.attr}
    assert names == tabled


def test_unknown_fields_are_kept_and_written_back(tmp_path):
    """Unknown keys at every level (text config, linear_attn_config, wrapper, vision_config) survive
    from_dict / to_dict and a load / save of the checkpoint."""
    root = shared_path("fixtures", "k3-ref-tiny-a")
    d = _json(root / "config.json")
    d["future_wrapper_flag"] = {"a": [1, 2]}
    d["text_config"]["future_text_flag"] = "x"
    d["text_config"]["linear_attn_config"]["future_kda_flag"] = 3
    d["vision_config"]["future_vision_flag"] = None
    assert K3Config.from_dict(d).to_dict() == d
    for fn in ("model.safetensors",):
        os.symlink(root / fn, tmp_path / fn)
    (tmp_path / "config.json").write_text(json.dumps(d))
    out = tmp_path / "out"
    load_pretrained(tmp_path).save_pretrained(out)
    assert _json(out / "config.json") == d


def test_two_spellings_of_one_field_must_agree():
    d = _json(shared_path("fixtures", "official-config-matrix", "kl_base", "config.json"))
    d["n_routed_experts"] = 16
    with pytest.raises(ValueError, match="num_experts.*n_routed_experts"):
        K3Config.from_dict(d)
    d["n_routed_experts"] = 8
    assert K3Config.from_dict(d).to_dict() == d
    d = _json(shared_path("fixtures", "official-config-matrix", "k3_like", "config.json"))
    d["gate_lower_bound"] = -3.0  # a top-level copy of a KDA field is read, never dropped
    with pytest.raises(ValueError, match="gate_lower_bound"):
        K3Config.from_dict(d)


def test_kda_fields_at_the_top_level_are_read():
    """A text config that spells the KDA fields at the top level (transformers style, no
    linear_attn_config) keeps the K3 gate: nothing lands silently in extra_text_config."""
    d = preset("k3-test-tiny").to_dict()
    lin = d.pop("linear_attn_config")
    d["layer_types"] = ["linear_attention" if i + 1 in lin["kda_layers"] else "full_attention" for i in range(6)]
    d.update(linear_num_heads=lin["num_heads"], linear_head_dim=lin["head_dim"],
             linear_conv_kernel_dim=lin["short_conv_kernel_size"], gate_lower_bound=lin["gate_lower_bound"],
             use_full_rank_gate=lin["use_full_rank_gate"])
    cfg = K3Config.from_dict(d)
    assert cfg.is_k3 and cfg.use_full_rank_gate and cfg.layer_types == preset("k3-test-tiny").layer_types
    assert "gate_lower_bound" not in cfg.extra_text_config and cfg.to_dict() == d


def test_readme_config_table_is_the_declarative_table():
    assert fields_markdown() in (REPO / "README.md").read_text()
    # Every row has the header's six cells: a "|" inside a cell ("int | null") is escaped.
    for row in fields_markdown().splitlines():
        assert len(re.findall(r"(?<!\\)\|", row)) == 7, row


def _tiny_class_style(**extra) -> dict:
    """A small config as KimiLinearConfig writes it, without linear_attn_config or num_experts."""
    d = {"model_type": "kimi_linear", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 3, "num_attention_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True, "linear_attn_config": None,
         "num_experts": None, "bos_token_id": 256, "eos_token_id": 258, "pad_token_id": 511}
    d.update(extra)
    return d


@torch.no_grad()
def test_models_without_kda_or_without_moe_run_prefill_and_decode():
    """Configs the official class writes with no linear_attn_config (every layer MLA) or no
    num_experts (every FFN dense) build, decode like a full forward, and plan their cache (no KDA
    state); an all-KDA config has no MLA cache."""
    from openk3.engine.planner import kda_state_bytes, kv_bytes_per_token

    for d in (_tiny_class_style(),
              _tiny_class_style(linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [], "num_heads": 4,
                                                    "head_dim": 16, "short_conv_kernel_size": 4},
                                kv_lora_rank=None, qk_nope_head_dim=None, qk_rope_head_dim=None, v_head_dim=None,
                                num_experts=8, num_experts_per_token=2, moe_intermediate_size=24,
                                num_shared_experts=None)):
        cfg = K3Config.from_dict(d)
        model = sharp(build_model(cfg, seed=2), seed=3).eval()
        ids = torch.randint(0, 512, (2, 20))
        full = model(ids).logits
        cache = model.new_cache(2, 24)
        steps = [model(ids[:, :12], cache).logits] + [model(ids[:, t:t + 1], cache).logits for t in range(12, 20)]
        assert_close(torch.cat(steps, 1), full, atol=1e-4, what="prefill + decode vs full forward")
        has_kda = KDA in cfg.layer_types
        assert (kda_state_bytes(cfg)["total"] > 0) == has_kda and (kv_bytes_per_token(cfg) > 0) != has_kda


def test_vision_config_absent_mm_hidden_size_means_vt_hidden_size():
    """KimiK3VisionConfig: ``mm_hidden_size = mm_hidden_size if not None else vt_hidden_size``."""
    from openk3.vision.config import VisionConfig

    d = vision_preset("tiny").to_dict()
    for value in ("absent", None):
        e = dict(d)
        if value == "absent":
            del e["mm_hidden_size"]
        else:
            e["mm_hidden_size"] = None
        assert VisionConfig.from_dict(e).mm_hidden_size == d["vt_hidden_size"] == 32
    with pytest.raises(ValueError, match="attn_bias"):
        VisionConfig.from_dict(dict(d, attn_bias=None))
