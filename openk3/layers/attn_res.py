"""Block Attention Residuals: the depth mixer, the block schedule, and the two-phase serving form.

Shape legend: ``*`` any leading token dims (e.g. B, T), D hidden size, N candidate sources,
L decoder layers, S sites (pseudo-queries).

Sources: architecture.md §2 (whole-model wiring, steps 1–8) and §5 (two-phase inference form);
k3-release-notes.md §1.6; fixture README "Conventions the reference fixes"; config field
``attn_res_block_size`` (decoder layers per block, None = plain residual stream).

Depth mixer at one site with RMSNorm weight n and projection w (pseudo-query q = n ⊙ w):

    z_j = RMSNorm(v_j; no weight, eps) · q      a = softmax_j(z) (fp32)      out = Σ_j a_j v_j

Schedule per decoder layer l, block size B, carrying ``blocks`` (completed block sums) and the
partial block sum ``p`` (starts at the embedding x₀):

    h  = Mix_attn_l(blocks ++ [p]) if blocks else p        (layer 0: h = x₀)
    if l % B == 0: blocks.append(p)                        (snapshot before the mixer)
    a  = M_l(...h...);  p = a if the block just opened else p + a
    h' = Mix_ffn_l(blocks ++ [p]);  f = F_l(...h'...);  p = p + f
    y  = Mix_out(blocks ++ [p])                            (after the last layer)

AttnRes has no state across tokens: it mixes over depth within each token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from openk3.layers.norm import rms_norm

ATTN, FFN = 0, 1  # sublayer site kinds within a decoder layer


def pseudo_query(norm_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """Effective pseudo-query q = n ⊙ w of one site, [D] fp32.

    Args:
        norm_weight: [D] (``*_res_norm.weight``); proj_weight: [1, D] or [D] (``*_res_proj.weight``).
    Raises:
        ValueError: the two do not both hold D values.
    """
    n = norm_weight.reshape(-1)
    w = proj_weight.reshape(-1)
    if n.shape != w.shape:
        raise ValueError(
            f"proj_weight: expected {n.numel()} values like norm_weight, got shape {tuple(proj_weight.shape)}"
        )
    return n.float() * w.float()


def _stack(sources: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    if isinstance(sources, torch.Tensor):
        return sources
    if len(sources) == 0:
        raise ValueError("sources: need at least one candidate")
    return torch.stack(list(sources))


def depth_mix(
    sources: Sequence[torch.Tensor] | torch.Tensor,
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Softmax mixture over depth candidates at one AttnRes site (architecture.md §2 "Depth mixer").

    Args:
        sources: list of N tensors [*, D] or one stacked [N, *, D] (same dtype).
        norm_weight: [D]; proj_weight: [1, D] or [D]; their product is the pseudo-query.
        eps: RMSNorm eps of the keys (``rms_norm_eps``).
    Returns:
        [*, D] in the sources' dtype. Keys, softmax and the weighted sum are fp32; the values
        are the raw (unnormalised) candidates.
    Raises:
        ValueError: empty sources or mismatched weight shapes.
    """
    v = _stack(sources)
    q = pseudo_query(norm_weight, proj_weight)
    z = rms_norm(v.float(), None, eps) @ q  # [N, *]
    a = torch.softmax(z, dim=0)
    return torch.einsum("n...,n...d->...d", a, v.float()).to(v.dtype)


# --------------------------------------------------------------------- two-phase form
@dataclass
class BlockStats:
    """Online-softmax statistics of S sites over the completed blocks (architecture.md §5 phase 1).

    Attributes:
        m: [S, *] max logit over blocks; s: [S, *] Σ_j exp(z_j − m); u: [S, *, D] Σ_j exp(z_j − m) b_j.
        All fp32.
    """

    m: torch.Tensor
    s: torch.Tensor
    u: torch.Tensor


def block_stats(
    blocks: Sequence[torch.Tensor] | torch.Tensor, queries: torch.Tensor, eps: float = 1e-5
) -> BlockStats:
    """Phase 1: one batched pass of S pseudo-queries over the N completed blocks.

    Args:
        blocks: N tensors [*, D] or stacked [N, *, D]; queries: [S, D] (rows = n ⊙ w per site).
    Returns:
        :class:`BlockStats` with S rows.
    """
    b = _stack(blocks).float()
    z = torch.einsum("n...d,sd->sn...", rms_norm(b, None, eps), queries.float())  # [S, N, *]
    m = z.amax(dim=1)
    e = torch.exp(z - m[:, None])
    return BlockStats(m=m, s=e.sum(dim=1), u=torch.einsum("sn...,n...d->s...d", e, b))


def merge_partial(
    m: torch.Tensor,
    s: torch.Tensor,
    u: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Phase 2 at one site: fold the current partial sum into that site's block statistics.

        m' = max(m, z_p);  h = (e^{m−m'} u + e^{z_p−m'} p) / (e^{m−m'} s + e^{z_p−m'})

    Args:
        m, s: [*]; u: [*, D] (one row of :class:`BlockStats`); partial: [*, D]; query: [D].
    Returns:
        [*, D] in ``partial.dtype``; equals ``depth_mix(blocks ++ [partial])`` up to rounding.
    """
    p = partial.float()
    zp = rms_norm(p, None, eps) @ query.float()
    mm = torch.maximum(m, zp)
    wb = torch.exp(m - mm)
    wp = torch.exp(zp - mm)
    h = (wb[..., None] * u + wp[..., None] * p) / (wb * s + wp)[..., None]
    return h.to(partial.dtype)


# ------------------------------------------------------------------------- schedule
@dataclass
class AttnResState:
    """Per-forward Block AttnRes bookkeeping for one batch of tokens (architecture.md §2).

    Call order for each decoder layer l = 0, 1, …, L−1::

        h = state.attn_input(l, n_attn, w_attn);   a = mixer(input_layernorm(h))
        state.after_mixer(l, a)
        h = state.ffn_input(l, n_ffn, w_ffn);      f = ffn(post_attention_layernorm(h))
        state.after_ffn(l, f)

    then ``y = state.output(n_out, w_out)`` feeds the final norm. ``state.partial`` after
    ``after_ffn`` is what the decoder layer "returns" (the partial block sum).

    ``block_size=None`` is the plain residual stream (Kimi Linear): every input is the stream,
    ``after_*`` add to it, and the weights may be None.

    With ``site_queries`` ([2L+1, D]: row 2l = attention site of layer l, 2l+1 = FFN site, 2L =
    output site) the state runs the two-phase form of §5 instead: when a block opens, one
    batched pass computes the statistics of every site of that block over the completed blocks,
    and each site merges its partial sum by online softmax. The per-call weights are then ignored.

    Attributes:
        blocks: completed block sums, each [*, D] (blocks[0] is the embedding).
        partial: [*, D] running sum of sublayer outputs in the current block.
    Raises:
        ValueError: calls out of order (layer index or site), bad ``block_size``.
    """

    partial: torch.Tensor
    block_size: int | None
    eps: float = 1e-5
    site_queries: torch.Tensor | None = None
    blocks: list[torch.Tensor] = field(default_factory=list)
    _step: int = field(default=0, init=False, repr=False)  # 4·layer + position in the call order
    _stats: BlockStats | None = field(default=None, init=False, repr=False)
    _stat_rows: dict[int, int] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def start(
        cls,
        x0: torch.Tensor,
        block_size: int | None,
        *,
        eps: float = 1e-5,
        site_queries: torch.Tensor | None = None,
    ) -> "AttnResState":
        """State before layer 0: no blocks, partial = the embedding x0 [*, D]."""
        if block_size is not None and (not isinstance(block_size, int) or block_size <= 0):
            raise ValueError(
                f"block_size={block_size!r}: must be a positive integer (decoder layers) or None"
            )
        if site_queries is not None and (site_queries.dim() != 2 or site_queries.shape[0] % 2 != 1):
            raise ValueError(f"site_queries: expected [2L+1, D], got {tuple(site_queries.shape)}")
        return cls(partial=x0, block_size=block_size, eps=eps, site_queries=site_queries)

    # -------------------------------------------------------------------- helpers
    _CALLS = ("attn_input", "after_mixer", "ffn_input", "after_ffn")

    def _advance(self, layer_idx: int, phase: int) -> None:
        if 4 * layer_idx + phase != self._step:
            l, k = divmod(self._step, 4)
            raise ValueError(
                f"layer_idx={layer_idx}: {self._CALLS[phase]} out of order; expected {self._CALLS[k]}({l}, ...)"
            )
        self._step += 1

    def _opens_block(self, layer_idx: int) -> bool:
        return self.block_size is not None and layer_idx % self.block_size == 0

    def _num_layers(self) -> int:
        assert self.site_queries is not None
        return (self.site_queries.shape[0] - 1) // 2

    def _open_two_phase(self, layer_idx: int) -> None:
        """Phase 1 for the block starting at ``layer_idx``: stats of all its sites over ``blocks``."""
        L = self._num_layers()
        end = min(layer_idx + self.block_size, L)
        rows = [2 * l + s for l in range(layer_idx, end) for s in (ATTN, FFN)]
        if end == L:
            rows.append(2 * L)
        self._stat_rows = {r: i for i, r in enumerate(rows)}
        self._stats = block_stats(self.blocks, self.site_queries[rows], self.eps)

    def _mix(self, row: int, partial: torch.Tensor | None, norm_w, proj_w) -> torch.Tensor:
        """Mixture over ``blocks`` (+ ``partial`` if given) at site ``row`` of ``site_queries``."""
        if self.site_queries is None:
            sources = self.blocks if partial is None else self.blocks + [partial]
            return depth_mix(sources, norm_w, proj_w, self.eps)
        if row not in self._stat_rows:
            raise ValueError(
                f"layer_idx={row // 2}: beyond the {self._num_layers()} layers site_queries describe"
            )
        i = self._stat_rows[row]
        st = self._stats
        if partial is None:
            return (st.u[i] / st.s[i][..., None]).to(self.partial.dtype)
        return merge_partial(st.m[i], st.s[i], st.u[i], partial, self.site_queries[row], self.eps)

    # ------------------------------------------------------------------ schedule
    def attn_input(self, layer_idx: int, norm_weight=None, proj_weight=None) -> torch.Tensor:
        """Steps 1–3: the mixer input h [*, D] of layer ``layer_idx``; opens a block if due."""
        self._advance(layer_idx, 0)
        p_in = self.partial
        if self.block_size is None:
            return p_in
        opens = self._opens_block(layer_idx)
        if self.site_queries is None:
            h = (
                depth_mix(self.blocks + [p_in], norm_weight, proj_weight, self.eps)
                if self.blocks
                else p_in
            )
            if opens:
                self.blocks.append(p_in)
            return h
        if opens:
            had_blocks = bool(self.blocks)
            # blocks_old ++ [p_in] == blocks_new: the opening site needs no partial merge.
            self.blocks.append(p_in)
            self._open_two_phase(layer_idx)
            return self._mix(2 * layer_idx, None, None, None) if had_blocks else p_in
        return self._mix(2 * layer_idx, p_in, None, None)

    def after_mixer(self, layer_idx: int, a: torch.Tensor) -> None:
        """Steps 4–5: a new block starts with the mixer output a [*, D]; otherwise it is added."""
        self._advance(layer_idx, 1)
        self.partial = a if self._opens_block(layer_idx) else self.partial + a

    def ffn_input(self, layer_idx: int, norm_weight=None, proj_weight=None) -> torch.Tensor:
        """Step 6: the FFN input h' [*, D] = Mix_ffn(blocks ++ [p])."""
        self._advance(layer_idx, 2)
        if self.block_size is None:
            return self.partial
        return self._mix(2 * layer_idx + 1, self.partial, norm_weight, proj_weight)

    def after_ffn(self, layer_idx: int, f: torch.Tensor) -> None:
        """Step 8: p = p + f [*, D]."""
        self._advance(layer_idx, 3)
        self.partial = self.partial + f

    def output(self, norm_weight=None, proj_weight=None) -> torch.Tensor:
        """After the last layer: y [*, D] = Mix_out(blocks ++ [p]) (input of the final norm)."""
        if self._step % 4:
            raise ValueError(
                f"output: layer {self._step // 4} is unfinished ({self._CALLS[self._step % 4]} is next)"
            )
        if self.block_size is None or not self.blocks:
            return self.partial
        ran = self._step // 4
        if self.site_queries is not None and ran != self._num_layers():
            raise ValueError(
                f"output: site_queries describe {self._num_layers()} layers, ran {ran}"
            )
        return self._mix(2 * ran, self.partial, norm_weight, proj_weight)


# ------------------------------------------------------------------ whole schedule
@dataclass
class SiteWeights:
    """Parameters of one AttnRes site: ``norm_weight`` [D] and ``proj_weight`` [1, D] or [D]."""

    norm_weight: torch.Tensor
    proj_weight: torch.Tensor

    @property
    def query(self) -> torch.Tensor:
        """[D] fp32 pseudo-query n ⊙ w."""
        return pseudo_query(self.norm_weight, self.proj_weight)


def run_attn_res(
    x0: torch.Tensor,
    mixers: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    ffns: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    attn_sites: Sequence[SiteWeights],
    ffn_sites: Sequence[SiteWeights],
    out_site: SiteWeights,
    block_size: int | None,
    *,
    eps: float = 1e-5,
    two_phase: bool = False,
) -> torch.Tensor:
    """The whole Block AttnRes schedule over toy sublayers (reference driver for tests and docs).

    Args:
        x0: [*, D] embedding. mixers, ffns: L callables [*, D] -> [*, D] applied to the mixed
            inputs (any pre-norm is part of the callable). attn_sites, ffn_sites: L
            :class:`SiteWeights`; out_site: the output site.
        block_size: decoder layers per block, or None (plain residual).
        two_phase: use the §5 serving form instead of the direct mixture.
    Returns:
        [*, D] the output-site mixture y (input of the final norm).
    Raises:
        ValueError: list lengths disagree.
    """
    L = len(mixers)
    if not (len(ffns) == len(attn_sites) == len(ffn_sites) == L):
        raise ValueError(
            f"mixers/ffns/attn_sites/ffn_sites: need one per layer, got {L}, {len(ffns)}, "
            f"{len(attn_sites)}, {len(ffn_sites)}"
        )
    queries = None
    if two_phase and block_size is not None:
        rows = [q for l in range(L) for q in (attn_sites[l].query, ffn_sites[l].query)] + [
            out_site.query
        ]
        queries = torch.stack(rows)
    st = AttnResState.start(x0, block_size, eps=eps, site_queries=queries)
    for l in range(L):
        a = mixers[l](st.attn_input(l, attn_sites[l].norm_weight, attn_sites[l].proj_weight))
        st.after_mixer(l, a)
        f = ffns[l](st.ffn_input(l, ffn_sites[l].norm_weight, ffn_sites[l].proj_weight))
        st.after_ffn(l, f)
    return st.output(out_site.norm_weight, out_site.proj_weight)
