"""Memory planner: Kimi K3 numbers equal architecture.md §14 (27,648 B/token MLA latent in BF16,
414 MiB fp32 KDA state per sequence), weight bytes by format, sequences that fit, and the
``openk3 plan`` / ``openk3 generate`` commands."""

from __future__ import annotations

import shutil

import pytest
import torch

import openk3
from openk3.cli import main
from openk3.engine.planner import (GPU_MEMORY, kda_state_bytes, kv_bytes_per_token, parse_gpus, plan,
                                   sequence_bytes, weight_bytes)
from tests.conftest import shared_path

MIB = 2**20


def test_kimi_k3_decode_state_matches_architecture_section_14():
    cfg = openk3.preset("kimi-k3")
    assert kv_bytes_per_token(cfg) == 27_648  # 24 MLA layers x (512 + 64) x 2 B
    assert kv_bytes_per_token(cfg) * 1_048_576 == 27 * 2**30  # "27 GiB at 1,048,576 tokens"
    kda = kda_state_bytes(cfg)
    assert kda["recurrent"] == 414 * MIB  # 69 x 96 x 128 x 128 x 4 B
    assert round(kda["conv"] / MIB, 1) == 14.6  # 69 x 3 x 12,288 x 3 x 2 B
    assert kda_state_bytes(cfg, torch.float32)["recurrent"] == 414 * MIB  # the recurrent state is always fp32
    assert sequence_bytes(cfg, 1000) == kda["total"] + 1000 * 27_648


def test_kimi_k3_weights_and_fit():
    cfg = openk3.preset("kimi-k3")
    w = weight_bytes(cfg)
    # routed experts: 92 layers x 896 experts x 3 x 3584 x 3072 values at 4.25 bits = 17,547,264 B per
    # expert (k3-release-notes.md §1.9)
    assert w["params"]["mxfp4"] == 92 * 896 * 3 * 3584 * 3072
    assert w["mxfp4"] == 92 * 896 * 17_547_264
    assert w["params"]["mxfp4"] + w["params"]["bf16"] == 2_779_484_476_000  # architecture.md §12
    assert w["bf16"] == 2 * w["params"]["bf16"]
    # the preset carries the released vision_config: MoonViT-V2 tower 401,214,464 + projector
    # 46,144,512 parameters (architecture.md §11), in BF16 as `openk3 info` lists them
    assert w["params"]["vision"] == 401_214_464 + 46_144_512 and w["vision"] == 2 * w["params"]["vision"]
    assert w["total"] == w["mxfp4"] + w["bf16"] + w["vision"]
    assert w["total"] == weight_bytes(cfg.replace(wrapper=None))["total"] + w["vision"]
    p = plan(cfg, "8xH200", 1_048_576)
    assert p.max_sequences == 0 and "do not fit" in p.notes[0]  # 1.56 TB of weights > 8 x 141 GB
    p = plan(cfg, "16xB300", 1_048_576)
    free = 16 * 288e9 * 0.9 - w["total"]
    assert p.max_sequences == int(free // (kda_state_bytes(cfg)["total"] + 1_048_576 * 27_648)) == 87
    assert parse_gpus("8xH200") == (8, "H200", GPU_MEMORY["H200"])
    assert parse_gpus("2x96GiB") == (2, "96GiB", 96 * 2**30)
    for bad in ("8xFOO", "0xH200", "eight"):
        with pytest.raises(ValueError, match="gpus"):
            parse_gpus(bad)
    with pytest.raises(ValueError, match="context"):
        plan(cfg, "8xH200", 0)


def test_plan_command(capsys):
    assert main(["plan", "--config", "kimi-k3", "--gpus", "8xH200", "--context", "1048576"]) == 0
    out = capsys.readouterr().out
    assert "27,648 B/token" in out and "414.0 MiB fp32 recurrent" in out
    assert "2,722,740,830,208 params" in out and "fit: 0" in out
    assert main(["plan", "--config", "kimi-k3", "--gpus", "8xNOPE"]) == 2
    assert "unknown GPU" in capsys.readouterr().err


@torch.no_grad()
def test_generate_command_streams_greedy_text(tmp_path, capsys):
    from openk3.pretrained import build_model
    from openk3.tokenizer import load_tokenizer

    tok_dir = shared_path("kimi-tokenizer")
    tok = load_tokenizer(tok_dir)
    cfg = openk3.preset("k3-test-tiny").replace(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                                                eos_token_id=tok.end_of_msg_id, pad_token_id=tok.pad_id,
                                                media_placeholder_token_id=tok.media_pad_id)
    model = build_model(cfg, seed=3)
    model.save_pretrained(tmp_path)
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, tmp_path / f)
    ids = tok.encode_text("Hello K3")
    ref = []
    for _ in range(4):
        nxt = int(model(torch.tensor([ids + ref])).logits[0, -1].argmax())
        if nxt in tok.stop_token_ids:
            break
        ref.append(nxt)
    assert main(["generate", str(tmp_path), "--prompt", "Hello K3", "--max-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.out == tok.decode(ref) + "\n"
    assert "prompt" in captured.err
