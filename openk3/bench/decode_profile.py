"""Where one engine decode step goes: aten calls, host syncs and op time, grouped by module.

The measurement that a static-shape, compiled decode step starts from (performance.md §6): for
batch sizes B in {1, 8} on the ``vs-transformers`` model (:func:`~openk3.bench.common.kimi_linear_config`,
fp32, CPU), B prompts are prefilled, a few decode steps warm up, and then ``steps`` decode steps of
:meth:`openk3.engine.Engine.step` run under a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
that sees every aten call. Reported per B:

* ``aten_calls_per_step`` and ``host_syncs_per_step``: a *host sync* is an aten call whose result
  the host must read before it can go on — ``_local_scalar_dense`` (what ``bool(t)``, ``t.item()``,
  ``int(t)`` dispatch to), the ops whose output shape depends on tensor values (``nonzero``,
  ``masked_select``, ``unique``...) and indexing with a boolean mask. On a GPU each one stalls the stream, and none may sit inside a
  captured CUDA graph; on a CPU they are what keeps a step from being one compiled graph.
* ``by_module``: calls, syncs and the aten op time of each group, a group being the direct child of
  a decoder layer (``self_attn`` of a KDA or MLA layer, ``mlp``, ``attn_res``, norms), the top-level
  modules (``model.embed_tokens``, ``model.norm``, ``lm_head``), the code of the model's and of a
  decoder layer's own forward outside those children, or ``engine`` for everything outside the
  model's forward (scheduling, sampling, cache bookkeeping);
* ``sync_sites``: the ``openk3`` source line of every host sync, with its count per step
  (``Tensor.tolist()`` reads memory without an aten call and is not seen: the engine's one read of
  the sampled tokens per step is not in the count);
* ``step_ms`` (median wall time of a decode step without the dispatch mode), the weight-product
  floor of the same step (:func:`openk3.bench.vs_transformers.gemv_floor`) and their ratio: the
  number a decode step has to bring to <= 2;
* ``compiled`` (``--set compile=true``, the default at full size): the eager engine and one with
  ``EngineConfig(compile=True)`` (:mod:`openk3.engine.decode_step`) decoding the same prompts,
  timed in rotating order together with one pass of the floor's weight products, after the
  warm-up steps in which the compiled one compiles its bucket: median ms per step of each, their
  ratios to the floor measured in the same rounds, the speed-up, and the graphs compiled after
  warm-up (0 is the target). Each is also timed in CPU time of the calling thread
  (``time.thread_time``: what a loaded machine's waits for a core do not inflate; the step runs
  in that thread, 1 torch thread) with the ratios of those medians. Tokens must be equal at every
  step.

Op times are taken inside the dispatch mode (each aten call timed on its own), so they add up to
less than a step's wall time; the difference (``python_and_dispatch_ms``) is the Python and
dispatch cost around the ops, which is what fusing small ops and compiling the step remove.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import Counter, defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from openk3.bench.common import (
    check,
    environment,
    kimi_linear_config,
    random_prompts,
    settings,
    target,
)

FULL = {
    "hidden": 256,
    "layers": 4,
    "prompt_len": 128,
    "steps": 8,
    "warmup_steps": 4,
    "batches": (1, 8),
    "reps": 7,
    "compile": True,
}
QUICK = {
    "hidden": 64,
    "layers": 4,
    "prompt_len": 16,
    "steps": 2,
    "warmup_steps": 1,
    "batches": (1, 2),
    "reps": 1,
    "compile": False,
}

# aten ops that make the host wait for a tensor's values (their overload packets' names)
# (under inference_mode a dispatch mode sees composite ops such as ``item`` / ``is_nonzero`` whole;
# with autograd keys on it sees what they decompose into, ``_local_scalar_dense``)
SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",
        "item",
        "is_nonzero",
        "nonzero",
        "nonzero_static",
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "repeat_interleave",
        "bincount",
        "histc",
    }
)
# indexing with a boolean mask computes the mask's nonzero positions inside the op
BOOL_INDEX_OPS = frozenset({"index", "index_put", "_index_put_impl", "index_put_"})
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../openk3
_SELF = os.path.abspath(__file__)


class _ModuleStack:
    """Forward pre/post hooks that keep the name of the innermost group being executed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.stack: list[str] = []
        self.handles = []
        for name, mod in model.named_modules():
            group = _group_of(name, mod, model)
            if group is None:
                continue
            self.handles.append(mod.register_forward_pre_hook(lambda m, a, g=group: self._enter(g)))
            self.handles.append(mod.register_forward_hook(lambda m, a, o: self._leave()))

    # hooks must return None: a value returned by a hook replaces the module's input / output
    def _enter(self, group: str) -> None:
        self.stack.append(group)

    def _leave(self) -> None:
        self.stack.pop()

    def current(self) -> str:
        return self.stack[-1] if self.stack else "engine"

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _group_of(name: str, mod: torch.nn.Module, model: torch.nn.Module) -> str | None:
    """The reporting group of module ``name``, or None when its parent's group covers it."""
    parts = name.split(".")
    if name in ("model.embed_tokens", "model.norm", "lm_head"):
        return name
    if name == "model":
        return "model (outside the layers)"
    if len(parts) == 3 and parts[:2] == ["model", "layers"]:
        return "decoder layer (outside its children)"
    # model.layers.<i>.<child>: one group per child kind, the attention kind made explicit
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        child = parts[3]
        return f"{child} ({type(mod).__name__})" if child in ("self_attn", "mlp") else child
    return None


class _Counter(TorchDispatchMode):
    """Counts and times every aten call, attributed to the current module group."""

    def __init__(self, stack: _ModuleStack) -> None:
        super().__init__()
        self.stack = stack
        self.calls: Counter = Counter()
        self.syncs: Counter = Counter()
        self.seconds: defaultdict = defaultdict(float)
        self.ops: Counter = Counter()
        self.sites: Counter = Counter()
        self._depth = 0  # > 0 inside an op: nested calls are that op's own decomposition

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        group = self.stack.current()
        op = func.overloadpacket.__name__
        if self._depth:
            return func(*args, **(kwargs or {}))
        self._depth += 1
        try:
            t = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            self.seconds[group] += time.perf_counter() - t
        finally:
            self._depth -= 1
        self.calls[group] += 1
        self.ops[op] += 1
        if op in SYNC_OPS or (op in BOOL_INDEX_OPS and _has_bool_index(args)):
            self.syncs[group] += 1
            self.sites[_caller()] += 1
        return out


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def _caller() -> str:
    """``path:line`` of the innermost openk3 frame (outside this module) on the Python stack."""
    f = sys._getframe(1)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if path.startswith(_PKG) and path != _SELF:
            return f"{os.path.relpath(path, os.path.dirname(_PKG))}:{f.f_lineno}"
        f = f.f_back
    return "<outside openk3>"


def _engine_at_decode(model, B: int, P: int, total_steps: int, vocab: int, compile: bool = False):
    """An engine whose B requests are prefilled (one step) and will decode ``total_steps`` more."""
    from openk3.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(
        model,
        EngineConfig(
            max_num_seqs=B,
            enable_prefix_cache=False,
            compile=compile,
            prefill_chunk=max(512, B * P),
            max_model_len=P + total_steps + 16,
        ),
    )
    for i, p in enumerate(random_prompts(B, P, vocab, seed=100 + B)):
        engine.add_request(
            p, SamplingParams(max_tokens=total_steps + 2, temperature=0.0), request_id=f"{i:04d}"
        )
    outs = engine.step()
    check(
        len(outs) == B and all(len(o.new_token_ids) == 1 for o in outs),
        f"B={B}: the first step did not prefill every request ({len(outs)} outputs)",
    )
    return engine


def _decode_step(engine, B: int) -> list[int]:
    outs = engine.step()
    check(
        len(outs) == B and all(len(o.new_token_ids) == 1 and not o.finished for o in outs),
        f"B={B}: a decode step did not give one token per request",
    )
    return [o.new_token_ids[0] for o in sorted(outs, key=lambda o: o.request_id)]


def _eager_vs_compiled(model, B: int, P: int, W: int, reps: int, vocab: int) -> dict:
    """Median ms (wall and thread CPU) of a decode step, eager engine vs
    ``EngineConfig(compile=True)``, and of one pass of the floor's weight products, timed in
    rotating order after W warm-up steps (the compiled engine compiles its bucket there); both
    engines decode the same prompts and must produce the same tokens at every step."""
    from torch._dynamo.utils import counters

    from openk3.bench.vs_transformers import run_products, weight_products

    torch._dynamo.reset()
    products = weight_products(model, B)
    engines = {
        name: _engine_at_decode(model, B, P, W + reps, vocab, compile=name == "compiled")
        for name in ("eager", "compiled")
    }
    t = time.perf_counter()
    for _ in range(W):
        toks = {name: _decode_step(e, B) for name, e in engines.items()}
        check(toks["eager"] == toks["compiled"], f"B={B}: compiled decode tokens differ from eager")
    warm_s = time.perf_counter() - t
    graphs = counters["stats"]["unique_graphs"]
    names = ("eager", "compiled", "floor")
    times: dict = {name: [] for name in names}
    cpu: dict = {name: [] for name in names}
    for i in range(reps):
        toks = {}
        for name in names[i % 3 :] + names[: i % 3]:
            t = time.perf_counter()
            c = time.thread_time()
            if name == "floor":
                run_products(products)
            else:
                toks[name] = _decode_step(engines[name], B)
            cpu[name].append(time.thread_time() - c)
            times[name].append(time.perf_counter() - t)
        check(toks["eager"] == toks["compiled"], f"B={B}: compiled decode tokens differ from eager")
    eager, compiled, floor = (statistics.median(times[n]) for n in names)
    ce, cc, cf = (statistics.median(cpu[n]) for n in names)
    return {
        "eager_step_ms": 1e3 * eager,
        "compiled_step_ms": 1e3 * compiled,
        "speedup": eager / compiled,
        "floor_ms": 1e3 * floor,
        "compiled_over_floor": compiled / floor,
        "eager_over_floor": eager / floor,
        "cpu_ms": {"eager": 1e3 * ce, "compiled": 1e3 * cc, "floor": 1e3 * cf},
        "cpu_compiled_over_floor": cc / cf,
        "cpu_eager_over_floor": ce / cf,
        "warmup_s": warm_s,
        "graphs": graphs,
        "recompiles_after_warmup": counters["stats"]["unique_graphs"] - graphs,
        "buckets": sorted(engines["compiled"].runner.decode_step.shapes),
    }


@torch.no_grad()
def run(quick: bool = False, reps: int | None = None, **overrides) -> dict:
    """Profile decode steps; returns the result dict (see the module docstring).

    Args:
        quick: tiny sizes for a smoke run. reps: timed decode steps for ``step_ms`` (default 7).
        overrides: any of ``hidden, layers, prompt_len, steps, warmup_steps, batches``.
    Raises:
        BenchmarkError: a step did not produce one token per request.
        ValueError: an unknown override.
    """
    from openk3.bench.vs_transformers import gemv_floor
    from openk3.pretrained import build_model

    p = settings(QUICK if quick else FULL, overrides)
    reps = reps or p["reps"]
    cfg = kimi_linear_config(p["hidden"], p["layers"])
    model = build_model(cfg, seed=0).eval()
    P, W, S = p["prompt_len"], p["warmup_steps"], p["steps"]
    result: dict = {
        "benchmark": "decode-profile",
        "quick": quick,
        "config": {
            "model": "kimi-linear-tiny scaled (as vs-transformers)",
            "hidden": cfg.hidden_size,
            "layers": cfg.num_hidden_layers,
            "layer_types": cfg.layer_types,
            "experts": f"{cfg.n_routed_experts} top-{cfg.num_experts_per_tok}",
            "dtype": "float32",
            "prompt_len": P,
            "profiled_steps": S,
            "timed_steps": reps,
            "threads": torch.get_num_threads(),
        },
        "batches": {},
        "targets": {},
    }
    for B in p["batches"]:
        # wall time of plain decode steps (no dispatch mode), one engine per measurement run
        engine = _engine_at_decode(model, B, P, W + reps, cfg.vocab_size)
        for _ in range(W):
            _decode_step(engine, B)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            _decode_step(engine, B)
            times.append(time.perf_counter() - t)
        step_s = statistics.median(times)

        engine = _engine_at_decode(model, B, P, W + S, cfg.vocab_size)
        for _ in range(W):
            _decode_step(engine, B)
        stack = _ModuleStack(model)
        counter = _Counter(stack)
        try:
            with counter:
                for _ in range(S):
                    _decode_step(engine, B)
        finally:
            stack.remove()
        check(not stack.stack, "module hooks unbalanced after the profiled steps")
        floor = gemv_floor(model, B, max(reps, 3))
        op_ms = 1e3 * sum(counter.seconds.values()) / S
        groups = sorted(counter.calls, key=lambda g: -counter.seconds[g])
        row = {
            "step_ms": 1e3 * step_s,
            "step_ms_min": 1e3 * min(times),
            "gemv_floor_ms": 1e3 * floor["seconds"],
            "step_over_floor": step_s / floor["seconds"],
            "aten_calls_per_step": sum(counter.calls.values()) / S,
            "host_syncs_per_step": sum(counter.syncs.values()) / S,
            "op_time_ms_per_step": op_ms,
            "by_module": {
                g: {
                    "aten_calls": counter.calls[g] / S,
                    "host_syncs": counter.syncs[g] / S,
                    "op_ms": 1e3 * counter.seconds[g] / S,
                }
                for g in groups
            },
            "sync_sites": {site: n / S for site, n in counter.sites.most_common()},
            "top_ops": {op: n / S for op, n in counter.ops.most_common(15)},
        }
        result["batches"][f"B={B}"] = row
        result["targets"][f"step_over_floor_B{B}"] = target(
            row["step_over_floor"], "<=", 2.0, f"decode step / weight-product floor at B={B}"
        )
        result["targets"][f"host_syncs_B{B}"] = target(
            row["host_syncs_per_step"], "<=", 0, f"host syncs per decode step at B={B}"
        )
        if p["compile"]:
            c = _eager_vs_compiled(model, B, P, W, reps, cfg.vocab_size)
            row["compiled"] = c
            result["targets"][f"compiled_over_floor_B{B}"] = target(
                c["compiled_over_floor"],
                "<=",
                2.0,
                f"compiled decode step / weight-product floor at B={B}",
            )
            result["targets"][f"recompiles_B{B}"] = target(
                c["recompiles_after_warmup"], "<=", 0, f"recompilations after warm-up at B={B}"
            )
    result["env"] = environment()
    return result


def format_profile(result: dict) -> str:
    """A plain-text table of :func:`run`'s result (one block per batch size)."""
    lines = []
    for b, row in result["batches"].items():
        lines.append(
            f"{b}: step {row['step_ms']:.2f} ms, floor {row['gemv_floor_ms']:.2f} ms "
            f"({row['step_over_floor']:.1f}x), {row['aten_calls_per_step']:.0f} aten calls, "
            f"{row['host_syncs_per_step']:.0f} host syncs, op time {row['op_time_ms_per_step']:.2f} ms"
        )
        lines.append(f"  {'group':<28} {'calls':>7} {'syncs':>6} {'op ms':>7}")
        for g, m in row["by_module"].items():
            lines.append(
                f"  {g:<28} {m['aten_calls']:>7.0f} {m['host_syncs']:>6.0f} {m['op_ms']:>7.3f}"
            )
        for site, n in row["sync_sites"].items():
            lines.append(f"  sync {n:>4.0f}/step  {site}")
        if "compiled" in row:
            c = row["compiled"]
            lines.append(
                f"  interleaved: eager {c['eager_step_ms']:.2f} ms ({c['eager_over_floor']:.1f}x floor), "
                f"compiled {c['compiled_step_ms']:.2f} ms ({c['compiled_over_floor']:.1f}x floor), "
                f"floor {c['floor_ms']:.2f} ms, {c['speedup']:.2f}x; {c['recompiles_after_warmup']} recompiles "
                f"after warm-up ({c['warmup_s']:.0f} s), buckets {c['buckets']}"
            )
            m = c["cpu_ms"]
            lines.append(
                f"  thread CPU: eager {m['eager']:.2f} ms ({c['cpu_eager_over_floor']:.1f}x), compiled "
                f"{m['compiled']:.2f} ms ({c['cpu_compiled_over_floor']:.1f}x), floor {m['floor']:.2f} ms"
            )
    return "\n".join(lines)
