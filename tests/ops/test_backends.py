"""One backend switch for every fast-path op: use_backend(op, name) and OPENK3_<OP>_BACKEND, with
the precedence explicit argument > use_backend > environment > automatic."""

from __future__ import annotations

import pytest
import torch

from openk3.ops import attention, backends, grouped_mm
from openk3.ops import kda as kda_op
from openk3.ops.backends import env_var, forced_backend, use_backend
from openk3.quant import packed


def test_every_op_has_one_variable_and_the_known_names():
    assert {op: env_var(op) for op in backends.BACKENDS} == {
        "kda": "OPENK3_KDA_BACKEND", "attention": "OPENK3_ATTENTION_BACKEND",
        "grouped_mm": "OPENK3_GROUPED_MM_BACKEND", "mxfp4": "OPENK3_MXFP4_BACKEND",
        "decode": "OPENK3_DECODE_BACKEND",
    }
    assert set(attention.BACKENDS) == {"sdpa", "reference"}
    assert set(grouped_mm.BACKENDS) == {"grouped_mm", "bmm", "static", "loop"}
    assert set(packed.PACKED_IMPLS) == {"native", "torch"}
    assert {"batched", "reference"} <= set(backends.BACKENDS["kda"])


@pytest.mark.parametrize("op, name", [("kda", "reference"), ("attention", "reference"),
                                      ("grouped_mm", "loop"), ("mxfp4", "torch"),
                                      ("decode", "reference")])
def test_precedence_and_errors(op, name, monkeypatch):
    monkeypatch.delenv(env_var(op), raising=False)
    assert forced_backend(op) is None
    monkeypatch.setenv(env_var(op), name)
    assert forced_backend(op) == name
    other = next(n for n in backends.BACKENDS[op] if n != name)
    with use_backend(op, other):  # the in-process override wins over the environment
        assert forced_backend(op) == other
        with use_backend(op, None):
            assert forced_backend(op) == name
    assert forced_backend(op) == name
    monkeypatch.setenv(env_var(op), "nope")
    with pytest.raises(ValueError, match=f"{env_var(op)}='nope'"):
        forced_backend(op)
    with pytest.raises(ValueError, match="backend='nope'"):
        with use_backend(op, "nope"):
            pass
    with pytest.raises(ValueError, match="op='fla'"):
        with use_backend("fla", name):
            pass


def test_the_ops_follow_the_switch(monkeypatch):
    for op in backends.BACKENDS:
        monkeypatch.delenv(env_var(op), raising=False)
    assert attention.get_attention_backend() == "sdpa"
    monkeypatch.setenv("OPENK3_ATTENTION_BACKEND", "reference")
    assert attention.get_attention_backend() == "reference"
    q = torch.randn(1, 2, 5, 8)
    calls = []
    real = attention.causal_attention_reference
    monkeypatch.setattr(attention, "causal_attention_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
    attention.causal_attention(q, q, q, scale=0.3)
    assert calls == [1]
    attention.causal_attention(q, q, q, scale=0.3, backend="sdpa")  # an explicit argument wins
    assert calls == [1]
    x = torch.randn(4, 16)
    w1 = torch.randn(3, 8, 16)
    with use_backend("grouped_mm", "loop"):
        assert grouped_mm._select_backend(x, w1, None) == "loop"
        assert grouped_mm._select_backend(x, w1, "bmm") == "bmm"
    with use_backend("mxfp4", "torch"):
        assert packed._select_impl(x, None) == "torch"
    with use_backend("kda", "reference"):
        assert kda_op._select_backend(x) == "reference"
    assert kda_op._select_backend(x) == "batched"
