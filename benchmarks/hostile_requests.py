"""Single hostile requests against one ``openk3 serve`` on loopback: for each, the answer, its
time, ``/health`` latency while it is in flight (polled every 10 ms from a separate process) next
to the same poller's latency in a quiet window just before, the first-token time of a second
client streaming meanwhile next to its quiet value, and the server's RSS before and after.

    python benchmarks/hostile_requests.py [--cases 5mib,25mib,enum1m] [--repeat 1] [--json out.json]

The quiet window matters on a shared machine: ``/health`` answered in 150 ms with nothing else
running says the machine is loaded, not that the server blocks. Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time

MODEL = "openk3-tiny"


def _chat(**extra) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                       **extra}).encode()


def _tool(**fn) -> list:
    return [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, **fn}}]


def cases() -> dict[str, tuple[str, bytes]]:
    """name -> (path, body); built lazily by the caller (the big ones take a moment)."""
    enum = {"type": "object", "properties": {"a": {"enum": [f"v{i}" for i in range(1_000_000)]}}}
    return {
        "5mib": ("/v1/chat/completions", _chat(tools=_tool(description="x" * (5 << 20)))),
        "25mib": ("/v1/chat/completions", _chat(tools=_tool(description="x" * (25 << 20)))),
        "enum1m": ("/v1/chat/completions", _chat(tools=_tool(parameters=enum))),
        "count-25mib": ("/v1/tokenizers/estimate-token-count", json.dumps({
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "tools": _tool(description="x" * (25 << 20))}).encode()),
        "anthropic-25mib": ("/anthropic/v1/messages", json.dumps({
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "description": "x" * (25 << 20), "input_schema": {"type": "object"}}]}).encode()),
        "ints-extra-2m": ("/v1/chat/completions", _chat(junk=list(range(2_000_000)))),
    }


def _poll(port: int, stop, out) -> None:
    """Child process: GET /health every 10 ms on one keep-alive connection; sends (t, latency)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    samples = []
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            conn.request("GET", "/health")
            conn.getresponse().read()
        except OSError:  # not answered within the timeout: recorded as such, on a new connection
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        samples.append((t0, time.monotonic() - t0))
        time.sleep(0.01)
    out.send(samples)


def _post(port: int, path: str, body: bytes) -> tuple[int, float, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.monotonic()
    conn.request("POST", path, body=body, headers={"content-type": "application/json"})
    r = conn.getresponse()
    text = r.read().decode(errors="replace")
    return r.status, time.monotonic() - t0, text


def _ttft(port: int) -> float:
    """First content token of a short streaming chat, seconds."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": 8,
                       "messages": [{"role": "user", "content": "Tell me about Paris."}]}).encode()
    t0 = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
    r = conn.getresponse()
    while True:
        line = r.fp.readline()
        if not line:
            return float("nan")
        if line.startswith(b"data: ") and (b'"content"' in line or b'"reasoning_content"' in line) \
                and b'"role"' not in line:
            out = time.monotonic() - t0
            r.close()
            return out


def _streamer(port: int, delay: float, out) -> None:
    time.sleep(delay)
    out.send(_ttft(port))


def rss_mb(pid: int) -> float:
    """Resident set of the process and its children (the body-parsing workers), MB."""
    total = 0
    pids = [pid] + [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    for p in pids:
        try:
            total += int(re.search(r"VmRSS:\s+(\d+)", open(f"/proc/{p}/status").read()).group(1))
        except (OSError, AttributeError):
            pass
    return total / 1024


def main_rss_mb(pid: int) -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", open(f"/proc/{pid}/status").read()).group(1)) / 1024


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * 0.99))]


def measure(port: int, path: str, body: bytes, quiet_s: float = 2.0) -> dict:
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    recv, send = ctx.Pipe(duplex=False)
    poller = ctx.Process(target=_poll, args=(port, stop, send))
    poller.start()
    time.sleep(0.5)
    quiet_ttft = _ttft(port)
    time.sleep(quiet_s)
    t_start = time.monotonic()
    srecv, ssend = ctx.Pipe(duplex=False)
    streamer = ctx.Process(target=_streamer, args=(port, 0.05, ssend))  # starts while the body is in flight
    streamer.start()
    status, seconds, text = _post(port, path, body)
    t_end = time.monotonic()
    busy_ttft = srecv.recv()
    streamer.join()
    stop.set()
    samples = recv.recv()
    poller.join()
    quiet = [lat for t, lat in samples if t < t_start]
    busy = [lat for t, lat in samples if t_start <= t <= t_end]
    ms = lambda xs, f: round(1000 * f(xs), 1) if xs else None  # noqa: E731
    return {"status": status, "seconds": round(seconds, 3), "answer": text[:160],
            "health_quiet_p50_ms": ms(quiet, statistics.median), "health_quiet_max_ms": ms(quiet, max),
            "health_busy_p50_ms": ms(busy, statistics.median), "health_busy_p99_ms": ms(busy, _p99),
            "health_busy_max_ms": ms(busy, max),
            "health_busy_n": len(busy), "ttft_quiet_s": round(quiet_ttft, 3), "ttft_busy_s": round(busy_ttft, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="5mib,25mib,enum1m,count-25mib,anthropic-25mib,ints-extra-2m")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = open(os.environ["HOSTILE_LOG"], "w") if os.environ.get("HOSTILE_LOG") else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "openk3.cli", "serve", "--port", "0", "--host", "127.0.0.1"],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    m = re.search(r"at http://[^:]+:(\d+)/v1", proc.stdout.readline())
    if not m:
        print("server did not start", file=sys.stderr)
        return 1
    port = int(m.group(1))
    results: dict = {"rows": []}
    try:
        all_cases = cases()
        _post(port, *all_cases["5mib"])  # warm-up: first-request costs (imports, workers) out of the numbers
        _ttft(port)
        time.sleep(1)
        results["rss_before_mb"], results["main_rss_before_mb"] = rss_mb(proc.pid), main_rss_mb(proc.pid)
        for _ in range(args.repeat):
            for name in args.cases.split(","):
                row = {"case": name, **measure(port, *all_cases[name])}
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
        time.sleep(2)
        results["rss_after_mb"], results["main_rss_after_mb"] = rss_mb(proc.pid), main_rss_mb(proc.pid)
    finally:
        proc.terminate()
        results["exit_code"] = proc.wait(120)
    print(f"RSS (server + workers) before / after: {results['rss_before_mb']:.0f} / {results['rss_after_mb']:.0f} MB "
          f"(main process {results['main_rss_before_mb']:.0f} / {results['main_rss_after_mb']:.0f} MB); "
          f"exit {results['exit_code']}")
    # the acceptance: answered (200 / 4xx) within 2 s, /health under 100 ms meanwhile, RSS back within 10 %
    rows = results["rows"]
    results["rss_ratio"] = round(results["rss_after_mb"] / results["rss_before_mb"], 3)
    results["pass"] = (all(r["status"] < 500 and r["seconds"] <= 2.0 and (r["health_busy_max_ms"] or 0) < 100
                           for r in rows) and results["rss_ratio"] <= 1.10)
    print(f"worst answer {max(r['seconds'] for r in rows):.2f} s, worst /health max "
          f"{max(r['health_busy_max_ms'] or 0 for r in rows):.0f} ms / p99 "
          f"{max(r['health_busy_p99_ms'] or 0 for r in rows):.0f} ms, RSS after/before {results['rss_ratio']:.3f}: "
          + ("pass" if results["pass"] else "FAIL"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if results["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
