"""The fused KDA decode step equals its oracle and the layer's general path."""

from __future__ import annotations

import pytest
import torch

import openk3
from openk3.cache import KDALayerState
from openk3.layers.kda import KimiDeltaAttention
from openk3.ops import kda_reference
from openk3.ops.backends import use_backend
from openk3.ops.kda_decode import kda_decode_step
from tests.conftest import assert_close


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_fused_decode_step_equals_the_oracle(gate):
    g = torch.Generator().manual_seed(0)
    B, H, K, W = 3, 2, 8, 4
    P = H * K
    args = (torch.randn(B, 3, P, generator=g), torch.randn(B, 3, P, W - 1, generator=g),
            torch.randn(3, P, W, generator=g) * 0.5, torch.randn(B, H, K, generator=g),
            torch.randn(B, H, generator=g), torch.randn(H, generator=g) * 0.3, torch.randn(H * K, generator=g),
            torch.randn(B, H, K, K, generator=g), K ** -0.5, -5.0 if gate == "lower_bound" else None)
    got = kda_decode_step(*args)
    want = kda_reference.kda_decode_step(*args)
    for a, b, what in zip(got, want, ("o", "conv tail", "state")):
        assert a.shape == b.shape and a.dtype == b.dtype, what
        assert_close(a, b, atol=1e-5, rtol=1e-5, what=what)
    assert torch.equal(got[1], want[1])  # the tail is a shift: exact


@pytest.mark.parametrize("preset", ["k3-test-tiny", "kimi-linear-tiny"])
@torch.no_grad()
def test_layer_decode_steps_equal_the_reference_backend(preset):
    """Decode steps of a KDA layer through the fused step (default backend) and through the
    general path with the reference backend: outputs and cached state agree."""
    cfg = openk3.preset(preset)
    torch.manual_seed(1)
    layer = KimiDeltaAttention(cfg, 0)
    for p in layer.parameters():  # away from the init's special values (zero A_log, ones norm)
        p.add_(torch.randn_like(p) * 0.1)
    B = 2
    x = torch.randn(B, 7, cfg.hidden_size)
    caches = [KDALayerState.zeros(cfg, B), KDALayerState.zeros(cfg, B)]
    for c in caches:
        layer(x[:, :4], c)  # a prefill, then decode steps
    for t in range(4, 7):
        fused = layer(x[:, t:t + 1], caches[0], mode="recurrent")
        with use_backend("kda", "reference"):
            ref = layer(x[:, t:t + 1], caches[1], mode="recurrent")
        assert_close(fused, ref, atol=1e-5, rtol=1e-5, what=f"output at t={t}")
        assert_close(caches[0].recurrent, caches[1].recurrent, atol=1e-5, rtol=1e-5, what="state")
        assert torch.equal(caches[0].conv, caches[1].conv)
