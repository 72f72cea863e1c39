"""``openk3 export``: a trainer checkpoint becomes a servable directory whose MXFP4-packed experts
compute exactly what the float model computes with its experts fake-quantized; names of shipped
models resolve; a failed or refused export leaves nothing behind."""

from __future__ import annotations

import json

import pytest
import torch

from openk3.checkpoint import read_safetensors
from openk3.export import export_model
from openk3.pretrained import load_pretrained
from openk3.quant.packed import compressed_tensors_config
from openk3.quant.qat import resolve_scheme
from openk3.shipped import SHIPPED_DIR, resolve_model_path, shipped_model_path
from tests.server.checkpoint import build_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The server tests' tiny checkpoint, re-saved with MX-compatible expert widths (multiples of 32)."""
    from openk3.pretrained import build_model

    d = build_checkpoint(tmp_path_factory.mktemp("export") / "src")
    cfg = load_pretrained(d).config.replace(moe_intermediate_size=32)
    build_model(cfg, seed=1).save_pretrained(str(d))
    return d


def test_mxfp4_export_reloads_with_quantized_expert_logits(ckpt, tmp_path):
    out = tmp_path / "served"
    res = export_model(ckpt, out)
    assert res["max_abs_logit_diff"] is not None and res["max_abs_logit_diff"] <= 1e-5
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    tensors = read_safetensors(str(out))
    packed = [k for k in tensors if k.endswith("weight_packed")]
    assert packed and all(tensors[k].dtype == torch.uint8 for k in packed)
    # a plain (non-wrapper) config is the text config: the released compressed-tensors block sits at its top
    assert json.loads((out / "config.json").read_text())["quantization_config"] == compressed_tensors_config("mxfp4")
    # independent check: fake-quantize the source experts ourselves and compare logits
    src = load_pretrained(ckpt, dtype=torch.float32)
    sch = resolve_scheme("mxfp4")
    with torch.no_grad():
        for n, p in src.named_parameters():
            if ".block_sparse_moe.experts." in n:
                p.copy_(sch.fake_quant_weight(p))
        ids = torch.arange(3, 40).unsqueeze(0)
        diff = (load_pretrained(out, dtype=torch.float32)(ids).logits - src(ids).logits).abs().max().item()
    assert diff <= 1e-5


def test_float_export_is_bit_exact(ckpt, tmp_path):
    export_model(ckpt, tmp_path / "f", quantization=None)
    a, b = read_safetensors(str(ckpt)), read_safetensors(str(tmp_path / "f"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # every file of the export is readable by others (safetensors alone would create 0600 weights)
    import os

    mask = os.umask(0)
    os.umask(mask)
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "f").iterdir()} == \
        {p.name: 0o666 & ~mask for p in (tmp_path / "f").iterdir()}


def test_existing_destination_is_refused_and_untouched(ckpt, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="exists"):
        export_model(ckpt, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_failed_export_leaves_no_partial_directory(ckpt, tmp_path):
    with pytest.raises(ValueError):
        export_model(ckpt, tmp_path / "x", quantization="nf4")
    assert list(tmp_path.iterdir()) == []


def test_cli_export_reports_errors(ckpt, tmp_path, capsys):
    from openk3.cli import main

    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "o")]) == 2
    assert "openk3 export:" in capsys.readouterr().err
    assert main(["export", str(ckpt), str(tmp_path / "o"), "--quantization", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["files"]


def test_shipped_names_resolve_but_never_shadow_a_local_path(tmp_path, monkeypatch):
    assert resolve_model_path("openk3-tiny") == str(SHIPPED_DIR / "openk3-tiny")
    assert resolve_model_path("no-such-model") == "no-such-model"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "openk3-tiny").mkdir()
    assert resolve_model_path("openk3-tiny") == "openk3-tiny"
    with pytest.raises(ValueError, match="unknown shipped model 'gpt'"):
        shipped_model_path("gpt")
