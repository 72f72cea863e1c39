"""Block AttnRes for the compiled decode step: each site's depth mixture as one broadcast softmax.

Shape legend: ``*`` leading token dims (a decode step: [Bp, 1]), D hidden size, N candidate
sources of a site (the completed blocks, plus the partial block sum where the site takes it),
L decoder layers.

:class:`DirectAttnRes` runs the schedule of :class:`openk3.layers.attn_res.AttnResState`
(architecture.md §2: blocks, partial sum, a mixture before every mixer and FFN and at the output)
with the same call order, but computes every site's mixture directly from its N sources and the
cached pseudo-queries:

    z_j = (v_j · q) / sqrt(mean(v_j²) + eps)      a = softmax_j(z)      out = Σ_j a_j v_j   (fp32)

instead of the reference's two-phase form (§5: one batched pass of block statistics when a block
opens, then an online-softmax merge of the partial sum at each site). Both give the direct
softmax up to rounding. The two-phase form saves arithmetic over many sites and long token
ranges; in a decode step (one token per row, N <= 1 + L / block size) the arithmetic is tiny and
what costs is the number of graph ops and buffers: under ``torch.compile`` each direct mixture is
a few reductions over D that Inductor fuses with its neighbours, where the block statistics were
extern batched products and [S, *, D] buffers every time a block opened. Scoring with
``(v · q) * rsqrt(...)`` instead of ``RMSNorm(v) · q`` folds the normalisation into the [*]
logits rather than scaling every [*, D] source.

Eager on CPU in float32 (a prefill forward; not under ``torch.compile``), each mixture is one call
of the native kernel :func:`openk3.ops.attn_res_cpu.mix` instead (same function, one pass per
token over its sources).

This module imports nothing from the reference; tests compare it with
:func:`openk3.layers.attn_res.depth_mix` and with the reference forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from openk3.ops import attn_res_cpu


def inv_rms(v: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(v²) + eps) over the last dim: [*, D] -> [*] fp32 (the key norm's scale)."""
    return torch.rsqrt(v.float().square().mean(-1) + eps)


def direct_mix(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    eps: float,
    scales: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Softmax mixture over depth candidates at one site, from its pseudo-query.

    Written per source, without stacking them: Inductor's CPU backend lowers a stack to a copy
    into a new [N, *, D] buffer, one per site, where these per-source reductions over D and the
    weighted sum fuse with their neighbours and read each block where it already is.

    Args:
        sources: N >= 1 tensors [*, D] of one dtype; query: [D] fp32 pseudo-query (norm weight ×
            projection); eps: RMSNorm eps of the keys; scales: optional per-source [*] fp32
            :func:`inv_rms` already computed (None entries are computed here): a completed block's
            scale does not depend on the site, so callers compute it once per block.
    Returns:
        [*, D] in the sources' dtype (scores, softmax and the weighted sum in fp32).
    """
    vs = [s.float() for s in sources]
    if scales is None:
        scales = [None] * len(vs)
    z = [
        (v * query).sum(-1) * (inv_rms(v, eps) if r is None else r) for v, r in zip(vs, scales)
    ]  # N x [*]
    m = z[0]
    for zj in z[1:]:
        m = torch.maximum(m, zj)
    num, den = 0.0, 0.0
    for v, zj in zip(vs, z):
        e = torch.exp(zj - m)  # [*], the max source's is 1
        num = num + e.unsqueeze(-1) * v
        den = den + e
    return (num / den.unsqueeze(-1)).to(sources[0].dtype)


@dataclass
class DirectAttnRes:
    """Per-forward Block AttnRes state with direct per-site mixtures (see the module docstring).

    Same interface and call order as :class:`openk3.layers.attn_res.AttnResState` (``start``,
    then per layer ``attn_input``, ``after_mixer``, ``ffn_input``, ``after_ffn``; then
    ``output``; ``partial`` is the running block sum), for callers that have checked the order
    and shapes once: it runs no order or shape checks (they are host-side work on every step),
    and the per-call norm/projection weights are ignored (the queries come from ``site_queries``).

    Attributes:
        partial: [*, D] running sum of the current block's sublayer outputs.
        block_size: decoder layers per block, or None (plain residual stream).
        site_queries: [2L+1, D] fp32 (row 2l: layer l's mixer site, 2l+1 its FFN site, 2L the
            output site); may be None only with ``block_size=None``.
        blocks: completed block sums [*, D] (blocks[0] is the embedding).
        block_scales: their :func:`inv_rms` [*] fp32, computed once when each block closes (a
            block's key norm does not depend on the site; up to L later sites reuse it); None
            where the native mixture will run (it computes the norms in its own pass).
    Raises:
        ValueError: (``start``) AttnRes without ``site_queries``.
    """

    partial: torch.Tensor
    block_size: int | None
    eps: float = 1e-5
    site_queries: torch.Tensor | None = None
    blocks: list[torch.Tensor] = field(default_factory=list)
    block_scales: list[torch.Tensor | None] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        x0: torch.Tensor,
        block_size: int | None,
        *,
        eps: float = 1e-5,
        site_queries: torch.Tensor | None = None,
    ) -> "DirectAttnRes":
        """State before layer 0: no blocks, partial = the embedding x0 [*, D]."""
        if block_size is not None and site_queries is None:
            raise ValueError(
                f"site_queries: needed with block_size={block_size} (the direct form has no "
                "per-call weights)"
            )
        return cls(partial=x0, block_size=block_size, eps=eps, site_queries=site_queries)

    def _mix(self, row: int, partial: torch.Tensor | None) -> torch.Tensor:
        """Mixture at site ``row`` over the completed blocks (cached scales) and ``partial``."""
        sources, scales = list(self.blocks), list(self.block_scales)
        if partial is not None:
            sources.append(partial)
            scales.append(None)
        query = self.site_queries[row]
        if attn_res_cpu.applies(sources, query):  # eager CPU fp32: one native pass per site
            return attn_res_cpu.mix(sources, query, self.eps)
        return direct_mix(sources, query, self.eps, scales)

    def attn_input(self, layer_idx: int, norm_weight=None, proj_weight=None) -> torch.Tensor:
        """The mixer input h [*, D] of layer ``layer_idx``; snapshots the partial sum as a new
        block when one opens (then blocks already end with it: no separate partial)."""
        p = self.partial
        if self.block_size is None:
            return p
        if layer_idx % self.block_size == 0:
            had_blocks = bool(self.blocks)
            self.blocks.append(p)
            # the native mixture computes the norms itself (None: direct_mix computes it too)
            native = attn_res_cpu.applies([p], self.site_queries[0])
            self.block_scales.append(None if native else inv_rms(p, self.eps))
            return self._mix(2 * layer_idx, None) if had_blocks else p
        return self._mix(2 * layer_idx, p)

    def after_mixer(self, layer_idx: int, a: torch.Tensor) -> None:
        """A new block starts with the mixer output a [*, D]; otherwise a is added."""
        opens = self.block_size is not None and layer_idx % self.block_size == 0
        self.partial = a if opens else self.partial + a

    def ffn_input(self, layer_idx: int, norm_weight=None, proj_weight=None) -> torch.Tensor:
        """The FFN input h' [*, D] = Mix_ffn(blocks ++ [partial])."""
        if self.block_size is None:
            return self.partial
        return self._mix(2 * layer_idx + 1, self.partial)

    def after_ffn(self, layer_idx: int, f: torch.Tensor) -> None:
        """partial = partial + f [*, D]."""
        self.partial = self.partial + f

    def output(self, norm_weight=None, proj_weight=None) -> torch.Tensor:
        """y [*, D] = Mix_out(blocks ++ [partial]) (last row of ``site_queries``), the input of
        the final norm."""
        if self.block_size is None or not self.blocks:
            return self.partial
        return self._mix(-1, self.partial)
