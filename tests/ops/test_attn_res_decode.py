"""The decode step's direct Block AttnRes (openk3.ops.attn_res_decode) against the reference:
one site's mixture, the whole schedule over toy sublayers, and the K3 backbone's forward."""

from __future__ import annotations

import pytest
import torch

import openk3
from openk3.layers.attn_res import SiteWeights, depth_mix, run_attn_res
from openk3.ops.attn_res_decode import DirectAttnRes, direct_mix, inv_rms
from openk3.pretrained import build_model
from tests.conftest import assert_close, perturb


@pytest.mark.parametrize("n", [1, 2, 5])
def test_direct_mix_equals_depth_mix(n):
    g = torch.Generator().manual_seed(n)
    D = 32
    sources = [3.0 * torch.randn(4, 1, D, generator=g) for _ in range(n)]
    norm_w, proj_w = 1 + 0.3 * torch.randn(D, generator=g), torch.randn(1, D, generator=g)
    q = norm_w * proj_w[0]
    got = direct_mix(sources, q, 1e-5)
    want = depth_mix(sources, norm_w, proj_w, 1e-5)
    assert got.shape == (4, 1, D) and got.dtype == torch.float32
    assert_close(got, want, atol=1e-5, what="direct mixture")
    if n > 1:  # the weights are not degenerate: the mixture is not one of the sources
        assert min((got - s).abs().max().item() for s in sources) > 1e-2
    # precomputed key scales for all but the last source (as DirectAttnRes passes its blocks')
    scales = [inv_rms(s, 1e-5) for s in sources[:-1]] + [None]
    assert_close(direct_mix(sources, q, 1e-5, scales), want, atol=1e-5, what="cached scales")
    # the scales are used, not recomputed: doubling one source's scale changes the mixture
    if n > 1:
        wrong = [2 * scales[0]] + scales[1:]
        assert (direct_mix(sources, q, 1e-5, wrong) - want).abs().max().item() > 1e-3


def test_direct_mix_keeps_the_sources_dtype():
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(2, 1, 16, generator=g).bfloat16() for _ in range(3)]
    q = torch.randn(16, generator=g)
    got = direct_mix(sources, q, 1e-5)
    want = depth_mix(sources, q, torch.ones(16), 1e-5)
    assert got.dtype == torch.bfloat16
    assert_close(got.float(), want.float(), atol=2e-2, what="bf16 direct mixture")


def _toy(L: int, D: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    mats = [torch.randn(D, D, generator=g) / D**0.5 for _ in range(2 * L)]
    sites = [SiteWeights(1 + 0.3 * torch.randn(D, generator=g), torch.randn(1, D, generator=g))
             for _ in range(2 * L + 1)]
    mixers = [lambda h, w=mats[2 * l]: torch.tanh(h @ w) for l in range(L)]
    ffns = [lambda h, w=mats[2 * l + 1]: torch.tanh(h @ w) for l in range(L)]
    return mixers, ffns, sites


@pytest.mark.parametrize("block_size", [1, 2, 3, None])
def test_direct_schedule_equals_the_reference_schedule(block_size):
    """DirectAttnRes driven in the reference call order gives run_attn_res's output (both the
    direct and the two-phase reference forms), for block sizes that divide L and one that does not."""
    L, D = 5, 24
    mixers, ffns, sites = _toy(L, D, seed=7)
    x0 = torch.randn(3, 1, D, generator=torch.Generator().manual_seed(8))
    queries = torch.stack([s.query for s in sites])  # rows: 2l mixer, 2l+1 FFN, 2L output
    attn_sites, ffn_sites, out_site = sites[0:2 * L:2], sites[1:2 * L:2], sites[2 * L]
    st = DirectAttnRes.start(x0, block_size, site_queries=queries)
    for l in range(L):
        st.after_mixer(l, mixers[l](st.attn_input(l)))
        st.after_ffn(l, ffns[l](st.ffn_input(l)))
    got = st.output()
    for two_phase in (False, True):
        want = run_attn_res(x0, mixers, ffns, attn_sites, ffn_sites, out_site, block_size,
                            two_phase=two_phase)
        assert_close(got, want, atol=1e-5, what=f"direct schedule vs reference (two_phase={two_phase})")
    if block_size is not None:
        assert len(st.blocks) == -(-L // block_size)
        plain = run_attn_res(x0, mixers, ffns, attn_sites, ffn_sites, out_site, None)
        assert (got - plain).abs().max().item() > 1e-2  # the mixing is not a no-op here


def test_direct_state_needs_the_queries():
    with pytest.raises(ValueError, match=r"site_queries: needed with block_size=2"):
        DirectAttnRes.start(torch.zeros(1, 1, 4), 2)


def test_backbone_forward_with_direct_attn_res_equals_the_reference():
    """K3Model.forward(attn_res_state=DirectAttnRes) over a prompt (chunk form) and then decode
    tokens through a cache gives the reference forward's outputs within fp32 rounding."""
    from openk3.cache import HybridCache

    m = perturb(build_model(openk3.preset("k3-test-tiny"), seed=4), 1.0).eval()
    assert m.config.use_attn_res
    backbone = m.model
    q = backbone._site_queries()
    ids = torch.randint(0, m.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        caches = [HybridCache.empty(m.config, 2, 16) for _ in range(2)]
        outs = []
        for cache, kind in zip(caches, (None, DirectAttnRes)):
            steps = [backbone(ids[:, :5], cache, site_queries=q, attn_res_state=kind)]
            steps += [backbone(ids[:, t:t + 1], cache, site_queries=q, attn_res_state=kind) for t in (5, 6)]
            outs.append(steps)
    for want, got in zip(*outs):
        assert_close(got, want, atol=1e-5, what="backbone output, direct vs two-phase AttnRes")
