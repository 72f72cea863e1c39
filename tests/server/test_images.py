"""Images through ``openk3 serve`` (a tiny random vision model: structure only) with the ``openai`` and
``anthropic`` SDKs: image requests answer; ``usage.prompt_tokens`` counts each image as its
documented block (independent formula below), identical in the response, the token-count endpoints
and the engine, for landscape / portrait / square / tiny / huge images; http URLs, corrupt images and
text-only models get 400s naming the problem."""

from __future__ import annotations

import base64
import io
import math
import shutil

import anthropic
import httpx
import openai
import pytest
import torch
from PIL import Image

from tests.server.checkpoint import check_steering, steer
from tests.server.conftest import API_KEY, MODEL, ServerProcess

# (width, height, format): landscape, portrait, square, tiny, huge (over the 7168-px side limit)
SIZES = {"landscape": (64, 40, "PNG"), "portrait": (40, 64, "JPEG"), "square": (56, 56, "WEBP"),
         "tiny": (1, 1, "GIF"), "huge": (8000, 100, "PNG")}


def documented_tokens(w: int, h: int, p: int = 14, m: int = 2, limit: int = 65536, side: int = 512) -> int:
    """N from the released resize rule (openk3.vision.preprocess docstring), written out again."""
    scale = min(1.0, math.sqrt(limit / (max(1.0, w // p) * max(1.0, h // p))), side * p / w, side * p / h)
    nw, nh = min(max(1, int(w * scale)), side * p), min(max(1, int(h * scale)), side * p)
    gw, gh = math.ceil(nw / (m * p)) * m, math.ceil(nh / (m * p)) * m
    return (gw // m) * (gh // m)


def test_documented_examples():
    assert [documented_tokens(*s) for s in ((224, 224), (1000, 500), (2800, 2800), (1, 1))] == [64, 648, 10000, 1]


def data_url(w: int, h: int, fmt: str, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    small = torch.randint(0, 256, (min(h, 64), min(w, 64), 3), generator=g, dtype=torch.uint8).numpy()
    img = Image.fromarray(small).resize((w, h), Image.Resampling.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def body(url: str, text: str = "What is in this image?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture(scope="module")
def vision_checkpoint(checkpoint, tmp_path_factory):
    """The server suite's tokenizer + k3-test-tiny with the tiny MoonViT (random, steered head)."""
    import openk3
    from openk3.pretrained import build_model
    from openk3.tokenizer import load_tokenizer
    from openk3.vision import vision_preset

    out = tmp_path_factory.mktemp("vision") / "k3-tiny-vl"
    out.mkdir()
    for f in checkpoint.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.startswith("model"):
            shutil.copy(f, out / f.name)
    tok = load_tokenizer(out)
    cfg = openk3.preset("k3-test-tiny").replace(
        vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.end_of_msg_id, pad_token_id=tok.pad_id,
        media_placeholder_token_id=tok.media_pad_id, max_position_embeddings=4096).as_k3_wrapper()
    cfg.wrapper["vision_config"] = vision_preset("tiny").to_dict()
    model = build_model(cfg, seed=0).eval()
    steer(model, tok)
    check_steering(model, tok)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def vserver(vision_checkpoint, tmp_path_factory):
    srv = ServerProcess(vision_checkpoint, "--served-model-name", MODEL, "--api-key", API_KEY,
                        log_dir=tmp_path_factory.mktemp("vlogs"))
    yield srv
    srv.stop()
    assert "Traceback" not in srv.output(), srv.output()


@pytest.fixture(scope="module")
def vclient(vserver):
    with openai.OpenAI(base_url=vserver.url, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def vhttp(vserver):
    with httpx.Client(base_url=vserver.base, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def local(vision_checkpoint):
    """In-process serving core + engine over the same checkpoint (the engine's own count)."""
    from openk3.engine import Engine, EngineConfig
    from openk3.pretrained import load_pretrained
    from openk3.server import ChatServing, ModelInfo
    from openk3.server.images import image_config_for
    from openk3.server.metrics import Metrics
    from openk3.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    model = load_pretrained(vision_checkpoint)
    serving = ChatServing(None, load_tokenizer(vision_checkpoint), ModelInfo(MODEL, 4096, supports_image_in=True),
                          Metrics(), image_config=image_config_for(model, str(vision_checkpoint)))
    return serving, Engine(model, EngineConfig(max_num_seqs=2))


def test_models_report_image_support(vclient, client):
    assert vclient.models.retrieve(MODEL).supports_image_in is True
    assert client.models.retrieve(MODEL).supports_image_in is False


@pytest.mark.parametrize("kind", list(SIZES))
def test_image_token_counts_agree_everywhere(kind, vclient, vhttp, local):
    from openk3.engine import SamplingParams

    w, h, fmt = SIZES[kind]
    messages = body(data_url(w, h, fmt))
    serving, engine = local
    tok = serving.tokenizer
    text_only = serving.count_tokens(serving.parse({"model": MODEL, "messages": [{"role": "user", "content": [
        messages[0]["content"][0]]}]}, counting=True))
    want = text_only + 3 + len(tok.encode_text(f"image {w}x{h}")) + documented_tokens(w, h)

    r = vclient.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
    counted = vhttp.post("/v1/tokenizers/estimate-token-count", json={"model": MODEL, "messages": messages})
    assert counted.status_code == 200, counted.text
    req = {"model": MODEL, "messages": messages, "max_completion_tokens": 1}
    prep = serving.prepare(serving.parse(req))
    engine.add_request(prep.prompt_ids, SamplingParams(max_tokens=1, temperature=0.0), mm_inputs=prep.mm_inputs)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    out = outs[-1]
    assert out.finished
    engine_count = out.usage.prompt_tokens - prep.prompt.pending_tokens  # the engine also holds the 3-id stub
    assert r.usage.prompt_tokens == counted.json()["data"]["total_tokens"] == engine_count == want


def test_anthropic_image_block(vserver, local):
    src = data_url(64, 40, "PNG").split(",", 1)[1]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Describe."},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": src}}]}]
    with anthropic.Anthropic(base_url=vserver.base + "/anthropic", api_key=API_KEY, max_retries=0, timeout=120) as ac:
        m = ac.messages.create(model=MODEL, max_tokens=2, messages=msgs)
        n = ac.messages.count_tokens(model=MODEL, messages=msgs).input_tokens
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n
        assert n == local[0].count_tokens(local[0].parse({"model": MODEL, "messages": body(data_url(64, 40, "PNG"), "Describe.")},
                                                          counting=True))
        bad = [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": base64.b64encode(b"not an image").decode()}}]}]
        with pytest.raises(anthropic.BadRequestError) as e:
            ac.messages.create(model=MODEL, max_tokens=2, messages=bad)
        assert "messages[0].content[1]" in e.value.body["error"]["message"]


def test_image_errors(vclient):
    with pytest.raises(openai.BadRequestError) as e:
        vclient.chat.completions.create(model=MODEL, messages=body("https://example.com/cat.png"), max_completion_tokens=2)
    assert "http" in e.value.body["message"]
    two = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "reasoning_content": ""},
           {"role": "user", "content": [{"type": "text", "text": "and this?"},
                                        {"type": "image_url", "image_url": {"url": data_url(8, 8, "PNG")}},
                                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not-b64"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        vclient.chat.completions.create(model=MODEL, messages=two, max_completion_tokens=2)
    msg = e.value.body["message"]
    assert msg.startswith("messages[2].content[2]: invalid image (corrupt)"), msg
    garbage = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n truncated").decode()
    with pytest.raises(openai.BadRequestError) as e:
        vclient.chat.completions.create(model=MODEL, messages=body(garbage), max_completion_tokens=2)
    assert e.value.body["message"].startswith("messages[0].content[1]: invalid image"), e.value.body["message"]
    buf = io.BytesIO()
    Image.new("1", (8000, 8000)).save(buf, format="PNG")  # a small file declaring 64 M pixels
    bomb = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    with pytest.raises(openai.BadRequestError) as e:  # > max_image_pixels: refused from the header
        vclient.chat.completions.create(model=MODEL, messages=body(bomb), max_completion_tokens=2)
    assert e.value.body["message"].startswith("messages[0].content[1]: invalid image (too_large)")


def test_text_only_model_refuses_images(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=body(data_url(16, 16, "PNG")), max_completion_tokens=2)
    assert e.value.body["message"] == "model does not support image input"


def test_image_parts_only_where_the_api_allows_them(vhttp):
    """OpenAI route: image parts only in user messages; system / developer / assistant / tool ones are
    a 400 naming the part (on a vision model, so the role rule and not the capability answers).
    Anthropic route: image blocks in user turns and inside tool_result content, not in assistant
    turns or ``system``."""
    img = {"type": "image_url", "image_url": {"url": data_url(8, 8, "PNG")}}
    text = {"type": "text", "text": "look"}
    call = {"id": "functions.snap:0", "type": "function", "function": {"name": "snap", "arguments": "{}"}}
    tools = [{"type": "function", "function": {"name": "snap", "parameters": {"type": "object"}}}]
    ask = {"role": "user", "content": "What do you see?"}
    cases = [
        ([{"role": "system", "content": [text, img]}, ask], "messages[0].content[1]", "system"),
        ([{"role": "developer", "content": [img]}, ask], "messages[0].content[0]", "developer"),
        ([ask, {"role": "assistant", "content": [text, img], "reasoning_content": ""}, ask],
         "messages[1].content[1]", "assistant"),
        ([ask, {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "functions.snap:0", "content": [text, img]}],
         "messages[2].content[1]", "tool"),
    ]
    for messages, where, role in cases:
        r = vhttp.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": tools,
                                                     "max_completion_tokens": 2})
        assert r.status_code == 400, (role, r.text)
        assert r.json() == {"error": {"message": f"{where}: image parts are only allowed in user messages, not in "
                                                 f"{role} messages", "type": "invalid_request_error"}}, r.text
    valid = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [text, img]}]
    ok = vhttp.post("/v1/chat/completions", json={"model": MODEL, "messages": valid, "max_completion_tokens": 2})
    assert ok.status_code == 200, ok.text

    src = {"type": "base64", "media_type": "image/png", "data": data_url(8, 8, "PNG").split(",", 1)[1]}
    block = {"type": "image", "source": src}
    a_tool = {"name": "snap", "input_schema": {"type": "object"}}
    loop = [{"role": "user", "content": "Take a picture."},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                              {"type": "tool_use", "id": "functions.snap:0", "name": "snap",
                                               "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "functions.snap:0",
                                          "content": [{"type": "text", "text": "photo"}, block]}]}]
    for path in ("/anthropic/v1/messages", "/anthropic/v1/messages/count_tokens"):
        r = vhttp.post(path, json={"model": MODEL, "max_tokens": 2, "tools": [a_tool], "messages": loop})
        assert r.status_code == 200, (path, r.text)
    bad = [({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
                {"type": "text", "text": "see"}, block]}]},
            "messages[1].content[1]: image blocks are only allowed in user messages and in tool_result content, "
            "not in assistant messages"),
           ({"system": [{"type": "text", "text": "s"}, block], "messages": [{"role": "user", "content": "hi"}]},
            "system[1]: image blocks are only allowed in user messages and in tool_result content, not in system")]
    for extra, message in bad:
        r = vhttp.post("/anthropic/v1/messages", json={"model": MODEL, "max_tokens": 2, **extra})
        assert r.status_code == 400, r.text
        assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}, r.text
