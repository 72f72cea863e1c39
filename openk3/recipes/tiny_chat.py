"""The ``tiny-chat`` recipe: a K3 you train yourself in about ten minutes on a laptop-class CPU and
then talk to (README "Train your own tiny K3 in 10 minutes").

It is the ``default-model`` pipeline (:mod:`openk3.recipes.default_model`: corpus -> BPE with the K3
special tokens -> pretraining -> SFT on the chat mixture with thinking traces and tool calls) at a
size that fits the time: the ``openk3-tiny`` architecture (8 layers, KDA + gated MLA, LatentMoE,
Block AttnRes) with a 4096-id vocabulary, 200 pretraining steps and 250 SFT steps of 1024 tokens,
no QAT (the export quantizes the experts afterwards). The corpus is the one ``openk3
build-corpus`` builds (``data/corpus``, reused when present; Debian documentation is included only
when its packages are installed, so no root is needed); the tokenizer goes to its own directory
(``data/tokenizer-tiny-chat``) so the default model's is never overwritten.

What comes out is a checkpoint in the official format with a tokenizer beside it: ``openk3 export
OUT/checkpoints/step-0000250 DIR --tokenizer data/tokenizer-tiny-chat`` makes a servable
directory for ``openk3 chat DIR`` / ``openk3 serve DIR``. At this size it answers in the K3 chat
format (reasoning, then an answer; tool calls when given tools) but its answers are mostly wrong;
the shipped ``openk3-tiny`` is the same pipeline at about 12x the steps.
"""

from __future__ import annotations

from openk3.recipes.default_model import DefaultModelSettings, default_model
from openk3.train.run_config import RunConfig

STEPS = 250
#: The default-model settings at this size (the rest are the default model's).
SETTINGS = DefaultModelSettings(
    tokenizer_dir="data/tokenizer-tiny-chat",
    vocab_size=4096,
    tokenizer_max_mb=8,
    pretrain_steps=200,
    pretrain_eval_every=100,
    sft_items=2000,
    pretrain_copy_narrow_steps=0,
    pretrain_copy_steps=0,
)  # 200 steps: too few to copy


def tiny_chat() -> RunConfig:
    """A K3 to talk to in ~10 minutes: corpus -> 4096-id BPE -> 200 pretraining + 250 SFT steps."""
    return default_model().replace(
        name="tiny-chat",
        total_steps=STEPS,
        qat=None,
        eval_every=50,
        ckpt_every=50,
        settings=SETTINGS,
    )


__all__ = ["tiny_chat", "SETTINGS", "STEPS"]
