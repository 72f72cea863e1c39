"""Parity with transformers' KimiLinearForCausalLM (the public implementation of K3's predecessor)
on random weights in the Kimi Linear configuration: openk3 writes the official checkpoint format,
transformers loads it with its own converter, logits agree within 1e-4 (fp32)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub kernels: use transformers' torch fallbacks

import pytest
import torch

from openk3.config import preset
from openk3.pretrained import build_model
from tests.conftest import assert_close
from tests.test_model import sharp

transformers = pytest.importorskip("transformers")


def _fla_absent():
    try:
        import fla  # noqa: F401
    except ImportError:
        return True
    return False


@pytest.mark.skipif(not _fla_absent(), reason="flash-linear-attention switches transformers to Triton kernels")
@pytest.mark.parametrize("T", [9, 70])
def test_logits_match_transformers_kimi_linear(tmp_path, T):
    from transformers import KimiLinearForCausalLM

    model = sharp(build_model(preset("kimi-linear-tiny"), seed=11), seed=12)
    model.save_pretrained(tmp_path)
    ref = KimiLinearForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, 512, (2, T))
    with torch.no_grad():
        want = ref(ids).logits
        got = model(ids).logits
    assert want.abs().max() > 1.0  # a sharp enough network for the comparison to mean something
    assert_close(got, want, atol=1e-4, what="logits vs transformers KimiLinear")
