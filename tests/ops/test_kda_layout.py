"""The KDA oracle and the fast path stand apart: neither imports the other, and the production gates
and L2 norm the layer runs equal the oracle's own forms."""

from __future__ import annotations

import ast

import pytest
import torch

import openk3
from openk3.ops import kda_gate, kda_reference
from tests.conftest import assert_close

ORACLE = "openk3.ops.kda_reference"
FAST = ("openk3.ops.kda_chunk", "openk3.ops.kda_scan", "openk3.ops.kda_gate", "openk3.ops.kda_decode")


def imported(module: str) -> set[str]:
    path = openk3.__file__.rsplit("/", 1)[0] + "/" + module.split(".", 1)[1].replace(".", "/") + ".py"
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_oracle_imports_no_fast_path_and_no_fast_path_imports_the_oracle():
    assert not imported(ORACLE) & set(FAST)
    for fast in FAST:
        assert ORACLE not in imported(fast), fast
    assert ORACLE not in imported("openk3.layers.kda")


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_production_gate_equals_the_oracle(gate):
    H, K = 3, 8
    z, A_log, dt_bias = 6 * torch.randn(7, H, K), torch.randn(H), torch.randn(H * K)
    if gate == "lower_bound":
        got, want = (m.kda_gate_lower_bound(z, A_log, dt_bias, -5.0) for m in (kda_gate, kda_reference))
    else:
        got, want = (m.kda_gate_softplus(z, A_log, dt_bias) for m in (kda_gate, kda_reference))
    assert got.dtype == want.dtype == torch.float32
    assert_close(got, want, atol=1e-6, what=f"{gate} gate")
    x = torch.randn(7, H, K, dtype=torch.bfloat16)
    assert_close(kda_gate.l2_normalize(x), kda_reference.l2_normalize(x), atol=1e-6, what="l2 normalize")
    with pytest.raises(ValueError, match="A_log"):
        kda_gate.kda_gate_softplus(z, torch.zeros(H + 1), dt_bias)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate.kda_gate_lower_bound(z, A_log, dt_bias, 1.0)
