"""A short training run with ``qat: mxfp4`` converges to within 2% of the unquantized loss on the
tiny preset, and the MXFP4-packed checkpoint of the QAT model has the same eval loss as the
fake-quantized model it was saved from.

Why two seeds and 240 steps: one 120-step run per side is still converging, and its QAT / fp32
ratio depended on the CPU (0.98 on one Xeon VM, 1.035-1.064 over seeds 0-2 on an EPYC VM), while
the fp32 loss alone moves by +-1.7 % between seeds. At 240 steps the per-seed ratios on the EPYC
VM were 0.981 / 0.987 / 1.022 (seeds 0 / 1 / 2), so the 2 % bound is on the mean of two seeds,
and each seed separately must stay within 5 % (the same regime)."""

import pytest
import torch

from openk3.config import preset
from openk3.pretrained import load_pretrained
from openk3.quant.qat import model_qat
from openk3.recipes import get_recipe
from openk3.train.trainer import _take, evaluate, train

# The tiny preset with expert widths that MXFP4 can block (multiples of 32).
CFG = preset("k3-test-tiny").replace(moe_intermediate_size=32)
STEPS = 240
SEEDS = (0, 1)


def _final_eval(run, ckpt, qat):
    model = load_pretrained(ckpt)
    if qat:
        model_qat(model, qat)
    with torch.no_grad():
        return model, evaluate(model, _take(run.data(run, "eval"), 8))["eval_loss"]


@pytest.mark.slow
def test_qat_mxfp4_converges_like_fp32_and_packed_eval_equals_fake_quant(tmp_path):
    results = {}
    for seed in SEEDS:
        for qat in (None, "mxfp4"):
            run = get_recipe("smoke", model=CFG, qat=qat, total_steps=STEPS, eval_every=0, ckpt_every=STEPS,
                             keep_checkpoints=1, threads=1, seed=seed)
            res = train(run, tmp_path / f"{qat}-{seed}", progress=False)
            assert res.step == STEPS and res.checkpoint is not None
            results[qat, seed] = (run, res.checkpoint, *_final_eval(run, res.checkpoint, qat))
    unigram = 2.86  # the synthetic corpus' unigram entropy (nats): every run must really learn
    for seed in SEEDS:
        fp32_loss, qat_loss = results[None, seed][3], results["mxfp4", seed][3]
        assert fp32_loss < unigram / 2 and qat_loss < unigram / 2
        assert abs(qat_loss - fp32_loss) <= 0.05 * fp32_loss, (seed, qat_loss, fp32_loss)
    # "within 2% of the unquantized loss": QAT may not cost more than 2% (it may land lower)
    fp32_mean = sum(results[None, s][3] for s in SEEDS) / len(SEEDS)
    qat_mean = sum(results["mxfp4", s][3] for s in SEEDS) / len(SEEDS)
    assert qat_mean <= 1.02 * fp32_mean, (qat_mean, fp32_mean)

    run, ckpt, fake_quant_model, fake_quant_loss = results["mxfp4", SEEDS[0]]
    fake_quant_model.save_pretrained(tmp_path / "packed", quantization="mxfp4")
    packed = load_pretrained(tmp_path / "packed", keep_packed=True)
    model_qat(packed, "mxfp4")  # MXFP8 expert inputs, as in training; weights already MXFP4
    with torch.no_grad():
        packed_loss = evaluate(packed, _take(run.data(run, "eval"), 8))["eval_loss"]
    assert abs(packed_loss - fake_quant_loss) <= 1e-5, (packed_loss, fake_quant_loss)
