"""The chunk-sequential KDA state pass: hand-written backward == autograd reference == gradcheck."""

import pytest
import torch

from openk3.ops.kda_scan import kda_state_pass, kda_state_pass_reference
from tests.conftest import assert_close

B, H, N, C, K, V = 2, 3, 8, 4, 5, 6


def make(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    # Scores/factors of the size chunkwise KDA produces (decays in (0, 1), small products).
    xs = (0.3 * r(B, H, N, C, K), r(B, H, N, C, V), 0.3 * r(B, H, N, C, C), 0.3 * r(B, H, N, C, K),
          0.3 * r(B, H, N, K, C), torch.rand(B, H, N, K, 1, generator=g, dtype=dtype), r(B, H, K, V))
    return [x.requires_grad_() for x in xs]


@pytest.mark.parametrize("every", [None, 1, 2, 8])
def test_values_and_gradients_equal_autograd_reference(every):
    xs = make()
    o, s = kda_state_pass(*xs, every=every)
    o_ref, s_ref = kda_state_pass_reference(*xs, every=every)
    assert s.shape == (B, H, N // (every or N), K, V)
    assert_close(o, o_ref, atol=1e-5, what="outputs")
    assert_close(s, s_ref, atol=1e-5, what="states")
    w_o, w_s = torch.randn_like(o), torch.randn_like(s)
    grads = torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), xs)
    grads_ref = torch.autograd.grad((o_ref * w_o).sum() + (s_ref * w_s).sum(), xs)
    for name, a, b in zip(("W", "U", "A", "Q", "Kt", "D", "S0"), grads, grads_ref):
        assert_close(a, b, atol=1e-4, rtol=1e-5, what=f"d/d{name}")


def test_gradcheck_float64():
    xs = make(torch.float64)
    assert torch.autograd.gradcheck(lambda *a: kda_state_pass(*a, every=2), xs)
    # only the outputs used: the states' gradient arrives as None
    assert torch.autograd.gradcheck(lambda *a: kda_state_pass(*a)[0], xs)


def test_inference_path_equals_reference():
    xs = [x.detach() for x in make()]
    with torch.no_grad():
        o, s = kda_state_pass(*xs, every=4)
    o_ref, s_ref = kda_state_pass_reference(*xs, every=4)
    assert_close(o, o_ref, atol=1e-5, what="outputs")
    assert_close(s, s_ref, atol=1e-5, what="states")


def test_bad_arguments_raise():
    xs = [x.detach() for x in make()]
    with pytest.raises(ValueError, match="every=3"):
        kda_state_pass(*xs, every=3)
    with pytest.raises(ValueError, match="A: expected shape"):
        kda_state_pass(xs[0], xs[1], xs[2][..., :-1], *xs[3:])
    with pytest.raises(ValueError, match="W: expected"):
        kda_state_pass(xs[0][0], *xs[1:])
