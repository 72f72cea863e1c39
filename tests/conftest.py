"""Shared test helpers: seeding, the ../shared location, one tolerance helper."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("OPENK3_SHARED", REPO.parent / "shared"))

# Tiny-model tests gain nothing from intra-op threads, and on a loaded 2-core machine the thread
# pool makes each small forward 10-50x slower (`make test` also sets OMP_NUM_THREADS=1).
torch.set_num_threads(int(os.environ.get("OPENK3_TEST_THREADS", "1")))
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


def shared_cases(load) -> tuple[list, str | None]:
    """``(load(), None)``, or ``([], reason)`` when `load` skipped because ../shared is absent (it
    calls :func:`shared_path`). For module-level parametrization: see :func:`shared_params`. In CI
    the missing data stays an error (collection fails)."""
    try:
        return load(), None
    except pytest.skip.Exception as e:
        return [], str(e.msg)


def shared_params(values: list, reason: str | None, id) -> list:
    """``parametrize`` values built from ../shared data: one ``pytest.param`` per value (``id(value)``
    names it), or, without ../shared, a single parameter skipped with `reason` (instead of pytest's
    bare "got empty parameter set")."""
    if reason is not None:
        return [pytest.param(None, id="no-shared", marks=pytest.mark.skip(reason=reason))]
    return [pytest.param(v, id=id(v)) for v in values]


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


def perturb(model: torch.nn.Module, scale: float, seed: int = 0) -> torch.nn.Module:
    """Add seeded noise to every float tensor of ``model`` in place: N(0, 0.5) on ``A_log`` /
    ``dt_bias``, N(0, 0.2) on vectors and AttnRes pseudo-queries, N(0, (max(std, 0.02)·scale)²)
    on matrices — so that no branch (AttnRes, router bias, norms) is trivially near zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point():
                continue
            noise = torch.randn(p.shape, generator=g)
            if name.endswith(("A_log", "dt_bias")):
                p.add_(0.5 * noise)
            elif p.ndim == 1 or name.endswith("_res_proj.weight"):
                p.add_(0.2 * noise)
            else:
                p.add_(noise * max(p.std().item(), 0.02) * scale)
    return model
