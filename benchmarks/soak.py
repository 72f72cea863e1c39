"""Soak: well-behaved streams, client disconnects and hostile bodies against one ``openk3 serve``
on loopback, for a bounded time; prints errors, 5xx, leaked blocks / slots, peak RSS and the p99
time to first token of the well-behaved streams, next to a baseline run without hostile traffic.

    python benchmarks/soak.py [--minutes 1] [--streams 64] [--json out.json]

Traffic, per client (``--streams`` async clients, each looping until the time is up):

* 75 %: a well-behaved streaming chat request (short prompt, 16 tokens); its TTFT is recorded;
* 25 %: the same stream, disconnected after its first content chunk;
* hostile run only, one extra client in four also sends, in turn: a 5 MiB tool description, a
  200k-value enum, a 4,300-digit ``max_tokens``, 16 images of 7168 px (over the context at a small
  ``--max-model-len``; at the shipped 1,048,576 tokens they fit it, 262k tokens, and are refused
  from their headers by the server's ``--max-request-memory``, which the soak sets, default 1G:
  their estimate, pixels included, exceeds it),
  a 2464 px image (inside the context: answered 200 or 400), an Anthropic image with a string
  ``source``, a 31 MiB announced body to ``/health``.

Pass criteria (the issue's acceptance): 0 5xx, 0 leaked MLA blocks / KDA slots after the run
(``/metrics`` engine stats once idle), p99 TTFT of the well-behaved streams within 2x of the
baseline. Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import re
import subprocess
import sys
import time

import httpx

MODEL = "openk3-tiny"


def _png(side: int, mode: str = "1") -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (side, side)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def hostile_bodies() -> list[tuple[str, str, bytes, dict]]:
    """(name, path, raw body, headers) of the hostile requests, built once."""
    user = [{"role": "user", "content": "hi"}]
    fn = {"name": "f", "parameters": {"type": "object"}}
    j = {"content-type": "application/json"}

    def chat(**extra):
        return json.dumps({"model": MODEL, "messages": user, "max_tokens": 4, **extra}).encode()

    img = lambda url: [{"role": "user", "content": [{"type": "text", "text": "?"},  # noqa: E731
                                                    {"type": "image_url", "image_url": {"url": url}}]}]
    big_img = _png(7168)
    return [
        ("tool description 5 MiB", "/v1/chat/completions",
         chat(tools=[{"type": "function", "function": dict(fn, description="x" * (5 << 20))}]), j),
        ("enum 200k values", "/v1/chat/completions", chat(tools=[{"type": "function", "function": dict(
            fn, parameters={"type": "object", "properties": {"a": {"enum": [f"v{i}" for i in range(200_000)]}}})}]), j),
        ("max_tokens 4,300 digits", "/v1/chat/completions",
         b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": %s}'
         % (MODEL.encode(), b"9" * 4300), j),
        ("16 images of 7168 px", "/v1/chat/completions",
         json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
             {"type": "text", "text": "?"}] + [{"type": "image_url", "image_url": {"url": big_img}}] * 16}]}).encode(), j),
        ("image 2464 px", "/v1/chat/completions",
         json.dumps({"model": MODEL, "max_tokens": 1, "messages": img(_png(2464, "RGB"))}).encode(), j),
        ("anthropic source string", "/anthropic/v1/messages", json.dumps({
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": "x"}]}]}]}).encode(), j),
        ("31 MiB announced to /health", "/health", None, {"content-length": str(31 << 20)}),  # head only
    ]


async def well_behaved(c: httpx.AsyncClient, disconnect: bool, stats: dict) -> None:
    body = {"model": MODEL, "stream": True, "max_tokens": 16,
            "messages": [{"role": "user", "content": "Tell me about the weather in Paris."}]}
    t0 = time.monotonic()
    try:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            stats["codes"][r.status_code] = stats["codes"].get(r.status_code, 0) + 1
            if r.status_code != 200:
                return
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"error"' in line:
                    stats["stream_errors"] += 1
                    return
                if line.startswith("data: ") and ('"content"' in line or '"reasoning_content"' in line) \
                        and '"role"' not in line:
                    if "first" not in locals():
                        first = time.monotonic() - t0
                        if not disconnect:
                            stats["ttft"].append(first)
                    if disconnect:
                        stats["disconnects"] += 1
                        return
    except httpx.HTTPError:
        stats["client_errors"] += 1


async def hostile(c: httpx.AsyncClient, bodies: list, k: int, stats: dict) -> None:
    name, path, raw, headers = bodies[k % len(bodies)]
    try:
        if raw is None:  # a body announced and never sent: the answer must come from the head alone
            host, port = str(c.base_url.host), c.base_url.port
            reader, writer = await asyncio.open_connection(host, port)
            head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{head}\r\n".encode())
            status = int((await asyncio.wait_for(reader.readline(), 60)).split()[1])
            writer.close()
        else:
            status = (await c.post(path, content=raw, headers=headers)).status_code
        stats["hostile"].setdefault(name, {}).setdefault(status, 0)
        stats["hostile"][name][status] += 1
        stats["codes"][status] = stats["codes"].get(status, 0) + 1
    except (httpx.HTTPError, OSError, asyncio.TimeoutError, IndexError, ValueError):
        stats["client_errors"] += 1


def engine_stats(base: str) -> dict:
    out = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        m = re.match(r'openk3_engine_stat\{key="([^"]+)"\} (\S+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def rss_mb(pid: int) -> tuple[int, int]:
    s = open(f"/proc/{pid}/status").read()
    return tuple(int(re.search(k + r":\s+(\d+)", s).group(1)) // 1024 for k in ("VmRSS", "VmHWM"))


def new_stats() -> dict:
    return {"codes": {}, "ttft": [], "disconnects": 0, "stream_errors": 0, "client_errors": 0, "hostile": {},
            "peak_rss_mb": 0, "leaked_blocks": 0, "leaked_slots": 0, "engine_failures": 0, "seconds": 0.0}


async def run_phase(base: str, seconds: float, streams: int, bodies: list | None, pid: int, stats: dict) -> None:
    """One segment of a phase: `streams` clients (and, with `bodies`, the attackers) for
    `seconds`; counts go into `stats`, and the server's RSS is sampled every 0.5 s."""
    end = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as c:
        async def client(i: int) -> None:
            n = 0
            while time.monotonic() < end:
                await well_behaved(c, disconnect=(n + i) % 4 == 0, stats=stats)
                n += 1

        async def attacker(i: int) -> None:
            k = i
            while time.monotonic() < end:
                await hostile(c, bodies, k, stats)
                k += 1

        async def sampler() -> None:
            while time.monotonic() < end:
                stats["peak_rss_mb"] = max(stats["peak_rss_mb"], rss_mb(pid)[0])
                await asyncio.sleep(0.5)

        tasks = [client(i) for i in range(streams)] + [sampler()]
        if bodies:
            tasks += [attacker(i) for i in range(max(1, streams // 16))]
        t0 = time.monotonic()
        await asyncio.gather(*tasks)
        stats["seconds"] += time.monotonic() - t0


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * 0.99))] if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0, help="per phase (baseline, then hostile)")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternate baseline / hostile segments this many times (each minutes/rounds long), so "
                         "that load drift on a shared machine falls on both phases alike")
    ap.add_argument("--max-request-memory", default="1G",
                    help="the server's --max-request-memory (the 16 large images are refused by it)")
    ap.add_argument("--without", default="",
                    help="comma-separated names of hostile bodies to leave out (e.g. 'image 2464 px', to see "
                         "the rest of the hostile traffic without its largest legitimate work, the vision tower's)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    log = open(os.devnull if not os.environ.get("SOAK_LOG") else os.environ["SOAK_LOG"], "w")
    proc = subprocess.Popen([sys.executable, "-m", "openk3.cli", "serve", "--port", "0", "--host", "127.0.0.1",
                             "--max-num-seqs", "16", "--max-request-memory", args.max_request_memory], stdout=subprocess.PIPE, stderr=log, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    line = proc.stdout.readline()
    m = re.search(r"at (http://\S+)/v1", line)
    if not m:
        print("server did not start:", line, file=sys.stderr)
        return 1
    base = m.group(1)
    results = {}
    try:
        left_out = {n.strip() for n in args.without.split(",") if n.strip()}
        bodies = [b for b in hostile_bodies() if b[0] not in left_out]
        phases = {"baseline": new_stats(), "hostile": new_stats()}
        for _ in range(args.rounds):
            for phase, hostile_traffic in (("baseline", None), ("hostile", bodies)):
                s = phases[phase]
                asyncio.run(run_phase(base, args.minutes * 60 / args.rounds, args.streams, hostile_traffic,
                                      proc.pid, s))
                time.sleep(2)
                st = engine_stats(base)  # once idle: every block and slot must be back
                s["leaked_blocks"] = max(s["leaked_blocks"], int(st.get("mla_blocks.used") or 0))
                s["leaked_slots"] = max(s["leaked_slots"], int(st.get("kda_slots.used") or 0))
                s["engine_failures"] = int(st.get("failures") or 0)
        for phase, s in phases.items():
            results[phase] = {
                "seconds": round(s["seconds"], 1), "requests": sum(s["codes"].values()), "codes": s["codes"],
                "5xx": sum(v for k, v in s["codes"].items() if k >= 500),
                "stream_errors": s["stream_errors"], "client_errors": s["client_errors"],
                "disconnects": s["disconnects"], "ttft_n": len(s["ttft"]),
                "ttft_p50_s": sorted(s["ttft"])[len(s["ttft"]) // 2] if s["ttft"] else None,
                "ttft_p99_s": p99(s["ttft"]), "leaked_blocks": s["leaked_blocks"], "leaked_slots": s["leaked_slots"],
                "engine_failures": s["engine_failures"], "peak_rss_mb": s["peak_rss_mb"], "hostile": s["hostile"]}
        results["server_vmhwm_mb"] = rss_mb(proc.pid)[1]
    finally:
        proc.terminate()
        code = proc.wait(120)
    results["exit_code_after_sigterm"] = code
    b, h = results["baseline"], results["hostile"]
    results["ttft_p99_ratio"] = h["ttft_p99_s"] / b["ttft_p99_s"]
    print(f"{'phase':10s} {'requests':>8s} {'5xx':>4s} {'errors':>6s} {'disc.':>5s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
          f"{'leaked blocks/slots':>20s} {'peak RSS':>9s}")
    for name in ("baseline", "hostile"):
        r = results[name]
        print(f"{name:10s} {r['requests']:8d} {r['5xx']:4d} {r['stream_errors'] + r['client_errors']:6d} "
              f"{r['disconnects']:5d} {r['ttft_p50_s']:8.3f}s {r['ttft_p99_s']:8.3f}s "
              f"{int(r['leaked_blocks'] or 0):>10d}/{int(r['leaked_slots'] or 0):<9d} {r['peak_rss_mb']:6d} MB")
    print("hostile answers:", json.dumps(h["hostile"]))
    print(f"p99 TTFT ratio hostile/baseline: {results['ttft_p99_ratio']:.2f}; exit code after SIGTERM: {code}")
    ok = (h["5xx"] == 0 and b["5xx"] == 0 and not h["leaked_blocks"] and not h["leaked_slots"]
          and not b["leaked_blocks"] and not b["leaked_slots"] and results["ttft_p99_ratio"] <= 2.0)
    results["pass"] = ok
    print("pass" if ok else "FAIL")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
