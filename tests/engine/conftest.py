"""Fixtures of the engine tests: one perturbed tiny K3 model per module."""

from __future__ import annotations

import pytest

import openk3
from openk3.pretrained import build_model
from tests.conftest import perturb
from tests.test_model import sharp



@pytest.fixture(scope="session")
def model():
    """k3-test-tiny (every branch: KDA + MLA, dense + MoE, AttnRes), fp32, weights perturbed so that
    outputs are not degenerate."""
    return sharp(build_model(openk3.preset("k3-test-tiny"), seed=1)).eval()




@pytest.fixture(scope="session")
def mild_model():
    """k3-test-tiny perturbed at scale 1 (logits ~O(1)). The sharp model amplifies fp32 rounding
    so much that merely moving a prefill split point changes logits by ~2e-5; here that noise is
    ~2e-6, well inside the 1e-5 gate, while a wrong KDA state changes logits by ~1."""
    return perturb(build_model(openk3.preset("k3-test-tiny"), seed=1), 1.0).eval()
