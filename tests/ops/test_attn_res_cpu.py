"""openk3.ops.attn_res_cpu: the native AttnRes mixture against the torch direct form and the
reference depth mixer (float64)."""

from __future__ import annotations

import pytest
import torch

from openk3.layers.attn_res import depth_mix
from openk3.ops import attn_res_cpu as K
from openk3.ops.attn_res_decode import DirectAttnRes, direct_mix

pytestmark = pytest.mark.skipif(not K.available(), reason=str(K.unavailable_reason()))


def _sources(n, shape, seed):
    g = torch.Generator().manual_seed(seed)
    # different scales per source, as blocks of a residual stream have
    return [torch.randn(*shape, generator=g) * (0.5 + j) for j in range(n)]


@pytest.mark.parametrize(
    "n,shape", [(1, (5, 128)), (5, (2, 300, 128)), (3, (7, 20)), (9, (33, 16))]
)
def test_mix_matches_the_reference_depth_mixer(n, shape):
    src = _sources(n, shape, n + shape[-1])
    g = torch.Generator().manual_seed(1)
    norm_w = 1 + 0.1 * torch.randn(shape[-1], generator=g)
    proj_w = 0.3 * torch.randn(1, shape[-1], generator=g)
    query = norm_w * proj_w[0]
    got = K.mix(src, query, 1e-5)
    want = depth_mix([s.double() for s in src], norm_w.double(), proj_w.double(), 1e-5)
    assert got.shape == shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6 * (n + 0.5))
    torch.testing.assert_close(got, direct_mix(src, query, 1e-5), rtol=1e-5, atol=1e-5)


def test_strided_sources_and_threads():
    src = [s.T for s in _sources(4, (64, 600), 3)]  # [600, 64] views, not contiguous
    query = 0.2 * torch.randn(64, generator=torch.Generator().manual_seed(2))
    a = K.mix(src, query, 1e-5, threads=1)
    b = K.mix(src, query, 1e-5, threads=4)
    assert torch.equal(a, b)
    torch.testing.assert_close(a, direct_mix(src, query, 1e-5), rtol=1e-5, atol=1e-5)


def test_applies_only_where_the_kernel_runs():
    src, q = _sources(2, (4, 8), 0), torch.ones(8)
    assert K.applies(src, q)
    assert not K.applies([s.double() for s in src], q)
    assert not K.applies(src, torch.ones(9))
    assert not K.applies([src[0], src[1][:2]], q)  # shapes differ
    assert not K.applies([], q)
    with torch.enable_grad():
        assert not K.applies([src[0].requires_grad_(), src[1]], q)


def test_bad_inputs():
    with pytest.raises(ValueError, match="sources"):
        K.mix([], torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="one shape"):
        K.mix([torch.ones(4, 8), torch.ones(3, 8)], torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="one shape"):
        K.mix([torch.ones(4, 8)], torch.ones(8, dtype=torch.float64), 1e-5)


def test_direct_state_with_the_kernel_equals_its_torch_form(monkeypatch):
    # the whole schedule (blocks of 2 layers, 5 layers, output site) with and without the kernel
    D, L = 32, 5
    g = torch.Generator().manual_seed(7)
    queries = 0.3 * torch.randn(2 * L + 1, D, generator=g)
    outs = [torch.randn(3, 11, D, generator=g) for _ in range(2 * L)]

    def run():
        st = DirectAttnRes.start(
            torch.randn(3, 11, D, generator=torch.Generator().manual_seed(0)),
            2,
            site_queries=queries,
        )
        seen = []
        for l in range(L):
            seen.append(st.attn_input(l))
            st.after_mixer(l, outs[2 * l])
            seen.append(st.ffn_input(l))
            st.after_ffn(l, outs[2 * l + 1])
        seen.append(st.output())
        return seen

    native = run()
    monkeypatch.setattr(K, "applies", lambda *a: False)
    plain = run()
    for a, b in zip(native, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
