"""Block AttnRes (architecture.md §2, §5): depth mixer vs its formula, schedule vs a literal
transcription of §2 steps 1–8, two-phase serving form vs direct form, and the reference's own
recorded per-layer values (fixture k3-ref-tiny-a)."""

from __future__ import annotations

import math

import pytest
import torch

from openk3.layers.attn_res import (
    AttnResState,
    SiteWeights,
    block_stats,
    depth_mix,
    merge_partial,
    run_attn_res,
)
from tests.conftest import assert_close, shared_path

D = 8


def naive_mix(V, n, w, eps=1e-5):
    """§2 'Depth mixer' written per token, float64: V list of [M, D] candidates."""
    n, w = n.double().reshape(-1), w.double().reshape(-1)
    out = torch.zeros_like(V[0], dtype=torch.float64)
    for t in range(V[0].shape[0]):
        z = torch.stack([
            sum(w[c] * n[c] * v[t, c].double() for c in range(v.shape[1])) / math.sqrt(v[t].double().pow(2).mean() + eps)
            for v in V
        ])
        a = torch.softmax(z, 0)
        out[t] = sum(a[j] * V[j][t].double() for j in range(len(V)))
    return out


def _site(scale=1.0):
    return SiteWeights(1.0 + 0.1 * torch.randn(D), scale * torch.randn(1, D))


def _toy(L, seed=1):
    """L mixers and L FFNs (distinct nonlinear maps, recorded inputs) plus 2L+1 sites."""
    g = torch.Generator().manual_seed(seed)
    Ws = [torch.randn(D, D, generator=g) / math.sqrt(D) for _ in range(2 * L)]
    log = []

    def make(i):
        def f(h):
            log.append((i, h))
            return torch.tanh(h @ Ws[i]) + 0.1 * i
        return f

    mixers = [make(2 * l) for l in range(L)]
    ffns = [make(2 * l + 1) for l in range(L)]
    return mixers, ffns, [_site() for _ in range(L)], [_site() for _ in range(L)], _site(), log


def naive_schedule(x0, mixers, ffns, attn_sites, ffn_sites, out_site, B):
    """architecture.md §2 steps 1-8, literally (own mixer: naive_mix)."""
    blocks, p = [], x0
    for l in range(len(mixers)):
        p_in = p                                                                   # 1
        s = attn_sites[l]
        h = naive_mix(blocks + [p_in], s.norm_weight, s.proj_weight).float() if blocks else p_in  # 2
        opened = False
        if l % B == 0:                                                             # 3
            blocks.append(p_in)
            opened = True
        a = mixers[l](h)                                                           # 4
        p = a if opened else p_in + a                                              # 5
        s = ffn_sites[l]
        h2 = naive_mix(blocks + [p], s.norm_weight, s.proj_weight).float()         # 6
        f = ffns[l](h2)                                                            # 7
        p = p + f                                                                  # 8
    return naive_mix(blocks + [p], out_site.norm_weight, out_site.proj_weight), blocks


def test_depth_mix_matches_formula():
    V = [torch.randn(5, D) * (j + 1) for j in range(4)]
    n, w = 1.0 + 0.2 * torch.randn(D), torch.randn(1, D)
    want = naive_mix(V, n, w)
    assert_close(depth_mix(V, n, w), want, atol=1e-5, what="list input")
    assert_close(depth_mix(torch.stack(V), n, w.reshape(-1)), want, atol=1e-5, what="stacked input, [D] proj")
    out16 = depth_mix([v.bfloat16() for v in V], n, w)
    assert out16.dtype == torch.bfloat16
    assert_close(out16.float(), naive_mix([v.bfloat16() for v in V], n, w), atol=0.1, what="bf16 values")


def test_depth_mix_uses_raw_values_and_pseudo_query_product():
    V = [torch.randn(3, D), torch.randn(3, D)]
    n, w = torch.randn(D), torch.randn(1, D)
    # Scaling a candidate leaves its key (RMS-normalised) unchanged but scales its value.
    a = depth_mix([V[0], V[1]], n, w)
    b = depth_mix([V[0], 10 * V[1]], n, w)
    weight1 = ((a - V[0]) / (V[1] - V[0]))  # a = V0 + a1 (V1 - V0)
    assert_close(b, V[0] + weight1 * (10 * V[1] - V[0]), atol=1e-4, what="raw values, normalised keys")
    # Only n ⊙ w matters.
    assert_close(depth_mix(V, 2 * n, w / 2), a, atol=1e-6, what="pseudo-query = n * w")


def test_zero_pseudo_query_is_uniform_average():
    V = [torch.randn(4, D) for _ in range(5)]
    out = depth_mix(V, torch.ones(D), torch.zeros(1, D))
    assert_close(out, torch.stack(V).mean(0), atol=1e-6, what="uniform depth average")


@pytest.mark.parametrize("L,B", [(13, 3), (7, 2), (5, 12), (8, 1)])
def test_schedule_matches_literal_spec_loop(L, B):
    mixers, ffns, att, ff, out, log = _toy(L)
    x0 = torch.randn(6, D)
    y = run_attn_res(x0, mixers, ffns, att, ff, out, B)
    ours = list(log)
    log.clear()
    want, _ = naive_schedule(x0, mixers, ffns, att, ff, out, B)
    assert_close(y, want, atol=1e-5, what=f"L={L} B={B} output")
    assert [i for i, _ in ours] == [i for i, _ in log]
    for (i, h), (_, h_ref) in zip(ours, log):
        assert_close(h, h_ref, atol=1e-5, what=f"sublayer {i} input")


def test_block_size_counts_decoder_layers():
    L, B = 13, 3
    mixers, ffns, att, ff, out, _ = _toy(L)
    outs = {}

    def wrap(fs, kind):
        return [lambda h, f=f, l=l: outs.setdefault((kind, l), f(h)) for l, f in enumerate(fs)]

    x0 = torch.randn(4, D)
    st = AttnResState.start(x0, B)
    mx, fx = wrap(mixers, "a"), wrap(ffns, "f")
    for l in range(L):
        st.after_mixer(l, mx[l](st.attn_input(l, att[l].norm_weight, att[l].proj_weight)))
        st.after_ffn(l, fx[l](st.ffn_input(l, ff[l].norm_weight, ff[l].proj_weight)))
    # Blocks open at layers 0, 3, 6, 9, 12: [x0, b1, b2, b3] completed + partial b4 (layer 12).
    assert len(st.blocks) == 5 and torch.equal(st.blocks[0], x0)
    for k in range(1, 5):
        layers = range(B * (k - 1), B * k)
        want = sum(outs[("a", l)] + outs[("f", l)] for l in layers)
        assert_close(st.blocks[k], want, atol=1e-5, what=f"block {k} = 2*{B} sublayer outputs")
    assert_close(st.partial, outs[("a", 12)] + outs[("f", 12)], atol=1e-6, what="partial last block")


@pytest.mark.parametrize("L,B", [(13, 3), (11, 4), (6, 2), (9, 12)])
def test_two_phase_equals_direct(L, B):
    mixers, ffns, att, ff, out, log = _toy(L, seed=L)
    for s in att + ff + [out]:
        s.proj_weight.mul_(3.0)  # peaked softmax: exercises the max shift of the online merge
    x0 = torch.randn(5, D) * 3
    y = run_attn_res(x0, mixers, ffns, att, ff, out, B)
    direct = list(log)
    log.clear()
    y2 = run_attn_res(x0, mixers, ffns, att, ff, out, B, two_phase=True)
    # Exact in real arithmetic; in fp32 the two orders of summation differ by a few ulp of the
    # values' scale, hence 1e-6 relative to max |value|.
    assert_close(y2, y, atol=1e-6 * _scale(y), what=f"L={L} B={B} two-phase output")
    for (i, h), (_, h2) in zip(direct, log):
        assert_close(h2, h, atol=1e-6 * _scale(h), what=f"sublayer {i} input, two-phase")


def test_block_stats_merge_equals_softmax():
    blocks = [torch.randn(3, D) * 4 for _ in range(4)]
    p = torch.randn(3, D)
    sites = [_site(5.0) for _ in range(3)]
    st = block_stats(blocks, torch.stack([s.query for s in sites]))
    for i, s in enumerate(sites):
        h = merge_partial(st.m[i], st.s[i], st.u[i], p, s.query)
        want = depth_mix(blocks + [p], s.norm_weight, s.proj_weight)
        assert_close(h, want, atol=1e-6 * _scale(want), what=f"site {i}")


def test_plain_residual_when_block_size_is_none():
    L = 4
    mixers, ffns, att, ff, out, log = _toy(L)
    x0 = torch.randn(3, D)
    y = run_attn_res(x0, mixers, ffns, att, ff, out, None)
    stream = x0
    for l in range(L):
        stream = stream + mixers[l](stream)
        stream = stream + ffns[l](stream)
    assert_close(y, stream, atol=1e-6, what="plain residual stream")


def test_call_order_is_enforced():
    st = AttnResState.start(torch.randn(2, D), 2)
    s = _site()
    st.attn_input(0, s.norm_weight, s.proj_weight)
    with pytest.raises(ValueError, match="after_mixer"):
        st.ffn_input(0, s.norm_weight, s.proj_weight)
    with pytest.raises(ValueError, match="layer_idx"):
        st.after_mixer(1, torch.zeros(2, D))
    st.after_mixer(0, torch.zeros(2, D))
    with pytest.raises(ValueError, match="output"):
        st.output(s.norm_weight, s.proj_weight)
    with pytest.raises(ValueError, match="block_size"):
        AttnResState.start(torch.randn(2, D), 0)


def test_matches_reference_recorded_layers():
    """Feed the reference's recorded sublayer outputs through our schedule with the checkpoint's
    AttnRes weights; every recorded mixture (attn_in, ffn_in, out, final_norm_in) must match."""
    from safetensors import safe_open

    root = shared_path("fixtures", "k3-ref-tiny-a")
    with safe_open(str(root / "reference_outputs.safetensors"), "pt") as f:
        rec = {k: f.get_tensor(k) for k in f.keys() if k.startswith("short.hidden.")}
    with safe_open(str(root / "model.safetensors"), "pt") as f:
        w = {k.removeprefix("language_model.model."): f.get_tensor(k) for k in f.keys() if "_res_" in k}
    L, B = 7, 2

    def site(prefix):
        return SiteWeights(w[f"{prefix}_norm.weight"], w[f"{prefix}_proj.weight"])

    for two_phase in (False, True):
        mixers = [lambda h, l=l: _expect(h, rec[f"short.hidden.layer{l}.attn_in"], l, "attn_in")
                  or rec[f"short.hidden.layer{l}.mixer_out"] for l in range(L)]
        ffns = [lambda h, l=l: _expect(h, rec[f"short.hidden.layer{l}.ffn_in"], l, "ffn_in")
                or rec[f"short.hidden.layer{l}.ffn_out"] for l in range(L)]
        y = run_attn_res(
            rec["short.hidden.layer0.attn_in"], mixers, ffns,
            [site(f"layers.{l}.self_attention_res") for l in range(L)],
            [site(f"layers.{l}.mlp_res") for l in range(L)], site("output_attn_res"), B, two_phase=two_phase,
        )
        want = rec["short.hidden.final_norm_in"]
        assert_close(y, want, atol=1e-4 * want.abs().max().item(), what=f"final_norm_in (two_phase={two_phase})")


def _scale(x):
    return max(1.0, x.abs().max().item())


def _expect(h, want, layer, what):
    assert_close(h, want, atol=1e-4 * want.abs().max().item(), what=f"layer {layer} {what}")
    return None
