"""One weight init: every construction path gives the same weights for the same seed, and the
weights follow openk3.weight_init's rules (checked on the values, per rule)."""

from __future__ import annotations

import math

import pytest
import torch

import openk3
from openk3.layers.kda import KimiDeltaAttention
from openk3.layers.mla import GatedMLA
from openk3.model import K3ForCausalLM
from openk3.multimodal import K3ForConditionalGeneration
from openk3.pretrained import build_model
from openk3.vision import vision_preset


def mm_config():
    cfg = openk3.preset("k3-test-tiny").as_k3_wrapper()
    cfg.wrapper["vision_config"] = vision_preset("tiny").to_dict()
    return cfg


def configs():
    return {
        "k3-test-tiny": openk3.preset("k3-test-tiny"),
        "kimi-linear-tiny": openk3.preset("kimi-linear-tiny"),
        "tied": openk3.preset("k3-test-tiny").replace(tie_word_embeddings=True),
        "multimodal": mm_config(),
    }


def assert_same(a: torch.nn.Module, b: torch.nn.Module, what: str) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb), what
    differ = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not differ, f"{what}: {len(differ)} tensors differ, first {differ[:3]}"


@pytest.mark.parametrize("name", list(configs()))
def test_same_seed_same_weights_on_every_path(name):
    cfg = configs()[name]
    cls = K3ForConditionalGeneration if name == "multimodal" else K3ForCausalLM
    built = build_model(cfg, seed=7)
    torch.manual_seed(7)
    direct = cls(cfg)
    with torch.device("meta"):
        meta = cls(cfg)
    meta = meta.to_empty(device="cpu")
    meta.init_weights(torch.Generator().manual_seed(7))
    meta.tie_weights()
    assert type(built) is cls
    assert_same(built, direct, "build_model vs the constructor")
    assert_same(built, meta, "build_model vs meta + init_weights")
    if cfg.tie_word_embeddings:
        assert direct.lm_head.weight is direct.model.embed_tokens.weight
    other = build_model(cfg, seed=8)
    assert not torch.equal(other.model.embed_tokens.weight, built.model.embed_tokens.weight)


def test_constructor_on_meta_stays_on_meta():
    with torch.device("meta"):
        m = K3ForCausalLM(openk3.preset("k3-test-tiny"))
    assert all(p.is_meta for p in m.parameters())


@pytest.mark.parametrize("name", ["k3-test-tiny", "kimi-linear-tiny"])
def test_values_follow_the_rules(name):
    cfg = openk3.preset(name)
    torch.manual_seed(0)
    m = K3ForCausalLM(cfg)
    std = cfg.initializer_range
    params = dict(m.named_parameters())
    for n, p in params.items():
        if n.endswith("_res_proj.weight"):
            assert torch.equal(p, torch.zeros_like(p)), n
        elif n.endswith("A_log"):
            if cfg.is_k3:
                assert torch.equal(p, torch.zeros_like(p)), n
            else:
                assert bool(((p >= 0) & (p <= math.log(16.0))).all()) and p.std() > 0, n
        elif n.endswith("dt_bias"):
            dt = torch.nn.functional.softplus(p.double())
            assert bool(((dt >= 1e-3 * (1 - 1e-5)) & (dt <= 1e-1 * (1 + 1e-5))).all()), n
        elif p.ndim == 1:
            assert torch.equal(p, torch.ones_like(p)), n
        elif p.numel() >= 512:
            assert abs(p.std().item() - std) < 0.2 * std and abs(p.mean().item()) < 0.2 * std, n
    conv = params["model.layers.0.self_attn.q_conv1d.weight"]
    assert abs(conv.std().item() - std) < 0.2 * std  # short convs like every other kernel
    for n, b in m.named_buffers():
        if n.endswith("e_score_correction_bias"):
            assert torch.equal(b, torch.zeros_like(b)), n


def test_a_layer_built_alone_uses_the_same_rules_and_its_generator():
    cfg = openk3.preset("k3-test-tiny")
    layer = KimiDeltaAttention(cfg, 0)
    std = cfg.initializer_range
    assert abs(layer.q_conv1d.weight.std().item() - std) < 0.2 * std
    assert torch.equal(layer.A_log, torch.zeros_like(layer.A_log))
    assert torch.equal(layer.o_norm.weight, torch.ones_like(layer.o_norm.weight))
    for make in (lambda: KimiDeltaAttention(cfg, 0), lambda: GatedMLA(cfg, 3)):
        a, b, c = make(), make(), make()
        a.init_weights(torch.Generator().manual_seed(3))
        b.init_weights(torch.Generator().manual_seed(3))
        c.init_weights(torch.Generator().manual_seed(4))
        assert_same(a, b, f"{type(a).__name__}.init_weights with equal seeds")
        assert not torch.equal(a.o_proj.weight, c.o_proj.weight)
