"""Image slot expansion: the official ``<|media_begin|>image WxH<|media_content|>`` + N pads +
``<|media_end|>`` layout, pad positions, and agreement with ``Prompt.prompt_tokens_with_images``."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from openk3.chat_format.render import encode_request
from openk3.vision import expand_image_slots, expand_prompt, image_block
from openk3.vision.preprocess import process_image
from tests.conftest import kimi_tokenizer as kimi


def _request():
    parts = [{"type": "text", "text": "compare"}, {"type": "image_url", "image_url": {"url": "data:a"}},
             {"type": "text", "text": "with"}, {"type": "image", "image": "data:b"}]
    return {"messages": [{"role": "user", "content": parts}]}


def test_expansion_layout_positions_and_count():
    tok = kimi()
    prompt = encode_request(_request(), tok)
    sizes, pads = [(1000, 500), (37, 53)], [648, 4]
    ex = expand_image_slots(prompt.token_ids, prompt.image_slots, sizes, pads, tok)
    # text between the slots is unchanged, and each slot became exactly its block
    pieces, prev = [], -1
    for slot in prompt.image_slots:
        pieces.append(prompt.token_ids[prev + 1:slot])
        prev = slot
    pieces.append(prompt.token_ids[prev + 1:])
    blocks = [[tok.media_begin_id] + tok.encode_text(f"image {w}x{h}") + [tok.media_content_id]
              + [tok.media_pad_id] * n + [tok.media_end_id] for (w, h), n in zip(sizes, pads)]
    assert ex.token_ids == pieces[0] + blocks[0] + pieces[1] + blocks[1] + pieces[2]
    assert tok.encode_text("image 1000x500") == [4017, 220, 1570, 15, 87, 3668]  # size text is ordinary BPE
    # pad positions: contiguous, N each, and together exactly the pad ids of the expanded prompt
    assert [len(r) for r in ex.pad_positions] == pads
    flat = [i for r in ex.pad_positions for i in r]
    assert flat == [i for i, t in enumerate(ex.token_ids) if t == tok.media_pad_id]
    for r in ex.pad_positions:
        assert ex.token_ids[r.start - 1] == tok.media_content_id and ex.token_ids[r.stop] == tok.media_end_id
    # usage accounting agrees with the renderer's formula
    assert ex.image_token_counts == [len(b) for b in blocks] == [3 + len(tok.encode_text(f"image {w}x{h}")) + n
                                                                 for (w, h), n in zip(sizes, pads)]
    assert len(ex.token_ids) - prompt.pending_tokens == prompt.prompt_tokens_with_images(ex.image_token_counts)
    assert ex.token_ids[-prompt.pending_tokens:] == prompt.token_ids[-prompt.pending_tokens:]


def test_expand_prompt_with_processed_images():
    tok = kimi()
    prompt = encode_request(_request(), tok)
    imgs = []
    for size in [(90, 40), (30, 70)]:
        buf = io.BytesIO()
        Image.new("RGB", size, (1, 2, 3)).save(buf, "PNG")
        imgs.append(process_image(buf.getvalue()))
    ex = expand_prompt(prompt, imgs, tok)
    assert ex.num_pads == [im.num_tokens for im in imgs] == [4 * 2, 2 * 3]
    assert tok.decode(ex.token_ids[ex.pad_positions[0].start - 8:ex.pad_positions[0].start]).endswith(
        "<|media_begin|>image 90x40<|media_content|>")


def test_expansion_errors():
    tok = kimi()
    prompt = encode_request(_request(), tok)
    with pytest.raises(ValueError, match="2 slots, 1 sizes"):
        expand_image_slots(prompt.token_ids, prompt.image_slots, [(1, 1)], [1, 1], tok)
    with pytest.raises(ValueError, match="not <\\|media_pad\\|>"):
        expand_image_slots(prompt.token_ids, [0, prompt.image_slots[1]], [(1, 1)] * 2, [1, 1], tok)
    with pytest.raises(ValueError, match="not increasing"):
        expand_image_slots(prompt.token_ids, prompt.image_slots[::-1], [(1, 1)] * 2, [1, 1], tok)
    with pytest.raises(ValueError, match="positive"):
        image_block(tok, 0, 5, 1)
