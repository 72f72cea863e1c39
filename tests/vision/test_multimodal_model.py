"""K3ForConditionalGeneration: built from a vision_config, image features land exactly on the pad
positions, the official checkpoint layout round-trips (fixture k3-ref-tiny-a bit-exactly), and a
text-only model is unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import openk3
from openk3.checkpoint import read_safetensors
from openk3.model import K3ForCausalLM
from openk3.multimodal import K3ForConditionalGeneration, vision_config_of
from openk3.pretrained import build_model, load_pretrained
from openk3.vision import vision_preset
from tests.conftest import shared_path

PAD = 277  # k3-test-tiny media_placeholder_token_id



def mm_config():
    cfg = openk3.preset("k3-test-tiny").as_k3_wrapper()
    cfg.wrapper["vision_config"] = vision_preset("tiny").to_dict()
    return cfg


@pytest.fixture(scope="module")
def model():
    return build_model(mm_config(), seed=3).eval()


def images(seed=0):
    """Two images: grids (1, 4, 6) -> 6 tokens and (1, 2, 2) -> 1 token."""
    g = torch.Generator().manual_seed(seed)
    grids = [(1, 4, 6), (1, 2, 2)]
    pv = torch.randn(sum(t * h * w for t, h, w in grids), 3, 14, 14, generator=g)
    return pv, grids


def test_built_from_vision_config_only():
    assert type(build_model(openk3.preset("k3-test-tiny"))) is K3ForCausalLM
    m = build_model(mm_config())
    assert isinstance(m, K3ForConditionalGeneration) and isinstance(m, K3ForCausalLM)
    names = set(m.state_dict())
    assert "vision_tower.encoder.blocks.1.wqkv.weight" in names and "mm_projector.proj.2.weight" in names
    bad = mm_config()
    bad.wrapper["vision_config"]["text_hidden_size"] = 32
    with pytest.raises(ValueError, match="text_hidden_size"):
        vision_config_of(bad)


def test_features_replace_exactly_the_pad_positions(model):
    pv, grids = images()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 250, (2, 12), generator=g)  # never the pad id
    ids[0, 3:9] = PAD       # image 0: 6 tokens in row 0
    ids[1, 10] = PAD        # image 1: 1 token in row 1
    with torch.no_grad():
        feats = model.encode_images(pv, grids)
        # independent reference for the features: tower, 2x2 merge and projector applied one by one
        alone = [model.mm_projector(model.vision_tower(pv[:24], [grids[0]])),
                 model.mm_projector(model.vision_tower(pv[24:], [grids[1]]))]
        emb = model.embed_with_images(ids, feats)
        plain = model.model.embed_tokens(ids)
    assert feats.shape == (7, 64)
    torch.testing.assert_close(feats, torch.cat(alone), atol=1e-5, rtol=0)  # packing: fp32 rounding only
    assert torch.equal(emb[0, 3:9], feats[:6]) and torch.equal(emb[1, 10], feats[6])
    mask = ids == PAD
    assert torch.equal(emb[~mask], plain[~mask])
    with torch.no_grad():
        out = model(ids, pixel_values=pv, grid_thws=grids).logits
        ref = model(inputs_embeds=emb).logits
        text = model(ids).logits
    assert torch.equal(out, ref)
    # the image changes what follows it (row 0 after position 3), not what precedes it
    torch.testing.assert_close(out[0, :3], text[0, :3], atol=1e-5, rtol=0)  # causal: fp32 rounding only
    assert (out[0, 3:] - text[0, 3:]).abs().max() > 1e-2
    with pytest.raises(ValueError, match="image_features"):
        model.embed_with_images(ids, feats[:6])


def test_gradients_reach_the_tower(model):
    pv, grids = images()
    ids = torch.randint(0, 250, (1, 10))
    ids[0, 2:8] = PAD
    ids[0, 9] = PAD
    m = build_model(mm_config(), seed=4)
    out = m(ids, pixel_values=pv, grid_thws=grids, labels=ids.roll(-1, 1))
    out.loss.backward()
    assert m.vision_tower.patch_embed.proj.weight.grad.abs().sum() > 0
    assert m.mm_projector.proj[0].weight.grad.abs().sum() > 0


def test_fixture_load_save_keeps_vision_tensors_bit_exactly(tmp_path):
    root = shared_path("fixtures", "k3-ref-tiny-a")
    model = load_pretrained(root)
    assert isinstance(model, K3ForConditionalGeneration)
    model.save_pretrained(tmp_path)
    src, back = read_safetensors(str(root)), read_safetensors(str(tmp_path))
    vision = [k for k in src if k.startswith(("vision_tower.", "mm_projector."))]
    assert len(vision) == 12
    assert src.keys() == back.keys()
    for k in src:
        assert src[k].dtype == back[k].dtype and torch.equal(src[k], back[k]), k
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((root / "config.json").read_text())


def test_round_trip_and_strict_vision_loading(model, tmp_path):
    model.save_pretrained(tmp_path / "a")
    names = set(read_safetensors(str(tmp_path / "a")))
    assert "vision_tower.patch_embed.pos_emb.weight" in names and "mm_projector.post_norm.weight" in names
    assert "language_model.model.embed_tokens.weight" in names
    back = load_pretrained(tmp_path / "a")
    sd, sd2 = model.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)

    tensors = read_safetensors(str(tmp_path / "a"))
    cut = {k: v for k, v in tensors.items() if k != "mm_projector.post_norm.weight"}
    save_file(cut, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(ValueError, match="mm_projector.post_norm.weight"):
        load_pretrained(tmp_path / "a")
    wrong = dict(tensors, **{"vision_tower.encoder.final_layernorm.weight": torch.ones(5)})
    save_file(wrong, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(ValueError, match="final_layernorm"):
        load_pretrained(tmp_path / "a")
    # a wrapper config whose file has no vision tensors loads as the text model, as before
    text = {k: v for k, v in tensors.items() if not k.startswith(("vision_tower.", "mm_projector."))}
    save_file(text, str(tmp_path / "a" / "model.safetensors"))
    assert type(load_pretrained(tmp_path / "a")) is K3ForCausalLM
