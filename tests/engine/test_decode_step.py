"""The engine's decode step: no device->host sync inside it (what a captured or compiled step
needs), with the tokens still those of the independent full-forward reference."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import openk3
from openk3.bench.decode_profile import BOOL_INDEX_OPS, SYNC_OPS
from openk3.engine import Engine, EngineConfig
from openk3.pretrained import build_model
from tests.conftest import perturb
from tests.engine.common import full_forward_greedy, greedy, prompts_of


class HostSyncs(TorchDispatchMode):
    """Records every aten call that makes the host wait for a tensor's values (``item`` /
    ``bool(t)`` / ``int(t)``, value-dependent output shapes, boolean-mask indexing)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func.overloadpacket.__name__
        indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
        bool_index = op in BOOL_INDEX_OPS and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                  for i in indices)
        if op in SYNC_OPS or bool_index:
            self.seen.append(op)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def kimi_linear_model():
    """kimi-linear-tiny (KDA + MLA without AttnRes, softplus gate, low-rank output gate)."""
    return perturb(build_model(openk3.preset("kimi-linear-tiny"), seed=2), 1.0).eval()


@pytest.mark.parametrize("which", ["k3", "kimi-linear"])
@pytest.mark.parametrize("batch", [1, 3])
def test_engine_decode_step_makes_no_host_sync(model, kimi_linear_model, which, batch):
    m = model if which == "k3" else kimi_linear_model
    prompts = prompts_of((9, 21, 14)[:batch], seed=11, vocab=m.config.vocab_size)
    n_new = 5
    eng = Engine(m, EngineConfig(block_size=8, enable_prefix_cache=False))
    ids = [eng.add_request(p, greedy(n_new)) for p in prompts]
    tokens = {rid: [] for rid in ids}
    for out in eng.step():  # the prefill step (it may sync: rows of different lengths)
        tokens[out.request_id] += out.new_token_ids
    assert all(len(t) == 1 for t in tokens.values())
    syncs = []
    for _ in range(n_new - 2):  # decode steps that cross block boundaries (block_size 8)
        guard = HostSyncs()
        with guard:
            outs = eng.step()
        syncs.append(guard.seen)
        assert len(outs) == batch and all(len(o.new_token_ids) == 1 for o in outs)
        for out in outs:
            tokens[out.request_id] += out.new_token_ids
    assert syncs == [[]] * (n_new - 2), f"host syncs per decode step: {syncs}"
    for out in eng.step():
        tokens[out.request_id] += out.new_token_ids
    for rid, p in zip(ids, prompts):
        assert tokens[rid] == full_forward_greedy(m, p, n_new)


def test_the_guard_sees_host_syncs():
    """The guard is not blind: ``bool(t)``, ``int(t)`` and a boolean-mask gather register."""
    x = torch.arange(6.0)
    guard = HostSyncs()
    with guard:
        bool((x > 2).any())
        int(x.max())
        x[x > 2]
    assert len(guard.seen) == 3, guard.seen

