"""Hostile but well-formed requests: each must be answered (200 or a 4xx naming the limit) with
bounded memory and time, and must leave the server serving everyone else.

In-process tests drive :class:`~openk3.server.serving.ChatServing` and the engine directly; the
server tests use the suite's ``openk3 serve`` process (``tests/server/conftest.py``).
"""

from __future__ import annotations

import base64
import io
import re

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
    from openk3.server.protocol import APIError

    parts = [{"type": "text", "text": "Compare these."}]
    parts += [{"type": "image_url", "image_url": {"url": _png(7168, 7168)}} for _ in range(16)]
    req = {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_completion_tokens": 4}
    with pytest.raises(APIError) as e:
        vision_serving.prepare(vision_serving.parse(req))
    assert e.value.status == 400 and e.value.message.startswith("Your request exceeded model token limit: 4096")
    assert loads == []
    small = {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "And this?"}, {"type": "image_url", "image_url": {"url": _png(64, 40, "RGB")}}]}]}
    counted = vision_serving.count_tokens(vision_serving.parse(small, counting=True))
    assert loads == [] and counted > 16  # 16 image tokens + text, sized from the header
    prep = vision_serving.prepare(vision_serving.parse(small))
    assert loads == [(64, 40)] and prep.prompt_tokens == counted  # decoded once, after the checks


class _LiveApp:
    """``create_app`` over a real engine, served by uvicorn on a loopback port in a thread of the
    test process (so that a test can inject a fault into the engine's forward)."""

    def __init__(self, checkpoint, **serving_kwargs):
        import socket
        import threading
        import time

        import uvicorn

        from openk3.server.app import build_serving, create_app

        self.serving, self.aengine = build_serving(str(checkpoint), served_model_name=MODEL, **serving_kwargs)
        app = create_app(self.serving, engine_shutdown=self.aengine.shutdown)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    def poison(self, n: int = 1, after_tokens: int = 0) -> list:
        """The next ``n`` forwards that compute a request past ``after_tokens`` generated tokens
        raise like a failed allocation; returns the list of failures so far."""
        engine = self.aengine.engine
        original = engine.runner.forward
        failed: list = []

        def forward(pieces, need):
            if len(failed) < n and any(p.request.completion_tokens >= after_tokens for p in pieces):
                failed.append([p.request.request_id for p in pieces])
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory (injected)")
            return original(pieces, need)

        engine.runner.forward = forward
        return failed

    def close(self):
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture(scope="module")
def live(checkpoint):
    app = _LiveApp(checkpoint, max_num_seqs=4)
    yield app
    app.close()


def test_engine_failure_is_a_500_then_the_server_serves_100_requests(live):
    """A request whose engine work fails gets a 500 in the platform envelope (non-streaming and
    Anthropic), or an SSE error event once streaming has started; its blocks and slot are back at
    once, /health stays ok, and the next 100 requests all succeed."""
    import json

    import httpx

    from openk3.server.serving import ENGINE_FAILED

    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_completion_tokens": 4}
    with httpx.Client(base_url=live.base, timeout=60) as http:
        failed = live.poison(1)
        r = http.post("/v1/chat/completions", json=ask)
        assert len(failed) == 1
        assert r.status_code == 500 and r.json() == {"error": {"message": ENGINE_FAILED, "type": "server_error"}}
        live.poison(1)
        r = http.post("/anthropic/v1/messages", json={"model": MODEL, "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 500 and r.json() == {"type": "error", "error": {"type": "api_error",
                                                                                "message": ENGINE_FAILED}}
        live.poison(1, after_tokens=2)  # fails mid-stream, after two tokens went out
        with http.stream("POST", "/v1/chat/completions", json=dict(ask, stream=True, max_completion_tokens=8)) as s:
            assert s.status_code == 200
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-1]) == {"error": {"message": ENGINE_FAILED, "type": "server_error"}}
        assert "[DONE]" not in events and len(events) >= 2
        assert http.get("/health").json()["status"] == "ok"
        stats = live.aengine.engine.stats()
        assert stats["failures"] == 3 and stats["kda_slots"]["used"] == 0 and stats["mla_blocks"]["used"] == 0
        codes = [http.post("/v1/chat/completions", json=dict(ask, max_completion_tokens=2)).status_code
                 for _ in range(100)]
        assert codes == [200] * 100
        assert http.get("/health").json()["status"] == "ok"
        assert live.aengine.engine.check_consistency() == []


def test_out_of_memory_while_preparing_is_a_500_and_the_connection_goes_on(live, monkeypatch):
    """A failed allocation while a request is prepared (numpy's MemoryError decoding an image under
    a memory cap) is a 500 in the platform envelope on every surface; the client's keep-alive
    connection stays open and serves the next request (an unhandled exception would close it)."""
    import http.client
    import json

    import numpy as np

    from openk3.server.app import OUT_OF_MEMORY

    failures: list = []
    real = live.serving.render

    def render(req, *args):
        if not failures:
            failures.append(1)
            np.empty(1 << 62, dtype=np.uint8)  # numpy's _ArrayMemoryError, a MemoryError
        return real(req, *args)

    monkeypatch.setattr(live.serving, "render", render)
    host, port = live.base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2}
    cases = [("/v1/chat/completions", chat, {"error": {"message": OUT_OF_MEMORY, "type": "server_error"}}),
             ("/v1/tokenizers/estimate-token-count", {"model": MODEL, "messages": chat["messages"]},
              {"error": {"message": OUT_OF_MEMORY, "type": "server_error"}}),
             ("/anthropic/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": chat["messages"]},
              {"type": "error", "error": {"type": "api_error", "message": OUT_OF_MEMORY}})]
    for path, body, want in cases:
        failures.clear()
        conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
        r = conn.getresponse()
        assert (r.status, json.loads(r.read())) == (500, want), path
        assert (r.getheader("connection") or "").lower() != "close", path
        conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
        r = conn.getresponse()  # same socket: still open
        assert r.status == 200, (path, r.read())
        r.read()
    conn.close()
    assert live.aengine.engine.check_consistency() == []


def _spy_tokenizer(monkeypatch, tok) -> list[int]:
    """Lengths of every text the tokenizer encodes while the test runs."""
    seen: list[int] = []
    real = tok.encode_text

    def encode_text(text: str) -> list[int]:
        seen.append(len(text))
        return real(text)

    monkeypatch.setattr(tok, "encode_text", encode_text)
    return seen


def _bodies() -> list[dict]:
    """Chat bodies exercising every rendered field (thinking on and off)."""
    params = {"type": "object", "properties": {"city": {"type": "string", "description": "the city name",
                                                        "enum": ["Paris", "Lyon", "Nice"]}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now.", "parameters": params}}]
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "", "tools": [{"type": "function", "function": {"name": "later", "parameters": params}}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}, {"type": "text", "text": " And Lyon?"}]},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two cities, two calls.", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":   "Paris",\n  "n": [1, 2, {"k": "v"}]}'}},
            {"id": "functions.get_weather:1", "type": "function",
             "function": {"name": "get_weather", "arguments": "not json at all"}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 C"},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": [{"type": "text", "text": "21 C"}]},
        {"role": "user", "content": "Thanks. As JSON please."},
    ]
    schema = {"type": "json_schema", "json_schema": {"name": "w", "strict": True, "schema": {
        "type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}}}
    out = []
    for thinking in ({"type": "enabled"}, {"type": "disabled"}):
        out.append({"model": MODEL, "messages": history, "tools": tools, "thinking": thinking})
        out.append({"model": MODEL, "messages": history, "tools": tools, "thinking": thinking,
                    "response_format": schema, "tool_choice": "none"})
        out.append({"model": MODEL, "thinking": thinking, "messages": history[:3] + [
            {"role": "assistant", "content": "", "reasoning_content": "Partial thought", "partial": True}]})
    return out


def test_rendered_chars_never_exceeds_what_is_tokenized(tokenizer, monkeypatch):
    """The bound's soundness: the characters it counts are all tokenized by the renderer."""
    from openk3.chat_format import encode_request, parse_conversation
    from openk3.server.validation import rendered_chars

    def chars(body, thinking=False):
        return rendered_chars(parse_conversation(body), thinking)

    seen = _spy_tokenizer(monkeypatch, tokenizer)
    for body in _bodies():
        thinking = parse_conversation(body).options.thinking
        seen.clear()
        encode_request(body, tokenizer)
        counted = chars(body, thinking)
        assert 0 < counted <= sum(seen), (body.get("thinking"), counted, sum(seen))
        assert chars(body) <= counted  # without the reasoning: still a lower bound
    # and it does count every field family: each one alone pushes the total
    base = _bodies()[0]
    grow = {
        "tool description": lambda b: b["tools"][0]["function"].__setitem__("description", "d" * 5000),
        "enum": lambda b: b["tools"][0]["function"]["parameters"]["properties"]["city"].__setitem__(
            "enum", ["e" * 50] * 100),
        "dynamic tools": lambda b: b["messages"][1]["tools"][0]["function"].__setitem__("description", "d" * 5000),
        "arguments": lambda b: b["messages"][3]["tool_calls"][0]["function"].__setitem__(
            "arguments", '{"city": "' + "p" * 5000 + '"}'),
        "response schema": lambda b: b.__setitem__("response_format", {"type": "json_schema", "json_schema": {
            "schema": {"type": "object", "description": "s" * 5000}}}),
        "reasoning": lambda b: b["messages"][3].__setitem__("reasoning_content", "r" * 5000),
    }
    import copy

    for what, change in grow.items():
        body = copy.deepcopy(base)
        change(body)
        assert chars(body, True) >= chars(base, True) + 4000, what


def test_every_rendered_field_is_bounded_before_any_work(tokenizer, monkeypatch):
    """Megabyte tool descriptions, enums, schemas, dynamic tools, tool-call arguments and
    Anthropic tool descriptions, on both surfaces and both count endpoints: a 400 naming the
    token limit, with nothing tokenized and no schema compiled."""
    import llguidance

    from openk3.server import anthropic
    from openk3.server.metrics import Metrics
    from openk3.server.protocol import APIError
    from openk3.server.serving import ChatServing, ModelInfo

    ctx = 64
    serving = ChatServing(None, tokenizer, ModelInfo(MODEL, ctx), Metrics())
    big = "x" * (ctx * serving.max_token_bytes() + 1)
    seen = _spy_tokenizer(monkeypatch, tokenizer)
    compiled: list = []
    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar", lambda *a, **k: compiled.append(a) or "")
    fn = {"name": "f", "parameters": {"type": "object"}}
    user = [{"role": "user", "content": "hi"}]
    chat_cases = {
        "tool description": {"tools": [{"type": "function", "function": dict(fn, description=big)}]},
        "enum": {"tools": [{"type": "function", "function": dict(fn, parameters={"type": "object", "properties": {
            "a": {"enum": [big[:100]] * (len(big) // 100 + 1)}}})}]},
        "response_format": {"response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "object", "description": big}}}},
        "dynamic tools": {"messages": [{"role": "system", "content": "", "tools": [
            {"type": "function", "function": dict(fn, description=big)}]}] + user},
        "tool-call arguments": {"messages": user + [
            {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "f", "arguments": '{"a": "' + big + '"}'}}]},
            {"role": "tool", "tool_call_id": "c0", "content": "ok"}, {"role": "user", "content": "?"}]},
    }
    for what, extra in chat_cases.items():
        body = {"model": MODEL, "messages": user, **extra}
        with pytest.raises(APIError) as e:
            serving.prepare(serving.parse(body))
        assert e.value.status == 400 and e.value.message.startswith(
            f"Your request exceeded model token limit: {ctx} (requested: at least "), what
        with pytest.raises(APIError) as e:
            serving.count_tokens(serving.parse(body, counting=True))
        assert e.value.status == 400 and e.value.message.startswith("request: the text to render ("), what
    a_body = {"model": MODEL, "max_tokens": 4, "messages": user,
              "tools": [{"name": "f", "description": big, "input_schema": {"type": "object"}}]}
    with pytest.raises(APIError) as e:
        anthropic.prepare(serving, a_body)
    assert re.fullmatch(rf"prompt is too long: \d+ tokens > {ctx - 1} maximum", e.value.message)  # Anthropic's wording
    with pytest.raises(APIError) as e:
        anthropic.count_tokens(serving, a_body)
    assert e.value.message.startswith("request: the text to render (")
    assert seen == [] and compiled == []


def test_images_over_the_memory_budget_are_refused_before_decoding(tokenizer, loads):
    """With ``--max-request-memory``, images whose tower activations exceed it get a 400 naming
    the limit, from the header sizes alone; within it they are served as before."""
    import dataclasses

    from openk3.server.metrics import Metrics
    from openk3.server.protocol import APIError
    from openk3.server.serving import ChatServing, ModelInfo
    from openk3.server.validation import Limits
    from openk3.vision import vision_preset
    from openk3.vision.encoder import tower_activation_bytes

    vc = vision_preset("tiny")
    serving = ChatServing(None, tokenizer, ModelInfo(MODEL, 4096, supports_image_in=True), Metrics(),
                          dataclasses.replace(Limits(), max_request_memory=32 * 2**20),
                          activation_bytes=lambda grids: tower_activation_bytes(vc, grids))
    def req(side):
        return {"model": MODEL, "max_completion_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": _png(side, side)}}]}]}

    big = req(1400)  # 100 x 100 patches: 2,500 tokens, inside the context
    need = tower_activation_bytes(vc, [(1, 100, 100)])
    assert need > 32 * 2**20
    with pytest.raises(APIError) as e:
        serving.prepare(serving.parse(big))
    assert e.value.status == 400 and e.value.message == (
        f"messages: the images need about {need / 2**20:.0f} MiB of activation memory in the vision tower, above "
        "this server's per-request limit of 32 MiB (--max-request-memory); send fewer or smaller images")
    assert loads == []
    small = req(280)
    assert serving.prepare(serving.parse(small)).mm_inputs and loads == [(280, 280)]


def test_small_hostile_fields_are_400s_naming_the_field(live):
    """A 4,300-digit ``max_tokens`` (Python cannot print it) and an Anthropic image ``source``
    that is not an object: 400s in the platform envelope, never a 500."""
    import httpx

    huge = "9" * 4300
    user = '[{"role": "user", "content": "hi"}]'
    with httpx.Client(base_url=live.base, timeout=60, headers={"content-type": "application/json"}) as http:
        r = http.post("/v1/chat/completions", content=f'{{"model": "{MODEL}", "messages": {user}, "max_tokens": {huge}}}')
        assert r.status_code == 400, r.text
        ctx = live.serving.model.context_length
        assert r.json()["error"]["message"].startswith(f"Your request exceeded model token limit: {ctx} (requested: "
                                                       "an integer of about 430"), r.text  # 4,300 or 4,301 digits
        r = http.post("/anthropic/v1/messages", content=f'{{"model": "{MODEL}", "messages": {user}, "max_tokens": {huge}}}')
        assert r.status_code == 400 and "an integer of about 430" in r.json()["error"]["message"], r.text
        # Longer than Python parses: json.loads itself fails, and the 400 still names the key.
        longer = "9" * 5000
        for path, body in (("/v1/chat/completions", f'{{"model": "{MODEL}", "messages": {user}, "max_tokens": {longer}}}'),
                           ("/anthropic/v1/messages", f'{{"model": "{MODEL}", "messages": {user}, "max_tokens": -{longer}}}'),
                           ("/v1/chat/completions", f'{{"model": "{MODEL}", "messages": {user}, "seed": [{longer}]}}')):
            r = http.post(path, content=body)
            want = "max_tokens" if "max_tokens" in body else "body"
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == f"Invalid request: {want}: an integer of more than 4300 digits", r.text
        block = {"type": "tool_result", "tool_use_id": "t0", "content": [{"type": "image", "source": "abc"}]}
        r = http.post("/anthropic/v1/messages", json={"model": MODEL, "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": [block]}]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == ("messages[0].content[0].content[0].source: must be an object (type "
                                                "base64 with media_type and data), got str")


def test_bodies_to_paths_without_one_are_never_buffered(server):
    """POSTs to open or unknown paths: a large announced body is a 413 before any byte is read;
    a small one gets the path's own answer. Auth still guards /v1 before any body is read."""
    import httpx

    for path in ("/health", "/metrics", "/docs", "/no/such/path"):
        with httpx.Client(base_url=server.base, timeout=30) as http:
            r = http.post(path, content=b"{}", headers={"content-type": "application/json"})
            assert r.status_code in (404, 405), (path, r.status_code)
    import socket

    for path in ("/health", "/no/such/path", "/v1/chat/completions"):
        host, port = server.base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {31 * 2**20}\r\n\r\n".encode())  # announced, never sent
            head = s.recv(4096).decode()
        want = "401" if path.startswith("/v1") else "413"
        assert head.startswith(f"HTTP/1.1 {want}"), (path, head[:80])


def test_malformed_checkpoint_files_are_one_line_errors_naming_the_file(tmp_path):
    """Tokenizer and config files that are special files, malformed, not UTF-8 or not objects,
    and a config deeper than its weights: a ValueError naming the file, raised before any large
    read or build (``openk3 serve`` prints it as one ``cannot load`` line)."""
    import json
    import os
    import shutil

    from openk3.pretrained import load_pretrained
    from openk3.shipped import shipped_model_path
    from openk3.tokenizer import load_tokenizer

    src = shipped_model_path()
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    cases = {
        "tokenizer.json": [("symlink", "/dev/urandom", "not a regular file"), ("text", '{"model": ', "Expecting value"),
                           ("bytes", b"\xff\xfe", "not UTF-8 text")],
        "tokenizer_config.json": [("text", "[1, 2]", "expected a JSON object"), ("text", "{", "invalid JSON"),
                                  ("text", '{"added_tokens_decoder": {"x": "y"}}', "invalid literal")],
    }
    for name, variants in cases.items():
        for kind, value, want in variants:
            target = ck / name
            target.unlink()
            if kind == "symlink":
                os.symlink(value, target)
            elif kind == "bytes":
                target.write_bytes(value)
            else:
                target.write_text(value)
            with pytest.raises(ValueError) as e:
                load_tokenizer(ck)
            msg = str(e.value)
            assert msg.startswith(f"{target}: cannot load: ") and want in msg and "\n" not in msg, msg
            target.unlink()
            shutil.copy(src / name, target)
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = 1_000_000
    (ck / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: num_hidden_layers=1000000 but the weights hold layers 0\.\.7"):
        load_pretrained(ck)
    (ck / "config.json").unlink()
    os.mkfifo(ck / "config.json")  # a FIFO would block a plain open() forever
    with pytest.raises(ValueError, match="config.json: cannot load: not a regular file"):
        load_pretrained(ck)


def test_oversized_checkpoint_files_are_refused_before_reading(tmp_path):
    """A config or tokenizer file over its size cap (a sparse file: it takes no disk) is a
    one-line ``cannot load`` error naming the file and the cap, raised from its size alone."""
    import os
    import shutil

    from openk3.files import MAX_CONFIG_BYTES, MAX_TOKENIZER_BYTES
    from openk3.pretrained import load_pretrained
    from openk3.shipped import shipped_model_path
    from openk3.tokenizer import load_tokenizer

    src = shipped_model_path()
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    for name, cap, load in (("tokenizer.json", MAX_TOKENIZER_BYTES, load_tokenizer),
                            ("tokenizer_config.json", MAX_CONFIG_BYTES, load_tokenizer),
                            ("config.json", MAX_CONFIG_BYTES, load_pretrained)):
        target = ck / name
        original = target.read_bytes()
        os.truncate(target, cap + 1)
        with pytest.raises(ValueError) as e:
            load(ck)
        assert str(e.value) == f"{target}: cannot load: {cap + 1} bytes is over the {cap}-byte limit", str(e.value)
        target.write_bytes(original)
    assert load_tokenizer(ck).vocab_size == load_tokenizer(src).vocab_size  # restored: loads again
