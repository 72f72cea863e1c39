"""Column-fact probe: does a checkpoint know the one-digit facts that column arithmetic looks up?

Teacher-forced, fp32, one forward per document: 20 drill documents of 30 fact lines
(:func:`openk3.datasets.column_facts.fact_line`, seed 424242, not a training seed) and 20 documents
of 8 worked problems each (operations drawn by the line count so far, the SFT's operands and ``work()`` lines). A
line counts as right when every result token after its ``" = "`` (up to the first comma) is the
model's argmax given the true text before it. Reported per kind: ``drill_+/-/*`` (drill lines),
``col_+/-/*`` (column lines inside worked problems) and ``so_+/-/*`` (the ``so a op b = v`` line,
which assembles the digits already written: copying, not facts). One JSON line on stdout::

    python scripts/column_facts_probe.py runs/dm/mid/checkpoints/step-0001500 --tokenizer data/tokenizer
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from openk3.datasets.column_facts import fact_line
from openk3.datasets.sft_data import OPS, operands, work
from openk3.pretrained import load_pretrained
from openk3.tokenizer import load_tokenizer

PROBE_SEED = 424242


def _op(line: str) -> str:
    head = line.split(",")[0]
    return "*" if " * " in head else "+" if " + " in head else "-"


def documents(seed: int = PROBE_SEED) -> list[tuple[list[str], list[str | None]]]:
    """``(lines, tags)`` per document; a tag names the kind a line is scored as (None: context)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(20):
        lines = [fact_line(rng) for _ in range(30)]
        docs.append((lines, [f"drill_{_op(x)}" for x in lines]))
    for _ in range(20):
        lines, tags = [], []
        for _ in range(8):
            op = OPS[len(lines) % 3]  # the operation by the line count so far (as first measured)
            a, b = operands(rng, op)
            cols, v = work(a, op, b)
            lines += [f"Problem: {a} {op} {b}", *cols, f"so {a} {op} {b} = {v}"]
            tags += [None] + [f"col_{op}" if " = " in c else None for c in cols] + [f"so_{op}"]
        docs.append((lines, tags))
    return docs


def probe(model, tok, docs) -> dict:
    """Share of right lines per tag, and the counts (``n``)."""
    newline = tok.encode_text("\n")
    hits: dict[str, list[int]] = {}
    for lines, tags in docs:
        ids = [tok.bos_id]
        targets = []
        for line, tag in zip(lines, tags):
            if tag is None or " = " not in line:
                ids += tok.encode_text(line) + newline
                continue
            cut = line.index(" = ") + 2
            result = line[cut:].split(",")[0]
            rest = line[cut + len(result) :]
            ids += tok.encode_text(line[:cut])
            want = tok.encode_text(result)
            targets.append((len(ids), want, tag))
            ids += want + (tok.encode_text(rest) if rest else []) + newline
        with torch.no_grad():
            pred = model(torch.tensor([ids])).logits[0].argmax(-1)
        for pos, want, tag in targets:
            ok = all(int(pred[pos - 1 + j]) == w for j, w in enumerate(want))
            h = hits.setdefault(tag, [0, 0])
            h[0] += ok
            h[1] += 1
    return {k: round(v[0] / v[1], 3) for k, v in sorted(hits.items())} | {
        "n": {k: v[1] for k, v in sorted(hits.items())}
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's)")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = load_pretrained(args.checkpoint)
    model.eval()
    tok = load_tokenizer(args.tokenizer or args.checkpoint)
    print(json.dumps({"checkpoint": args.checkpoint, **probe(model, tok, documents())}))


if __name__ == "__main__":
    main()
