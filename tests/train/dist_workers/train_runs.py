"""torchrun worker for ``tests/train/test_distributed_train.py``: the recipe runner
(:func:`openk3.train.trainer.train` and ``openk3 train``) under ``torchrun --nproc-per-node 2``.

Launch: ``torchrun --nproc-per-node 2 tests/train/dist_workers/train_runs.py OUT_DIR`` with the
repository root on PYTHONPATH. In one launch, one after another, it runs:

* ``fsdp``: ``train()`` of :func:`tiny_recipe` (FSDP2 only) into ``OUT/fsdp``;
* ``ep2``: ``openk3 train --recipe ...:tiny_recipe --set ep_size=2`` (FSDP2 + EP=2, the CLI);
* ``ep2_qat``: ``train()`` with ``ep_size=2, qat="mxfp4"``, a checkpoint after every step;
* ``resume``: the CLI with ``--max-steps 2``, then ``--resume`` to the end (EP=2);
* ``sigterm``: rank 1 alone receives SIGTERM while drawing the data of step 3;
* ``nan``: rank 1 alone sees a NaN loss in step 3.

Each rank's outcome (return code, :class:`TrainResult` fields or the error) is gathered to
``OUT/results.json`` as ``{scenario: [rank 0, rank 1]}``. The process group is created here
with a 60 s timeout, so a rank left waiting fails instead of hanging the test.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from openk3.config import preset
from openk3.recipes import RunConfig, get_recipe, synthetic_data

RECIPE = "tests.train.dist_workers.train_runs:tiny_recipe"
STEPS = 4
# The random model's per-head max logits start near 0.04 at this size; 0.04 clips some heads from the
# the first step, so QK-Clip is exercised from step 1 on.
QK_TAU = 0.04


class NoSpaceTargets:
    """The wrapped source with every label that predicts a space (byte 32) ignored, so micro-
    batches hold different numbers of labelled tokens (the loss must be the global token mean,
    not a mean of per-rank means). Content-based, hence the same after a resume."""

    def __init__(self, src) -> None:
        self.src = src

    def next_batch(self) -> dict:
        mb = dict(self.src.next_batch())
        mb["labels"] = mb["labels"].masked_fill(mb["labels"] == 32, -100)
        return mb

    def state_dict(self):
        return self.src.state_dict()

    def load_state_dict(self, state):
        self.src.load_state_dict(state)


def no_space_data(run: RunConfig, split: str) -> NoSpaceTargets:
    """:func:`~openk3.recipes.synthetic_data` through :class:`NoSpaceTargets`."""
    return NoSpaceTargets(synthetic_data(run, split))


def tiny_recipe() -> RunConfig:
    """``smoke`` shrunk for tests: k3-test-tiny with expert width 32 (so MXFP4 QAT applies),
    32-token rows without space targets, one micro-batch per rank and step, 4 steps, a
    checkpoint every 2 steps."""
    model = preset("k3-test-tiny").replace(moe_intermediate_size=32)
    return get_recipe("smoke", model=model, data=no_space_data, total_steps=STEPS, seq_len=32, grad_accum=1,
                      warmup_steps=1,
                      lr=3e-3, qk_clip_tau=QK_TAU, qb_bins=200, ckpt_every=2, eval_every=0, eval_batches=0,
                      keep_checkpoints=None, threads=1, extra={"num_docs": 40})


class SignalAt:
    """A data source that sends ``sig`` to this process when batch number ``at`` (0-based) is
    drawn; otherwise it is the wrapped source."""

    def __init__(self, src, at: int | None, sig: int = signal.SIGTERM) -> None:
        self.src, self.at, self.sig, self.n = src, at, sig, 0

    def next_batch(self):
        if self.n == self.at:
            os.kill(os.getpid(), self.sig)
        self.n += 1
        return self.src.next_batch()

    def state_dict(self):
        return self.src.state_dict()

    def load_state_dict(self, state):
        self.src.load_state_dict(state)


def _outcome(result) -> dict:
    return {"step": result.step, "signal": result.signal, "checkpoint": result.checkpoint}


def _cli(*args: str) -> dict:
    from openk3.cli import main

    return {"rc": main(["train", "--recipe", RECIPE, "--no-progress", *args])}


def scenario(name: str, out: str) -> dict:
    """Run one scenario into ``out``; returns this rank's outcome."""
    from openk3.model import K3ForCausalLM
    from openk3.train.trainer import TrainingStopped, train

    rank = dist.get_rank()
    run = tiny_recipe()
    if name == "fsdp":
        return _outcome(train(run, out, progress=False))
    if name == "ep2":
        return _cli("--out", out, "--set", "ep_size=2")
    if name == "ep2_qat":
        return _outcome(train(run.replace(ep_size=2, qat="mxfp4", ckpt_every=1), out, progress=False))
    if name == "resume":
        first = _cli("--out", out, "--set", "ep_size=2", "--max-steps", "2")
        return {"first": first, "second": _cli("--out", out, "--set", "ep_size=2", "--resume")}
    if name == "sigterm":
        inner = run.data
        # Batches 4 and 5 form step 3 (two ranks, one micro-batch each): only rank 1 is signalled.
        run = run.replace(data=lambda r, split: SignalAt(inner(r, split), 4 if rank == 1 else None))
        before = signal.getsignal(signal.SIGTERM)
        res = _outcome(train(run, out, progress=False))
        res["handler_restored"] = signal.getsignal(signal.SIGTERM) is before
        return res
    if name == "nan":
        real = K3ForCausalLM.forward
        calls = {"n": 0}

        def poisoned(self, *a, **k):
            out_ = real(self, *a, **k)
            calls["n"] += 1
            if rank == 1 and calls["n"] == 3 and out_.loss is not None:  # rank 1, step 3
                out_.loss = out_.loss * float("nan")
            return out_

        K3ForCausalLM.forward = poisoned
        try:
            train(run, out, progress=False)
            return {"raised": None}
        except TrainingStopped as e:
            return {"raised": str(e), "step": e.step, "checkpoint": e.checkpoint}
        finally:
            K3ForCausalLM.forward = real
    raise ValueError(f"unknown scenario {name!r}")


SCENARIOS = ("fsdp", "ep2", "ep2_qat", "resume", "sigterm", "nan")


def main(argv: list[str]) -> None:
    out_dir = argv[0]
    names = argv[1:] or list(SCENARIOS)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = {}
    try:
        for name in names:
            try:
                mine = scenario(name, os.path.join(out_dir, name))
            except Exception as e:  # reported to the test instead of killing the launch
                mine = {"error": f"{type(e).__name__}: {e}"}
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            results[name] = gathered
        if dist.get_rank() == 0:
            with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as f:
                json.dump(results, f, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
