"""MXFP4 checkpoints: the released compressed-tensors layout (names, dtypes, shapes, config) and
loading them back (dequantized or packed) to the logits of the fake-quantized fp32 model."""

from __future__ import annotations

import gzip
import json
import re

import pytest
import torch
from safetensors.torch import save_file

from openk3.checkpoint import read_safetensors
from openk3.config import preset
from openk3.vision.config import vision_preset
from openk3.pretrained import build_model, load_pretrained
from openk3.quant.mx import mxfp4_weight_from_packed, mxfp4_weight_to_packed
from openk3.quant.packed import PackedExperts, compressed_tensors_config, expert_storage
from openk3.quant.qat import model_qat
from tests.conftest import assert_close, shared_path

EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.")
EXPERT_PATTERN = re.compile(r"\.experts\.N\.wN\.")


def _cfg(wrapper: bool = True):
    """k3-test-tiny with F = 32 (its F = 24 holds no whole MX block); ``wrapper``: as the released
    ``kimi_k3`` layout, with a tiny vision tower (the official class needs a vision_config)."""
    cfg = preset("k3-test-tiny").replace(moe_intermediate_size=32)
    if not wrapper:
        return cfg
    cfg = cfg.as_k3_wrapper()
    cfg.wrapper["vision_config"] = vision_preset("tiny").to_dict()
    return cfg


def _pattern(name: str) -> str:
    return re.sub(r"\d+", "N", name)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One fp32 model saved with MXFP4 experts (k3 wrapper names)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mxfp4")
    model = build_model(_cfg(), seed=7)
    model.save_pretrained(path, quantization="mxfp4")
    return model, path


def test_loaded_checkpoint_gives_the_fake_quant_logits(saved):
    model, path = saved
    ids = torch.randint(0, 512, (1, 6))
    want = {}
    with torch.no_grad():
        plain = model(ids).logits
        for scheme in ("mxfp4-weight-only", "mxfp4"):
            model_qat(model, scheme)
            want[scheme] = model(ids).logits
    model_qat(model, None)
    assert (plain - want["mxfp4-weight-only"]).abs().max() > 1e-4  # quantization is visible: the test can fail
    for keep_packed in (False, True):
        back = load_pretrained(path, keep_packed=keep_packed)
        assert any(isinstance(m, PackedExperts) for m in back.modules()) == keep_packed
        kind = "packed" if keep_packed else "dequantized"
        with torch.no_grad():
            assert_close(back(ids).logits, want["mxfp4-weight-only"], atol=1e-5, what=f"{kind} vs fake-quant")
            # MXFP8 activation fake-quant is a runtime flag (the release stores weights only)
            model_qat(back, "mxfp4")
            assert_close(back(ids).logits, want["mxfp4"], atol=1e-5, what=f"{kind} + MXFP8 inputs vs QAT model")


def test_dequantized_experts_equal_the_fake_quantized_weights(saved):
    model, path = saved
    back = load_pretrained(path)
    for name, p in model.state_dict().items():
        q = back.state_dict()[name]
        if name.endswith(("experts.w1", "experts.w2", "experts.w3")):
            assert torch.equal(q, mxfp4_weight_from_packed(*mxfp4_weight_to_packed(p))), name
        else:
            assert torch.equal(q, p), name  # everything else is stored unquantized


def test_expert_tensor_names_and_dtypes_match_the_release_index(saved):
    model, path = saved
    with gzip.open(shared_path("k3", "model.safetensors.index.json.gz"), "rt", encoding="utf-8") as f:
        released = {_pattern(n) for n in json.load(f)["weight_map"]}
    tensors = read_safetensors(str(path))
    ours = {_pattern(n) for n in tensors}
    expert_ours = {p for p in ours if EXPERT_PATTERN.search(p)}
    expert_released = {p for p in released if EXPERT_PATTERN.search(p)}
    assert expert_ours == expert_released == {
        f"language_model.model.layers.N.block_sparse_moe.experts.N.wN.{s}" for s in ("weight_packed", "weight_scale")
    }
    assert ours <= released, sorted(ours - released)  # and every other name is a released one
    cfg = model.config
    e, f, l = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_latent_size
    for name, t in tensors.items():
        if not EXPERT.search(name):
            assert t.is_floating_point(), name
            continue
        out, k = (l, f) if ".w2." in name else (f, l)
        if name.endswith("weight_packed"):
            assert t.dtype == torch.uint8 and tuple(t.shape) == (out, k // 2), name
        else:
            assert t.dtype == torch.uint8 and tuple(t.shape) == (out, k // 32), name
    n_moe = sum(t == "sparse" for t in cfg.mlp_layer_types)
    assert sum(bool(EXPERT.search(n)) for n in tensors) == n_moe * e * 3 * 2


@pytest.mark.parametrize("wrapper", [True, False], ids=["kimi_k3", "kimi_linear"])
def test_quantization_config_is_the_released_one(tmp_path, wrapper):
    released = json.loads(shared_path("k3", "config.json").read_text())["text_config"]["quantization_config"]
    assert compressed_tensors_config("mxfp4") == released
    build_model(_cfg(wrapper)).save_pretrained(tmp_path, quantization="mxfp4")
    written = json.loads((tmp_path / "config.json").read_text())
    text = written["text_config"] if wrapper else written
    assert text["quantization_config"] == released
    assert "quantization_config" not in written or not wrapper  # only inside text_config, as released
    # a float save of the same model (or of a packed one) carries no quantization_config
    load_pretrained(tmp_path, keep_packed=True).save_pretrained(tmp_path / "float")
    written = json.loads((tmp_path / "float" / "config.json").read_text())
    assert "quantization_config" not in (written["text_config"] if wrapper else written)
    assert not any(n.endswith("weight_packed") for n in read_safetensors(str(tmp_path / "float")))


def test_keep_packed_holds_experts_at_4_25_bits(saved):
    _, path = saved
    packed, dense = expert_storage(load_pretrained(path, keep_packed=True)), expert_storage(load_pretrained(path))
    assert packed["weights"] == dense["weights"] > 0
    assert packed["bits_per_weight"] == 4.25 and dense["bits_per_weight"] == 32.0


def test_bf16_save_quantizes_from_the_fp32_masters(tmp_path):
    model = build_model(_cfg(False), seed=3)
    model.save_pretrained(tmp_path, quantization="mxfp4", dtype=torch.bfloat16)
    t = read_safetensors(str(tmp_path))
    p, s = mxfp4_weight_to_packed(model.state_dict()["model.layers.2.block_sparse_moe.experts.w3"][4])
    assert torch.equal(t["model.layers.2.block_sparse_moe.experts.4.w3.weight_packed"], p)
    assert torch.equal(t["model.layers.2.block_sparse_moe.experts.4.w3.weight_scale"], s)
    assert t["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert t["model.layers.2.block_sparse_moe.gate.weight"].dtype == torch.float32
    back = load_pretrained(tmp_path)  # dequantized experts follow embed_tokens' dtype (exact in bf16)
    w = back.state_dict()["model.layers.2.block_sparse_moe.experts.w3"]
    assert w.dtype == torch.bfloat16 and torch.equal(w[4].float(), mxfp4_weight_from_packed(p, s))


def test_keep_packed_quantizes_a_float_checkpoint(tmp_path):
    model = build_model(_cfg(False), seed=5)
    model.save_pretrained(tmp_path)
    back = load_pretrained(tmp_path, keep_packed=True)
    buf = back.state_dict()["model.layers.1.block_sparse_moe.experts.w2.weight_packed"]
    want = mxfp4_weight_to_packed(model.state_dict()["model.layers.1.block_sparse_moe.experts.w2"])[0]
    assert torch.equal(buf, want)


def test_bad_mxfp4_checkpoints_name_the_problem(saved, tmp_path):
    model, path = saved
    tensors = read_safetensors(str(path))
    config = (path / "config.json").read_text()
    (tmp_path / "config.json").write_text(config)
    pre = "language_model.model.layers.2.block_sparse_moe.experts"

    def load(ts, **kw):
        save_file(ts, str(tmp_path / "model.safetensors"))
        return load_pretrained(tmp_path, **kw)

    gone = dict(tensors)
    del gone[f"{pre}.5.w3.weight_scale"]
    for keep in (False, True):
        with pytest.raises(ValueError, match=r"missing tensor .*experts\.5\.w3\.weight_scale"):
            load(gone, keep_packed=keep)
    no_expert = {k: v for k, v in tensors.items() if ".experts.6.w1." not in k or "layers.2." not in k}
    with pytest.raises(ValueError, match=r"missing tensor .*layers\.2\.block_sparse_moe\.experts\.6\.w1\.weight_packed"):
        load(no_expert)
    both = dict(tensors)
    both[f"{pre}.1.w1.weight"] = torch.zeros(32, 32)
    with pytest.raises(ValueError, match=r"both .*experts\.1\.w1\.weight and its packed form"):
        load(both)
    bad = dict(tensors)
    bad[f"{pre}.0.w2.weight_packed"] = torch.zeros(32, 8, dtype=torch.uint8)
    bad[f"{pre}.0.w2.weight_scale"] = torch.zeros(32, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="per-expert shapes differ"):
        load(bad, keep_packed=True)
    cfg = json.loads(config)
    cfg["text_config"]["quantization_config"]["format"] = "nvfp4-pack-quantized"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"text_config\.quantization_config: .*'nvfp4-pack-quantized'"):
        load(tensors)


def test_packed_tensor_outside_the_experts_is_dequantized(saved, tmp_path):
    model, path = saved
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tensors = read_safetensors(str(path))
    name = "language_model.model.layers.1.block_sparse_moe.routed_expert_up_proj"
    p, s = mxfp4_weight_to_packed(tensors.pop(f"{name}.weight"))
    tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"] = p, s
    save_file(tensors, str(tmp_path / "model.safetensors"))
    back = load_pretrained(tmp_path)
    got = back.state_dict()["model.layers.1.block_sparse_moe.routed_expert_up_proj.weight"]
    assert torch.equal(got, mxfp4_weight_from_packed(p, s))


def test_quantized_save_rejects_widths_without_whole_blocks(tmp_path):
    with pytest.raises(ValueError, match="moe_intermediate_size=24"):
        build_model(preset("kimi-linear-tiny")).save_pretrained(tmp_path, quantization="mxfp4")
    with pytest.raises(ValueError, match="quantization='fp8'"):
        build_model(_cfg(False)).save_pretrained(tmp_path, quantization="fp8")


def test_packed_tensors_with_wrong_dtypes_are_refused_at_load(tmp_path):
    """A corrupt MXFP4 checkpoint fails at load time, naming the file tensor, in both load modes."""
    from safetensors.torch import save_file

    from openk3.checkpoint import read_safetensors
    from openk3.config import preset as _preset
    from openk3.pretrained import build_model as _build, load_pretrained as _load

    model = _build(_preset("k3-test-tiny").replace(moe_intermediate_size=32))
    model.save_pretrained(tmp_path, quantization="mxfp4")
    tensors = read_safetensors(str(tmp_path))
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
    for bad in (torch.int8, torch.float32):
        t = dict(tensors)
        t[name] = t[name].to(bad)
        save_file(t, str(tmp_path / "model.safetensors"))
        for keep in (False, True):
            with pytest.raises(ValueError, match=rf"{name}: dtype {bad}"):
                _load(tmp_path, keep_packed=keep)


def test_empty_inputs_and_float64():
    from openk3.quant.mx import fake_quant_mxfp8, quantize_mxfp4

    codes, scales = quantize_mxfp4(torch.zeros(0, 32))
    assert codes.shape == (0, 32) and scales.shape == (0, 1)
    assert fake_quant_mxfp8(torch.zeros(0, 64)).shape == (0, 64)
    with pytest.raises(ValueError, match="float64"):
        quantize_mxfp4(torch.zeros(2, 32, dtype=torch.float64))
