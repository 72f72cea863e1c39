"""The long-prefill benchmark input: Claude Code's default request, synthetic or recorded at run time.

    python benchmarks/claude_code_request.py                    # synthetic request -> stdout (JSON)
    python benchmarks/claude_code_request.py --out req.json     # ... -> a file, with its shape on stderr
    python benchmarks/claude_code_request.py --record           # the real one, recorded into a temp dir

``openk3 bench long-prefill`` uses the synthetic request of :mod:`openk3.bench.agent_prompt` (generated
words at the recorded request's sizes; nothing recorded is kept in the repository). ``--record``
installs ``@anthropic-ai/claude-code`` from npm into a temporary directory, starts a local logging
endpoint that answers like the Messages API, runs ``claude -p "say hi"`` against it (fresh HOME, a
dummy key) and prints the shape of the first request it sent: system block sizes, tool count and
sizes, message blocks, and its prompt tokens through openk3's Anthropic surface with ``openk3-tiny``'s
tokenizer, next to the same numbers for the synthetic request. The recording stays in the temp dir
(deleted at exit) unless ``--out`` names a file of your own; it is third-party text: do not commit it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_EVENTS = (
    ("message_start", {"type": "message_start", "message": {
        "id": "msg_0", "type": "message", "role": "assistant", "model": "logger", "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}}),
    ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                       "usage": {"output_tokens": 1}}),
    ("message_stop", {"type": "message_stop"}),
)


def _logging_server(bodies: list) -> ThreadingHTTPServer:
    """A loopback endpoint that keeps every POSTed JSON body and answers "hi" (stream or not)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            body = json.loads(raw or b"{}")
            bodies.append({"path": self.path, "body": body})
            if "count_tokens" in self.path:
                self._json({"input_tokens": 1})
            elif body.get("stream"):
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                for name, data in _EVENTS:
                    self.wfile.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
            else:
                self._json({"id": "msg_0", "type": "message", "role": "assistant", "model": "logger",
                            "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
                            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}})

        def _json(self, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_HEAD(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


def record(workdir: str, version: str | None) -> dict:
    """Install Claude Code into ``workdir``, run ``claude -p "say hi"`` against a logging endpoint and
    return its main request (the Messages body with tools).

    Raises:
        RuntimeError: npm or claude failed, or no request with tools was seen.
    """
    pkg = "@anthropic-ai/claude-code" + (f"@{version}" if version else "")
    r = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", workdir, pkg],
                       capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise RuntimeError(f"npm install {pkg} failed:\n{r.stderr[-2000:]}")
    bodies: list = []
    server = _logging_server(bodies)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    home = os.path.join(workdir, "home")
    os.makedirs(home, exist_ok=True)
    env = dict(os.environ, HOME=home, ANTHROPIC_BASE_URL=f"http://127.0.0.1:{server.server_address[1]}",
               ANTHROPIC_API_KEY="sk-logging-endpoint")
    try:
        r = subprocess.run([os.path.join(workdir, "node_modules", ".bin", "claude"), "-p", "say hi"],
                           capture_output=True, text=True, timeout=300, env=env, cwd=workdir)
    finally:
        server.shutdown()
    main = [b["body"] for b in bodies if isinstance(b["body"], dict) and b["body"].get("tools")]
    if not main:
        raise RuntimeError(f"claude -p made {len(bodies)} requests, none with tools (exit {r.returncode}):\n"
                           f"{r.stderr[-2000:]}")
    return main[0]


def shape(request: dict) -> dict:
    """Sizes of an Anthropic Messages body and its prompt tokens as openk3 serves it (openk3-tiny)."""
    from openk3.bench.agent_prompt import prompt_ids
    from openk3.tokenizer import load_tokenizer

    system = request.get("system") or []
    system = [{"type": "text", "text": system}] if isinstance(system, str) else system
    messages = request.get("messages") or []
    # System-role turns inside `messages` go to the system prompt here (the K3 format allows a
    # system message anywhere; this keeps the count independent of how the server places them).
    moved = [m for m in messages if m.get("role") == "system"]
    body = dict(request, messages=[m for m in messages if m.get("role") != "system"],
                system=system + [{"type": "text", "text": m["content"] if isinstance(m["content"], str) else
                                  "".join(b.get("text", "") for b in m["content"])} for m in moved])
    tok = load_tokenizer("openk3-tiny")
    no_tools = dict(body)
    no_tools.pop("tools", None)
    no_tools.pop("tool_choice", None)
    n = len(prompt_ids(body, tok))
    return {"system_blocks": [len(b.get("text", "")) for b in system], "tools": len(request.get("tools") or []),
            "tool_json_chars": sum(len(json.dumps(t)) for t in request.get("tools") or []),
            "messages": [(m.get("role"), len(m["content"]) if isinstance(m["content"], list) else 1) for m in messages],
            "max_tokens": request.get("max_tokens"), "prompt_tokens": n,
            "tool_tokens": n - len(prompt_ids(no_tools, tok))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", action="store_true", help="record the real request (npm + claude -p) at run time")
    ap.add_argument("--version", help="Claude Code version to install with --record (default: latest)")
    ap.add_argument("--scale", type=float, help="synthetic request size (default: ~24K tokens)")
    ap.add_argument("--out", help="write the request JSON here (default: stdout, synthetic only)")
    args = ap.parse_args(argv)
    from openk3.bench.agent_prompt import DEFAULT_SCALE, claude_code_like_request

    synthetic = claude_code_like_request(scale=args.scale or DEFAULT_SCALE)
    if not args.record:
        text = json.dumps(synthetic, indent=1)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(text)
            print(json.dumps({"synthetic": shape(synthetic)}), file=sys.stderr)
        else:
            print(text)
        return 0
    with tempfile.TemporaryDirectory(prefix="claude-code-") as tmp:
        try:
            real = record(tmp, args.version)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            print(f"claude_code_request: {e}", file=sys.stderr)
            return 1
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(real, f)
        print(json.dumps({"recorded": shape(real), "synthetic": shape(synthetic)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
