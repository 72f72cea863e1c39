"""Quantile Balancing (QB): K3's auxiliary-loss-free update of the router bias.

Shape legend: N tokens (a micro-batch, leading dims flattened), E experts, k experts per token
(``num_experts_per_tok``), B histogram bins.

Source: architecture.md §7 (report §2.3.3, Appendices C-D). Routing picks
``argtop_k(s + b)`` with sigmoid scores s in (0, 1) and bias b (the checkpoint buffer
``block_sparse_moe.gate.e_score_correction_bias`` [E] fp32). QB sets b to the exact coordinate
minimiser of the balanced-assignment dual:

1. Route with top-(k+1) on ``s_i + b``: the first k are the routes taken; the (k+1)-th biased
   score is token i's cutoff ``alpha_i`` (the score an expert must beat to enter the top k).
2. ``b_hat_j`` = the (q+1)-th smallest required bias ``r_ij = alpha_i - s_ij`` over the m
   tokens of the whole step, q = m k / E: with the cutoffs fixed, exactly q tokens then have
   ``s_ij + b_hat_j > alpha_i``.
3. ``b = b_hat - mean(b_hat)`` (a common offset does not change any top-k).
4. The new b is used from the **next** step on, never on the batch it came from.

:func:`qb_exact_bias` is that update on one score matrix (the readable reference);
:class:`QuantileBalancer` is the histogram estimator K3 runs: per step it counts every ``r_ij``
into B uniform bins over ``[b_min - 1, b_max + 1]`` (the range every r lies in, recomputed from
the current bias each step), sums the integer counts over micro-batches and data-parallel
ranks, and reads each expert's quantile with linear interpolation inside the bin.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def topk_with_cutoff(
    scores: torch.Tensor, bias: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-(k+1) routing: the k routes taken and each token's cutoff alpha (QB step 1).

    Args:
        scores: [N, E] router scores (sigmoid, any float dtype; compared in fp32).
        bias: [E] the bias of the current step.
        k: experts per token, ``1 <= k < E``.
    Returns:
        ``(topk_idx [N, k] int64, cutoff [N] fp32)``; ``cutoff`` is the (k+1)-th largest biased
        score of each token.
    Raises:
        ValueError: shapes or k out of range.
    """
    if scores.ndim != 2 or bias.shape != (scores.shape[1],):
        raise ValueError(
            f"scores {tuple(scores.shape)} / bias {tuple(bias.shape)}: expected [N, E] and [E]"
        )
    if not 1 <= k < scores.shape[1]:
        raise ValueError(
            f"k={k}: must be in [1, E-1={scores.shape[1] - 1}] (QB needs a (k+1)-th expert)"
        )
    vals, idx = (scores.float() + bias.float()).topk(k + 1, dim=-1, sorted=True)
    return idx[:, :k], vals[:, k]


def expert_loads(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Tokens routed to each expert by ``argtop_k(scores + bias)``: [E] int64."""
    idx, _ = topk_with_cutoff(scores, bias, k)
    return torch.bincount(idx.reshape(-1), minlength=scores.shape[1])


def qb_exact_bias(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """One exact QB update (steps 1-3 above) from all m tokens of a step.

    q = floor(m k / E) (the target load; it is an integer whenever E divides m k).

    Args:
        scores: [m, E] router scores in (0, 1). bias: [E] bias the step was routed with.
        k: experts per token.
    Returns:
        The next bias [E] fp32, mean-centred.
    Raises:
        ValueError: from :func:`topk_with_cutoff`.
    """
    _, alpha = topk_with_cutoff(scores, bias, k)
    required = alpha[:, None] - scores.float()  # [m, E]
    m, n = required.shape
    q = (m * k) // n
    b_hat = required.kthvalue(q + 1, dim=0).values
    return b_hat - b_hat.mean()


class QuantileBalancer:
    """Histogram estimator of the QB bias for one MoE layer (architecture.md §7, report App. D).

    Use per training step::

        for micro_batch in step:                        # forward passes, bias fixed
            balancer.observe(scores, bias)              # or pass cutoff/topk_idx from the router
        all_reduce_balancers_(balancers)                # integer SUM over data-parallel ranks
        new_bias = balancer.step(bias)                  # after the step's last forward
        bias.copy_(new_bias)                            # so it routes the NEXT step only

    ``alpha_i`` is the (k+1)-th largest biased score ``s_i + b`` of token i under the step's
    bias (top-(k+1) routing, :func:`topk_with_cutoff`). Counts are exact integers, so the
    estimate does not depend on how the step's tokens were split over micro-batches or ranks.

    Args:
        num_experts: E. top_k: k (``1 <= k < E``).
        num_bins: B (report: 1000); the estimate is within one bin width
            ``(b_max - b_min + 2) / B`` of the exact quantile.
        ema: None, or a decay in [0, 1): the returned bias is an exponential moving average of
            the centred per-step estimates (the report's optional noise reduction).
        interpolate: False snaps the estimate to the lower edge of the quantile's bin (the
            variant the report warns stalls before balance; kept for comparison).
        device: where the counts live until the first :meth:`observe` moves them.
    Attributes:
        counts: [E, B] int32 histogram of the current step. loads: [E] int64 tokens routed.
        last_stats: dict of the last :meth:`step` (see there).
    Raises:
        ValueError: bad arguments, naming them.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        num_bins: int = 1000,
        *,
        ema: float | None = None,
        interpolate: bool = True,
        device: torch.device | str = "cpu",
    ) -> None:
        if not isinstance(num_experts, int) or num_experts < 2:
            raise ValueError(f"num_experts={num_experts!r}: must be an integer >= 2")
        if not isinstance(top_k, int) or not 1 <= top_k < num_experts:
            raise ValueError(f"top_k={top_k!r}: must be in [1, num_experts-1={num_experts - 1}]")
        if not isinstance(num_bins, int) or num_bins < 1:
            raise ValueError(f"num_bins={num_bins!r}: must be a positive integer")
        if ema is not None and not 0.0 <= ema < 1.0:
            raise ValueError(f"ema={ema!r}: must be None or in [0, 1)")
        self.num_experts = num_experts
        self.top_k = top_k
        self.num_bins = num_bins
        self.ema = ema
        self.interpolate = interpolate
        self.counts = torch.zeros(num_experts, num_bins, dtype=torch.int32, device=device)
        self.loads = torch.zeros(num_experts, dtype=torch.int64, device=device)
        self._bias: torch.Tensor | None = None  # the step's bias, fixed at its first observe
        self._ema_bias: torch.Tensor | None = None
        self.last_stats: dict = {}

    def _range(self, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Lower edge ``b_min - 1`` and bin width ``(b_max - b_min + 2) / B`` (0-dim, bias dtype)."""
        return bias.min() - 1.0, (bias.max() - bias.min() + 2.0) / self.num_bins

    @torch.no_grad()
    def observe(
        self,
        scores: torch.Tensor,
        bias: torch.Tensor,
        *,
        cutoff: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
    ) -> None:
        """Add one micro-batch's required biases ``r = alpha - s`` to the step's histogram.

        Args:
            scores: [..., E] sigmoid router scores of the micro-batch.
            bias: [E] the bias it was routed with; must be the same for every micro-batch of a
                step (checked in :meth:`step`).
            cutoff: [...] alpha per token if the router already ran top-(k+1); computed here
                otherwise. topk_idx: [..., k] the routes taken (for the load statistics).
        Raises:
            ValueError: shapes that do not match E / k.
        """
        E = self.num_experts
        s = scores.detach().reshape(-1, scores.shape[-1]).float()
        if s.shape[1] != E or bias.shape != (E,):
            raise ValueError(
                f"scores {tuple(scores.shape)} / bias {tuple(bias.shape)}: expected [..., {E}] and [{E}]"
            )
        if self.counts.device != s.device:
            self.counts, self.loads = self.counts.to(s.device), self.loads.to(s.device)
        b = bias.detach().float().to(s.device)
        if self._bias is None:
            self._bias = b.clone()
        if cutoff is None:
            topk_idx, alpha = topk_with_cutoff(s, b, self.top_k)
        else:
            alpha = cutoff.detach().reshape(-1).float()
            if alpha.shape[0] != s.shape[0]:
                raise ValueError(f"cutoff: {alpha.shape[0]} tokens, scores have {s.shape[0]}")
        required = alpha[:, None] - s  # [N, E]
        lo, width = self._range(self._bias)
        bins = ((required - lo) / width).floor_().clamp_(0, self.num_bins - 1).long()
        self.counts.scatter_add_(1, bins.T, torch.ones_like(bins.T, dtype=self.counts.dtype))
        if topk_idx is not None:
            self.loads += torch.bincount(topk_idx.reshape(-1), minlength=E)
        else:
            # Without ties, expert j is in token i's top k exactly when s_ij + b_j > alpha_i.
            self.loads += (required < b).sum(0)

    def all_reduce_(self, group=None) -> None:
        """Integer SUM of counts and loads over ``group`` (no-op without torch.distributed)."""
        all_reduce_balancers_([self], group)

    @torch.no_grad()
    def quantiles(self) -> torch.Tensor:
        """The uncentred estimate b_hat [E] fp64 from the counts so far (report App. D).

        ``b_hat_j = b_min - 1 + (beta_j + clip((q - c_j) / h_j, 0, 1)) * w``: beta_j is the first
        bin whose cumulative count reaches ceil(q), c_j the count below it, h_j the count in it,
        q = m k / E with m the tokens counted (each expert's histogram counts every token once).
        The q-th smallest required bias lies in bin beta_j, so the error is at most w.

        Raises:
            ValueError: no token has been counted this step.
        """
        counts = self.counts.long()
        m = counts[0].sum()
        if self._bias is None or int(m) == 0:
            raise ValueError("QuantileBalancer.quantiles: no tokens observed this step")
        q = m.double() * self.top_k / self.num_experts
        cum = counts.cumsum(1)
        target_bin = (cum < q.ceil()).sum(1).clamp_(max=self.num_bins - 1)  # [E]
        in_bin = counts.gather(1, target_bin[:, None])[:, 0]
        below = cum.gather(1, target_bin[:, None])[:, 0] - in_bin
        frac = (
            ((q - below) / in_bin.clamp(min=1)).clamp(0.0, 1.0)
            if self.interpolate
            else torch.zeros_like(q)
        )
        lo, width = self._range(self._bias.double())
        return lo + (target_bin.double() + frac) * width

    @torch.no_grad()
    def step(self, bias: torch.Tensor) -> torch.Tensor:
        """End of step: the next bias (mean-centred :meth:`quantiles`, EMA'd if enabled), then
        reset for the next step. Call after the step's last forward (and the all-reduce).

        Args:
            bias: [E] the bias the step was routed with.
        Returns:
            The next bias [E] fp32 on ``bias``'s device; ``bias`` itself (as fp32) if no token
            was counted this step (on any rank, after the all-reduce).
        Sets ``last_stats``: ``loads`` [E] int64 (this step, pooled), ``tokens`` m, ``target``
            q, ``max_over_mean``, ``min_over_mean``, ``bin_width``.
        Raises:
            ValueError: ``bias`` differs from the bias of the step's first :meth:`observe`.
        """
        b = bias.detach().float().to(self.counts.device)
        if self._bias is None:
            # A rank that routed no tokens still holds the pooled counts after the all-reduce;
            # the bias is the same on every rank, so it fixes the same bins.
            self._bias = b.clone()
        elif not torch.equal(b, self._bias):
            raise ValueError(
                "bias: changed during the step; QB needs one fixed bias per step "
                "(apply the new bias only after step())"
            )
        m = int(self.counts[0].sum())
        if m == 0:
            self.last_stats = {}
            self._bias = None
            return bias.detach().float().clone()
        b_hat = self.quantiles()
        new = b_hat - b_hat.mean()
        if self.ema is not None:
            self._ema_bias = (
                new
                if self._ema_bias is None
                else self.ema * self._ema_bias.to(new) + (1 - self.ema) * new
            )
            new = self._ema_bias
        loads = self.loads.clone()
        mean_load = loads.double().mean().clamp(min=1e-12)
        self.last_stats = {
            "loads": loads,
            "tokens": m,
            "target": m * self.top_k / self.num_experts,
            "max_over_mean": float(loads.max() / mean_load),
            "min_over_mean": float(loads.min() / mean_load),
            "bin_width": float(self._range(self._bias.double())[1]),
        }
        self.counts.zero_()
        self.loads.zero_()
        self._bias = None
        return new.float().to(bias.device)

    def state_dict(self) -> dict:
        """What a checkpoint taken between steps needs: the settings and the EMA state."""
        return {
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_bins": self.num_bins,
            "ema": self.ema,
            "interpolate": self.interpolate,
            "ema_bias": self._ema_bias,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ValueError: the saved settings differ from this balancer's (naming the field).
        """
        for key in ("num_experts", "top_k", "num_bins", "ema", "interpolate"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"state_dict[{key!r}]={state.get(key)!r} != {getattr(self, key)!r}"
                )
        ema_bias = state.get("ema_bias")
        self._ema_bias = None if ema_bias is None else ema_bias.clone()


def all_reduce_balancers_(balancers: Sequence[QuantileBalancer], group=None) -> None:
    """One integer SUM all-reduce of every balancer's counts (and one of the loads) over
    ``group``, in place; a no-op when torch.distributed is not initialised.

    Every rank must call it with the same balancers in the same order (even ranks that saw no
    tokens), since their buffers are concatenated into one message.
    """
    if not balancers or not (dist.is_available() and dist.is_initialized()):
        return
    counts = torch.cat([b.counts.reshape(-1) for b in balancers])
    loads = torch.cat([b.loads for b in balancers])
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(loads, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for i, b in enumerate(balancers):
        b.counts.copy_(counts[offset : offset + b.counts.numel()].view_as(b.counts))
        b.loads.copy_(loads[i * b.num_experts : (i + 1) * b.num_experts])
        offset += b.counts.numel()


__all__ = [
    "topk_with_cutoff",
    "expert_loads",
    "qb_exact_bias",
    "QuantileBalancer",
    "all_reduce_balancers_",
]
