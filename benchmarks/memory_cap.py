"""Engine recovery under a real memory cap: ``openk3 serve`` (the shipped model) runs with an
address-space limit (``RLIMIT_AS``, what ``prlimit --as`` sets) a little above what it needs for
ordinary requests; a request whose memory need is over that limit (an image whose vision-tower
activations do not fit) must get a clean error, and the next requests must all succeed.

    python benchmarks/memory_cap.py [--headroom-mb 300] [--image-px 2464] [--after 100] [--json out.json]

Steps: (1) an uncapped server is warmed up with the same kinds of requests (text, streaming,
image) to measure the address space it needs (``VmPeak``) for ordinary work; (2) a server capped
at that size plus ``--headroom-mb`` answers the large image (expected: an error, 500 in the
platform envelope or a 4xx, never a dropped connection), then ``--after`` ordinary requests
(expected: all 200), with ``/health`` checked before and after. Prints the answers, the capped
server's log lines about the failure, and a pass / fail line. Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

import httpx

MODEL = "openk3-tiny"


def _png(side: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.effect_noise((side, side), 64).convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _start(cap: int | None, log_path: str) -> tuple[subprocess.Popen, str]:
    def limit() -> None:
        if cap is not None:
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    log = open(log_path, "w")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "openk3.cli", "serve", "--port", "0", "--host", "127.0.0.1"],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env, preexec_fn=limit)
    line = proc.stdout.readline()
    m = re.search(r"at (http://\S+)/v1", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}\n{open(log_path).read()[-3000:]}")
    return proc, m.group(1)


def _vm(pid: int, key: str) -> int:
    return int(re.search(key + r":\s+(\d+)", open(f"/proc/{pid}/status").read()).group(1)) * 1024


def _ordinary(c: httpx.Client, small_image: str, k: int) -> int:
    """One ordinary request (text, streaming, count or small image in turn); its status."""
    try:
        return _ordinary_status(c, small_image, k)
    except httpx.HTTPError:  # a dropped or reset connection: a failure of the server, counted as 0
        return 0


def _ordinary_status(c: httpx.Client, small_image: str, k: int) -> int:
    user = [{"role": "user", "content": f"Say something about the number {k}."}]
    kind = k % 4
    if kind == 0:
        return c.post("/v1/chat/completions", json={"model": MODEL, "messages": user, "max_tokens": 4}).status_code
    if kind == 1:
        with c.stream("POST", "/v1/chat/completions", json={"model": MODEL, "messages": user, "max_tokens": 4,
                                                            "stream": True}) as r:
            body = "".join(r.iter_text())
            return r.status_code if "[DONE]" in body and '"error"' not in body else 599
    if kind == 2:
        return c.post("/v1/tokenizers/estimate-token-count", json={"model": MODEL, "messages": user}).status_code
    return c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": small_image}}]}]}).status_code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--headroom-mb", type=int, default=300)
    ap.add_argument("--image-px", type=int, default=2464)
    ap.add_argument("--after", type=int, default=100)
    ap.add_argument("--json")
    args = ap.parse_args()
    small, big = _png(224), _png(args.image_px)
    big_req = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": {"url": big}}]}]}
    tmp = tempfile.mkdtemp(prefix="openk3-memcap-")
    out: dict = {}
    # (1) what ordinary work needs, uncapped
    proc, base = _start(None, os.path.join(tmp, "uncapped.log"))
    try:
        with httpx.Client(base_url=base, timeout=600) as c:
            codes = [_ordinary(c, small, k) for k in range(12)]
            out["warm_codes"] = codes
            out["ordinary_vmpeak_mb"] = _vm(proc.pid, "VmPeak") >> 20
            t0 = time.monotonic()
            r = c.post("/v1/chat/completions", json=big_req)
            out["uncapped_big"] = {"status": r.status_code, "seconds": round(time.monotonic() - t0, 1),
                                   "vmpeak_mb": _vm(proc.pid, "VmPeak") >> 20, "hwm_mb": _vm(proc.pid, "VmHWM") >> 20}
    finally:
        proc.terminate()
        proc.wait(120)
    cap = (out["ordinary_vmpeak_mb"] + args.headroom_mb) << 20
    out["cap_mb"] = cap >> 20
    # (2) capped: the big request fails cleanly, the rest succeed
    log_path = os.path.join(tmp, "capped.log")
    proc, base = _start(cap, log_path)
    try:
        with httpx.Client(base_url=base, timeout=600) as c:
            out["health_before"] = c.get("/health").status_code
            out["warm_capped"] = [_ordinary(c, small, k) for k in range(4)]
            t0 = time.monotonic()
            try:
                r = c.post("/v1/chat/completions", json=big_req)
                out["capped_big"] = {"status": r.status_code, "body": r.text[:300],
                                     "seconds": round(time.monotonic() - t0, 1)}
            except httpx.HTTPError as e:
                out["capped_big"] = {"status": None, "error": repr(e)}
            after = [_ordinary(c, small, k) for k in range(args.after)]
            out["after_codes"] = {str(k): after.count(k) for k in sorted(set(after))}
            out["health_after"] = c.get("/health").status_code
            stats = {}
            for line in c.get("/metrics").text.splitlines():
                m = re.match(r'openk3_engine_stat\{key="([^"]+)"\} (\S+)', line)
                if m:
                    stats[m.group(1)] = float(m.group(2))
            out["engine"] = {k: stats.get(k) for k in ("failures", "mla_blocks.used", "kda_slots.used")}
        out["server_alive"] = proc.poll() is None
    finally:
        proc.terminate()
        out["exit_code"] = proc.wait(120)
    log = open(log_path).read()
    out["log_failure_lines"] = [ln for ln in log.splitlines() if "fail" in ln.lower() or "memory" in ln.lower()][:10]
    out["log_tracebacks"] = log.count("Traceback")
    big_status = out["capped_big"].get("status")
    ok = (big_status is not None and big_status != 200 and out["after_codes"] == {"200": args.after}
          and out["health_after"] == 200 and out["server_alive"] and not out["engine"]["mla_blocks.used"]
          and not out["engine"]["kda_slots.used"])
    out["pass"] = ok
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
