"""Shared test helpers: seeding, the ../shared location, one tolerance helper."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("OPENK3_SHARED", REPO.parent / "shared"))

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def shared_path(*parts: str) -> Path:
    """Path under ../shared; skips the test with a clear message when it is absent (a fresh clone)."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        if os.environ.get("CI"):
            raise FileNotFoundError(f"{p} is missing; CI must have ../shared")
        pytest.skip(f"reference data not found: {p} (../shared is only present in the project workspace and CI)")
    return p


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float = 0.0, what: str = "") -> None:
    """fp32 correctness gate: reports max abs error and relative RMS error, rejects NaN/inf."""
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values in actual"
    err = (a - e).abs()
    max_abs = err.max().item() if err.numel() else 0.0
    rel_rms = (err.pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp_min(1e-30)).item() if err.numel() else 0.0
    bound = atol + rtol * e.abs()
    assert bool((err <= bound).all()), f"{what}: max abs err {max_abs:.3e} (rel rms {rel_rms:.3e}) > atol {atol} rtol {rtol}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


_KIMI_TOKENIZER = None


def kimi_tokenizer():
    """The official Kimi BPE from ../shared, loaded once per session (hypothesis tests cannot take
    function-scoped fixtures, so this is a plain cached function)."""
    global _KIMI_TOKENIZER
    if _KIMI_TOKENIZER is None:
        from openk3.tokenizer import load_tokenizer

        _KIMI_TOKENIZER = load_tokenizer(shared_path("kimi-tokenizer"))
    return _KIMI_TOKENIZER
