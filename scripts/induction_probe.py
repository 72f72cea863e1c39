"""Induction probe: does a checkpoint copy a span it has just seen?

For each held-out item the model reads ``[BOS] span span`` (``span``: ``L`` token ids drawn
uniformly from the ordinary BPE ids, so nothing but the earlier occurrence predicts it) and the
probe reports the mean next-token NLL (nats) of the span's tokens 2..L in the first copy and in the
second copy (the first token of each copy is unpredictable either way). A model without a copying
circuit scores about the same on both (near ln V); one with it drives the second copy towards 0.
A second probe does the same with text: ``repeat`` documents of :mod:`openk3.datasets.induction`
from a seed no training run uses (pool values, so the tokens are in-distribution).

Usage (one JSON line per checkpoint on stdout; ``--watch`` keeps probing new checkpoints)::

    python scripts/induction_probe.py runs/dm/pretrain/checkpoints/step-0000400 --tokenizer data/tokenizer
    python scripts/induction_probe.py openk3-tiny              # the shipped model with its tokenizer
    python scripts/induction_probe.py --watch runs/dm/pretrain/checkpoints --tokenizer data/tokenizer \\
        --out runs/dm/induction.jsonl

Fixed items (seed 4242, lengths 4-10 and 20), fp32, one thread unless OMP says otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

PROBE_SEED = 4242
TEXT_SEED = 987_654  # not an openk3 training seed (training uses sft_seed + 200 = 201)


def _nll(model, ids: list[int]) -> torch.Tensor:
    """Per-position NLL [T-1] of ``ids`` (position t predicts ids[t+1])."""
    x = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none")


def random_span_probe(model, tok, n: int, lengths: tuple[int, ...]) -> dict:
    """Mean NLL of tokens 2..L of the first and second copy of random-id spans, per length."""
    rng = random.Random(PROBE_SEED)
    ordinary = [i for i in range(256, tok.vocab_size) if i not in tok.special_ids]
    out = {}
    for L in lengths:
        first, second = [], []
        for _ in range(n):
            span = [rng.choice(ordinary) for _ in range(L)]
            nll = _nll(model, [tok.bos_id, *span, *span])
            # ids[1 + j] is span[j] of the first copy; predicted at position j
            first.append(nll[1:L].mean().item())
            second.append(nll[L + 1:2 * L].mean().item())
        out[str(L)] = {"first": sum(first) / n, "second": sum(second) / n}
    return out


def text_repeat_probe(model, tok, n: int) -> dict:
    """Mean NLL of the first and second occurrence of the line of held-out ``repeat`` documents."""
    from openk3.datasets.induction import induction_text

    first, second = [], []
    for i in range(n):
        text = induction_text(TEXT_SEED, i, "repeat")
        line = text.split("\n")[0]
        a = tok.encode_text(line)
        b = tok.encode_text(line + "\n" + line)
        if b[:len(a)] != a:  # the BPE merged across the line break: skip the item
            continue
        nll = _nll(model, [tok.bos_id, *b])
        L = len(a)
        first.append(nll[1:L].mean().item())
        second.append(nll[len(b) - L + 1:len(b)].mean().item())
    k = len(first)
    return {"items": k, "first": sum(first) / k, "second": sum(second) / k}


def probe(path: str, tokenizer: str | None, n: int) -> dict:
    from openk3.pretrained import load_pretrained
    from openk3.shipped import resolve_model_path
    from openk3.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    model = load_pretrained(path, dtype=torch.float32).eval()
    tok = load_tokenizer(tokenizer or resolve_model_path(path))
    row = {"checkpoint": str(path), "vocab": tok.vocab_size, "ln_vocab": math.log(tok.vocab_size),
           "random_spans": random_span_probe(model, tok, n, (4, 7, 10, 20)),
           "text_repeat": text_repeat_probe(model, tok, n)}
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="+", help="checkpoint directories or shipped model names")
    ap.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's own)")
    ap.add_argument("--n", type=int, default=100, help="items per span length (default 100)")
    ap.add_argument("--watch", action="store_true", help="PATHS[0] is a checkpoints folder: probe each new step-*")
    ap.add_argument("--out", help="append the JSON lines here too")
    ap.add_argument("--every", type=int, default=1, help="--watch: only steps that are multiples of this")
    ap.add_argument("--poll", type=float, default=30.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    def emit(row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    if not args.watch:
        for p in args.paths:
            emit(probe(p, args.tokenizer, args.n))
        return 0
    root, seen = Path(args.paths[0]), set()
    while True:  # stopped by the caller (kill PID) or when the run writes DONE beside its checkpoints
        for d in sorted(root.glob("step-*")):
            if d.name in seen or not (d / "config.json").is_file():
                continue
            if int(d.name.split("-")[1]) % args.every:
                seen.add(d.name)
                continue
            time.sleep(5)  # let the writer finish the directory
            try:
                emit({"step": int(d.name.split("-")[1]), **probe(str(d), args.tokenizer, args.n)})
            except (FileNotFoundError, ValueError, OSError) as e:  # pruned while read: skip it
                print(f"skip {d}: {e}", file=sys.stderr)
            seen.add(d.name)
        if (root.parent / "DONE").is_file() and not any(d.name not in seen for d in root.glob("step-*")):
            return 0
        time.sleep(args.poll)


if __name__ == "__main__":
    sys.exit(main())
