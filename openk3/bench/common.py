"""Shared machinery of the ``openk3 bench`` suite: interleaved timing, medians, targets, the
environment record, the benchmark model configurations and an engine driver.

Method (performance.md §6.1): every benchmark runs its contenders in one process, interleaved
(A B, then B A, ...) after warm-up, reports medians of at least five repetitions with min and max,
and asserts that the contenders computed the same thing (:func:`check`) so that a speed-up cannot
come from a wrong result. Nothing here is a test: timings are reported, never asserted.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from openk3.config import KDA, MLA, K3Config, preset


class BenchmarkError(AssertionError):
    """A correctness assertion of a benchmark failed (the contenders disagree)."""


def check(ok: bool, message: str) -> None:
    """Raise :class:`BenchmarkError` with ``message`` unless ``ok`` (survives ``python -O``)."""
    if not ok:
        raise BenchmarkError(message)


# ----------------------------------------------------------------------------- statistics
def summary(xs: list[float]) -> dict:
    """``{"median", "min", "max", "n"}`` of a list of measurements (seconds or rates)."""
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation (``q=0.5`` is the median)."""
    s = sorted(xs)
    if not s:
        raise ValueError("percentile: empty list")
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def interleaved(
    runs: dict[str, Callable[[], dict]], reps: int, warmup: int = 1
) -> dict[str, dict[str, list]]:
    """Run every contender ``warmup + reps`` times, alternating the order each round.

    Args:
        runs: name -> zero-argument callable returning a dict of measurements for one run
            (e.g. ``{"ttft_s": ..., "decode_s": ...}``); non-numeric values are kept as is.
        reps: timed rounds (>= 1); warmup: untimed rounds first.
    Returns:
        name -> measurement key -> list of ``reps`` values (warm-up rounds dropped).
    """
    names = list(runs)
    out: dict[str, dict[str, list]] = {n: {} for n in names}
    for i in range(warmup + reps):
        order = names if i % 2 == 0 else names[::-1]
        for n in order:
            res = runs[n]()
            if i >= warmup:
                for k, v in res.items():
                    out[n].setdefault(k, []).append(v)
    return out


def medians(measured: dict[str, list]) -> dict:
    """Summaries of every numeric series in one contender's measurements."""
    return {k: summary(v) for k, v in measured.items() if v and isinstance(v[0], (int, float))}


def target(measured: float | None, op: str, bound: float, what: str) -> dict:
    """A target verdict: ``measured op bound`` with ``op`` in ``">=", "<="``."""
    if op not in (">=", "<="):
        raise ValueError(f"op={op!r}: must be '>=' or '<='")
    met = measured is not None and (measured >= bound if op == ">=" else measured <= bound)
    return {"what": what, "measured": measured, "target": f"{op} {bound:g}", "met": bool(met)}


# ----------------------------------------------------------------------------- environment
def environment() -> dict:
    """Versions, CPU model and flags, threads and load average (recorded with every result)."""
    cpu = platform.processor() or platform.machine()
    flags = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
        for line in text.splitlines():
            if line.startswith("model name") and cpu in (
                "",
                platform.machine(),
                platform.processor(),
            ):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = sorted(
                    have & {"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
                )
                break
    except OSError:
        pass
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_flags": flags,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


def write_json(result: dict, path: str | None) -> None:
    """Write ``result`` as indented JSON to ``path`` (no-op for None)."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, default=str)
            f.write("\n")


# ----------------------------------------------------------------------------- model configs
def hybrid_layer_types(layers: int) -> list[str]:
    """3 KDA : 1 MLA, an MLA layer closing every group of four (Kimi Linear / K3 pattern)."""
    if layers < 1:
        raise ValueError(f"layers={layers}: must be >= 1")
    return [MLA if i % 4 == 3 else KDA for i in range(layers)]


def kimi_linear_config(hidden: int = 256, layers: int = 4, vocab: int = 1024) -> K3Config:
    """``kimi-linear-tiny`` scaled to ``hidden`` (heads of 64, experts of hidden/2, 8 experts top-2).

    ``initializer_range`` is 0.05 so greedy argmax margins of the random model stay far above
    fp32 rounding differences between implementations (token-exact comparisons).
    """
    if hidden % 64:
        raise ValueError(f"hidden={hidden}: must be a multiple of 64 (heads of 64)")
    heads = hidden // 64
    return preset("kimi-linear-tiny").replace(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        kv_lora_rank=hidden // 4,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=64,
        linear_num_heads=heads,
        linear_head_dim=64,
        moe_intermediate_size=hidden // 2,
        layer_types=hybrid_layer_types(layers),
        mlp_layer_types=[],
        initializer_range=0.05,
        bos_token_id=min(256, vocab - 3),
        eos_token_id=min(258, vocab - 2),
        pad_token_id=vocab - 1,
    )


def k3_config(
    hidden: int = 256, layers: int = 8, vocab: int = 1024, attn_res_block_size: int | None = 2
) -> K3Config:
    """``k3-test-tiny`` (every K3 component: lower-bounded KDA gate, full-rank output gate, gated
    MLA with q-LoRA, dense first layer + LatentMoE, SiTU-GLU, Block AttnRes) scaled to ``hidden``."""
    if hidden % 64:
        raise ValueError(f"hidden={hidden}: must be a multiple of 64 (heads of 64)")
    heads = hidden // 64
    return preset("k3-test-tiny").replace(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=hidden // 2,
        kv_lora_rank=hidden // 4,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=64,
        linear_num_heads=heads,
        linear_head_dim=64,
        n_routed_experts=16,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=hidden // 2,
        routed_expert_hidden_size=hidden // 2,
        attn_res_block_size=attn_res_block_size,
        layer_types=hybrid_layer_types(layers),
        mlp_layer_types=[],
        initializer_range=0.05,
        bos_token_id=min(256, vocab - 4),
        eos_token_id=min(258, vocab - 3),
        pad_token_id=vocab - 1,
        media_placeholder_token_id=min(277, vocab - 2),
    )


def settings(defaults: dict, overrides: dict) -> dict:
    """``defaults`` updated with ``overrides`` (``--set KEY=VALUE``), each checked against the
    default's type: an int for an int (bool for bool), a list/tuple of ints for a sequence.

    Raises:
        ValueError: an unknown key, or a value of the wrong type (naming the key and value).
    """
    unknown = set(overrides) - set(defaults)
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}; known: {sorted(defaults)}")
    out = dict(defaults)
    for key, value in overrides.items():
        ref = defaults[key]
        if isinstance(ref, bool):
            ok = isinstance(value, bool)
        elif isinstance(ref, int):
            ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        elif isinstance(ref, (list, tuple)):
            ok = (
                isinstance(value, (list, tuple))
                and bool(value)
                and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
            )
        else:
            ok = isinstance(value, type(ref))
        if not ok:
            raise ValueError(f"setting {key}={value!r}: expected a value like {ref!r}")
        out[key] = tuple(value) if isinstance(ref, (list, tuple)) else value
    return out


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` uniform random token ids (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


# ----------------------------------------------------------------------------- engine driver
@dataclass
class Trace:
    """What :func:`drive` saw of one request: tokens and the wall-clock times they arrived
    (seconds after the driver started), and the final usage."""

    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    usage: object = None
    finish_reason: str | None = None

    @property
    def ttft(self) -> float:
        """Seconds to the first token."""
        return self.times[0]


def drive(
    engine, requests: list[tuple[list[int], object]], on_step: Callable[[int], None] | None = None
) -> tuple[list[Trace], float]:
    """Queue ``(prompt_ids, SamplingParams)`` requests at once and step the engine until idle.

    Returns:
        (one :class:`Trace` per request in order, total seconds). Timing starts before the first
        ``add_request`` so time-to-first-token includes admission.
    """
    t0 = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in requests]
    traces = {rid: Trace() for rid in ids}
    i = 0
    while engine.has_unfinished():
        if on_step is not None:
            on_step(i)
        outs = engine.step()
        now = time.perf_counter() - t0
        for o in outs:
            tr = traces[o.request_id]
            tr.tokens += o.new_token_ids
            tr.times += [now] * len(o.new_token_ids)
            if o.finished:
                tr.usage = o.usage
                tr.finish_reason = o.finish_reason
        i += 1
    return [traces[r] for r in ids], time.perf_counter() - t0


class ForwardTimer:
    """Accumulates wall time spent inside ``model.model`` and ``model.lm_head`` (forward hooks), so
    that an engine step splits into model forward and everything else (scheduling, cache
    bookkeeping, tensor building, sampling)."""

    def __init__(self, model) -> None:
        self.total = 0.0
        self._t: dict[int, float] = {}
        self._handles = []
        for mod in (model.model, model.lm_head):
            self._handles.append(mod.register_forward_pre_hook(self._pre))
            self._handles.append(mod.register_forward_hook(self._post))

    def _pre(self, mod, args) -> None:
        self._t[id(mod)] = time.perf_counter()

    def _post(self, mod, args, out) -> None:
        if (
            isinstance(out, torch.Tensor) and out.is_cuda
        ):  # GPU kernels run asynchronously: wait for them
            torch.cuda.synchronize(out.device)
        self.total += time.perf_counter() - self._t.pop(id(mod))

    def remove(self) -> None:
        """Detach the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
