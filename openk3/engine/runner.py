"""The engine's model runner: builds the tensors of a step's forwards from request state and the
cache pools, and runs the model (and, for image requests, the vision tower).

Shape legend: B rows of one batched forward, T tokens per row (right padded), V vocabulary,
MB block-table width, N image tokens of one image, D hidden size.

Every forward gets a :class:`~openk3.cache.HybridCache` whose entries are pool views
(:class:`~openk3.cache.SlotKDAState` rows of the slot pool, :class:`~openk3.cache.PagedMLACache`
block tables into the latent pool), so the model runs unchanged. The runner reads a request's
tokens, slot, block table and image inputs; it never changes a request's progress
(``num_computed``) or the resources it holds: the scheduler allocated the blocks a piece writes
when it planned the step, and the engine records the progress after the forward.

Decode rows run either through the same eager forward (the reference) or, with ``compile``,
through :class:`~openk3.engine.decode_step.StaticDecodeStep` (bucketed static shapes).
"""

from __future__ import annotations

import torch

from openk3.cache import HybridCache
from openk3.config import KDA
from openk3.engine.decode_step import StaticDecodeStep, decode_backend
from openk3.engine.kv_pool import KDAStatePool, MLABlockPool, SlotPool, layer_views
from openk3.engine.request import Piece, Request
from openk3.ops import attn_res_cpu
from openk3.ops.attn_res_decode import DirectAttnRes
from openk3.vision.encoder import encode_in_pieces


class ModelRunner:
    """Runs a model's forwards over the engine's pools.

    Args:
        model: a :class:`~openk3.model.K3ForCausalLM` (or the multimodal model; its device and
            dtype are the pools').
        blocks, slots: the MLA block pool and the KDA slot pool the forwards read and write.
        compile: decode rows through a compiled :class:`StaticDecodeStep`; False: the eager forward
            (:func:`~openk3.engine.decode_step.decode_backend` decides: ``OPENK3_DECODE_BACKEND``
            wins, and without a compiler the eager forward runs).
        max_batch: largest decode batch (the scheduler's ``max_num_seqs``; the static step's cap).
        max_blocks: blocks of one ``max_model_len`` sequence (the static step's table cap).
        encoder_step_flops: vision-tower FLOPs one engine step may spend; the tower runs in pieces
            of a quarter of it (:func:`~openk3.vision.encoder.encode_in_pieces`).
    Attributes:
        layer_pools: per decoder layer, ``("kda", i)`` or ``("mla", i)``: its index into the pools.
        decode_step: the :class:`StaticDecodeStep` (None without ``compile``).
    """

    def __init__(
        self,
        model,
        blocks: MLABlockPool,
        slots: SlotPool,
        *,
        compile: bool,
        max_batch: int,
        max_blocks: int,
        encoder_step_flops: int,
    ) -> None:
        self.model = model
        self.blocks = blocks
        self.slots = slots
        self.device = model.lm_head.weight.device
        self.encoder_step_flops = encoder_step_flops
        counts = {"kda": 0, "mla": 0}
        self.layer_pools: list[tuple[str, int]] = []
        for t in model.config.layer_types:
            kind = "kda" if t == KDA else "mla"
            self.layer_pools.append((kind, counts[kind]))
            counts[kind] += 1
        # Block AttnRes of prefill forwards: each site's direct mixture in one native pass on CPU
        # (openk3.ops.attn_res_cpu via DirectAttnRes; ~10x less time than the reference's
        # two-phase form at 2,048 tokens); elsewhere the model's default (two-phase) state.
        self.prefill_attn_res = (
            DirectAttnRes if self.device.type == "cpu" and attn_res_cpu.available() else None
        )
        self.decode_step = None
        if decode_backend(compile, self.device) == "compiled":
            self.decode_step = StaticDecodeStep(
                model,
                blocks,
                slots,
                self.layer_pools,
                max_batch=max_batch,
                max_blocks=max_blocks,
                compile=True,
            )

    # ------------------------------------------------------------------ language model
    def forward(
        self, pieces: list[Piece], need: list[bool]
    ) -> tuple[torch.Tensor | None, list[list[tuple[int, KDAStatePool, int]]]]:
        """One batched forward of ``pieces`` (each request's table must cover ``[0, end)`` and its
        slot hold the state after ``start`` tokens).

        Returns:
            (logits [sum(need), V] fp32 at the last position of the rows flagged in ``need``, None
            when none is; per piece, for each of its ``marks`` in order, ``(position, pool, row)``:
            the KDA state of every layer after ``position`` tokens is row ``row`` of ``pool``, a
            :class:`~openk3.engine.kv_pool.KDAStatePool` over the states the forward captured).
        """
        dev = self.device
        B = len(pieces)
        T = max(p.length for p in pieces)
        ids = torch.tensor(
            [p.request.tokens[p.start : p.end] + [0] * (T - p.length) for p in pieces],
            dtype=torch.long,
            device=dev,
        )
        lens = torch.tensor([p.length for p in pieces], dtype=torch.long, device=dev)
        MB = max(len(p.request.blocks) for p in pieces)
        tables = torch.tensor(
            [p.request.blocks + [0] * (MB - len(p.request.blocks)) for p in pieces],
            dtype=torch.long,
            device=dev,
        )
        slots = torch.tensor([p.request.slot for p in pieces], dtype=torch.long, device=dev)
        marks = tuple((row, m - p.start) for row, p in enumerate(pieces) for m in p.marks)
        layers = layer_views(self.layer_pools, self.blocks, self.slots, slots, tables, marks)
        past = torch.tensor([p.start for p in pieces], dtype=torch.long, device=dev)
        cache = HybridCache(layers=layers, lengths=past)
        full = all(p.length == T for p in pieces)
        embeds = self.image_embeds(pieces, ids)
        # validate=False: ids were checked by add_request or sampled, lengths and tables built
        # here, room allocated by the scheduler; the model then reads no tensor value on the host.
        hidden = self.model.model(
            None if embeds is not None else ids,
            cache,
            inputs_embeds=embeds,
            lengths=None if full else lens,
            validate=False,
            attn_res_state=self.prefill_attn_res,
        )
        marked = self._marked(pieces, layers, len(marks))
        rows = [i for i in range(B) if need[i]]
        if not rows:
            return None, marked
        idx = torch.tensor(rows, device=dev)
        h = hidden[idx, lens[idx] - 1]
        return self.model.lm_head(h).float(), marked

    def _marked(
        self, pieces: list[Piece], layers: list, count: int
    ) -> list[list[tuple[int, KDAStatePool, int]]]:
        """The states the KDA layers captured at the pieces' marks, as one
        :class:`KDAStatePool` of ``count`` rows (in mark order), and per piece its
        ``(position, pool, row)`` triples (see :meth:`forward`)."""
        if not count:
            return [[] for _ in pieces]
        kda = [layers[i] for i, (kind, _) in enumerate(self.layer_pools) if kind == "kda"]
        if kda:
            conv = torch.stack([e.marked[0] for e in kda])
            recurrent = torch.stack([e.marked[1] for e in kda])
        else:  # no KDA layer: the state is empty
            conv = self.slots.conv.new_zeros(0, count, *self.slots.conv.shape[2:])
            recurrent = self.slots.recurrent.new_zeros(0, count, *self.slots.recurrent.shape[2:])
        pool = KDAStatePool.of(conv, recurrent)
        out, row = [], 0
        for p in pieces:
            out.append([(m, pool, row + i) for i, m in enumerate(p.marks)])
            row += len(p.marks)
        return out

    def decode(self, reqs: list[Request]) -> torch.Tensor:
        """The next token of each of ``reqs`` (one token to feed each, tables covering it):
        logits [B, V] fp32, through :attr:`decode_step` when compiled, else :meth:`forward`."""
        if self.decode_step is not None:
            return self.decode_step([(r.tokens, r.slot, r.blocks, r.num_computed) for r in reqs])
        return self.forward(
            [Piece(r, r.num_computed, r.num_computed + 1) for r in reqs], [True] * len(reqs)
        )[0]

    # ------------------------------------------------------------------ images
    def image_embeds(self, pieces: list[Piece], ids: torch.Tensor) -> torch.Tensor | None:
        """[B, T, D] inputs for rows whose piece overlaps an image (None when no row does):
        token embeddings with each overlapped pad position replaced by its feature row."""
        hits = [
            (row, p)
            for row, p in enumerate(pieces)
            if p.request.images
            and any(
                im.positions.start < p.end and p.start < im.positions.stop
                for im in p.request.images
            )
        ]
        if not hits:
            return None
        embeds = self.model.model.embed_tokens(ids)
        for row, p in hits:
            s = p.start
            e = p.end
            feats = self.features(p.request)
            for im, f in zip(p.request.images, feats):
                a = max(s, im.positions.start)
                b = min(e, im.positions.stop)
                if a < b:
                    off = im.positions.start
                    embeds[row, a - s : b - s] = f[a - off : b - off].to(embeds.dtype)
        return embeds

    def features(self, r: Request) -> list:
        """Per image of ``r``, its [N, D] features on the model's device (None for images entirely
        below ``num_computed``, i.e. served by the prefix cache). Normally complete before
        admission (the engine's encoding queue); an image the prefix cache held at arrival but
        evicted since is encoded here, whole."""
        if r.image_features is None:
            r.image_features = [None] * len(r.images)
        for i, im in enumerate(r.images):
            if r.image_features[i] is None and im.positions.stop > r.num_computed:
                gen = self.tower(im)
                while True:
                    try:
                        next(gen)
                    except StopIteration as done:
                        r.image_features[i] = done.value
                        break
        return r.image_features

    def tower(self, im):
        """The resumable tower + projector work of one image (a generator, see
        :func:`~openk3.vision.encoder.encode_in_pieces`)."""
        m = self.model
        return encode_in_pieces(
            m.vision_tower,
            im.pixel_values.to(self.device),
            im.grid_thw,
            m.mm_projector,
            piece_flops=max(1, self.encoder_step_flops // 4),
        )
