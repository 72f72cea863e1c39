"""Shared helpers of the engine tests: independent full-forward references and engine drivers."""

from __future__ import annotations

import torch

from openk3.engine import Engine, SamplingParams



def prompts_of(lengths, seed: int = 5, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


_REF: dict = {}


@torch.no_grad()
def full_forward_greedy(model, prompt: list[int], n: int, allowed: torch.Tensor | None = None) -> list[int]:
    """Argmax decoding by re-running the whole sequence without any cache (the independent
    reference); ``allowed`` [V] bool restricts the argmax (constraint reference)."""
    key = (id(model), tuple(prompt), n, None if allowed is None else tuple(allowed.nonzero().flatten().tolist()))
    if key not in _REF:
        seq, out = list(prompt), []
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1]
            if allowed is not None:
                logits = logits.masked_fill(~allowed, float("-inf"))
            tok = int(logits.argmax())
            out.append(tok)
            seq.append(tok)
        _REF[key] = out
    return list(_REF[key])


@torch.no_grad()
def full_forward_logits(model, tokens: list[int]) -> torch.Tensor:
    """[V] fp32 logits after ``tokens`` from one uncached forward."""
    return model(torch.tensor([tokens])).logits[0, -1].float()


def run(engine: Engine, requests=(), *, max_steps: int = 10_000, on_step=None) -> dict:
    """Queue ``requests`` ((prompt, SamplingParams) pairs) and step until idle.

    Returns {request_id: {"tokens": [...], "outputs": [RequestOutput...]}}; ``on_step(i, engine)``
    runs before step i (to add or abort requests mid-run).
    """
    res: dict = {}
    for prompt, params in requests:
        rid = engine.add_request(prompt, params)
        res[rid] = {"tokens": [], "outputs": []}
    i = 0
    while engine.has_unfinished() or (on_step is not None and i == 0):
        if on_step is not None:
            for rid in on_step(i, engine) or ():
                res.setdefault(rid, {"tokens": [], "outputs": []})
        for out in engine.step():
            r = res.setdefault(out.request_id, {"tokens": [], "outputs": []})
            r["tokens"] += out.new_token_ids
            r["outputs"].append(out)
        i += 1
        assert i < max_steps, "engine did not finish"
    return res


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def assert_idle(engine: Engine) -> None:
    """Every block, reservation and slot is back (cached prefix blocks may stay, unreferenced)."""
    s = engine.stats()
    assert s["running"] == 0 and s["waiting"] == 0, s
    assert s["mla_blocks"]["used"] == 0 and s["mla_blocks"]["reserved"] == 0, s["mla_blocks"]
    assert s["mla_blocks"]["free"] + s["mla_blocks"]["cached"] == s["mla_blocks"]["total"], s["mla_blocks"]
    assert s["kda_slots"]["used"] == 0 and s["kda_slots"]["free"] == s["kda_slots"]["total"], s["kda_slots"]
