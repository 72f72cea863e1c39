"""Sampling parameters and the batched sampler: constraint masks, temperature, min-p, top-k, top-p,
seeded per-request draws, top-n logprobs.

Shape legend: N rows sampled this step (one per request), V vocabulary size (model ``vocab_size``),
W packed mask words (ceil(V' / 32)).

Order of operations per row (as vLLM's sampler): constraint mask -> greedy argmax when
``temperature == 0`` -> logits / temperature -> min-p -> top-k -> top-p -> one draw from the row's
own ``torch.Generator``. Logprobs are reported from the **raw** model distribution (log_softmax of the
logits before masks, temperature and truncation), as the OpenAI API reports them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """Per-request decoding settings (engine contract: :meth:`openk3.engine.engine.Engine.add_request`).

    Attributes:
        max_tokens: most tokens to generate (the engine also caps it by ``max_model_len``).
        temperature: 0.0 = greedy argmax; otherwise logits are divided by it.
        top_p: nucleus mass in (0, 1]; 1.0 = off.
        top_k: keep the k most likely tokens; 0 = off.
        min_p: in [0, 1]; drop tokens whose probability (after the temperature) is below
            ``min_p`` times the most likely token's (vLLM's / SGLang's ``min_p``); 0.0 = off.
        seed: seeds this request's own generator (reproducible whatever else is batched).
        stop_token_ids: finish with ``"stop"`` when sampled; the token is counted in
            ``completion_tokens`` but not returned in ``new_token_ids``.
        stop: stop strings, matched on the engine's ``detokenize`` of the generated ids; the token
            that completes the match is returned (the server trims the text at the match).
        logprobs: also report the top-n logprobs of every returned token (0 = only the sampled one).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises ValueError naming the first bad field and its value."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}: must be an integer >= 1")
        if (
            not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature={self.temperature!r}: must be a finite number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: must lie in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: must be an integer >= 0 (0 = off)")
        if (
            isinstance(self.min_p, bool)
            or not isinstance(self.min_p, (int, float))
            or not 0 <= self.min_p <= 1
        ):
            raise ValueError(f"min_p={self.min_p!r}: must be a number in [0, 1] (0 = off)")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r}: must be an integer or None")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs={self.logprobs!r}: must be an integer >= 0 or None")
        if vocab_size is not None and self.logprobs is not None and self.logprobs > vocab_size:
            raise ValueError(f"logprobs={self.logprobs}: more than the vocabulary ({vocab_size})")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise ValueError(f"stop_token_ids: {t!r} is not a token id in [0, {vocab_size})")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: {s!r} is not a non-empty string")

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0`` (argmax, no generator needed)."""
        return self.temperature == 0


@dataclass
class TokenLogprob:
    """Logprob of one returned token under the raw model distribution, plus the top-n alternatives
    ``[(token_id, logprob), ...]`` in descending order (empty when ``logprobs == 0``)."""

    token_id: int
    logprob: float
    top: list = field(default_factory=list)


# ----------------------------------------------------------------------------- masks
def constraint_mask(
    allowed: torch.Tensor, vocab_size: int, device: torch.device | None = None
) -> torch.Tensor:
    """Normalise a constraint's ``allowed_tokens()`` to a bool mask [V].

    Args:
        allowed: bool [V'] (True = allowed), or a packed integer bitmask [W] in which bit j of word
            w allows token 32·w + j (llguidance's layout). V' may differ from the model's V (the
            tokenizer's vocabulary is often smaller): missing ids are disallowed, extra ids ignored.
        vocab_size: V.
    Returns:
        bool [V] on ``device``.
    Raises:
        ValueError: not 1-D, or not bool / integer.
    """
    if allowed.dim() != 1:
        raise ValueError(f"allowed_tokens(): expected a 1-D mask, got shape {tuple(allowed.shape)}")
    if allowed.dtype != torch.bool:
        if allowed.dtype.is_floating_point or allowed.dtype.is_complex:
            raise ValueError(
                f"allowed_tokens(): expected bool [V] or a packed integer bitmask, got {allowed.dtype}"
            )
        words = allowed.to(torch.int64) & 0xFFFFFFFF
        bits = (words[:, None] >> torch.arange(32, device=words.device)) & 1
        allowed = bits.reshape(-1).bool()
    allowed = allowed.to(device) if device is not None else allowed
    n = allowed.shape[0]
    if n >= vocab_size:
        return allowed[:vocab_size]
    return torch.cat([allowed, allowed.new_zeros(vocab_size - n)])


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set logits of tokens less likely than ``min_p`` times their row's most likely token to -inf.

    Args:
        logits: [N, V] fp32 (already divided by the temperature).
        min_p: [N] fp32 in [0, 1], 0 = off. Token i of a row survives iff
            ``softmax(logits)[i] >= min_p * max(softmax(logits))`` (so the most likely token, and
            any tie with it, always survives).
    Returns:
        [N, V] new tensor.
    Source: vLLM's ``min_p`` sampling parameter (its ``MinPLogitsProcessor``), same definition.
    """
    probs = torch.softmax(logits, dim=-1)
    p = min_p.to(device=logits.device, dtype=torch.float32)
    threshold = probs.amax(dim=-1, keepdim=True) * p[:, None]  # [N, 1]; 0 keeps every token
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf (batched, per-row settings).

    Args:
        logits: [N, V] fp32 (already divided by the temperature).
        top_k: [N] int64, 0 = off. Ties with the k-th value are kept.
        top_p: [N] fp32 in (0, 1], 1 = off. Keeps the smallest prefix of the descending order whose
            mass reaches top_p: token i is kept iff the mass strictly before it is < top_p (so the
            most likely token always survives). Mass is measured after top-k.
    Returns:
        [N, V] new tensor.
    """
    N, V = logits.shape
    out = logits.clone()
    k = top_k.to(device=logits.device, dtype=torch.long)
    k = torch.where((k <= 0) | (k > V), torch.full_like(k, V), k)
    if bool((k < V).any()):
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])  # [N, 1]
        out = out.masked_fill(out < kth, float("-inf"))
    p = top_p.to(device=logits.device, dtype=torch.float32)
    if bool((p < 1).any()):
        sorted_logits, order = out.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs
        drop_sorted = (before >= p[:, None]) & (p[:, None] < 1)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def top_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, n: list[int | None]
) -> list[TokenLogprob | None]:
    """Raw-distribution logprobs of ``tokens`` [N] under ``logits`` [N, V] with each row's top-n
    (None where the row asked for none)."""
    out: list[TokenLogprob | None] = [None] * len(n)
    rows = [i for i, k in enumerate(n) if k is not None]
    if not rows:
        return out
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    kmax = max(n[i] for i in rows)
    vals, ids = lp.topk(kmax, dim=-1) if kmax > 0 else (None, None)
    chosen = lp.gather(1, tokens[rows].to(lp.device)[:, None])[:, 0].tolist()
    for j, i in enumerate(rows):
        top = list(zip(ids[j, : n[i]].tolist(), vals[j, : n[i]].tolist())) if n[i] else []
        out[i] = TokenLogprob(int(tokens[i]), chosen[j], top)
    return out


# ----------------------------------------------------------------------------- sampler
def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A request's generator: seeded by ``seed``, or by a draw from the global torch RNG (so that
    ``torch.manual_seed`` makes unseeded runs reproducible too)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    return torch.Generator(device=device).manual_seed(seed)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    masks: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Choose one token per row.

    Args:
        logits: [N, V] fp32 raw logits.
        params: N sampling settings. generators: N generators (None allowed for greedy rows).
        masks: N bool [V] allowed-token masks or None (unconstrained rows are untouched).
    Returns:
        [N] int64 token ids on ``logits.device``.
    Raises:
        ValueError: a row whose mask allows nothing (the caller should finish it first).
    """
    N, V = logits.shape
    x = logits.float()
    if masks is not None and any(m is not None for m in masks):
        rows = [i for i, m in enumerate(masks) if m is not None]
        allow = torch.stack([masks[i] for i in rows]).to(x.device)
        if bool((~allow.any(-1)).any()):
            raise ValueError("masks: a constraint allows no token")
        x = x.clone()
        x[rows] = x[rows].masked_fill(~allow, float("-inf"))
    tokens = x.argmax(dim=-1)
    rand = [i for i, p in enumerate(params) if not p.greedy]
    if rand:
        sub = (
            x[rand] / torch.tensor([params[i].temperature for i in rand], device=x.device)[:, None]
        )
        min_p = [float(params[i].min_p) for i in rand]
        if any(min_p):  # a Python test: no softmax, no device work for rows that leave it off
            sub = apply_min_p(sub, torch.tensor(min_p, device=x.device))
        sub = apply_top_k_top_p(
            sub,
            torch.tensor([params[i].top_k for i in rand], device=x.device),
            torch.tensor([float(params[i].top_p) for i in rand], device=x.device),
        )
        probs = torch.softmax(sub, dim=-1)
        for j, i in enumerate(rand):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return tokens
