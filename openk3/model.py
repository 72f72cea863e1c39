"""The K3 text backbone: decoder layers, Block AttnRes wiring, ``K3Model`` and ``K3ForCausalLM``.

Shape legend: B batch rows, T tokens in this call, D hidden size, V vocabulary, N packed
documents, E routed experts, k experts per token.

One ``forward(input_ids, cache=None, ...)`` serves training (no cache), prefill and decode (a
caller-owned :class:`~openk3.cache.HybridCache`). The layer schedule is data
(``config.layer_types`` / ``mlp_layer_types``). With ``attn_res_block_size`` set, the residual
stream is replaced by Block Attention Residuals exactly as in architecture.md §2 (steps 1-8);
without it (Kimi Linear) the layers use a plain pre-norm residual stream.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from openk3.cache import HybridCache
from openk3.config import DENSE, KDA, K3Config
from openk3.layers.attn_res import AttnResState, pseudo_query
from openk3.layers.kda import KimiDeltaAttention
from openk3.layers.mla import GatedMLA
from openk3.layers.mlp import MLP
from openk3.layers.moe import LatentMoE
from openk3.layers.norm import RMSNorm
from openk3.ops.varlen import check_cu_seqlens, check_lengths, check_past_lengths
from openk3.weight_init import init_module


@dataclass
class K3Output:
    """Result of :meth:`K3ForCausalLM.forward`.

    Attributes:
        logits: [B, T, V] fp32 (or the model dtype).
        loss: scalar mean cross-entropy over non-ignored labels, when ``labels`` was given.
        hidden: [B, T, D] the final-norm output (what feeds ``lm_head``).
    """

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    n_tokens: int = 0
    extras: dict = field(default_factory=dict)


class DecoderLayer(nn.Module):
    """One decoder layer: mixer (KDA or gated MLA) + FFN (dense MLP or LatentMoE), each with its
    pre-norm and, under Block AttnRes, its own depth-mixing site (norm weight × projection)."""

    def __init__(self, config: K3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_kda = config.layer_types[layer_idx] == KDA
        self.self_attn = (
            KimiDeltaAttention(config, layer_idx) if self.is_kda else GatedMLA(config, layer_idx)
        )
        if config.mlp_layer_types[layer_idx] == DENSE:
            self.mlp = MLP(config, config.hidden_size, config.intermediate_size)
        else:
            self.block_sparse_moe = LatentMoE(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.use_attn_res:
            self.self_attention_res_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.self_attention_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
            self.mlp_res_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.mlp_res_proj = nn.Linear(config.hidden_size, 1, bias=False)

    def mixer(self, h: torch.Tensor, cache_entry, ctx: dict) -> torch.Tensor:
        """[B, T, D] mixer input (before ``input_layernorm``) -> [B, T, D] mixer output; the
        arguments in ``ctx`` were validated by :meth:`K3Model.forward` (or its caller)."""
        x = self.input_layernorm(h)
        if self.is_kda:
            return self.self_attn(
                x,
                cache_entry,
                lengths=ctx["lengths"],
                cu_seqlens=ctx["cu_seqlens"],
                mode=ctx["mode"],
                validate=False,
            )
        max_logits = (
            ctx["max_logits"].get(self.layer_idx) if ctx["max_logits"] is not None else None
        )
        return self.self_attn(
            x,
            cache_entry,
            lengths=ctx["lengths"],
            past_lengths=ctx["past_lengths"],
            cu_seqlens=ctx["cu_seqlens"],
            max_logits_out=max_logits,
            validate=False,
        )

    def ffn(self, h: torch.Tensor, routing_sink: list | None) -> torch.Tensor:
        """[B, T, D] FFN input (before ``post_attention_layernorm``) -> [B, T, D] FFN output."""
        x = self.post_attention_layernorm(h)
        if hasattr(self, "mlp"):
            return self.mlp(x)
        return self.block_sparse_moe(x, routing_sink=routing_sink)


class K3Model(nn.Module):
    """Embeddings, decoder layers, output AttnRes site and final norm (checkpoint prefix ``model.``)."""

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.use_attn_res:
            self.output_attn_res_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(config.hidden_size, 1, bias=False)

    def _site_queries(self) -> torch.Tensor:
        """[2L+1, D] fp32 pseudo-queries (norm weight × projection) of every AttnRes site: row 2l
        is layer l's mixer site, 2l+1 its FFN site, 2L the output site."""
        qs = []
        for layer in self.layers:
            qs.append(
                pseudo_query(
                    layer.self_attention_res_norm.weight, layer.self_attention_res_proj.weight
                )
            )
            qs.append(pseudo_query(layer.mlp_res_norm.weight, layer.mlp_res_proj.weight))
        qs.append(pseudo_query(self.output_attn_res_norm.weight, self.output_attn_res_proj.weight))
        return torch.stack(qs)

    def check_inputs(
        self,
        input_ids: torch.Tensor | None,
        cache: HybridCache | None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Validate the arguments of :meth:`forward` (the model's public boundary); reads tensor
        values on the host (token range, lengths, cache room).

        Returns:
            ``lengths`` as int64 on the input's device (None stays None).
        Raises:
            ValueError: the first inconsistent argument, named; a call that would overflow the
                cache is refused before any layer state changes.
        """
        cfg = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
                raise ValueError(
                    f"input_ids: expected an int64 [B, T] tensor, got {input_ids.dtype} {tuple(input_ids.shape)}"
                )
            if input_ids.numel():
                lo, hi = (int(v) for v in torch.aminmax(input_ids))
                if lo < 0 or hi >= cfg.vocab_size:
                    raise ValueError(
                        f"input_ids: values must be in [0, vocab_size={cfg.vocab_size}), got [{lo}, {hi}]"
                    )
        x = input_ids if inputs_embeds is None else inputs_embeds
        B, T = x.shape[:2]
        if lengths is not None:
            lengths = lengths.to(device=x.device, dtype=torch.long)
            check_lengths(lengths, B, T)
        if cache is not None:
            if cache.batch_size != B:
                raise ValueError(f"cache: holds {cache.batch_size} rows, input has B={B}")
            check_past_lengths(cache.lengths, B)
            # Checked before any layer runs: a failed call must leave every layer's state untouched.
            cache.check_room(
                lengths if lengths is not None else torch.full((B,), T, dtype=torch.long)
            )
            if cu_seqlens is not None:
                raise ValueError(
                    "cu_seqlens: packed documents are a training input; not supported with a cache"
                )
        if cu_seqlens is not None:
            if B != 1:
                raise ValueError(f"cu_seqlens: needs a single packed row (B=1), got B={B}")
            check_cu_seqlens(cu_seqlens, T)
        return lengths

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        cache: HybridCache | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        routing_sink: list | None = None,
        max_logits: dict | None = None,
        hidden_sink: dict | None = None,
        validate: bool = True,
        site_queries: torch.Tensor | None = None,
        attn_res_state: type | None = None,
    ) -> torch.Tensor:
        """Run the backbone.

        Args:
            input_ids: [B, T] int64 (or ``inputs_embeds`` [B, T, D]).
            cache: caller-owned decode state; updated in place, ``cache.lengths += lengths``.
            lengths: [B] valid tokens per row in this call (right padding); None = all T.
            cu_seqlens: [N+1] document boundaries of a packed row (B = 1, training): KDA state
                and MLA attention reset at each boundary.
            routing_sink: if a list, every MoE layer appends its ``RouterOutput``.
            max_logits: {layer_idx: [H] tensor} for MLA layers, filled with per-head max logits
                (QK-Clip).
            hidden_sink: if a dict, receives per-layer intermediate values for parity tests.
            validate: check the arguments (the default; what a user call needs). False trusts
                them and reads no tensor value on the host (no device->host sync), for a caller
                that has validated them once at its own boundary — the engine: token ids checked
                by ``Engine.add_request`` or sampled from the V logits, ``lengths`` int64 on the
                model's device with every row >= 1, cache room allocated by the scheduler.
            site_queries: [2L+1, D] fp32 AttnRes pseudo-queries equal to
                :meth:`_site_queries` of the current weights, computed by the caller (ignored
                without AttnRes); None computes them here. The compiled decode step passes
                its cached copy: recomputed in its graph they cost 2(2L+1) more graph inputs
                and products every step, ~3 % of a small model's B=1 step.
            attn_res_state: the class whose ``start`` builds the forward's AttnRes state (the
                interface of :class:`~openk3.layers.attn_res.AttnResState`, the default: the
                two-phase form). The compiled decode step passes
                :class:`~openk3.ops.attn_res_decode.DirectAttnRes` (direct per-site mixtures,
                fewer graph ops for one token per row).
        Returns:
            [B, T, D] output of the final norm.
        Raises:
            ValueError: inconsistent arguments (named); only shape errors when ``validate=False``.
        """
        if validate:
            lengths = self.check_inputs(
                input_ids,
                cache,
                inputs_embeds=inputs_embeds,
                lengths=lengths,
                cu_seqlens=cu_seqlens,
            )
        cfg = self.config
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        T = x.shape[1]
        # Every layer trusts what was checked here (or by the caller, validate=False): the layers'
        # own value checks would each cost a device->host sync per layer per step.
        ctx = {
            "lengths": lengths,
            "past_lengths": cache.lengths if cache is not None else None,
            "cu_seqlens": cu_seqlens,
            # Decode steps use the token recurrence, everything else the chunkwise form.
            "mode": "recurrent" if (cache is not None and T == 1) else "chunk",
            "max_logits": max_logits,
        }
        sink = hidden_sink
        # Block AttnRes (architecture.md §2) in its two-phase form (§5): when a block opens, one
        # batched pass scores every site of the block against the completed blocks; each site
        # then merges the current partial sum by online softmax (exactly the direct softmax).
        # With attn_res_block_size=None the state is the plain residual stream (Kimi Linear).
        state = (attn_res_state or AttnResState).start(
            x,
            cfg.attn_res_block_size,
            eps=cfg.rms_norm_eps,
            site_queries=(
                (self._site_queries() if site_queries is None else site_queries)
                if cfg.use_attn_res
                else None
            ),
        )
        for l, layer in enumerate(self.layers):
            entry = cache.layers[l] if cache is not None else None
            h = state.attn_input(l)
            a = layer.mixer(h, entry, ctx)
            state.after_mixer(l, a)
            h_ffn = state.ffn_input(l)
            f = layer.ffn(h_ffn, routing_sink)
            state.after_ffn(l, f)
            if sink is not None:
                sink[l] = {
                    "attn_in": h,
                    "mixer_out": a,
                    "ffn_in": h_ffn,
                    "ffn_out": f,
                    "out": state.partial,
                }
        y = state.output()
        out = self.norm(y)
        if sink is not None:
            sink["final_norm_in"] = y
            sink["final_norm_out"] = out
        if cache is not None:
            cache.lengths += lengths if lengths is not None else T
        return out


class K3ForCausalLM(nn.Module):
    """``K3Model`` + untied ``lm_head``. The public model class of openk3.

    Attributes follow the official checkpoint names (``model.*``, ``lm_head.weight``); see
    :mod:`openk3.checkpoint` for the file format.
    """

    def __init__(self, config: K3Config) -> None:
        """Build the modules on the meta device, materialise them on the current default device and
        initialise every weight once (:meth:`init_weights`, drawing from the default generator):
        ``torch.manual_seed(s); K3ForCausalLM(config)`` equals ``build_model(config, seed=s)``.
        Under ``torch.device("meta")`` the model stays on meta (loading, parameter counts)."""
        super().__init__()
        self.config = config
        device = torch.get_default_device()
        with torch.device("meta"):  # no memory and no per-module init: init_weights is the one init
            self._build_modules()
        self.to_empty(device=device)
        self.init_weights()
        self.tie_weights()

    def _build_modules(self) -> None:
        """Create the submodules (subclasses add theirs after calling this)."""
        self.model = K3Model(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)

    def tie_weights(self) -> None:
        """Share ``lm_head.weight`` with the embedding when ``tie_word_embeddings`` (again after
        ``to_empty``, which gives every parameter its own storage)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        cache: HybridCache | None = None,
        *,
        labels: torch.Tensor | None = None,
        logits_to_keep: int | None = None,
        **kwargs,
    ) -> K3Output:
        """Logits (and loss) for ``input_ids`` [B, T].

        Args:
            labels: [B, T] int64 next-token targets **already aligned** with the positions
                (label t is the token that should follow position t), -100 = ignored. Loss is
                the mean cross-entropy over the non-ignored labels, computed in fp32.
            logits_to_keep: compute logits for the last ``logits_to_keep`` positions only.
            kwargs: forwarded to :meth:`K3Model.forward` (``inputs_embeds``, ``lengths``,
                ``cu_seqlens``, ``routing_sink``, ``max_logits``, ``hidden_sink``).
        Returns:
            :class:`K3Output` with logits [B, T', V].
        """
        hidden = self.model(input_ids, cache, **kwargs)
        h = hidden if logits_to_keep is None else hidden[:, -logits_to_keep:]
        logits = self.lm_head(h)
        loss = None
        n = 0
        if labels is not None:
            if labels.shape != logits.shape[:2]:
                raise ValueError(
                    f"labels: shape {tuple(labels.shape)} does not match logits {tuple(logits.shape[:2])}"
                )
            n = int((labels != -100).sum())
            loss = F.cross_entropy(
                logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100
            )
        return K3Output(logits=logits, loss=loss, hidden=hidden, n_tokens=n)

    # ----------------------------------------------------------------- helpers
    def new_cache(self, batch: int, capacity: int) -> HybridCache:
        """An empty :class:`HybridCache` for ``batch`` rows and ``capacity`` tokens, on the model's
        device and dtype."""
        p = self.lm_head.weight
        return HybridCache.empty(self.config, batch, capacity, device=p.device, dtype=p.dtype)

    def save_pretrained(
        self,
        path: str,
        *,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int | None = None,
        quantization: str | None = None,
    ) -> None:
        """Write the official format (``config.json`` + safetensors). See :mod:`openk3.checkpoint`.

        Args:
            dtype: cast floating tensors (except the release's fp32 ones) to this dtype.
            quantization: None (float experts) or "mxfp4": routed experts as compressed-tensors
                ``weight_packed`` + ``weight_scale`` quantized from the full-precision weights (before
                any ``dtype`` cast), with the released ``quantization_config`` in the text config
                (k3-release-notes.md §1.9); everything else unquantized.
        A ``kimi_k3`` config without a ``vision_config`` is written as its bare ``kimi_linear`` text
        config (unprefixed names, logged): the official ``KimiK3ForConditionalGeneration`` cannot be
        built without a vision config, while the reference ``KimiLinearForCausalLM``, vLLM and
        SGLang load the text config.

        Raises:
            ValueError: unknown ``quantization`` or expert widths that are not multiples of 32.
        """
        from openk3.checkpoint import (
            DEFAULT_SHARD_BYTES,
            quantized_config,
            to_hf_state_dict,
            write_checkpoint,
        )

        config = self.config
        if config.wrapper is not None and config.wrapper.get("vision_config") is None:
            logging.getLogger("openk3.checkpoint").warning(
                "%s: a kimi_k3 config without vision_config is written as its kimi_linear text config "
                "(the official KimiK3ForConditionalGeneration needs a vision_config)",
                path,
            )
            config = config.text_only()
        config = quantized_config(config, quantization)
        tensors = to_hf_state_dict(self.state_dict(), config, quantization)
        if dtype is not None:
            tensors = type(tensors)(
                (k, v.to(dtype) if v.is_floating_point() and not keeps_fp32(k) else v)
                for k, v in tensors.items()
            )
        write_checkpoint(path, tensors, config, max_shard_bytes or DEFAULT_SHARD_BYTES)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Initialise every parameter by :mod:`openk3.weight_init`'s name-driven rules (safe after
        meta-device construction + ``to_empty``; meta tensors are left alone).

        Args:
            generator: random source; None draws from the default generator.
        """
        init_module(
            self, self.config.initializer_range, is_k3=self.config.is_k3, generator=generator
        )


def keeps_fp32(name: str) -> bool:
    """Tensors the release keeps in fp32 whatever the model dtype (release notes §1.4, §1.7)."""
    return name.endswith(("A_log", "dt_bias", "e_score_correction_bias", ".gate.weight"))
