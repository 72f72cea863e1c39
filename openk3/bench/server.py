"""B7: what ``openk3 serve`` adds on top of the engine — streaming over loopback vs the
``AsyncEngine`` called in-process, same checkpoint, same run.

Setup: a servable checkpoint written to a temporary directory: a byte-level BPE (~1k tokens, the
K3 special tokens) trained on a few sentences, and the K3-shaped model of
:func:`~openk3.bench.common.k3_config` (default hidden 128, 4 layers, fp32, random weights: the
overhead is additive, and a small model keeps the step-time noise of a shared machine below it).

* ``server``: ``python -m openk3.cli serve CKPT --port 0 --no-prefix-cache`` in a subprocess; the
  client streams ``POST /v1/chat/completions`` (``stream: true``) with ``httpx`` on 127.0.0.1 and
  timestamps every SSE event on arrival.
* ``in_process``: :func:`openk3.server.app.build_serving` on the same directory in this process
  (same engine settings); the request body is rendered with the server's own ``prepare`` (untimed),
  then ``AsyncEngine.generate(prompt_ids, params, constraint)`` is timed (the server constrains every
  request with the output grammar, so both sides run it).

Both use the API's fixed sampling (temperature 1.0, top_p 0.95) with the same ``seed``, so they
generate the same tokens; asserted: equal ``completion_tokens`` and the server's streamed
reasoning + content text equals the output parser's text for the in-process tokens.

Per request: TTFT = submission to the first *text-bearing* token (server: first SSE chunk with
``reasoning_content`` / ``content`` / ``tool_calls``; in-process: the same token index, found by
feeding the tokens to the output parser), per-token latency = (time of the final event - time of
that first token) / number of engine outputs after it, end-to-end = time of the final event.
Reported: p50 over requests of each side, their difference, and the p50 of the per-request
paired differences (server - in-process for the same request, run back to back), which is the
added latency the targets use: pairing cancels the drift of a shared machine's speed that moves
both sides' p50s by more than the overhead. Requests alternate server / in-process.
Targets (performance.md §6.4, server overhead): added TTFT <= 5 ms, added per-token latency
<= 1 ms (p50 of the paired differences).

``concurrent_streams``: after the paired requests (the in-process engine stopped), for each n in
``streams`` (default 1 and 8), ``stream_rounds`` rounds of n streamed requests sent to the server
at once: per stream its completion tokens over its end-to-end time (tokens/s per stream, p50 and
summary), and per round all tokens over the round's wall time. ``--set model=openk3-tiny`` (or
any checkpoint directory) serves that model instead of the random benchmark checkpoint (``hidden``
and ``layers`` then do not apply). ``--set compile=true`` runs both sides' decode steps compiled
(``openk3 serve --compile``); request 0 and one untimed round per stream count warm the graphs up.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from openk3.bench.common import check, environment, k3_config, percentile, settings, summary, target

FULL = {
    "hidden": 128,
    "layers": 4,
    "new_tokens": 32,
    "requests": 40,
    "streams": (1, 8),
    "stream_rounds": 3,
    "model": "",
    "compile": False,
}
QUICK = {
    "hidden": 64,
    "layers": 4,
    "new_tokens": 4,
    "requests": 1,
    "streams": (1, 2),
    "stream_rounds": 1,
    "model": "",
    "compile": False,
}
_STARTUP = re.compile(r"openk3 serve: model (\S+) at (http://\S+)/v1")
MODEL_ID = "openk3-bench"
PROMPT = (
    "You are reviewing a pull request that adds a benchmark suite to an inference engine. "
    "Summarise in three sentences what the benchmarks measure, which peers they compare "
    "against, and how the results are checked for correctness before any number is reported."
)


def write_checkpoint(directory: Path, hidden: int, layers: int) -> Path:
    """Train a small byte-level BPE with the K3 special tokens and save it with a random K3-shaped
    model sized by ``hidden`` / ``layers``; returns ``directory``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from openk3.pretrained import build_model
    from openk3.tokenizer import K3_SPECIAL_TOKENS, Tokenizer, load_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=list(K3_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = [
        PROMPT,
        "message role user assistant system think response tools call argument",
        "The engine streams tokens; the server renders, parses and frames them as server-sent events.",
    ]
    bpe.train_from_iterator(text * 50, trainer)
    Tokenizer.from_bpe(bpe).save_pretrained(directory)
    tok = load_tokenizer(directory)
    cfg = k3_config(hidden, layers, vocab=tok.vocab_size).replace(
        bos_token_id=tok.bos_id,
        eos_token_id=tok.end_of_msg_id,
        pad_token_id=tok.pad_id,
        media_placeholder_token_id=tok.media_pad_id,
    )
    build_model(cfg, seed=0).save_pretrained(str(directory))
    return directory


class _Server:
    """``openk3 serve`` on a free loopback port, its output in a log file."""

    def __init__(
        self,
        ckpt: Path,
        log: Path,
        timeout: float = 180.0,
        device: str = "cpu",
        dtype: str = "float32",
        max_num_seqs: int = 4,
        compile: bool = False,
    ) -> None:
        self._log = open(log, "w+")
        self.log = log
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("OPENK3_API_KEY", None)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "openk3.cli",
                "serve",
                str(ckpt),
                "--port",
                "0",
                "--no-prefix-cache",
                "--max-num-seqs",
                str(max_num_seqs),
                "--served-model-name",
                MODEL_ID,
                "--device",
                device,
                "--dtype",
                dtype,
                "--quiet",
                *(["--compile"] if compile else []),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + timeout
        while True:
            m = _STARTUP.search(log.read_text())
            if m:
                self.base = m.group(2)
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"openk3 serve did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _stream_server(client, body: dict) -> dict:
    """One streamed request; event times are relative to sending it."""
    t0 = time.perf_counter()
    first_text = None
    last = None
    text = []
    usage = None
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:  # read the body only then: reading it drains the stream
            check(False, f"server answered {resp.status_code}: {resp.read()[:500]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter() - t0
            data = line[6:]
            if data == "[DONE]":
                break
            ev = json.loads(data)
            check("error" not in ev, f"server stream error: {ev}")
            if not ev.get("choices"):
                continue
            choice = ev["choices"][0]
            delta = choice.get("delta") or {}
            piece = (delta.get("reasoning_content") or "") + (delta.get("content") or "")
            if piece or delta.get("tool_calls"):
                text.append(piece)
                if first_text is None:
                    first_text = now
            if choice.get("finish_reason") is not None:
                last = now
                usage = choice.get("usage") or ev.get("usage")
    return {"first_text": first_text, "final": last, "text": "".join(text), "usage": usage}


def _concurrent_streams(client, n: int, rounds: int, new_tokens: int, warmup: bool = False) -> dict:
    """``rounds`` rounds of ``n`` streamed requests sent at once (one thread each): per stream its
    completion tokens over its end-to-end time (tokens/s), and per round all tokens over the
    round's wall time. ``warmup``: one untimed round first (a compiled decode step builds its
    graph for each new batch / block-table bucket on first use)."""
    from concurrent.futures import ThreadPoolExecutor

    per_stream = []
    aggregate = []
    for r in range(-1 if warmup else 0, rounds):
        bodies = [
            {
                "model": MODEL_ID,
                "messages": [{"role": "user", "content": f"{PROMPT} (stream {r}.{i})"}],
                "stream": True,
                "max_completion_tokens": new_tokens,
                "seed": 99 + 100 * r + i if r >= 0 else 9000 + i,
            }
            for i in range(n)
        ]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            outs = list(pool.map(lambda b: _stream_server(client, b), bodies))
        wall = time.perf_counter() - t0
        if r < 0:
            continue
        for o in outs:
            check(
                o["usage"] is not None and o["final"], f"{n} streams: a stream ended without usage"
            )
            per_stream.append(o["usage"]["completion_tokens"] / o["final"])
        aggregate.append(sum(o["usage"]["completion_tokens"] for o in outs) / wall)
    return {
        "tok_per_s_per_stream": summary(per_stream),
        "tok_per_s_per_stream_p50": percentile(per_stream, 0.5),
        "tok_per_s_total_p50": percentile(aggregate, 0.5),
        "requests": len(per_stream),
    }


async def _in_process(aeng, ids: list[int], params, constraint=None) -> dict:
    t0 = time.perf_counter()
    times = []
    tokens = []
    n_out = 0
    async for out in aeng.generate(ids, params, constraint):
        now = time.perf_counter() - t0
        n_out += 1
        times.append((now, list(out.new_token_ids)))
        tokens += out.new_token_ids
        if out.finished:
            return {"times": times, "tokens": tokens, "usage": out.usage, "final": now}
    raise RuntimeError("in-process stream ended without a finished output")


def _parsed_text(tokenizer, prep, tokens: list[int]) -> tuple[str, int | None]:
    """(reasoning + content text the server would stream, index of the first text-bearing token)."""
    from openk3.chat_format.parser import ContentDelta, OutputParser, ReasoningDelta, ToolCallStart

    parser = OutputParser(
        tokenizer,
        start_channel=prep.prompt.channel or "think",
        tool_index_start=prep.tool_index_start,
        tools_enabled=prep.tools_enabled,
    )
    text = []
    first = None
    for i, t in enumerate(tokens):
        for ev in parser.feed([t]):
            if isinstance(ev, (ReasoningDelta, ContentDelta)) and ev.text:
                text.append(ev.text)
                first = i if first is None else first
            elif isinstance(ev, ToolCallStart) and first is None:
                first = i
    for ev in parser.finish():
        if isinstance(ev, (ReasoningDelta, ContentDelta)):
            text.append(ev.text)
    return "".join(text), first


PLACEABLE = True  # takes device / dtype (openk3 bench --device / --dtype): both sides use them


def run(
    quick: bool = False,
    reps: int | None = None,
    *,
    device: Any = "cpu",
    dtype: Any = None,
    **overrides,
) -> dict:
    """Run B7 with both sides' model on `device` in `dtype` (None: float32); returns the result
    dict (see the module docstring). ``reps`` = requests per side.

    Raises:
        BenchmarkError: the server and the in-process engine generated different outputs.
        RuntimeError: the server did not start.
        ValueError: an unknown override.
    """
    import httpx

    from openk3.server.app import build_serving

    p = settings(QUICK if quick else FULL, overrides)
    n_req = reps or p["requests"]
    with tempfile.TemporaryDirectory() as tmp:
        if p["model"]:
            from openk3.shipped import resolve_model_path

            ckpt = Path(resolve_model_path(p["model"]))
        else:
            ckpt = write_checkpoint(Path(tmp) / "ckpt", p["hidden"], p["layers"])
        dtype_name = str(dtype or "float32").removeprefix("torch.")
        server = _Server(
            ckpt,
            Path(tmp) / "server.log",
            device=str(device),
            dtype=dtype_name,
            max_num_seqs=max(4, *p["streams"]),
            compile=bool(p["compile"]),
        )
        serving, aeng = build_serving(
            str(ckpt),
            served_model_name=MODEL_ID,
            max_num_seqs=4,
            enable_prefix_cache=False,
            device=device,
            dtype=dtype,
            compile=bool(p["compile"]),
        )
        loop = asyncio.new_event_loop()
        rows = {"server": [], "in_process": []}
        try:
            with httpx.Client(base_url=server.base, timeout=120) as client:
                for i in range(n_req + 1):  # request 0 warms both paths up
                    body = {
                        "model": MODEL_ID,
                        "messages": [{"role": "user", "content": f"{PROMPT} (#{i})"}],
                        "stream": True,
                        "max_completion_tokens": p["new_tokens"],
                        "seed": 1234 + i,
                    }
                    prep = serving.prepare(serving.parse(body))
                    order = ("server", "in_process") if i % 2 == 0 else ("in_process", "server")
                    res = {}
                    for side in order:
                        if side == "server":
                            res[side] = _stream_server(client, body)
                        else:
                            res[side] = loop.run_until_complete(
                                _in_process(
                                    aeng, prep.prompt.token_ids, prep.params, prep.constraint
                                )
                            )
                    s = res["server"]
                    e = res["in_process"]
                    text, k = _parsed_text(serving.tokenizer, prep, e["tokens"])
                    n_completion = e["usage"].completion_tokens
                    check(
                        s["usage"] is not None and s["usage"]["completion_tokens"] == n_completion,
                        f"request {i}: completion tokens differ: server {s['usage']}, in-process {n_completion}",
                    )
                    check(
                        s["text"] == text,
                        f"request {i}: streamed text differs from the in-process tokens' text:\n"
                        f"{s['text']!r}\n{text!r}",
                    )
                    if i == 0 or k is None:
                        continue
                    # engine outputs from the one holding token k (inclusive) to the end
                    idx = 0
                    seen = 0
                    for j, (_, toks) in enumerate(e["times"]):
                        if seen + len(toks) > k:
                            idx = j
                            break
                        seen += len(toks)
                    t_k = e["times"][idx][0]
                    steps_after = len(e["times"]) - 1 - idx
                    rows["in_process"].append(
                        {
                            "ttft_s": t_k,
                            "e2e_s": e["final"],
                            "per_token_s": (e["final"] - t_k) / steps_after
                            if steps_after
                            else None,
                        }
                    )
                    rows["server"].append(
                        {
                            "ttft_s": s["first_text"],
                            "e2e_s": s["final"],
                            "per_token_s": (s["final"] - s["first_text"]) / steps_after
                            if steps_after
                            else None,
                        }
                    )
            # the in-process engine stops first: the concurrent streams have the machine to themselves
            loop.run_until_complete(aeng.shutdown(drain=False))
            with httpx.Client(base_url=server.base, timeout=600) as client:
                streams = {
                    f"{n}": _concurrent_streams(
                        client, n, p["stream_rounds"], p["new_tokens"], warmup=bool(p["compile"])
                    )
                    for n in p["streams"]
                }
        finally:
            loop.run_until_complete(
                aeng.shutdown(drain=False)
            )  # again after a failure (a no-op after one)
            loop.close()
            server.stop()
    check(bool(rows["server"]), "no request produced text: nothing to time")
    stats = {}
    for side, rs in rows.items():
        ttft = [r["ttft_s"] for r in rs]
        per_tok = [r["per_token_s"] for r in rs if r["per_token_s"] is not None]
        stats[side] = {
            "ttft_ms": summary([1e3 * x for x in ttft]),
            "per_token_ms": summary([1e3 * x for x in per_tok]),
            "ttft_p50_ms": 1e3 * percentile(ttft, 0.5),
            "per_token_p50_ms": 1e3 * percentile(per_tok, 0.5) if per_tok else None,
        }
    for side, rs in rows.items():
        stats[side]["e2e_ms"] = summary([1e3 * r["e2e_s"] for r in rs])
    # Paired differences (request i on both sides, run back to back) cancel slow drifts of the
    # machine's speed; the targets use their median, the difference of the p50s is reported too.
    paired = {
        key: 1e3
        * percentile(
            [
                s[key] - e[key]
                for s, e in zip(rows["server"], rows["in_process"])
                if s[key] is not None and e[key] is not None
            ],
            0.5,
        )
        for key in ("ttft_s", "per_token_s", "e2e_s")
    }
    added_ttft = stats["server"]["ttft_p50_ms"] - stats["in_process"]["ttft_p50_ms"]
    added_tok = (
        stats["server"]["per_token_p50_ms"] - stats["in_process"]["per_token_p50_ms"]
        if stats["server"]["per_token_p50_ms"] is not None
        else None
    )
    return {
        "benchmark": "server",
        "quick": quick,
        "config": {
            "model": p["model"] or "k3-test-tiny scaled, random weights, trained ~1k BPE",
            "hidden": p["hidden"],
            "layers": p["layers"],
            "new_tokens": p["new_tokens"],
            "requests_per_side": n_req,
            "prompt_tokens": len(prep.prompt.token_ids),
            "transport": "httpx streaming over 127.0.0.1",
            "sampling": "API fixed (temperature 1.0, top_p 0.95), same seed both sides",
            "prefix_cache": False,
            "decode": "compiled" if p["compile"] else "eager",
        },
        "latency": stats,
        "added_ttft_ms_p50": added_ttft,
        "added_per_token_ms_p50": added_tok,
        "paired_median_difference_ms": {
            "ttft": paired["ttft_s"],
            "per_token": paired["per_token_s"],
            "end_to_end": paired["e2e_s"],
        },
        "outputs_identical": True,
        "concurrent_streams": streams,
        "targets": {
            "added_ttft": target(
                paired["ttft_s"],
                "<=",
                5.0,
                "median over requests of TTFT server streaming - in-process AsyncEngine (ms)",
            ),
            "added_per_token": target(
                paired["per_token_s"],
                "<=",
                1.0,
                "median over requests of per-token latency, server - in-process (ms)",
            ),
        },
        "env": environment(),
    }
