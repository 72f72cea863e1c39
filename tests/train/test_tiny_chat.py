"""The ``tiny-chat`` recipe: the default-model pipeline at the README's ten-minute size."""

from openk3.recipes.default_model import DefaultModelSettings, settings
from openk3.recipes import get_recipe


def test_tiny_chat_is_the_default_model_pipeline_at_a_small_size():
    run = get_recipe("tiny-chat")
    full = get_recipe("default-model")
    x = settings(run)
    assert run.prepare is full.prepare and run.data is full.data  # same stages, same data
    assert (run.total_steps, run.seq_len, run.qat) == (250, 1024, None)
    assert (x.pretrain_steps, x.pretrain_seq_len, x.vocab_size) == (200, 1024, 4096)
    # its own tokenizer directory: the default model's 8192-id tokenizer is never overwritten
    defaults = DefaultModelSettings()
    assert x.tokenizer_dir != defaults.tokenizer_dir and x.corpus_dir == defaults.corpus_dir
    # the README's export command names the last checkpoint
    assert f"step-{run.total_steps:07d}" == "step-0000250" and run.ckpt_every and run.total_steps % run.ckpt_every == 0
