"""Kimi Delta Attention layer (K3 variant and the predecessor Kimi Linear variant).

Shape legend: B batch rows, T tokens, D hidden size, H heads (``linear_num_heads``),
K head dim (``linear_head_dim``; K = V), P = H*K projection width, W short-conv kernel,
N packed documents.

y = o_proj( o_norm( KDA(q, k, v, g, beta), gate ) ), with
  q, k = L2N(SiLU(conv(q_proj x))), v = SiLU(conv(v_proj x)), beta = sigmoid(b_proj x),
  g = gate(f_b_proj(f_a_proj x)) per channel: K3 ``gate_lower_bound * sigmoid(exp(A_log) (z + dt_bias))``,
  Kimi Linear ``-exp(A_log) softplus(z + dt_bias)``; output gate ``g_proj x`` (K3, full rank) or
  ``g_b_proj(g_a_proj x)`` (Kimi Linear, low rank).

Source: architecture.md §3 (equations §3.2, init §3.3, decode cache §3.5), k3-release-notes.md §1.4,
fixtures/k3-ref-tiny-a/README.md "Conventions the reference fixes"; transformers
``KimiLinearDeltaAttention`` for the Kimi Linear variant. Attribute names are the checkpoint's.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.cache import KDAStateEntry
from openk3.config import KDA, K3Config
from openk3.layers.norm import GatedRMSNorm
from openk3.ops.cast import cast, fp32
from openk3.ops.kda import CHUNK_SIZE, MODES, fused_decode, kda
from openk3.ops.kda_decode import kda_decode_step
from openk3.ops.kda_gate import kda_gate_lower_bound, kda_gate_softplus, l2_normalize
from openk3.ops.short_conv import short_conv, short_conv_step, tails_at
from openk3.ops.varlen import check_lengths, pack_documents, unpack_documents
from openk3.weight_init import init_module


class KimiDeltaAttention(nn.Module):
    """KDA token mixer of one decoder layer.

    Parameters (checkpoint names, under ``model.layers.{i}.self_attn.``):
        q_proj, k_proj, v_proj: Linear D->P. q_conv1d, k_conv1d, v_conv1d: depthwise Conv1d weight
        [P, 1, W]. f_a_proj: D->K, f_b_proj: K->P (decay logit). dt_bias: [P] fp32. A_log: [H] fp32
        (one per head). b_proj: D->H. g_proj: D->P (``use_full_rank_gate``) or g_a_proj: D->K +
        g_b_proj: K->P. o_norm: GatedRMSNorm weight [K] shared by heads. o_proj: P->D. No biases.

    Args:
        config: the architecture; reads hidden_size, linear_num_heads, linear_head_dim,
            linear_conv_kernel_dim, gate_lower_bound, use_full_rank_gate, rms_norm_eps,
            initializer_range.
        layer_idx: 0-based layer index; ``config.layer_types[layer_idx]`` must be KDA.
    Raises:
        ValueError: layer_idx out of range or not a KDA layer.
    """

    def __init__(self, config: K3Config, layer_idx: int) -> None:
        super().__init__()
        if not 0 <= layer_idx < config.num_hidden_layers:
            raise ValueError(
                f"layer_idx={layer_idx}: outside [0, num_hidden_layers={config.num_hidden_layers})"
            )
        if config.layer_types[layer_idx] != KDA:
            raise ValueError(
                f"layer_idx={layer_idx}: config.layer_types[{layer_idx}]="
                f"{config.layer_types[layer_idx]!r}, not {KDA!r}"
            )
        self.layer_idx = layer_idx
        self.hidden_size = D = config.hidden_size
        self.num_heads = H = config.linear_num_heads
        self.head_dim = K = config.linear_head_dim
        self.proj_dim = P = H * K
        self.conv_size = W = config.linear_conv_kernel_dim
        self.gate_lower_bound = config.gate_lower_bound
        self.use_full_rank_gate = config.use_full_rank_gate
        self.initializer_range = config.initializer_range

        self.q_proj = nn.Linear(D, P, bias=False)
        self.k_proj = nn.Linear(D, P, bias=False)
        self.v_proj = nn.Linear(D, P, bias=False)
        self.q_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, P, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(P, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.b_proj = nn.Linear(D, H, bias=False)
        if self.use_full_rank_gate:
            self.g_proj = nn.Linear(D, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(D, K, bias=False)
            self.g_b_proj = nn.Linear(K, P, bias=False)
        self.o_norm = GatedRMSNorm(K, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(P, D, bias=False)
        self.init_weights()

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Initialise every parameter by :mod:`openk3.weight_init` (the rules the whole model uses:
        ``A_log`` 0 for K3 / log U[1, 16] for Kimi Linear, ``dt_bias`` inverse softplus of
        dt ~ exp(U[ln 1e-3, ln 1e-1]), ``o_norm`` ones, linears and short-conv kernels
        N(0, ``initializer_range``); architecture.md §3.3). Safe after meta-device construction."""
        init_module(
            self,
            self.initializer_range,
            is_k3=self.gate_lower_bound is not None,
            generator=generator,
        )

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: torch.Tensor,
        cache: KDAStateEntry | None = None,
        *,
        lengths: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        mode: str = "chunk",
        validate: bool = True,
    ) -> torch.Tensor:
        """Mix tokens of the (already RMSNorm'd) layer input.

        Args:
            x: [B, T, D] normed layer input (model dtype).
            cache: incoming per-row state (conv [B, 3, P, W-1], recurrent [B, H, K, K] fp32): a
                ``KDALayerState`` or the engine's pooled ``SlotKDAState``; UPDATED IN PLACE (its
                ``store``) with the state after each row's valid tokens. None = start from
                zeros and keep nothing. With ``cu_seqlens`` it holds one row per document. Its
                ``marks`` (row b, tokens t) ask for the state after t tokens of row b as well
                (t a multiple of :data:`~openk3.ops.kda.CHUNK_SIZE`, at most the row's valid
                tokens): handed over through ``store_marks`` in the marks' order, conv tails
                [M, 3, P, W-1] and the chunk kernel's per-chunk states [M, H, K, K].
            lengths: [B] valid (non-padding) tokens per row in this call, right padding;
                None = all T. Padded positions leave the state unchanged and output zeros.
            cu_seqlens: [N+1] packed document offsets with B == 1 (excludes ``lengths``); every
                document starts from its own state (zeros, or ``cache`` row n).
            mode: ``"chunk"`` (prefill/training) or ``"recurrent"`` (token loop; decode). Same result.
            validate: check the values of ``lengths`` (a host read); False when the caller has
                (:meth:`K3Model.forward`). Shapes are always checked.
        Returns:
            [B, T, D] in x's dtype.
        Raises:
            ValueError: bad shapes, lengths, cu_seqlens, mode, a cache of the wrong size, or marks
                outside the call or off the chunk grid (or with ``cu_seqlens``).
        """
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected [B, T, D={self.hidden_size}], got {tuple(x.shape)}")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: must be one of {MODES}")
        if cu_seqlens is None:
            return self._forward_rows(x, cache, lengths, mode, validate)
        if lengths is not None:
            raise ValueError(
                "lengths and cu_seqlens are mutually exclusive (packed documents carry their own lengths)"
            )
        if cache is not None and cache.marks:
            raise ValueError("cache.marks: not supported with cu_seqlens (packed documents)")
        # Packed documents run as padded rows; a varlen kernel can skip this.
        rows, doc_lengths = unpack_documents(x, cu_seqlens)
        # doc_lengths come from the checked cu_seqlens: nothing left to check.
        rows_out = self._forward_rows(rows, cache, doc_lengths, mode, validate=False)
        return pack_documents(rows_out, doc_lengths)

    def _decode_step(
        self, x: torch.Tensor, cache, conv0: torch.Tensor, rec0: torch.Tensor
    ) -> torch.Tensor:
        """One token per row ([B, 1, D], no padding) through the fused
        :func:`~openk3.ops.kda_decode.kda_decode_step`; same result as the general path."""
        B = x.shape[0]
        H, K = self.num_heads, self.head_dim
        x1 = x[:, 0]
        qkv = torch.stack([self.q_proj(x1), self.k_proj(x1), self.v_proj(x1)], dim=1)  # [B, 3, P]
        w = torch.stack(
            [c.weight[:, 0] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]
        )  # [3, P, W]
        z = self.f_b_proj(self.f_a_proj(x1)).view(B, H, K)
        o, tail, state = kda_decode_step(
            qkv,
            conv0,
            w,
            z,
            self.b_proj(x1),
            self.A_log,
            self.dt_bias,
            rec0,
            K**-0.5,
            self.gate_lower_bound,
        )
        cache.store(tail, state)
        gate = self.g_proj(x1) if self.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x1))
        out = self.o_norm(o, gate.view(B, H, K))  # fp32 [B, H, K]
        return self.o_proj(cast(out.reshape(B, 1, self.proj_dim), x.dtype))

    def _check_state(self, conv: torch.Tensor, recurrent: torch.Tensor, B: int) -> None:
        P, W, H, K = self.proj_dim, self.conv_size, self.num_heads, self.head_dim
        if tuple(conv.shape) != (B, 3, P, W - 1):
            raise ValueError(
                f"cache.conv: expected [B={B}, 3, P={P}, W-1={W - 1}], got {tuple(conv.shape)}"
            )
        if tuple(recurrent.shape) != (B, H, K, K):
            raise ValueError(
                f"cache.recurrent: expected [B={B}, H={H}, K={K}, V={K}], got {tuple(recurrent.shape)}"
            )

    @staticmethod
    def _check_marks(marks: tuple[tuple[int, int], ...], B: int, T: int) -> None:
        """Each mark (row b, tokens t): 0 <= b < B, 0 < t <= T, t on the KDA chunk grid (the chunk
        kernel's per-chunk states are the only mid-call states it yields)."""
        for b, t in marks:
            if not (0 <= b < B and 0 < t <= T and t % CHUNK_SIZE == 0):
                raise ValueError(
                    f"cache.marks: ({b}, {t}) must name a row < B={B} and a token count in "
                    f"(0, T={T}] that is a multiple of {CHUNK_SIZE}"
                )

    def _plain_projections(self) -> bool:
        """Whether q/k/v_proj are plain ``nn.Linear`` modules without hooks, so their three products
        may run as one (a subclass or a hook would be bypassed by the fused form)."""
        return all(
            type(p) is nn.Linear and not (p._forward_hooks or p._forward_pre_hooks)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )

    def _mixed_separate(
        self,
        x: torch.Tensor,
        conv0: torch.Tensor | None,
        lengths: torch.Tensor | None,
        mode: str,
        marks: tuple[tuple[int, int], ...] = (),
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """q, k, v after projection, short conv and SiLU, one projection at a time (decode steps, and
        the plain form :meth:`_mixed_fused` is tested against).

        Returns ([q, k, v] each [B, T, H, K] in x.dtype, new conv tails [B, 3, P, W-1], the conv
        tails at ``marks`` [M, 3, P, W-1])."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        tails = conv0.unbind(1) if conv0 is not None else (None, None, None)
        mixed = []
        new_tails = []
        marked = []
        for proj, conv, tail in zip(
            (self.q_proj, self.k_proj, self.v_proj),
            (self.q_conv1d, self.k_conv1d, self.v_conv1d),
            tails,
        ):
            inp = proj(x)  # [B, T, P]
            if tail is not None and T == 1 and mode == "recurrent":
                valid = None if lengths is None else lengths > 0
                out, new_tail = short_conv_step(
                    inp[:, 0], conv.weight, cast(tail, inp.dtype), valid, activation="silu"
                )
                out = out[:, None]
            else:
                out, new_tail = short_conv(
                    inp,
                    conv.weight,
                    None if tail is None else cast(tail, inp.dtype),
                    lengths,
                    activation="silu",
                    validate=False,
                )
            mixed.append(out.reshape(B, T, H, K))
            new_tails.append(new_tail)
            marked.append(tails_at(inp, tail, marks, self.conv_size))
        return mixed, torch.stack(new_tails, dim=1), torch.stack(marked, dim=1)

    def _mixed_fused(
        self,
        x: torch.Tensor,
        conv0: torch.Tensor | None,
        lengths: torch.Tensor | None,
        marks: tuple[tuple[int, int], ...] = (),
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """:meth:`_mixed_separate` for a multi-token call as one [D, 3P] projection and one short conv
        over the 3P channels (the conv is per channel, so stacking q, k and v changes nothing but
        the count of small ops: 0.74 + 1.06 -> ~1.1 ms per 512-token chunk at the shipped size,
        1 thread). Same returns."""
        B, T, _ = x.shape
        H, K, P = self.num_heads, self.head_dim, self.proj_dim
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])  # [3P, D]
        cw = torch.cat(
            [self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]
        )  # [3P, 1, W]
        inp = torch.nn.functional.linear(x, w)  # [B, T, 3P]
        tail = None if conv0 is None else cast(conv0.reshape(B, 3 * P, conv0.shape[-1]), inp.dtype)
        out, new_tail = short_conv(inp, cw, tail, lengths, activation="silu", validate=False)
        mixed = [t.reshape(B, T, H, K) for t in out.split(P, dim=-1)]
        W1 = new_tail.shape[-1]
        marked = tails_at(inp, tail, marks, self.conv_size).view(len(marks), 3, P, W1)
        return mixed, new_tail.view(B, 3, P, W1), marked

    def _forward_rows(
        self,
        x: torch.Tensor,
        cache: KDAStateEntry | None,
        lengths: torch.Tensor | None,
        mode: str,
        validate: bool = True,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        conv0 = rec0 = None
        marks = ()
        if cache is not None:
            # Read once: a pooled state (SlotKDAState) gathers on every access.
            conv0 = cache.conv
            rec0 = cache.recurrent
            self._check_state(conv0, rec0, B)
            marks = tuple(cache.marks)
            self._check_marks(marks, B, T)
        # The one lengths check of this call (or none: the caller's, validate=False); the short
        # conv and KDA below trust it.
        if lengths is not None:
            check_lengths(lengths, B, T, values=validate)
        if (
            cache is not None
            and T == 1
            and mode == "recurrent"
            and lengths is None
            and not marks
            and fused_decode()
        ):
            return self._decode_step(x, cache, conv0, rec0)

        if T == 1 and mode == "recurrent" or not self._plain_projections():
            mixed, new_tail, marked_tails = self._mixed_separate(x, conv0, lengths, mode, marks)
        else:
            mixed, new_tail, marked_tails = self._mixed_fused(x, conv0, lengths, marks)
        q = l2_normalize(mixed[0])
        k = l2_normalize(mixed[1])
        v = fp32(mixed[2])

        z = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, H, K)
        if self.gate_lower_bound is not None:
            g = kda_gate_lower_bound(z, self.A_log, self.dt_bias, self.gate_lower_bound)
        else:
            g = kda_gate_softplus(z, self.A_log, self.dt_bias)
        beta = torch.sigmoid(fp32(self.b_proj(x)))  # [B, T, H]

        o, state, *chunk_states = kda(
            q,
            k,
            v,
            g,
            beta,
            K**-0.5,
            rec0,
            lengths,
            mode=mode,
            chunk_size=CHUNK_SIZE,
            output_chunk_states=bool(marks),
            validate=False,
        )
        if cache is not None:
            cache.store(new_tail, state)
        if marks:
            # chunk_states[0]: [B, NC, H, K, V], entry c = the state after (c + 1) * CHUNK_SIZE tokens.
            rows = torch.tensor([b for b, _ in marks], device=x.device)
            chunk = torch.tensor([t // CHUNK_SIZE - 1 for _, t in marks], device=x.device)
            cache.store_marks(marked_tails, chunk_states[0][rows, chunk])

        gate = self.g_proj(x) if self.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        out = self.o_norm(o, gate.reshape(B, T, H, K))  # fp32 [B, T, H, K]
        return self.o_proj(cast(out.reshape(B, T, self.proj_dim), x.dtype))
