"""``openk3 serve`` as a command: --device / --dtype (a bfloat16 CPU server answers), the access log
line per request (no prompt text; --quiet silences it), and Ctrl-C (SIGINT) draining the in-flight
request and exiting with one line instead of a traceback."""

from __future__ import annotations

import json
import re
import signal

import httpx

from tests.server.conftest import API_KEY, MODEL, REPO, ServerProcess, user

ACCESS = re.compile(r"^\d\d:\d\d:\d\d (GET|POST) (\S+) (\d{3})(?: prompt=(\d+) cached=(\d+) completion=(\d+))? "
                    r"(\d+\.\d{3})s$", re.M)
SECRET = "the purple walrus recites prime numbers"


def test_bf16_cpu_server_answers_logs_each_request_and_drains_on_sigint(checkpoint, tmp_path):
    srv = ServerProcess(checkpoint, "--served-model-name", MODEL, "--device", "cpu", "--dtype", "bfloat16",
                        "--max-num-seqs", "2", log_dir=tmp_path)
    try:
        assert "; cpu, bfloat16)" in srv.output().splitlines()[-1]  # the startup line names where it computes
        r = httpx.post(srv.url + "/chat/completions", timeout=120, json={
            "model": MODEL, "messages": user(SECRET), "max_completion_tokens": 12})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["finish_reason"] in ("stop", "length")
        assert httpx.get(srv.url + "/models", timeout=10).status_code == 200
        lines: list[str] = []
        with httpx.stream("POST", srv.url + "/chat/completions", timeout=120, json={
                "model": MODEL, "messages": user(), "max_completion_tokens": 60, "stream": True,
                "stream_options": {"include_usage": True}}) as s:
            it = s.iter_lines()
            lines.append(next(it))
            srv.proc.send_signal(signal.SIGINT)
            lines.extend(line for line in it if line)
        assert lines[-1] == "data: [DONE]"  # the in-flight stream finished
        code = srv.proc.wait(60)
    finally:
        srv.stop()
    out = srv.output()
    assert code == 0, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert SECRET not in out  # the access log never carries request text
    assert re.findall(r"^openk3 serve: SIGINT.*$", out, re.M) == [
        "openk3 serve: SIGINT, stopping (finishing 1 in-flight request; Ctrl-C again to abort them)"]
    logged = ACCESS.findall(out)
    chat = [m for m in logged if m[1] == "/v1/chat/completions"]
    assert len(chat) == 2 and all(m[2] == "200" for m in chat), out
    usage = body["usage"]
    assert chat[0][3:6] == (str(usage["prompt_tokens"]), str(usage["cached_tokens"]), str(usage["completion_tokens"]))
    # the drained stream ran to its end (its budget, or a stop the bf16 model may reach first), and the log
    # counts the tokens the client was told about
    final = json.loads(lines[-2].removeprefix("data: "))
    assert final["choices"] == [] and 1 <= final["usage"]["completion_tokens"] <= 60
    assert chat[1][5] == str(final["usage"]["completion_tokens"])
    finishes = [json.loads(x.removeprefix("data: "))["choices"][0].get("finish_reason") for x in lines[:-2]
                if json.loads(x.removeprefix("data: "))["choices"]]
    assert finishes[-1] in ("stop", "length")
    assert ("GET", "/v1/models", "200", "", "", "") == logged[1][:6]


def test_quiet_server_logs_no_requests(checkpoint, tmp_path):
    srv = ServerProcess(checkpoint, "--served-model-name", MODEL, "--quiet", log_dir=tmp_path)
    try:
        assert httpx.get(srv.url + "/models", timeout=10).status_code == 200
        assert httpx.get(srv.base + "/health", timeout=10).status_code == 200
    finally:
        srv.stop()
    assert not ACCESS.search(srv.output()), srv.output()
    assert "openk3 serve: SIGTERM, stopping (no request in flight)" in srv.output()


def _serve_fails(*args: str) -> tuple[int, str]:
    """``openk3 serve ARGS`` expected to refuse before serving: (exit status, its output)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "openk3.cli", "serve", *args], capture_output=True, text=True,
                       timeout=120, env=env, cwd=REPO)
    return p.returncode, p.stdout + p.stderr


def test_busy_port_is_one_line_before_the_model_loads():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out = _serve_fails("--port", str(port))
    assert code == 2
    # one line, and no thread announcement: the port was refused before anything was loaded
    assert out == (f"openk3 serve: cannot listen on 127.0.0.1:{port}: Address already in use "
                   "(another server? --port N picks another port, --port 0 a free one)\n"), out


def test_accepted_connections_have_nagle_off():
    """The server's socket, served as uvicorn serves it (``loop.create_server(sock=...)``), hands
    out connections with ``TCP_NODELAY`` set, so a response's second write (the body after the
    headers) leaves at once instead of waiting for the client's delayed ACK."""
    import asyncio
    import socket

    from openk3.server.app import listen_socket

    async def accepted_nodelay(host: str) -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Protocol(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        sock = listen_socket(host, 0)
        server = await asyncio.get_running_loop().create_server(Protocol, sock=sock)
        _, writer = await asyncio.open_connection(host, sock.getsockname()[1])
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(accepted_nodelay("127.0.0.1")) != 0
    if socket.has_ipv6:
        try:
            nodelay = asyncio.run(accepted_nodelay("::1"))
        except OSError:  # no IPv6 loopback on this machine
            return
        assert nodelay != 0


def test_bad_runtime_flag_names_the_flag_not_the_model():
    code, out = _serve_fails("--port", "0", "--device", "tpu")
    assert code == 2
    assert out.startswith("openk3 serve: --device: 'tpu' is not a device") and out.count("\n") == 1, out
    assert "cannot load" not in out and "cannot start" not in out


def test_eval_against_a_server_names_its_error_and_an_unreachable_url(server):
    import socket

    import pytest

    from openk3.eval import ServerModel, run_eval

    m = ServerModel(server.base, model="no-such-model", api_key=API_KEY, max_tokens=4)
    with pytest.raises(ValueError) as e:
        run_eval(m, n=1, suites=("echo",))
    assert str(e.value) == (f"{server.base}/v1/chat/completions: HTTP 404: "
                            "Not found the model no-such-model or Permission denied")
    with pytest.raises(ValueError, match=r"/v1/models: HTTP 401: "):
        ServerModel(server.base)  # no key
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(OSError) as e:
        ServerModel(closed)
    assert str(e.value) == f"cannot reach {closed}: Connection refused (is the server running there?)"
