"""Hostile but well-formed requests: each must be answered (200 or a 4xx naming the limit) with
bounded memory and time, and must leave the server serving everyone else.

In-process tests drive :class:`~openk3.server.serving.ChatServing` and the engine directly; the
server tests use the suite's ``openk3 serve`` process (``tests/server/conftest.py``).
"""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image, ImageFile

from tests.server.conftest import MODEL


def _png(w: int, h: int, mode: str = "1") -> str:
    """A data URL of a w x h PNG (1-bit black: a few KB however large it declares itself)."""
    buf = io.BytesIO()
    Image.new(mode, (w, h)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture
def vision_serving(tokenizer):
    """A serving core that accepts images (no engine: prepare() and count_tokens() only)."""
    from openk3.server.metrics import Metrics
    from openk3.server.serving import ChatServing, ModelInfo

    return ChatServing(None, tokenizer, ModelInfo(MODEL, 4096, supports_image_in=True), Metrics())


@pytest.fixture
def loads(monkeypatch) -> list:
    """Every pixel decode (``ImageFile.load``) made while the test runs."""
    calls: list = []
    original = ImageFile.ImageFile.load

    def load(self, *a, **k):
        if self.tile:  # pixels still to decode (later calls on a loaded image are no-ops)
            calls.append(self.size)
        return original(self, *a, **k)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return calls


def test_images_over_the_context_are_refused_from_their_headers(vision_serving, loads):
    """16 images of 7168 x 7168 (51 M pixels each, 16,384 tokens each after the resize): the 400
    comes from the header sizes, before a single pixel is decoded; counting never decodes."""
    from openk3.server.protocol import APIError, ChatCompletionRequest

    parts = [{"type": "text", "text": "Compare these."}]
    parts += [{"type": "image_url", "image_url": {"url": _png(7168, 7168)}} for _ in range(16)]
    req = {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_completion_tokens": 4}
    with pytest.raises(APIError) as e:
        vision_serving.prepare(req, ChatCompletionRequest.model_validate(req))
    assert e.value.status == 400 and e.value.message.startswith("Your request exceeded model token limit: 4096")
    assert loads == []
    small = {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "And this?"}, {"type": "image_url", "image_url": {"url": _png(64, 40, "RGB")}}]}]}
    counted = vision_serving.count_tokens(small)
    assert loads == [] and counted > 16  # 16 image tokens + text, sized from the header
    prep = vision_serving.prepare(small, ChatCompletionRequest.model_validate(small))
    assert loads == [(64, 40)] and prep.prompt_tokens == counted  # decoded once, after the checks
