"""The engine's decode forward with static shapes, optionally compiled (``EngineConfig.compile``).

Shape legend: B decode rows of a step, Bp its batch bucket, MB block-table width (its bucket),
L block size, V vocabulary.

A decode step feeds one token per running request. Here every tensor of that forward has a shape
fixed by (Bp, MB): the rows are padded to the next power of two (up to ``max_num_seqs``) by
repeating the last row, and the block tables to the next power of two of blocks (entries past a
row's last block repeat it; the attention masks them). A repeated row reads the same state and
writes the same values to the same places as the row it copies, so padding changes nothing
(duplicate writes carry equal values). The forward itself is :meth:`K3Model.forward` with
``validate=False``: no host read of a tensor value, no value-dependent shape (the MoE runs its
static form, :func:`openk3.ops.grouped_mm.routed_experts_static`). One ``torch.compile`` graph
(Inductor, ``dynamic=False``) then serves every step of a bucket; a new bucket compiles once.

The eager forward of :meth:`~openk3.engine.runner.ModelRunner.forward` stays the reference (the default, and what every
prefill runs); this module only changes the shapes it is fed and who runs it. Which of the two a
decode step runs is the ``"decode"`` op of :mod:`openk3.ops.backends` (:func:`decode_backend`):
``OPENK3_DECODE_BACKEND=reference`` forces the reference whatever the configuration says.
"""

from __future__ import annotations

import logging
import types
from typing import Callable

import torch

from openk3.cache import HybridCache
from openk3.engine.kv_pool import layer_views
from openk3.ops.attn_res_decode import DirectAttnRes
from openk3.ops.backends import env_var, forced_backend

log = logging.getLogger("openk3.engine")


def compiler_missing(device: torch.device) -> str | None:
    """Why ``torch.compile`` (Inductor) cannot build kernels for ``device``, or None when it can:
    on CPU it needs a C++ compiler (``$CXX`` or ``g++``), on CUDA Triton."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - InvalidCxxCompiler and whatever the search raises
        return f"no C++ compiler for Inductor ({type(e).__name__})"
    return None


def decode_backend(compile: bool, device: torch.device) -> str:
    """The engine's decode step: ``"compiled"`` (:class:`StaticDecodeStep` under ``torch.compile``)
    or ``"reference"`` (the eager forward).

    The override of :mod:`openk3.ops.backends` wins (``use_backend("decode", name)``, then
    ``OPENK3_DECODE_BACKEND``); without one, ``compile`` (``EngineConfig.compile``) chooses, and
    a compile request on a machine where Inductor cannot build kernels falls back to the
    reference with a warning (logger ``openk3.engine``).

    Raises:
        ValueError: ``OPENK3_DECODE_BACKEND`` names an unknown backend, or forces ``compiled``
            where Inductor cannot build kernels (naming the variable and the reason).
    """
    forced = forced_backend("decode")
    want = forced or ("compiled" if compile else "reference")
    if want == "reference":
        return want
    missing = compiler_missing(device)
    if missing is None:
        return want
    if forced:
        raise ValueError(f"{env_var('decode')}=compiled (or use_backend): {missing}")
    log.warning("compile=True: %s; decode steps run the eager reference", missing)
    return "reference"


def bucket(n: int, most: int) -> int:
    """The smallest power of two >= ``n``, capped at ``most`` (at least ``n``)."""
    return max(n, min(most, 1 << max(n - 1, 0).bit_length()))


class StaticDecodeStep:
    """Runs decode rows as a forward of bucketed shapes; compiled once per bucket when asked.

    Under Block AttnRes the forward mixes each site directly over its sources
    (:class:`~openk3.ops.attn_res_decode.DirectAttnRes`, from the cached pseudo-queries of
    :meth:`site_queries`) instead of the reference's two-phase form: for one token per row the
    direct form is fewer, fusable graph ops (no block-statistics products when a block opens).

    Args:
        model: the engine's :class:`~openk3.model.K3ForCausalLM`.
        blocks, slots: the engine's MLA block pool and KDA slot pool.
        layer_pools: per decoder layer, ``("kda", i)`` or ``("mla", i)``: its index into the pools.
        max_batch: largest batch bucket (the engine's ``max_num_seqs``).
        max_blocks: largest block-table bucket (blocks of one ``max_model_len`` sequence).
        compile: run the step through ``torch.compile`` (Inductor); False runs the same
            fixed-shape forward eagerly (for parity tests and as the fallback).
    """

    def __init__(
        self,
        model,
        blocks,
        slots,
        layer_pools: list[tuple[str, int]],
        *,
        max_batch: int,
        max_blocks: int,
        compile: bool,
    ) -> None:
        self.model = model
        self.blocks = blocks
        self.slots = slots
        self.layer_pools = layer_pools
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.compiled = compile
        self.attn_res_state = DirectAttnRes
        # fullgraph=False: code compile cannot trace (e.g. a native kernel of packed MXFP4
        # experts) runs eagerly between graphs instead of failing the step. size_asserts off:
        # the guards of a dynamic=False graph already match every input's sizes and strides, and
        # the wrapper's ~100 repeated asserts per call were Python time on every decode step.
        # cpp_wrapper: the graph's ~50 GEMM calls, ~30 fused kernels and ~180 buffer allocations
        # and views are sequenced by generated C++ instead of a generated Python function (at
        # B=1 that Python was ~0.2 ms of a ~2.5 ms step, thread CPU).
        self.forward: Callable = (
            torch.compile(
                self._own_forward(),
                dynamic=False,
                options={"size_asserts": False, "cpp_wrapper": True},
            )
            if compile
            else self._forward
        )
        # AttnRes pseudo-queries, recomputed only when one of their weights changed in place
        # (a parameter's _version counts its in-place writes: load_state_dict, optimizer steps)
        backbone = model.model
        self.query_params: list[torch.Tensor] = (
            [
                w
                for site in [
                    *(
                        (l.self_attention_res_norm, l.self_attention_res_proj)
                        for l in backbone.layers
                    ),
                    *((l.mlp_res_norm, l.mlp_res_proj) for l in backbone.layers),
                    (backbone.output_attn_res_norm, backbone.output_attn_res_proj),
                ]
                for w in (site[0].weight, site[1].weight)
            ]
            if backbone.config.use_attn_res
            else []
        )
        self._queries: torch.Tensor | None = None
        self._queries_key: tuple | None = None
        self.shapes: set[tuple[int, int]] = set()  # (Bp, MB) buckets run so far
        # guard keys (see _run) whose graph Dynamo has already chosen with its full guards
        self.checked: set[tuple] = set()

    def _forward(
        self,
        ids: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        past: torch.Tensor,
        queries: torch.Tensor | None,
    ) -> torch.Tensor:
        """ids [Bp, 1], slots [Bp], tables [Bp, MB], past [Bp] (int64), queries [2L+1, D] fp32
        AttnRes pseudo-queries or None without AttnRes -> logits [Bp, V] fp32."""
        layers = layer_views(self.layer_pools, self.blocks, self.slots, slots, tables)
        cache = HybridCache(layers=layers, lengths=past.clone())
        hidden = self.model.model(
            ids, cache, validate=False, site_queries=queries, attn_res_state=self.attn_res_state
        )
        return self.model.lm_head(hidden[:, -1]).float()

    def _own_forward(self) -> Callable:
        """:meth:`_forward` bound to this instance through its own copy of the code object.

        Dynamo keeps compiled graphs per code object (one cache, one size limit), and
        :meth:`_run` skips its full guard check after a bucket's first call: the graphs it then
        chooses from should all be this instance's. Through the shared ``_forward`` code every
        engine of a process added its graphs to one cache, and in the engine tests run on the
        compiled step (``OPENK3_DECODE_BACKEND=compiled``, one engine after another) later
        engines' steps failed with "Recompilation triggered with skip_guard_eval_unsafe stance".
        """
        f = StaticDecodeStep._forward
        own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__)
        return types.MethodType(own, self)

    def site_queries(self) -> torch.Tensor | None:
        """[2L+1, D] fp32 AttnRes pseudo-queries of the current weights (None without AttnRes),
        computed once and again only after an in-place change of one of their weights."""
        if not self.query_params:
            return None
        key = tuple((id(w), w._version) for w in self.query_params)
        if key != self._queries_key:
            with torch.no_grad():
                self._queries = self.model.model._site_queries()
            self._queries_key = key
        return self._queries

    def __call__(self, rows: list[tuple[list[int], int, list[int], int]]) -> torch.Tensor:
        """Decode one token for each row (token ids so far, KDA slot, block ids, cached length),
        whose block list already covers position ``cached length``; returns logits [B, V] fp32."""
        dev = self.model.lm_head.weight.device
        B = len(rows)
        Bp = bucket(B, self.max_batch)
        MB = bucket(max(len(blocks) for _, _, blocks, _ in rows), self.max_blocks)
        rows = rows + [rows[-1]] * (Bp - B)
        ids = torch.tensor(
            [[tokens[past]] for tokens, _, _, past in rows], dtype=torch.long, device=dev
        )
        slots = torch.tensor([slot for _, slot, _, _ in rows], dtype=torch.long, device=dev)
        tables = torch.tensor(
            [blocks + blocks[-1:] * (MB - len(blocks)) for _, _, blocks, _ in rows],
            dtype=torch.long,
            device=dev,
        )
        past = torch.tensor([p for _, _, _, p in rows], dtype=torch.long, device=dev)
        self.shapes.add((Bp, MB))
        return self._run((Bp, MB), ids, slots, tables, past, self.site_queries())[:B]

    def _run(self, shape: tuple[int, int], *inputs: torch.Tensor) -> torch.Tensor:
        """``self.forward(*inputs)``; compiled, Dynamo's guards run in full only on the first call
        of each (bucket, grad mode, inference mode) key.

        Dynamo checks ~100 guards per call (every parameter's and pool's dtype, sizes and strides,
        the module tree, global state): ~0.3 ms of thread CPU per decode step here, as much as a
        fifth of a small model's step. Within one engine what those guards check does not change
        between steps of a bucket: the model, its parameters and the pools are fixed when the
        engine is built (their values change in place, which guards do not check anyway), and
        only the bucket and the autograd mode vary. So after the first call of a key, where a new
        bucket is compiled, the call runs under ``skip_guard_eval_unsafe``: Dynamo then checks
        only the guards that tell its compiled graphs apart (the input sizes of the buckets).
        Replacing a parameter or a pool tensor of a running engine is therefore not supported.
        """
        if not self.compiled:
            return self.forward(*inputs)
        key = (shape, torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        if key not in self.checked:
            out = self.forward(*inputs)
            self.checked.add(key)
            return out
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return self.forward(*inputs)
