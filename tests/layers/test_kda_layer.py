"""KimiDeltaAttention layer: official-reference parity, cache carry, padding, packing, both variants.

Shape legend: B batch, T tokens, D hidden, H heads, K head dim, P = H*K.
Spec: architecture.md §3; fixtures/k3-ref-tiny-a (the official reference's own per-layer outputs).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from openk3.cache import KDALayerState
from openk3.config import K3Config, preset
from openk3.layers.kda import KimiDeltaAttention
from openk3.layers.norm import rms_norm
from tests.conftest import assert_close, shared_path

FIXTURE = ("fixtures", "k3-ref-tiny-a")
VARIANTS = ["k3-test-tiny", "kimi-linear-tiny"]


def make_layer(name: str) -> KimiDeltaAttention:
    """Layer 0 of a preset with weights drawn like the fixture's (large enough to exercise every path)."""
    layer = KimiDeltaAttention(preset(name), 0)
    with torch.no_grad():
        for pname, p in layer.named_parameters():
            if pname == "A_log":
                continue  # keep the variant's own init (0 for K3, log U[1,16] for Kimi Linear)
            if pname == "dt_bias":
                p.normal_(0.0 if layer.gate_lower_bound is not None else -2.0, 1.0)
            elif pname == "o_norm.weight":
                p.normal_(1.0, 0.1)
            elif "conv1d" in pname:
                p.normal_(0.0, 0.4)
            else:
                p.normal_(0.0, 0.2)
    return layer


def zeros_state(layer: KimiDeltaAttention, batch: int) -> KDALayerState:
    P, W, H, K = layer.proj_dim, layer.conv_size, layer.num_heads, layer.head_dim
    return KDALayerState(torch.zeros(batch, 3, P, W - 1), torch.zeros(batch, H, K, K))


def random_state(layer: KimiDeltaAttention, batch: int) -> KDALayerState:
    s = zeros_state(layer, batch)
    return KDALayerState(torch.randn_like(s.conv), 0.3 * torch.randn_like(s.recurrent))


def clone(s: KDALayerState) -> KDALayerState:
    return KDALayerState(s.conv.clone(), s.recurrent.clone())


# ----------------------------------------------------------------------------- checkpoint layout
def test_parameter_names_and_shapes_match_checkpoint():
    from safetensors import safe_open

    root = shared_path(*FIXTURE)
    cfg = K3Config.from_pretrained(root)
    layer = KimiDeltaAttention(cfg, 0)
    shapes = {n: tuple(p.shape) for n, p in layer.state_dict().items()}
    assert shapes["A_log"] == (4,) and shapes["dt_bias"] == (64,)
    assert shapes["q_conv1d.weight"] == (64, 1, 4) and shapes["o_norm.weight"] == (16,)
    assert layer.A_log.dtype == layer.dt_bias.dtype == torch.float32
    prefix = "language_model.model.layers.0.self_attn."
    with safe_open(str(root / "model.safetensors"), "pt") as f:
        ckpt = {k[len(prefix):]: tuple(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith(prefix)}
    assert shapes == ckpt

    kl = KimiDeltaAttention(preset("kimi-linear-tiny"), 0)
    names = set(kl.state_dict())
    assert {"g_a_proj.weight", "g_b_proj.weight"} <= names and "g_proj.weight" not in names
    assert kl.g_a_proj.weight.shape == (16, 64) and kl.g_b_proj.weight.shape == (64, 16)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_matches_official_reference_fixture(mode):
    """Layer output and prefill cache vs what the official modeling code recorded (short batch, 37 tokens)."""
    from safetensors.torch import load_file

    root = shared_path(*FIXTURE)
    cfg = K3Config.from_pretrained(root)
    weights = load_file(str(root / "model.safetensors"))
    rec = load_file(str(root / "reference_outputs.safetensors"))
    for i in (0, 1, 2, 4):
        layer = KimiDeltaAttention(cfg, i)
        prefix = f"language_model.model.layers.{i}."
        layer.load_state_dict({k[len(prefix) + 10:]: v for k, v in weights.items()
                               if k.startswith(prefix + "self_attn.")}, strict=True)
        x = rms_norm(rec[f"short.hidden.layer{i}.attn_in"], weights[prefix + "input_layernorm.weight"], cfg.rms_norm_eps)
        state = zeros_state(layer, x.shape[0])
        with torch.no_grad():
            y = layer(x, state, mode=mode)
        assert_close(y, rec[f"short.hidden.layer{i}.mixer_out"], atol=5e-5, what=f"layer {i} mixer_out")
        # The reference stores S as [B, H, V, K] and keeps W (not W-1) conv inputs.
        assert_close(state.recurrent, rec[f"short.prefill_cache.layer{i}.kda_state"].transpose(-1, -2),
                     atol=1e-5, what=f"layer {i} recurrent state")
        for j, name in enumerate("qkv"):
            assert_close(state.conv[:, j], rec[f"short.prefill_cache.layer{i}.conv_state_{name}"][..., 1:],
                         atol=1e-6, what=f"layer {i} conv tail {name}")


# ----------------------------------------------------------------------------- cache and modes
@pytest.mark.parametrize("name", VARIANTS)
def test_prefill_then_decode_equals_full_pass(name):
    layer = make_layer(name)
    B, N, steps = 2, 37, 5
    x = torch.randn(B, N + steps, layer.hidden_size)
    with torch.no_grad():
        full = layer(x, mode="chunk")
        full_rec = layer(x, mode="recurrent")
        state = zeros_state(layer, B)
        parts = [layer(x[:, :N], state, mode="chunk")]
        for t in range(N, N + steps):
            parts.append(layer(x[:, t:t + 1], state, mode="recurrent"))
        end_state = zeros_state(layer, B)
        layer(x, end_state, mode="chunk")
    assert_close(full_rec, full, atol=1e-5, what="recurrent vs chunk mode, full pass")
    assert_close(torch.cat(parts, 1), full, atol=1e-5, what="prefill + decode vs full pass")
    assert_close(state.recurrent, end_state.recurrent, atol=1e-5, what="state after decode")
    assert_close(state.conv, end_state.conv, atol=1e-5, what="conv tails after decode")


@pytest.mark.parametrize("name", VARIANTS)
def test_multi_token_continuation_from_a_given_state(name):
    layer = make_layer(name)
    B = 2
    x = torch.randn(B, 90, layer.hidden_size)
    start = random_state(layer, B)
    with torch.no_grad():
        s_full = clone(start)
        full = layer(x, s_full, mode="chunk")
        s_parts = clone(start)
        parts = [layer(x[:, :70], s_parts, mode="chunk"), layer(x[:, 70:], s_parts, mode="recurrent")]
    assert_close(torch.cat(parts, 1), full, atol=1e-5, what="70 + 20 tokens vs 90")
    assert_close(s_parts.recurrent, s_full.recurrent, atol=1e-5, what="recurrent state")
    assert_close(s_parts.conv, s_full.conv, atol=1e-5, what="conv tails")


@pytest.mark.parametrize("name", VARIANTS)
def test_fused_qkv_projection_and_conv_equal_the_separate_ones(name, monkeypatch):
    # One [D, 3P] projection and one short conv over 3P channels (multi-token calls) against the
    # three projection + conv pairs: the mixed q/k/v, the new conv tails and the whole layer step
    # (outputs, recurrent state) agree, from a given state, with a padded row.
    layer = make_layer(name)
    B, T = 3, 37
    x = torch.randn(B, T, layer.hidden_size)
    lengths = torch.tensor([37, 11, 2])
    start = random_state(layer, B)
    with torch.no_grad():
        fused, tail_f, _ = layer._mixed_fused(x, start.conv, lengths)
        sep, tail_s, _ = layer._mixed_separate(x, start.conv, lengths, "chunk")
        for a, b, what in zip(fused, sep, "qkv"):
            assert_close(a, b, atol=1e-6, what=f"mixed {what}")
        assert_close(tail_f, tail_s, atol=0.0, what="conv tails")
        s_fused = clone(start)
        y_fused = layer(x, s_fused, lengths=lengths, mode="chunk")
        monkeypatch.setattr(KimiDeltaAttention, "_plain_projections", lambda self: False)
        s_sep = clone(start)
        y_sep = layer(x, s_sep, lengths=lengths, mode="chunk")
    assert_close(y_fused, y_sep, atol=1e-6, what="layer output")
    assert_close(s_fused.recurrent, s_sep.recurrent, atol=1e-6, what="recurrent state")
    assert torch.equal(s_fused.conv, s_sep.conv)


@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_marked_states_equal_the_states_of_calls_cut_there(mode, separate, monkeypatch):
    # One call over 200 tokens with marks at 64 and 128 (row 0) and 64 (row 1, 150 valid tokens)
    # hands over exactly the states that calls cut at those points store, and changes nothing
    # else: same outputs and final state as the call without marks.
    if separate:
        monkeypatch.setattr(KimiDeltaAttention, "_plain_projections", lambda self: False)
    layer = make_layer("k3-test-tiny")
    B, T = 2, 200
    x = torch.randn(B, T, layer.hidden_size)
    lengths = torch.tensor([200, 150])
    start = random_state(layer, B)
    marks = ((0, 64), (0, 128), (1, 64))
    with torch.no_grad():
        plain = clone(start)
        y_plain = layer(x, plain, lengths=lengths, mode=mode)
        marked = clone(start)
        marked.marks = marks
        y = layer(x, marked, lengths=lengths, mode=mode)
        assert torch.equal(y, y_plain) and torch.equal(marked.recurrent, plain.recurrent)
        assert torch.equal(marked.conv, plain.conv)
        conv, rec = marked.marked
        assert conv.shape == (3, 3, layer.proj_dim, layer.conv_size - 1) and rec.dtype == torch.float32
        for m, (b, t) in enumerate(marks):
            cut = KDALayerState(start.conv[b : b + 1].clone(), start.recurrent[b : b + 1].clone())
            layer(x[b : b + 1, :t], cut, mode=mode)
            assert torch.equal(conv[m], cut.conv[0]), f"conv tail at mark {(b, t)}"
            assert_close(rec[m], cut.recurrent[0], atol=1e-6, what=f"recurrent state at mark {(b, t)}")


def test_marks_off_the_chunk_grid_are_refused():
    layer = make_layer("k3-test-tiny")
    x = torch.randn(1, 100, layer.hidden_size)
    for bad in ((0, 50), (0, 128), (1, 64), (0, 0)):
        state = zeros_state(layer, 1)
        state.marks = (bad,)
        with pytest.raises(ValueError, match="cache.marks"):
            layer(x, state)


def test_a_hooked_projection_is_not_fused_away():
    # A forward hook on v_proj (or any wrapper) must still run: the layer falls back to the
    # separate projections.
    layer = make_layer("k3-test-tiny")
    x = torch.randn(1, 9, layer.hidden_size)
    with torch.no_grad():
        plain = layer(x, mode="chunk")
        handle = layer.v_proj.register_forward_hook(lambda m, a, out: out * 0)
        hooked = layer(x, mode="chunk")
        handle.remove()
    assert not torch.allclose(plain, hooked)
    with torch.no_grad():
        assert_close(layer(x, mode="chunk"), plain, atol=0.0, what="hook removed")


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_unequal_lengths_equal_rows_alone(mode):
    layer = make_layer("k3-test-tiny")
    T, lengths = 20, torch.tensor([20, 7, 0])
    x = torch.randn(3, T, layer.hidden_size)
    start = random_state(layer, 3)
    with torch.no_grad():
        state = clone(start)
        y = layer(x, state, lengths=lengths, mode=mode)
        for b, L in enumerate(lengths.tolist()):
            s_b = KDALayerState(start.conv[b:b + 1].clone(), start.recurrent[b:b + 1].clone())
            y_b = layer(x[b:b + 1, :L], s_b, mode=mode)
            assert_close(y[b:b + 1, :L], y_b, atol=1e-5, what=f"row {b} output")
            assert_close(state.recurrent[b:b + 1], s_b.recurrent, atol=1e-5, what=f"row {b} state")
            assert_close(state.conv[b:b + 1], s_b.conv, atol=1e-5, what=f"row {b} conv tail")
            assert torch.all(y[b, L:] == 0), "padded positions give zeros"
    assert torch.equal(state.recurrent[2], start.recurrent[2]) and torch.equal(state.conv[2], start.conv[2])


def test_decode_step_with_inactive_row_keeps_its_state():
    layer = make_layer("kimi-linear-tiny")
    x = torch.randn(3, 1, layer.hidden_size)
    start = random_state(layer, 3)
    with torch.no_grad():
        state = clone(start)
        y = layer(x, state, lengths=torch.tensor([1, 0, 1]), mode="recurrent")
        ref_state = clone(start)
        y_ref = layer(x, ref_state, mode="chunk")
    assert torch.equal(state.recurrent[1], start.recurrent[1]) and torch.equal(state.conv[1], start.conv[1])
    for b in (0, 2):
        assert_close(y[b], y_ref[b], atol=1e-5, what=f"active row {b}")
        assert_close(state.recurrent[b], ref_state.recurrent[b], atol=1e-5, what=f"active row {b} state")


def test_cu_seqlens_equals_documents_alone():
    layer = make_layer("k3-test-tiny")
    cu = torch.tensor([0, 9, 9, 39])  # documents of 9, 0 and 30 tokens
    x = torch.randn(1, 39, layer.hidden_size)
    start = random_state(layer, 3)
    with torch.no_grad():
        state = clone(start)
        y = layer(x, state, cu_seqlens=cu)
        assert y.shape == x.shape
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            s_n = KDALayerState(start.conv[n:n + 1].clone(), start.recurrent[n:n + 1].clone())
            y_n = layer(x[:, a:b], s_n)
            assert_close(y[:, a:b], y_n, atol=1e-5, what=f"document {n}")
            assert_close(state.recurrent[n:n + 1], s_n.recurrent, atol=1e-5, what=f"document {n} state")
        y_nocache = layer(x, cu_seqlens=cu)
        y_first = layer(x[:, :9])
    assert_close(y_nocache[:, :9], y_first, atol=1e-5, what="no cache: first document from zeros")


# ----------------------------------------------------------------------------- init and errors
def test_init_follows_spec():
    k3 = KimiDeltaAttention(preset("k3-test-tiny"), 0)
    kl = KimiDeltaAttention(preset("kimi-linear-tiny"), 0)
    assert torch.equal(k3.A_log, torch.zeros(4))
    assert bool(((kl.A_log >= 0) & (kl.A_log <= math.log(16.0))).all()) and kl.A_log.std() > 0
    for layer in (k3, kl):
        dt = torch.nn.functional.softplus(layer.dt_bias.double())
        assert bool(((dt >= 1e-3 * (1 - 1e-5)) & (dt <= 1e-1 * (1 + 1e-5))).all())
        assert torch.equal(layer.o_norm.weight, torch.ones(layer.head_dim))
        w = layer.q_proj.weight
        assert abs(w.std().item() - 0.02) < 0.004 and abs(w.mean().item()) < 0.004
    assert k3.gate_lower_bound == -5.0 and kl.gate_lower_bound is None


def test_invalid_arguments_raise():
    cfg = preset("k3-test-tiny")
    with pytest.raises(ValueError, match="layer_idx=3"):
        KimiDeltaAttention(cfg, 3)  # an MLA layer
    layer = KimiDeltaAttention(cfg, 0)
    x = torch.randn(2, 5, cfg.hidden_size)
    with pytest.raises(ValueError, match="x"):
        layer(x[..., :10])
    with pytest.raises(ValueError, match="mode"):
        layer(x, mode="fast")
    with pytest.raises(ValueError, match="cache.conv"):
        layer(x, zeros_state(layer, 3))
    with pytest.raises(ValueError, match="lengths"):
        layer(x, lengths=torch.tensor([6, 1]))
    with pytest.raises(ValueError, match="mutually exclusive"):
        layer(x[:1], lengths=torch.tensor([5]), cu_seqlens=torch.tensor([0, 5]))


# ----------------------------------------------------------------------------- transformers parity
def test_matches_transformers_kimi_linear_torch_path():
    """Kimi Linear variant vs transformers' KimiLinearDeltaAttention (its pure-torch fallback)."""
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention is importable; transformers would not take its torch path")
    modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    cfg = preset("kimi-linear-tiny")
    ours = make_layer("kimi-linear-tiny")
    tcfg = KimiLinearConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        linear_num_heads=cfg.linear_num_heads, linear_head_dim=cfg.linear_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, rms_norm_eps=cfg.rms_norm_eps, hidden_act="silu",
        layer_types=cfg.layer_types, pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
    )
    theirs = modeling.KimiLinearDeltaAttention(tcfg, 0).float()
    with torch.no_grad():
        for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj", "o_norm"):
            getattr(theirs, n).weight.copy_(getattr(ours, n).weight)
        theirs.conv1d.weight.copy_(torch.cat([ours.q_conv1d.weight, ours.k_conv1d.weight, ours.v_conv1d.weight]))
        fg = theirs.forget_gate
        fg.f_a_proj.weight.copy_(ours.f_a_proj.weight)
        fg.f_b_proj.weight.copy_(ours.f_b_proj.weight)
        fg.dt_bias.copy_(ours.dt_bias)
        fg.A_log.copy_(ours.A_log.view(fg.A_log.shape))
        x = torch.randn(2, 70, cfg.hidden_size)
        assert_close(ours(x), theirs(x), atol=5e-5, what="vs transformers KimiLinearDeltaAttention")
