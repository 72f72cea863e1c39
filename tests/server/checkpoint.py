"""A tiny servable checkpoint for the server tests: trained byte-level BPE + random K3 weights.

The weights are ``build_model(preset("k3-test-tiny"))`` (random, every K3 branch) with one change to
make generations *terminate*: the output head is steered toward a fixed set of tokens (printable
ASCII, the XTML markers, JSON closers). A random model over a ~1k vocabulary almost never emits
``<|close|>``, so constrained outputs (JSON, tool calls) would never finish within a small
``max_tokens``; with the steered head a grammar-constrained output (the server constrains every
request) completes in a few dozen tokens, and may also run to a small ``max_tokens`` first.

How the steering works: every token embedding gets a large constant in hidden dimension 0. The
random layers add only small updates, so the final hidden state after the output norm points along
dimension 0 for every context, and ``lm_head.weight[:, 0]`` then acts as a context-free logit bias.
:func:`check_steering` verifies this on the built model (the fixture fails loudly if a model change
breaks the assumption).
"""

from __future__ import annotations

from pathlib import Path

import torch

BIAS_FAVOURED = 8.0   # printable ASCII tokens (+0.75 per extra character), <|open|>
BIAS_CLOSER = 14.0    # <|close|>, <|sep|>, '"', '}', ']': short channels, tags, strings and objects
EMBED_CONST = 40.0


def train_tokenizer(directory: Path):
    """Train a ~1k byte-level BPE carrying the K3 special tokens; save and load it back."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from openk3.tokenizer import K3_SPECIAL_TOKENS, Tokenizer, load_tokenizer

    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=list(K3_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["The quick brown fox jumps over the lazy dog. What is the weather in Paris today?"] * 40
    corpus += ['{"city": "Paris", "unit": "celsius", "answer": 42, "ok": true}'] * 40
    corpus += [f"message role user assistant system tool think response tools call argument json {i}"
               for i in range(100)]
    # the XTML tag texts the grammar forces, so that tool calls take few tokens
    corpus += ['message role="assistant" think response tools call tool="get_weather" index="1" argument key="city" '
               'type="string" type="number" type="object" json type="array" get_time'] * 60
    corpus += ["thinking_effort guides on how much to think in your thinking channel. Here are the available "
               "tools, described in JSONSchema. The system is invoked with response_format=json_object."] * 20
    bpe.train_from_iterator(corpus, trainer)
    Tokenizer.from_bpe(bpe).save_pretrained(directory)
    return load_tokenizer(directory)


def favoured_ids(tok) -> tuple[list[int], list[int]]:
    """(favoured, closers): every token spelling printable ASCII, ``<|open|>``; and the closers."""
    favoured = {i for i in range(tok.vocab_size) if i not in tok.special_ids
                and all(32 <= b < 127 for b in tok.decode_bytes([i]))}
    favoured.add(tok.open_id)
    closers = {tok.close_id, tok.sep_id} | {tok.encode_text(c)[0] for c in '"}]'}
    return sorted(favoured - closers), sorted(closers)


@torch.no_grad()
def steer(model, tok) -> None:
    """Make ``lm_head`` a context-free logit bias (see the module docstring)."""
    favoured, closers = favoured_ids(tok)
    model.model.embed_tokens.weight[:, 0] = EMBED_CONST
    bias = torch.zeros(model.config.vocab_size)
    for i in favoured:  # longer tokens a little more: grammar-forced tag text then takes few tokens
        bias[i] = min(BIAS_FAVOURED + 0.75 * (len(tok.decode_bytes([i])) - 1), BIAS_CLOSER - 3)
    bias[closers] = BIAS_CLOSER
    h0 = model.config.hidden_size ** 0.5  # RMS-normalised state concentrated in one dimension
    model.lm_head.weight[:, 0] = bias / h0


@torch.no_grad()
def check_steering(model, tok) -> None:
    """Assert that the favoured tokens hold >99% of the probability mass in random contexts."""
    favoured, closers = favoured_ids(tok)
    keep = torch.tensor(favoured + closers)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=g)
    probs = model(ids).logits.float().softmax(-1)          # [2, 24, V]
    mass = probs[..., keep].sum(-1)
    assert bool((mass > 0.99).all()), f"steering failed: favoured mass min {mass.min().item():.4f}"


def build_checkpoint(directory: Path, **config) -> Path:
    """Write tokenizer + steered tiny K3 into `directory` (a servable ``openk3 serve`` checkpoint);
    ``config``: :class:`~openk3.config.K3Config` fields replacing the ``k3-test-tiny`` preset's."""
    import openk3
    from openk3.pretrained import build_model

    directory.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(directory)
    cfg = openk3.preset("k3-test-tiny").replace(
        vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.end_of_msg_id,
        pad_token_id=tok.pad_id, media_placeholder_token_id=tok.media_pad_id, max_position_embeddings=4096,
        **config)
    model = build_model(cfg, seed=0).eval()
    steer(model, tok)
    check_steering(model, tok)
    model.save_pretrained(str(directory))
    return directory
