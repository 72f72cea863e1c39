"""Expand a rendered prompt's image slots into the official K3 image blocks.

The renderer (``openk3.chat_format.render``) leaves one ``<|media_pad|>`` id per image. Before
inference each slot becomes (chat-format spec §10; ``../shared/fixtures/k3-chat-format/README.md``
"Images")::

    <|media_begin|>  BPE("image {W}x{H}")  <|media_content|>  N x <|media_pad|>  <|media_end|>

with W x H the original pixel size and N the vision token count of the image
(:func:`openk3.vision.preprocess.image_token_count`). Dropping the size text or keeping a single
pad are known bugs of other ports (the model goes blind but stays fluent). One image therefore
adds ``3 + len(encode("image WxH")) + N`` ids, the number :meth:`Prompt.prompt_tokens_with_images`
takes per image.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from openk3.tokenizer import MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, Tokenizer


@dataclass
class ExpandedPrompt:
    """Prompt ids with every image slot expanded.

    Attributes:
        token_ids: the expanded ids.
        pad_positions: per image, the positions of its N ``<|media_pad|>`` ids in ``token_ids``
            (a contiguous ``range``); the model writes projected vision features there, in order.
        image_token_counts: per image, the ids its block occupies (3 + len(size text) + N).
        num_pads: per image, N.
    """

    token_ids: list[int]
    pad_positions: list[range]
    image_token_counts: list[int]
    num_pads: list[int]


def image_block(tokenizer: Tokenizer, width: int, height: int, num_pads: int) -> list[int]:
    """The ids of one image block: media_begin, ``image WxH`` text, media_content, pads, media_end.

    Raises:
        ValueError: the tokenizer lacks a media token, or a non-positive size / count.
    """
    ids = [tokenizer.media_begin_id, tokenizer.media_content_id, tokenizer.media_end_id]
    if any(i is None for i in ids):
        names = [n for n, i in zip((MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END), ids) if i is None]
        raise ValueError(f"tokenizer: missing special token(s) {names} needed for image blocks")
    if width < 1 or height < 1 or num_pads < 1:
        raise ValueError(
            f"image_block: size {width}x{height} and num_pads {num_pads} must be positive"
        )
    return (
        [tokenizer.media_begin_id]
        + tokenizer.encode_text(f"image {width}x{height}")
        + [tokenizer.media_content_id]
        + [tokenizer.media_pad_id] * num_pads
        + [tokenizer.media_end_id]
    )


def expand_image_slots(
    token_ids: Sequence[int],
    image_slots: Sequence[int],
    sizes: Sequence[tuple[int, int]],
    num_pads: Sequence[int],
    tokenizer: Tokenizer,
) -> ExpandedPrompt:
    """Replace the pad id at each slot by its image block.

    Args:
        token_ids: rendered prompt ids. image_slots: increasing indices of the slots (each a
            ``<|media_pad|>`` id). sizes: original (W, H) per image. num_pads: N per image.
    Raises:
        ValueError: lengths disagree, a slot out of range / not increasing / not a pad id, or see
            :func:`image_block`.
    """
    if not (len(image_slots) == len(sizes) == len(num_pads)):
        raise ValueError(
            f"expand_image_slots: {len(image_slots)} slots, {len(sizes)} sizes, "
            f"{len(num_pads)} token counts"
        )
    out: list[int] = []
    pads: list[range] = []
    counts: list[int] = []
    prev = -1
    for k, (slot, (w, h), n) in enumerate(zip(image_slots, sizes, num_pads)):
        if not prev < slot < len(token_ids):
            raise ValueError(f"image_slots[{k}]: {slot} is out of range or not increasing")
        if token_ids[slot] != tokenizer.media_pad_id:
            raise ValueError(
                f"image_slots[{k}]: id {token_ids[slot]} at {slot} is not <|media_pad|>"
            )
        out.extend(token_ids[prev + 1 : slot])
        block = image_block(tokenizer, int(w), int(h), int(n))
        start = len(out) + len(block) - 1 - int(n)
        pads.append(range(start, start + int(n)))
        counts.append(len(block))
        out.extend(block)
        prev = slot
    out.extend(token_ids[prev + 1 :])
    return ExpandedPrompt(out, pads, counts, [int(n) for n in num_pads])


def expand_prompt(prompt, images: Sequence, tokenizer: Tokenizer) -> ExpandedPrompt:
    """Expand a :class:`~openk3.chat_format.render.Prompt` with its processed images.

    Args:
        prompt: the rendered prompt (``token_ids``, ``image_slots``).
        images: one :class:`~openk3.vision.preprocess.ProcessedImage` (or anything with ``width``,
            ``height``, ``num_tokens``) per slot, in order.
    Raises:
        ValueError: see :func:`expand_image_slots`.
    """
    return expand_image_slots(
        prompt.token_ids,
        prompt.image_slots,
        [(im.width, im.height) for im in images],
        [im.num_tokens for im in images],
        tokenizer,
    )
