"""The inference engine: continuous batching over a paged MLA latent pool, KDA state slots and a
KDA-aware prefix cache. Token ids in, token ids out (the contract: :class:`Engine` and its methods);
image requests also carry :class:`~openk3.engine.mm.ImageInput` (features for the pad positions).

Shape legend: B rows of one batched forward, T tokens per row (right padded), V vocabulary,
MB block-table width, L block size.

One :meth:`Engine.step`:

1. the :class:`~openk3.engine.scheduler.Scheduler` admits waiting requests (FCFS, memory
   reserved up front by the :class:`~openk3.engine.cache_manager.CacheManager`), plans the step
   and allocates every MLA block the step writes;
2. all single-token rows (decodes) run as **one** batched forward in the recurrent KDA mode;
3. prefill pieces run as batched forwards (chunked KDA form), split at snapshot boundaries, rows
   of similar length together (the scheduler's length groups);
4. every request whose known tokens are now all computed is sampled in one batched
   sampler call (constraint masks, temperature, top-k/top-p, per-request generators);
5. new tokens are checked against stop ids / stop strings / constraint completion / max_tokens,
   finished requests release their slot and blocks immediately, and computed full blocks and KDA
   snapshots are published to the prefix cache (the cache manager's ``on_computed`` /
   ``on_finished``).

The :class:`~openk3.engine.runner.ModelRunner` builds each forward's tensors and runs the model
unchanged: each forward gets a :class:`~openk3.cache.HybridCache` whose entries are pool views
(:class:`~openk3.cache.SlotKDAState` rows of the slot pool, :class:`~openk3.cache.PagedMLACache`
block tables into the latent pool). The step plan is made of
:class:`~openk3.engine.request.Piece` rows (request, start, end).

Images: a request whose images need the vision tower waits in an encoding queue, not in the
scheduler. Each step, after its forwards and sampling, runs pieces of the tower on the head of that
queue (one image at a time, :func:`~openk3.vision.encoder.encode_in_pieces`) until
``EngineConfig.encoder_step_flops`` is spent, so a large image never holds the other requests'
decodes for longer than that budget; the request joins the scheduler's queue when all its image
features are complete (images the prefix cache already holds are not encoded). Prefill pieces feed
``inputs_embeds`` = token embeddings with the piece's pad positions replaced by the matching rows of
the features, so a prefill chunk may end anywhere inside an image's pad run. Features are dropped
once the prompt is computed; prefix-cache keys of image blocks include the image content hash.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from openk3.engine.cache_manager import CacheManager
from openk3.engine.mm import check_images, image_span
from openk3.engine.planner import kda_state_bytes, sequence_bytes
from openk3.engine.request import Request
from openk3.engine.runner import ModelRunner
from openk3.engine.sampling import (
    SamplingParams,
    constraint_mask,
    make_generator,
    sample,
    top_logprobs,
)
from openk3.engine.scheduler import Scheduler
from openk3.typed_fields import check_fields


log = logging.getLogger("openk3.engine")


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (``EngineConfig.max_waiting``); the server answers 429."""


@dataclass
class EngineConfig:
    """Engine settings (contract fields first; the last four are openk3 additions with defaults).

    Attributes:
        max_num_seqs: most requests running at once (also the number of KDA slots wanted).
        cache_memory: bytes for MLA blocks + KDA slots + prefix snapshots; None = 80% of free GPU
            memory on CUDA, else room for ``max_num_seqs`` sequences of min(max_model_len, 32768)
            tokens (each at least twice a KDA state, so every one gets a slot) and for one
            sequence of max_model_len tokens, plus the snapshot share (CPU pools are committed
            lazily, :func:`~openk3.engine.kv_pool.pool_zeros`).
        block_size: L, tokens per MLA latent block and per prefix-hash block.
        max_model_len: longest prompt + output; default ``max_position_embeddings``. Never capped
            silently: more than the model declares, or more than the block pool holds for one
            sequence, is a ValueError naming both numbers.
        enable_prefix_cache: reuse prompt prefixes across requests.
        prefill_chunk: token budget of one step (decodes count one each). 2,048: one prefill
            forward may run past the 512-token KDA snapshot points (:mod:`.scheduler`), and
            2,048-token forwards take a cold 24K-token prefill to 0.92x of the time of 512-token
            ones (fewer per-forward costs in MoE, MLA and Block AttnRes; 1 CPU thread,
            interleaved A/B, docs/benchmarks.md "Long prefill").
        max_waiting: admission queue bound (:class:`EngineOverloaded` beyond it).
        chunked_prefill: split long prompts across steps (False: a prompt is computed whole).
        snapshot_interval: KDA snapshot spacing in tokens (multiple of L); None = the smallest
            multiple of L that is >= 512 (K3 hashes 512-token blocks, architecture.md §3.5).
        snapshot_fraction: share of ``cache_memory`` for KDA snapshots (prefix cache on only).
        seed: seeds the generators of requests without their own seed (None = global torch RNG).
        prefill_forward_cost: rows of a prefill round are split into length groups (one forward
            each) where that saves more than this many padded token positions per extra forward
            (:func:`~openk3.engine.scheduler.length_groups`); None = one forward per round. The
            default is about a forward's fixed cost in tokens for the small CPU benchmark models.
        encoder_step_flops: vision-tower work one step may run (FLOPs, 2 per multiply-add), in
            pieces of about a quarter of it; None = 2^28 on CPU (about 30 ms of one core for the
            fp32 tiny tower), 2^38 on CUDA. A piece of 64 rows may exceed it (one per step at most).
        compile: run decode steps as a static-shape forward through ``torch.compile``
            (:mod:`~openk3.engine.decode_step`; one compilation per batch and block-table
            bucket, minutes each on a small CPU). False: the eager forward (the reference).
            ``OPENK3_DECODE_BACKEND=reference`` / ``=compiled`` overrides it
            (:func:`~openk3.engine.decode_step.decode_backend`).
    """

    # A wrong type reads like the field's range error ("max_num_seqs='4': must be an integer >= 1").
    max_num_seqs: int = field(default=16, metadata={"expect": "an integer >= 1"})
    cache_memory: int | None = field(
        default=None, metadata={"expect": "a positive number of bytes"}
    )
    block_size: int = field(default=16, metadata={"expect": "an integer >= 1"})
    max_model_len: int | None = field(default=None, metadata={"expect": "an integer >= 2"})
    enable_prefix_cache: bool = True
    prefill_chunk: int = field(default=2048, metadata={"expect": "an integer >= 1"})
    max_waiting: int = field(default=256, metadata={"expect": "an integer >= 1"})
    chunked_prefill: bool = True
    snapshot_interval: int | None = None
    snapshot_fraction: float = field(default=0.25, metadata={"expect": "a number in [0, 1)"})
    seed: int | None = None
    prefill_forward_cost: int | None = field(
        default=32, metadata={"expect": "an integer >= 0 or None"}
    )
    encoder_step_flops: int | None = field(
        default=None, metadata={"expect": "an integer >= 1 or None"}
    )
    compile: bool = field(default=False, metadata={"expect": "True or False"})

    def validate(self) -> None:
        """Check every field's type (:func:`openk3.typed_fields.check_fields`), then the ranges.

        Raises:
            ValueError: ``"<field>=<value!r>: must be ..."`` for the first bad field.
        """
        check_fields(self, message=lambda name, value, why: f"{name}={value!r}: {why}")
        for name in ("max_num_seqs", "block_size", "prefill_chunk", "max_waiting"):
            v = getattr(self, name)
            if v < 1:
                raise ValueError(f"{name}={v!r}: must be an integer >= 1")
        if self.cache_memory is not None and self.cache_memory < 1:
            raise ValueError(
                f"cache_memory={self.cache_memory!r}: must be a positive number of bytes"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len!r}: must be an integer >= 2")
        si = self.snapshot_interval
        if si is not None and (si < self.block_size or si % self.block_size):
            raise ValueError(
                f"snapshot_interval={si!r}: must be a positive multiple of block_size={self.block_size}"
            )
        pfc = self.prefill_forward_cost
        if pfc is not None and pfc < 0:
            raise ValueError(f"prefill_forward_cost={pfc!r}: must be an integer >= 0 or None")
        esf = self.encoder_step_flops
        if esf is not None and esf < 1:
            raise ValueError(f"encoder_step_flops={esf!r}: must be an integer >= 1 or None")
        if not 0 <= self.snapshot_fraction < 1:
            raise ValueError(f"snapshot_fraction={self.snapshot_fraction!r}: must lie in [0, 1)")


@dataclass
class Usage:
    """Token counts of one request: prompt, prompt tokens served from the prefix cache, generated
    (stop token included)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class RequestOutput:
    """What one step produced for one request.

    Attributes:
        new_token_ids: tokens returned by this step (0 or 1; a stop token is never returned).
        finish_reason: "stop" | "length" | "abort" | "error" | None.
        usage: counts so far.
        logprobs: one :class:`~openk3.engine.sampling.TokenLogprob` per returned token, when asked.
        stop_reason: what stopped it: the stop token id, the matched stop string (the server cuts
            the text there), "constraint" (grammar complete or rejected), or None.
        error: with ``finish_reason="error"``: what failed while computing the request
            (exception type and message; internals a server should log, not show).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    usage: Usage
    logprobs: list | None = None
    stop_reason: Any = None
    error: str | None = None


class Engine:
    """Continuous-batching engine around a :class:`~openk3.model.K3ForCausalLM`.

    Args:
        model: the model (its device and dtype are the cache's).
        config: :class:`EngineConfig`.
        detokenize: ``list[int] -> str``, needed for stop strings.
        on_logits: optional ``(request_id, logits [V] fp32) -> None`` called for every sampled row
            (tests and debugging).
    Attributes:
        cache: the :class:`~openk3.engine.cache_manager.CacheManager` (layout, pools, prefix cache).
        scheduler: the :class:`~openk3.engine.scheduler.Scheduler` (queues and step plans).
        runner: the :class:`~openk3.engine.runner.ModelRunner` (forwards, decode step, vision tower).
        The engine itself keeps the requests, the encoding queue, sampling and stopping.
    Raises:
        ValueError: bad config, or a ``cache_memory`` too small for one sequence.
    """

    def __init__(
        self,
        model,
        config: EngineConfig | None = None,
        *,
        detokenize: Callable | None = None,
        on_logits: Callable | None = None,
    ) -> None:
        self.model = model.eval()
        self.config = cfg = config or EngineConfig()
        cfg.validate()
        mc = model.config
        self.model_config = mc
        w = model.lm_head.weight
        self.device = w.device
        self.dtype = w.dtype
        self.vocab_size = mc.vocab_size
        self.detokenize = detokenize
        self.on_logits = on_logits
        L = cfg.block_size
        frac = cfg.snapshot_fraction if cfg.enable_prefix_cache else 0.0
        memory = (
            cfg.cache_memory if cfg.cache_memory is not None else self._default_cache_memory(frac)
        )
        self.cache = CacheManager(
            mc,
            memory,
            block_size=L,
            max_num_seqs=cfg.max_num_seqs,
            snapshot_interval=cfg.snapshot_interval,
            snapshot_fraction=frac,
            enable_prefix_cache=cfg.enable_prefix_cache,
            device=self.device,
            dtype=self.dtype,
        )
        self.max_model_len = self._resolve_max_model_len(memory)
        self.scheduler = Scheduler(
            self.cache,
            max_num_seqs=min(cfg.max_num_seqs, self.cache.layout.num_slots),
            prefill_chunk=cfg.prefill_chunk,
            chunked_prefill=cfg.chunked_prefill,
            forward_cost=cfg.prefill_forward_cost,
        )
        self.encoder_step_flops = cfg.encoder_step_flops or (
            2**38 if self.device.type == "cuda" else 2**28
        )
        self.runner = ModelRunner(
            model,
            self.cache.blocks,
            self.cache.slots,
            compile=cfg.compile,
            max_batch=self.scheduler.max_num_seqs,
            max_blocks=-(-self.max_model_len // L),
            encoder_step_flops=self.encoder_step_flops,
        )
        self._requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []
        self._encoding: deque[Request] = (
            deque()
        )  # requests whose image features are not complete yet
        self._arrival = itertools.count()
        self._seeds = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
        self.failures = 0  # step work that raised (each failed its requests, see step())

    def _requested_max_model_len(self) -> int:
        """``max_model_len`` as configured (default: the model's ``max_position_embeddings``).

        Raises:
            ValueError: more than the model declares (naming both numbers).
        """
        cfg = self.config
        mc = self.model_config
        if cfg.max_model_len is not None and cfg.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len={cfg.max_model_len}: exceeds the model's context "
                f"(max_position_embeddings={mc.max_position_embeddings})"
            )
        return cfg.max_model_len or mc.max_position_embeddings

    def _resolve_max_model_len(self, memory: int) -> int:
        """The served context: the requested one if the MLA block pool holds that many tokens for
        one sequence.

        Raises:
            ValueError: it does not (naming max_model_len, the tokens the pool holds, cache_memory
                and the bytes the pool would need).
        """
        want = self._requested_max_model_len()
        lay = self.cache.layout
        room = lay.num_blocks * lay.block_size
        # A sequence of n tokens caches n - 1 of them: its last sampled token is never fed back.
        if want - 1 > room:
            need = -(-(want - 1) // lay.block_size) * lay.block_bytes
            what = (
                ""
                if self.config.max_model_len is not None
                else " (the model's max_position_embeddings)"
            )
            raise ValueError(
                f"max_model_len={want}{what}: cache_memory={memory} bytes holds sequences of up to "
                f"{room + 1} tokens ({lay.num_blocks} MLA blocks of {lay.block_size} tokens); {want} tokens "
                f"need {need} bytes of MLA blocks alone: raise cache_memory or lower max_model_len"
            )
        return want

    def _default_cache_memory(self, frac: float) -> int:
        cfg = self.config
        mc = self.model.config
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.8)  # the rest is for activations of the forward passes
        context = self._requested_max_model_len()
        tokens = min(context, 32768)
        # cache_layout gives max_num_seqs KDA slots only if they take at most half of the non-snapshot
        # budget; with short contexts the KDA state dominates a sequence, so budget at least twice it.
        kda = kda_state_bytes(mc, self.dtype)["total"]
        per_seq = max(sequence_bytes(mc, tokens, self.dtype), 2 * kda)
        # ... and one sequence must be able to use the whole context (one spare block for rounding).
        longest = (
            sequence_bytes(mc, context + cfg.block_size, self.dtype)
            + (2 * cfg.max_num_seqs - 1) * kda
        )
        return math.ceil(max(cfg.max_num_seqs * per_seq, longest) / (1 - frac)) + 1

    # ------------------------------------------------------------------ requests
    def check_request(
        self, prompt_ids: list[int], params: SamplingParams, constraint=None, mm_inputs=None
    ) -> int:
        """Validate a request without queueing it; returns its effective max_tokens.

        Args:
            mm_inputs: optional list of :class:`~openk3.engine.mm.ImageInput` (see :meth:`add_request`).
        Raises:
            ValueError: empty prompt, ids outside the vocabulary, bad params, stop strings without
                ``detokenize``, a prompt that can never fit (>= max_model_len), or a bad image input
                (:func:`~openk3.engine.mm.check_images`).
        """
        return self._check(prompt_ids, params, constraint, mm_inputs)[0]

    def _check(self, prompt_ids, params, constraint, mm_inputs) -> tuple[int, list]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise ValueError("prompt_ids: must be a non-empty list of token ids")
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids: {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.detokenize is None:
            raise ValueError("params.stop: stop strings need Engine(..., detokenize=fn)")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt_ids: {len(prompt_ids)} tokens leave no room to generate within max_model_len="
                f"{self.max_model_len}"
            )
        if constraint is not None and not callable(getattr(constraint, "allowed_tokens", None)):
            raise ValueError(
                "constraint: needs allowed_tokens(), accept(token_id) and is_finished()"
            )
        vc = getattr(self.model, "vision_config", None)
        images = check_images(
            mm_inputs,
            prompt_ids,
            hidden_size=self.model_config.hidden_size,
            pad_id=self.model_config.media_placeholder_token_id,
            merge_kernel=vc.merge_kernel_size if vc is not None else None,
            patch_size=vc.patch_size if vc is not None else None,
        )
        return min(params.max_tokens, self.max_model_len - len(prompt_ids)), images

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        constraint=None,
        request_id: str | None = None,
        mm_inputs=None,
    ) -> str:
        """Queue a request; returns its id.

        Args:
            prompt_ids: the prompt (images already expanded: one media pad id per image token).
            mm_inputs: one :class:`~openk3.engine.mm.ImageInput` per image: its pad positions, its
                content hash and either pixel values (the model's tower encodes them) or
                precomputed [N, D] features.
        Raises:
            ValueError: see :meth:`check_request`; a request id already in use.
            EngineOverloaded: the waiting queue holds ``max_waiting`` requests.
        """
        params = params or SamplingParams()
        max_tokens, images = self._check(prompt_ids, params, constraint, mm_inputs)
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if rid in self._requests:
            raise ValueError(f"request_id={rid!r}: already in use")
        queued = len(self.scheduler.waiting) + len(self._encoding)
        if queued >= self.config.max_waiting:
            raise EngineOverloaded(
                f"{queued} requests waiting (max_waiting={self.config.max_waiting})"
            )
        req = Request(
            rid,
            list(prompt_ids),
            params,
            constraint,
            next(self._arrival),
            max_tokens,
            tokens=list(prompt_ids),
            images=images,
            spans=[image_span(im) for im in images],
        )
        if not params.greedy:
            seed = params.seed
            if seed is None and self._seeds is not None:
                seed = int(torch.randint(0, 2**62, (), generator=self._seeds))
            req.generator = make_generator(seed, self.device)
        self._requests[rid] = req
        if self._to_encode(req):
            self._encoding.append(req)
        else:
            self.scheduler.waiting.append(req)
        return rid

    def _to_encode(self, req: Request) -> bool:
        """Set ``req.image_features`` (precomputed features, None where the tower must run) and
        say whether the tower must run: an image with pixels that the prefix cache does not hold
        now (a later eviction is covered by :meth:`ModelRunner.features`)."""
        if not req.images:
            return False
        req.image_features = [
            im.features.to(self.device) if im.features is not None else None for im in req.images
        ]
        cached = self.cache.cached_length(req)
        req.to_encode = [
            i
            for i, (im, f) in enumerate(zip(req.images, req.image_features))
            if f is None and im.positions.stop > cached
        ]
        return bool(req.to_encode)

    def abort(self, request_id: str) -> None:
        """Stop a request now: its slot, blocks and reservation are released before returning; the
        next :meth:`step` reports it with ``finish_reason="abort"``. Unknown ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        self._release(req)
        req.finished = True
        req.finish_reason = "abort"
        self._pending.append(RequestOutput(request_id, [], True, "abort", self._usage(req)))

    def abort_all(self) -> None:
        """:meth:`abort` every queued and running request."""
        for rid in list(self._requests):
            self.abort(rid)

    def has_unfinished(self) -> bool:
        """True while any request is queued, running, or has an output not yet returned by step()."""
        return bool(self._requests or self._pending)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs of requests that got a token or finished.

        Failure isolation: an exception (a failed allocation, a tower or constraint error) while
        computing one forward with its bookkeeping, or while sampling, fails exactly the requests
        of that work: each gets a final output with ``finish_reason="error"`` and ``error`` set,
        and its slot, blocks and reservation are released at once (:meth:`_fail`). The step goes
        on with the other requests, and the engine keeps serving. Only an exception while
        planning (the scheduler) propagates; :meth:`fail_all` recovers from that. A step ends with
        up to ``encoder_step_flops`` of vision-tower work (:meth:`_encode`); a tower exception
        fails only its request.
        """
        outputs = self._pending
        self._pending = []
        plan = self.scheduler.schedule()
        rows: list[tuple[Request, torch.Tensor]] = []
        if plan.decode:
            try:
                logits = self.runner.decode(plan.decode)
                for i, r in enumerate(plan.decode):
                    r.num_computed += 1
                    self._computed(r, logits[i])
                    rows.append((r, logits[i]))
            except Exception as e:  # noqa: BLE001 - isolated to these requests
                outputs += self._fail(plan.decode, e)
        for rnd in plan.prefill:
            rnd = [p for p in rnd if not p.request.finished]  # a failed request's later pieces
            if not rnd:
                continue
            try:
                need = [p.end == len(p.request.tokens) for p in rnd]
                logits, marked = self.runner.forward(rnd, need)
                for p in rnd:
                    p.request.num_computed = p.end
                j = 0
                for p, nd, at in zip(rnd, need, marked):
                    row = logits[j] if nd else None
                    j += nd
                    self._computed(p.request, row, at)
                    if nd:
                        rows.append((p.request, row))
            except Exception as e:  # noqa: BLE001 - isolated to these requests
                outputs += self._fail([p.request for p in rnd], e)
        for r in plan.ready:
            if not r.finished:
                rows.append((r, r.pending_logits))
                r.pending_logits = None
        rows = [(r, x) for r, x in rows if not r.finished]
        if rows:
            outputs += self._sample(rows)
        if self._encoding:
            outputs += self._encode()
        return outputs

    def _release(self, r: Request) -> None:
        """Give back everything ``r`` holds: its place in the encoding queue or the scheduler's,
        its partial tower work and image inputs, and its cache resources (:meth:`CacheManager.release`)."""
        if r in self._encoding:
            self._encoding.remove(r)
        self.scheduler.remove(r)
        self.cache.release(r)
        r.images = []
        r.image_features = None
        r.tower_job = None
        r.to_encode = []

    def _fail(self, reqs: list[Request], exc: BaseException) -> list[RequestOutput]:
        """Finish ``reqs`` with ``finish_reason="error"`` after ``exc`` was raised while computing
        them: slot, blocks and reservation go back now. Blocks they had published hold complete,
        correct latents (a block is published only after the forward that filled it); what the
        failed work wrote lies in their own unpublished blocks and slot, which are reused only
        after being overwritten (blocks) or zeroed (slots). Requests already finished are skipped.
        """
        self.failures += 1
        msg = f"{type(exc).__name__}: {exc}"[:2000]
        log.error("engine: %d request(s) failed: %s", len(reqs), msg, exc_info=exc)
        out = []
        for r in reqs:
            if r.finished or self._requests.get(r.request_id) is not r:
                continue
            self._release(r)
            self._requests.pop(r.request_id, None)
            r.finished = True
            r.finish_reason = "error"
            out.append(RequestOutput(r.request_id, [], True, "error", self._usage(r), error=msg))
        return out

    def fail_all(self, exc: BaseException) -> list[RequestOutput]:
        """Recover from an exception outside the isolated work (e.g. while planning a step): every
        queued and running request fails with ``finish_reason="error"`` and releases its resources;
        pending outputs are returned first. Raises RuntimeError if the pools still disagree with
        the (now empty) request set afterwards (:meth:`check_consistency`)."""
        outputs = self._pending
        self._pending = []
        outputs += self._fail(list(self._requests.values()), exc)
        problems = self.check_consistency()
        if problems:
            raise RuntimeError(f"engine state inconsistent after a failure: {'; '.join(problems)}")
        return outputs

    def check_consistency(self) -> list[str]:
        """Resource accounting against the live requests (empty when consistent): block
        references, reservations and slots held equal those of the running requests, and every
        known request is queued or running exactly once. O(blocks + requests)."""
        sch = self.scheduler
        live = list(sch.running) + list(sch.waiting)
        problems = []
        every = live + list(self._encoding)
        if len({id(r) for r in every}) != len(every) or {r.request_id for r in every} != set(
            self._requests
        ):
            problems.append(
                f"{len(self._requests)} known requests, {len(sch.running)} running + "
                f"{len(sch.waiting)} waiting + {len(self._encoding)} encoding"
            )
        for r in self._encoding:
            if self.cache.holds(r):
                problems.append(f"request {r.request_id} holds cache resources while encoding")
        return problems + self.cache.check(live)

    def _encode(self) -> list[RequestOutput]:
        """Run tower pieces for the head of the encoding queue until ``encoder_step_flops`` are
        spent; a request whose images are all encoded moves to the scheduler's queue. A tower
        exception fails that request alone (:meth:`_fail`)."""
        spent = 0
        outputs = []
        while self._encoding and spent < self.encoder_step_flops:
            r = self._encoding[0]
            try:
                if r.tower_job is None:
                    if not r.to_encode:  # every image encoded: prefill may start
                        self._encoding.popleft()
                        self.scheduler.waiting.append(r)
                        continue
                    i = r.to_encode.pop(0)
                    r.tower_job = (i, self.runner.tower(r.images[i]))
                i, gen = r.tower_job
                try:
                    spent += next(gen)
                except StopIteration as done:
                    r.image_features[i] = done.value
                    r.images[i] = dataclasses.replace(
                        r.images[i], pixel_values=None
                    )  # pixels no longer needed
                    r.tower_job = None
            except Exception as e:  # noqa: BLE001 - isolated to this request
                outputs += self._fail([r], e)
        return outputs

    def _computed(self, r: Request, logits: torch.Tensor | None, marked=()) -> None:
        """After a forward brought ``r`` to ``num_computed``: drop its image inputs once the prompt
        is done; the cache publishes blocks and takes the snapshots due, ``marked`` the states
        the forward captured at its piece's marks (:meth:`CacheManager.on_computed`)."""
        if r.images and r.num_computed >= len(r.prompt):
            r.images, r.image_features = (
                [],
                None,
            )  # prompt done: pixels and features are no longer needed
        self.cache.on_computed(r, logits, marked)

    # ------------------------------------------------------------------ sampling and stopping
    def _sample(self, rows: list[tuple[Request, torch.Tensor]]) -> list[RequestOutput]:
        """Sample one token for every row; a request whose constraint or acceptance raises fails
        alone (:meth:`_fail`), a failure of the batched sampler fails the rows it held."""
        outputs: list[RequestOutput] = []
        live: list[tuple[Request, torch.Tensor, torch.Tensor | None, bool]] = []
        for r, x in rows:
            try:
                if self.on_logits is not None:
                    self.on_logits(r.request_id, x)
                m = None
                dead = False
                if r.constraint is not None:
                    m = constraint_mask(r.constraint.allowed_tokens(), self.vocab_size, self.device)
                    if not bool(m.any()):
                        dead = True
                        m = torch.ones(self.vocab_size, dtype=torch.bool, device=self.device)
                live.append((r, x, m, dead))
            except Exception as e:  # noqa: BLE001 - isolated to this request
                outputs += self._fail([r], e)
        if not live:
            return outputs
        reqs = [r for r, _, _, _ in live]
        try:
            logits = torch.stack([x for _, x, _, _ in live]).to(self.device)
            tokens = sample(
                logits,
                [r.params for r in reqs],
                [r.generator for r in reqs],
                [m for _, _, m, _ in live],
            )
            lps = top_logprobs(logits, tokens, [r.params.logprobs for r in reqs])
        except Exception as e:  # noqa: BLE001 - isolated to these requests
            return outputs + self._fail(reqs, e)
        for i, ((r, _, _, dead), tok) in enumerate(zip(live, tokens.tolist())):
            try:
                if dead:  # the grammar allows nothing more: nothing valid can be generated
                    outputs.append(self._finish(r, [], "abort", "constraint", None))
                else:
                    outputs.append(self._accept(r, tok, lps[i]))
            except Exception as e:  # noqa: BLE001 - isolated to this request
                outputs += self._fail([r], e)
        return outputs

    def _accept(self, r: Request, tok: int, lp) -> RequestOutput:
        r.completion_tokens += 1
        if r.constraint is not None and not r.constraint.accept(tok):
            return self._finish(r, [], "abort", "constraint", None)
        if tok in r.params.stop_token_ids:
            return self._finish(r, [], "stop", tok, None)
        r.output.append(tok)
        r.tokens.append(tok)
        new = [tok]
        lps = [lp] if lp is not None else None
        stop = self._stop_string(r)
        if stop is not None:
            return self._finish(r, new, "stop", stop, lps)
        if r.constraint is not None and r.constraint.is_finished():
            return self._finish(r, new, "stop", "constraint", lps)
        if r.completion_tokens >= r.max_tokens:
            return self._finish(r, new, "length", None, lps)
        return RequestOutput(r.request_id, new, False, None, self._usage(r), lps)

    def _stop_string(self, r: Request) -> str | None:
        stops = r.params.stop
        if not stops:
            return None
        # A match completed by this token lies within the last few tokens: every token decodes to
        # at least one character except pieces of a multi-byte character, hence the margin.
        window = r.output[-(2 * max(len(s) for s in stops) + 8) :]
        text = self.detokenize(window)
        for s in stops:
            if s in text:
                return s
        return None

    def _finish(self, r: Request, new: list[int], reason: str, stop_reason, lps) -> RequestOutput:
        if reason in ("stop", "length"):
            self.cache.on_finished(
                r
            )  # a follow-up turn that extends this conversation resumes there
        self._release(r)
        self._requests.pop(r.request_id, None)
        r.finished = True
        r.finish_reason = reason
        r.stop_reason = stop_reason
        return RequestOutput(r.request_id, new, True, reason, self._usage(r), lps, stop_reason)

    def _usage(self, r: Request) -> Usage:
        return Usage(len(r.prompt), r.cached_tokens, r.completion_tokens)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict:
        """Pool occupancy, prefix-cache counters per pool, queue lengths, failed step work
        (``failures``, see :meth:`step`), memory layout."""
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "encoding": len(self._encoding),
            "failures": self.failures,
            "max_model_len": self.max_model_len,
            **self.cache.stats(),
        }
