"""Whole-model invariants on the tiny presets: cache paths equal the full forward, padding and
packing are exact, checkpoints round-trip bit-exactly, parameter counts match the K3 report."""

import json
import subprocess
import sys

import pytest
import torch

from openk3.checkpoint import read_safetensors
from openk3.params import count_parameters
from openk3.pretrained import build_model, load_pretrained
from openk3.config import preset
from safetensors.torch import save_file
from tests.conftest import assert_close, perturb

PRESETS = ["k3-test-tiny", "k3-test-tiny-noqlora", "kimi-linear-tiny"]


def sharp(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Perturb every tensor so that no branch is trivially near zero (AttnRes queries, router
    bias, norms): the standard init makes many comparisons vacuous."""
    return perturb(model, 4.0, seed)


def greedy_full(model, ids, n):
    seq = ids
    for _ in range(n):
        nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    return seq[:, ids.shape[1]:]


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("init", ["standard", "sharp"])
@torch.no_grad()
def test_prefill_then_decode_equals_full_forward(name, init):
    model = build_model(preset(name), seed=1)
    if init == "sharp":
        sharp(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 70))
    full = model(ids).logits
    cache = model.new_cache(2, 80)
    pre = model(ids[:, :50], cache).logits
    steps = [model(ids[:, t:t + 1], cache).logits for t in range(50, 70)]
    got = torch.cat([pre] + steps, 1)
    assert_close(got, full, atol=1e-3, what=f"{name} prefill+decode")
    assert torch.equal(got.argmax(-1), full.argmax(-1))
    assert cache.lengths.tolist() == [70, 70]


@torch.no_grad()
def test_greedy_decode_through_cache_matches_full_argmax():
    model = sharp(build_model(preset("k3-test-tiny"), seed=2))
    ids = torch.randint(0, 512, (1, 9))
    want = greedy_full(model, ids, 8)
    cache = model.new_cache(1, 32)
    logits = model(ids, cache).logits[:, -1]
    got = []
    for _ in range(8):
        nxt = logits.argmax(-1, keepdim=True)
        got.append(nxt)
        logits = model(nxt, cache).logits[:, -1]
    assert torch.equal(torch.cat(got, 1), want)


@pytest.mark.parametrize("name", PRESETS)
@torch.no_grad()
def test_chunked_prefill_with_history_and_padding(name):
    model = sharp(build_model(preset(name), seed=3))
    lens = [37, 70, 5]
    ids = torch.randint(0, 512, (3, 70))
    cache = model.new_cache(3, 80)
    outs = []
    for start in range(0, 70, 30):  # chunks of 30 with history in the cache, ragged rows
        chunk = ids[:, start:start + 30]
        valid = torch.tensor([max(0, min(l - start, chunk.shape[1])) for l in lens])
        outs.append(model(chunk, cache, lengths=valid).logits)
    got = torch.cat(outs, 1)
    assert cache.lengths.tolist() == lens
    for b, l in enumerate(lens):
        alone = model(ids[b:b + 1, :l]).logits[0]
        assert_close(got[b, :l], alone, atol=1e-4, what=f"{name} row {b}")
    # the padded rows then decode correctly from their own length
    nxt = torch.randint(0, 512, (3, 1))
    step = model(nxt, cache).logits[:, -1]
    for b, l in enumerate(lens):
        alone = model(torch.cat([ids[b:b + 1, :l], nxt[b:b + 1]], 1)).logits[0, -1]
        assert_close(step[b], alone, atol=1e-4, what=f"{name} row {b} decode after padding")


@pytest.mark.parametrize("name", ["k3-test-tiny", "kimi-linear-tiny"])
@torch.no_grad()
def test_packed_documents_equal_separate_forwards(name):
    model = sharp(build_model(preset(name), seed=4))
    docs = [torch.randint(0, 512, (1, n)) for n in (17, 70, 9)]
    packed = torch.cat(docs, 1)
    cu = torch.tensor([0, 17, 87, 96])
    got = model(packed, cu_seqlens=cu).logits[0]
    want = torch.cat([model(d).logits[0] for d in docs])
    assert_close(got, want, atol=1e-4, what="packed vs separate")


def test_loss_and_backward():
    model = build_model(preset("k3-test-tiny"), seed=5)
    ids = torch.randint(0, 512, (2, 20))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    out = model(ids, labels=labels)
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert_close(out.loss, ref, atol=1e-6, what="loss")
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    # layer 0's mixer AttnRes site exists in the checkpoint but is never used (architecture.md §2)
    unused = {"model.layers.0.self_attention_res_norm.weight", "model.layers.0.self_attention_res_proj.weight"}
    assert all(grads[n] is None or not grads[n].any() for n in unused)
    assert all(g is not None and torch.isfinite(g).all() for n, g in grads.items() if n not in unused)
    assert grads["model.layers.3.self_attn.kv_b_proj.weight"].abs().sum() > 0
    assert grads["model.layers.1.block_sparse_moe.experts.w1"].abs().sum() > 0


@pytest.mark.parametrize("name", PRESETS)
def test_save_load_round_trip_is_bit_exact(name, tmp_path):
    model = sharp(build_model(preset(name), seed=6))
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_bytes=40_000)
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        want = model(ids).logits
    for sub in ("one", "sharded"):
        back = load_pretrained(tmp_path / sub)
        sd, sd2 = model.state_dict(), back.state_dict()
        assert sd.keys() == sd2.keys()
        assert all(torch.equal(sd[k], sd2[k]) for k in sd)
        with torch.no_grad():
            assert torch.equal(back(ids).logits, want)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert not (tmp_path / "sharded" / "model.safetensors").exists()


def test_k3_wrapper_writes_official_names(tmp_path):
    from openk3.vision.config import vision_preset

    cfg = preset("k3-test-tiny").as_k3_wrapper()
    cfg.wrapper["vision_config"] = vision_preset("tiny").to_dict()
    model = build_model(cfg)
    model.save_pretrained(tmp_path)
    names = set(read_safetensors(str(tmp_path)))
    assert "language_model.lm_head.weight" in names
    assert "language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight" in names
    assert "language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias" in names
    assert "language_model.model.layers.0.self_attn.q_conv1d.weight" in names
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "kimi_k3"


def test_bad_checkpoints_name_the_tensor(tmp_path):
    model = build_model(preset("k3-test-tiny"))
    model.save_pretrained(tmp_path)
    tensors = read_safetensors(str(tmp_path))
    gone = dict(tensors)
    del gone["model.layers.3.self_attn.kv_b_proj.weight"]
    save_file(gone, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.3\.self_attn\.kv_b_proj\.weight"):
        load_pretrained(tmp_path)
    bad = dict(tensors)
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight: shape \(3, 3\)"):
        load_pretrained(tmp_path)
    expert = dict(tensors)
    del expert["model.layers.2.block_sparse_moe.experts.5.w3.weight"]
    save_file(expert, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts\.5\.w3\.weight"):
        load_pretrained(tmp_path)
    extra = dict(tensors)
    extra["model.layers.0.self_attn.surprise.weight"] = torch.zeros(1)
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensor model.layers.0.self_attn.surprise"):
        load_pretrained(tmp_path)


def test_parameter_counts_of_the_released_config():
    counts = count_parameters(preset("kimi-k3"))
    assert counts["total"] == 2_779_484_476_000
    assert counts["active"] == 104_189_612_640


def test_parameter_estimate_is_the_count_and_a_config_beyond_memory_is_refused_before_building(monkeypatch):
    """``estimate_parameters`` (one layer per kind) equals the full meta-built count; a config
    whose weights exceed the memory available (a million layers; a small limit for the tiny
    one) is a ValueError naming the count and the memory, raised before any module is built."""
    import time

    import openk3.model
    from openk3.params import estimate_parameters
    from openk3.pretrained import check_fits_memory

    for name in ("k3-test-tiny", "openk3-tiny", "kimi-k3"):
        cfg = preset(name)
        assert estimate_parameters(cfg) == count_parameters(cfg)["total"], name
    tiny = preset("k3-test-tiny")
    n = count_parameters(tiny)["total"]
    check_fits_memory(tiny, available=4 * n)  # fp32: exactly 4 bytes each fit
    with pytest.raises(ValueError) as e:
        check_fits_memory(tiny, available=4 * n - 1)
    assert f"config: {n:,} parameters x 4 bytes (torch.float32)" in str(e.value)
    check_fits_memory(tiny, dtype=torch.bfloat16, available=2 * n)
    deep = tiny.replace(num_hidden_layers=1_000_000, layer_types=tiny.layer_types[:1] * 1_000_000,
                        mlp_layer_types=tiny.mlp_layer_types[-1:] * 1_000_000)
    built = []
    monkeypatch.setattr(openk3.model.K3Model, "__init__", lambda *a, **k: built.append(1))
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"config: [\d,]+ parameters x 4 bytes .* GiB of memory available on cpu"):
        build_model(deep)
    assert built == [] and time.monotonic() - t0 < 30


def test_cli_info_json():
    out = subprocess.run([sys.executable, "-m", "openk3.cli", "info", "--config", "kimi-k3", "--json"],
                         capture_output=True, text=True, check=True)
    d = json.loads(out.stdout)
    assert (d["total"], d["active"]) == (2_779_484_476_000, 104_189_612_640)
    assert d["vision"]["vision_tower"] == 401_214_464
    bad = subprocess.run([sys.executable, "-m", "openk3.cli", "info", "--config", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "nope" in bad.stderr


@torch.no_grad()
def test_cache_overflow_leaves_the_cache_untouched():
    model = sharp(build_model(preset("k3-test-tiny"), seed=7))
    ids = torch.randint(0, 512, (1, 12))
    cache = model.new_cache(1, 10)
    model(ids[:, :8], cache)
    before = [(e.recurrent.clone(), e.conv.clone()) if hasattr(e, "recurrent") else (e.latent.clone(),) for e in cache.layers]
    with pytest.raises(ValueError, match="cache overflow: row 0 holds 8 tokens and needs 4 more, capacity is 10"):
        model(ids[:, 8:12], cache)
    after = [(e.recurrent, e.conv) if hasattr(e, "recurrent") else (e.latent,) for e in cache.layers]
    assert all(torch.equal(a, b) for x, y in zip(before, after) for a, b in zip(x, y))
    assert cache.lengths.tolist() == [8]
    # decoding on from the intact cache still matches the full forward
    step = model(ids[:, 8:10], cache).logits
    assert_close(step, model(ids[:, :10]).logits[:, 8:], atol=1e-4, what="after a refused call")


def test_out_of_range_token_ids_raise_value_error():
    model = build_model(preset("k3-test-tiny"))
    for bad in (torch.tensor([[600]]), torch.tensor([[-1]])):
        with pytest.raises(ValueError, match="input_ids: values must be in"):
            model(bad)
    with pytest.raises(ValueError, match="input_ids: expected an int64"):
        model(torch.tensor([[1.0]]))


def test_damaged_checkpoints_raise_value_errors_naming_the_file(tmp_path):
    model = build_model(preset("k3-test-tiny"))
    model.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        load_pretrained(tmp_path)
    f.write_bytes(b"")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_pretrained(tmp_path)
    f.unlink()
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("[1, 2]")
    with pytest.raises(ValueError, match="weight_map"):
        load_pretrained(tmp_path)
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "../../etc/passwd"}}))
    with pytest.raises(ValueError, match="not a file name in the checkpoint directory"):
        load_pretrained(tmp_path)


def test_dtypes_on_load_and_build(tmp_path):
    model = sharp(build_model(preset("k3-test-tiny"), seed=8))
    tensors = None
    model.save_pretrained(tmp_path)
    tensors = read_safetensors(str(tmp_path))
    mixed = dict(tensors)
    mixed["lm_head.weight"] = mixed["lm_head.weight"].to(torch.bfloat16)  # a stray bf16 tensor
    save_file(mixed, str(tmp_path / "model.safetensors"))
    back = load_pretrained(tmp_path)
    assert back.lm_head.weight.dtype == torch.float32
    back(torch.randint(0, 512, (1, 5)))  # one compute dtype: runs
    ints = dict(tensors)
    ints["model.embed_tokens.weight"] = ints["model.embed_tokens.weight"].to(torch.int64)
    save_file(ints, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.embed_tokens.weight: dtype torch.int64"):
        load_pretrained(tmp_path)
    bf = build_model(preset("k3-test-tiny"), dtype=torch.bfloat16)
    dtypes = {n: t.dtype for n, t in list(bf.named_parameters()) + list(bf.named_buffers())}
    assert dtypes["model.layers.0.self_attn.A_log"] == torch.float32
    assert dtypes["model.layers.1.block_sparse_moe.gate.weight"] == torch.float32
    assert dtypes["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"] == torch.float32
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16


def test_tied_embeddings_stay_tied(tmp_path):
    model = build_model(preset("k3-test-tiny").replace(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in read_safetensors(str(tmp_path))
    back = load_pretrained(tmp_path)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    ids = torch.randint(0, 512, (1, 6))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


@torch.no_grad()
def test_lengths_values_are_checked_once_per_forward(monkeypatch):
    """The model forward reads the values of ``lengths`` once (varlen.check_lengths); the layers
    and ops under it check shapes only, and a bad value is still refused at the boundary."""
    import openk3.layers.kda
    import openk3.layers.mla
    import openk3.model
    import openk3.ops.attention
    import openk3.ops.kda_inputs
    import openk3.ops.short_conv
    from openk3.ops import varlen

    value_checks = []

    def counting(lengths, batch, total, name="lengths", *, values=True):
        value_checks.append(values)
        varlen.check_lengths(lengths, batch, total, name, values=values)

    for mod in (
        openk3.model,
        openk3.layers.kda,
        openk3.layers.mla,
        openk3.ops.attention,
        openk3.ops.kda_inputs,
        openk3.ops.short_conv,
    ):
        monkeypatch.setattr(mod, "check_lengths", counting)
    model = build_model(preset("k3-test-tiny"), seed=3)
    ids = torch.randint(0, 512, (2, 6))
    lengths = torch.tensor([6, 4])
    for cache in (None, model.new_cache(2, 16)):
        value_checks.clear()
        model(ids, cache, lengths=lengths)
        assert value_checks.count(True) == 1, value_checks
        assert len(value_checks) > 1  # the layers and ops did run their shape checks
    with pytest.raises(ValueError, match=r"lengths: expected \[B=2\] values in \[0, T=6\], got \[7, 4\]"):
        model(ids, lengths=torch.tensor([7, 4]))
