"""GatedMLA: full causal form vs a naive float64 loop from the spec equations (architecture.md §4),
and the absorbed latent-cache path (decode, chunked prefill, ragged batches) vs the full form."""

from __future__ import annotations

import math

import pytest
import torch

from openk3.cache import MLALayerCache
from openk3.config import preset
from openk3.layers.mla import GatedMLA
from openk3.ops.backends import use_backend
from tests.conftest import assert_close


def _config(variant: str):
    base = preset("k3-test-tiny")
    return {
        "qlora+gate": base,
        "qlora": base.replace(mla_use_output_gate=False),
        "gate": base.replace(q_lora_rank=None),
        "plain": preset("kimi-linear-tiny"),  # Kimi Linear: q_proj, no gate
    }[variant]


VARIANTS = ("qlora+gate", "qlora", "gate", "plain")


def _layer(variant: str) -> GatedMLA:
    cfg = _config(variant)
    m = GatedMLA(cfg, layer_idx=3)
    with torch.no_grad():  # O(1) logits so the softmax is far from uniform
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    return m


def _rms(x, w, eps):
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w


def naive_mla(m: GatedMLA, x: torch.Tensor):
    """Spec §4 equations token by token and head by head, float64. Returns (y, max logit per head)."""
    W = {k: v.double() for k, v in m.state_dict().items()}
    B, T, _ = x.shape
    H, N, R, V, C = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    x = x.double()
    y = torch.zeros(B, T, m.hidden_size, dtype=torch.float64)
    best = torch.full((H,), -math.inf, dtype=torch.float64)
    for b in range(B):
        qs, ks, vs = [], [], []
        for t in range(T):
            xt = x[b, t]
            if m.q_lora_rank is None:
                q = W["q_proj.weight"] @ xt
            else:
                q = W["q_b_proj.weight"] @ _rms(W["q_a_proj.weight"] @ xt, W["q_a_layernorm.weight"], 1e-6)
            ckv_kr = W["kv_a_proj_with_mqa.weight"] @ xt
            c_hat = _rms(ckv_kr[:C], W["kv_a_layernorm.weight"], 1e-6)
            k_r = ckv_kr[C:]
            kv = W["kv_b_proj.weight"] @ c_hat
            qs.append([q[h * (N + R):(h + 1) * (N + R)] for h in range(H)])
            ks.append([torch.cat([kv[h * (N + V):h * (N + V) + N], k_r]) for h in range(H)])
            vs.append([kv[h * (N + V) + N:(h + 1) * (N + V)] for h in range(H)])
        for t in range(T):
            heads = []
            for h in range(H):
                logits = torch.stack([qs[t][h] @ ks[j][h] for j in range(t + 1)]) / math.sqrt(N + R)
                best[h] = max(best[h], logits.max())
                p = torch.softmax(logits, 0)
                heads.append(sum(p[j] * vs[j][h] for j in range(t + 1)))
            o = torch.cat(heads)
            if m.use_output_gate:
                o = o * torch.sigmoid(W["g_proj.weight"] @ x[b, t])
            y[b, t] = W["o_proj.weight"] @ o
    return y, best


@pytest.mark.parametrize("variant", VARIANTS)
def test_full_form_matches_naive_spec_loop(variant):
    m = _layer(variant)
    if m.q_lora_rank is not None:
        with torch.no_grad():  # tiny pre-norm activations make the 1e-6 latent-norm eps visible
            m.q_a_proj.weight.mul_(0.01)
            m.kv_a_proj_with_mqa.weight[: m.kv_lora_rank].mul_(0.01)
    x = torch.randn(2, 6, m.hidden_size)
    ml = torch.full((m.num_heads,), -math.inf)
    y = m(x, max_logits_out=ml)
    want, best = naive_mla(m, x)
    assert_close(y, want, atol=1e-5, what=f"{variant}: full form vs naive")
    assert_close(ml, best, atol=1e-4, what=f"{variant}: max logits vs naive")


def test_checkpoint_names_and_init():
    expect_common = {"kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"}
    names = {v: set(_layer(v).state_dict()) for v in VARIANTS}
    assert names["qlora+gate"] == expect_common | {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "g_proj.weight"}
    assert names["qlora"] == expect_common | {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"}
    assert names["gate"] == expect_common | {"q_proj.weight", "g_proj.weight"}
    assert names["plain"] == expect_common | {"q_proj.weight"}
    cfg = _config("qlora+gate")
    m = GatedMLA(cfg, 0)
    H, N, R, V, C = 4, 16, 8, 16, 16
    assert m.q_b_proj.weight.shape == (H * (N + R), cfg.q_lora_rank)
    assert m.kv_a_proj_with_mqa.weight.shape == (C + R, cfg.hidden_size)
    assert m.kv_b_proj.weight.shape == (H * (N + V), C)
    assert m.g_proj.weight.shape == (H * V, cfg.hidden_size) and m.o_proj.weight.shape == (cfg.hidden_size, H * V)
    assert m.q_a_layernorm.eps == 1e-6 and m.kv_a_layernorm.eps == 1e-6
    assert torch.equal(m.kv_a_layernorm.weight, torch.ones(C))
    w = torch.cat([p.flatten() for n, p in m.named_parameters() if "layernorm" not in n])
    assert abs(w.std().item() - cfg.initializer_range) < 0.1 * cfg.initializer_range
    assert all(mod.bias is None for mod in m.modules() if isinstance(mod, torch.nn.Linear))


@pytest.mark.parametrize("grad", (True, False), ids=("autograd", "inference"))
@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_then_decode_equals_full(variant, grad):
    # With autograd the cached prefill runs the dense latent form; without it (the engine) the tiled one.
    m = _layer(variant)
    B, T, T0 = 2, 10, 4
    x = torch.randn(B, T, m.hidden_size)
    with torch.set_grad_enabled(grad):
        full = m(x)
        cache = MLALayerCache.zeros(m_cfg := _config(variant), B, capacity=T)
        assert m_cfg.kv_lora_rank == cache.latent.shape[-1]
        outs = [m(x[:, :T0], cache, past_lengths=torch.zeros(B, dtype=torch.long))]
        past = torch.full((B,), T0)
        for t in range(T0, T):
            outs.append(m(x[:, t:t + 1], cache, past_lengths=past))
            past = past + 1
    assert_close(torch.cat(outs, 1), full, atol=1e-5, what=f"{variant}: prefill + decode vs full")


@pytest.mark.parametrize("variant", ("qlora+gate", "plain"))
def test_chunked_prefill_with_history_equals_full(variant):
    m = _layer(variant)
    B, chunks = 2, (3, 4, 1, 5)
    T = sum(chunks)
    x = torch.randn(B, T, m.hidden_size)
    ml_full = torch.full((m.num_heads,), -math.inf)
    full = m(x, max_logits_out=ml_full)
    cache = MLALayerCache.zeros(_config(variant), B, capacity=T + 3)
    ml_cached = torch.full((m.num_heads,), -math.inf)
    outs, start = [], 0
    for n in chunks:
        past = torch.full((B,), start)
        outs.append(m(x[:, start:start + n], cache, past_lengths=past, max_logits_out=ml_cached))
        start += n
    assert_close(torch.cat(outs, 1), full, atol=1e-5, what=f"{variant}: chunked prefill vs full")
    assert_close(ml_cached, ml_full, atol=1e-5, what="absorbed vs full max logits")


@pytest.mark.parametrize("grad", (True, False), ids=("autograd", "inference"))
def test_ragged_batch_unequal_lengths_and_history(grad):
    with torch.set_grad_enabled(grad):
        m = _layer("qlora+gate")
        D = m.hidden_size
        seqs = [torch.randn(n, D) for n in (6, 8, 3)]  # each row's own token stream
        B = len(seqs)
        cache = MLALayerCache.zeros(_config("qlora+gate"), B, capacity=8)
        # Three calls with different (past, lengths) per row; right-padded inputs.
        plan = [(torch.tensor([2, 5, 0]), 5), (torch.tensor([3, 1, 2]), 3), (torch.tensor([1, 2, 1]), 2)]
        past = torch.zeros(B, dtype=torch.long)
        got = [[] for _ in range(B)]
        for lengths, T in plan:
            x = torch.randn(B, T, D) * 100  # garbage in padded slots must not leak
            for b in range(B):
                x[b, : lengths[b]] = seqs[b][past[b]:past[b] + lengths[b]]
            y = m(x, cache, lengths=lengths, past_lengths=past)
            for b in range(B):
                got[b].append(y[b, : lengths[b]])
                assert bool((y[b, lengths[b]:] == 0).all()), "padded positions must be zero"
            past = past + lengths
        for b in range(B):
            assert_close(torch.cat(got[b]), m(seqs[b][None])[0], atol=1e-5, what=f"row {b} vs its own full forward")
            assert_close(cache.latent[b, past[b]:], torch.zeros_like(cache.latent[b, past[b]:]), atol=0, what="unwritten slots")


def test_full_form_padding_matches_unpadded_rows():
    m = _layer("gate")
    x = torch.randn(2, 7, m.hidden_size)
    lengths = torch.tensor([7, 4])
    ml = torch.full((m.num_heads,), -math.inf)
    y = m(x, lengths=lengths, max_logits_out=ml)
    ml0, ml1 = torch.full_like(ml, -math.inf), torch.full_like(ml, -math.inf)
    assert_close(y[0], m(x[:1], max_logits_out=ml0)[0], atol=1e-6, what="full row")
    assert_close(y[1, :4], m(x[1:, :4], max_logits_out=ml1)[0], atol=1e-6, what="padded row")
    assert bool((y[1, 4:] == 0).all())
    assert_close(ml, torch.maximum(ml0, ml1), atol=1e-6, what="padded max logits exclude padding")


@pytest.mark.parametrize("backend", ("sdpa", "reference"))
def test_cu_seqlens_packed_equals_separate(backend):
    m = _layer("qlora+gate")
    cu = torch.tensor([0, 4, 9, 10, 15])
    x = torch.randn(1, 15, m.hidden_size)
    with use_backend("attention", backend):
        packed = m(x, cu_seqlens=cu)
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            assert_close(packed[:, s:e], m(x[:, s:e]), atol=1e-5, what=f"{backend}: document [{s}, {e})")


def test_sdpa_and_reference_gradients_agree():
    m = _layer("qlora+gate")
    x = torch.randn(2, 9, m.hidden_size)
    grads = []
    for backend in ("sdpa", "reference"):
        m.zero_grad()
        with use_backend("attention", backend):
            m(x).pow(2).sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for n in grads[0]:
        assert_close(grads[0][n], grads[1][n], atol=1e-4, rtol=1e-4, what=f"grad {n}")


def test_cache_overflow_and_bad_arguments():
    m = _layer("qlora+gate")
    cfg = _config("qlora+gate")
    cache = MLALayerCache.zeros(cfg, 2, capacity=6)
    x = torch.randn(2, 3, m.hidden_size)
    before = cache.latent.clone()
    with pytest.raises(ValueError, match="overflow"):
        m(x, cache, past_lengths=torch.tensor([2, 4]))
    assert torch.equal(cache.latent, before), "a rejected call must not write the cache"
    m(x, cache, past_lengths=torch.tensor([2, 4]), lengths=torch.tensor([3, 2]))  # exactly fits
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(x, cache, cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="past_lengths"):
        m(x, past_lengths=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="lengths"):
        m(x, cache, lengths=torch.tensor([4, 1]))
    with pytest.raises(ValueError, match="cache"):
        m(x[:1], cache)
    with pytest.raises(ValueError, match="x"):
        m(torch.randn(2, 3, 5))


@pytest.mark.parametrize("variant", ("plain", "qlora"))
def test_matches_transformers_kimi_linear_attention(variant):
    """Same checkpoint tensors into transformers' KimiLinearAttention (the predecessor's NoPE MLA,
    no output gate): checks the per-head row layouts of q_b_proj/kv_b_proj and the latent-norm eps."""
    pytest.importorskip("transformers")
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

    m = _layer(variant)
    hf_cfg = KimiLinearConfig(
        hidden_size=m.hidden_size, num_attention_heads=m.num_heads, num_key_value_heads=m.num_heads,
        q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, num_hidden_layers=4,
    )
    hf_cfg._attn_implementation = "eager"
    ref = KimiLinearAttention(hf_cfg, 3).eval()
    ref.load_state_dict(m.state_dict(), strict=True)
    x = torch.randn(2, 7, m.hidden_size)
    causal = torch.full((7, 7), float("-inf")).triu(1)[None, None].expand(2, 1, 7, 7)
    with torch.no_grad():
        want, _ = ref(x, attention_mask=causal)
        got = m(x)
    assert_close(got, want, atol=1e-5, what=f"{variant}: vs transformers KimiLinearAttention")
