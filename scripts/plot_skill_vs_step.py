"""Skill vs training step, from ``openk3 eval --out`` tables of a run's checkpoints.

    python scripts/plot_skill_vs_step.py OUT.png --run LABEL STEP=EVAL.json STEP=EVAL.json ... \
        [--run LABEL ...]

Each ``--run`` is one training run (a line style); each metric is one colour, its rate (0-100 %)
against the SFT step, with the 95 % Wilson interval as a band. The metrics are the eval table's
targets (``targets`` in the JSON), so the plot reads the same numbers as MODEL_CARD.md's table.
Runs and checkpoints missing a metric simply leave a gap.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (suite, metric, short label): the skills the shipped model is judged on.
METRICS = (
    ("arithmetic", "correct_add", "add"),
    ("arithmetic", "correct_sub", "sub"),
    ("arithmetic", "correct_mul", "mul"),
    ("tools", "name_correct", "tool name"),
    ("tools", "args_correct", "tool args"),
    ("tool_result", "uses_result", "uses result"),
    ("json", "all_fields", "JSON fields"),
    ("recall", "correct", "recall"),
    ("effort", "correct", "effort"),
    ("echo", "correct", "echo"),
    ("out_of_scope", "honest", "out of scope"),
)
STYLES = ("-", "--", ":", "-.")


def _rates(path: Path) -> dict[tuple[str, str], tuple[float, float, float]]:
    """``{(suite, metric): (rate, lo, hi)}`` from one eval table (percent)."""
    table = json.loads(path.read_text())
    out = {}
    for t in table.get("targets", []):
        if "rate" in t:
            lo, hi = t.get("ci95") or (t["rate"], t["rate"])
            out[(t["suite"], t["metric"])] = (100 * t["rate"], 100 * lo, 100 * hi)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--run", nargs="+", action="append", required=True, metavar="LABEL STEP=EVAL.json")
    p.add_argument("--title", default="openk3-tiny: held-out skill vs SFT step (n = 100 per suite)")
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    colours = plt.cm.tab20.colors
    for r, (label, *points) in enumerate(args.run):
        steps, tables = [], []
        for pt in points:
            step, _, path = pt.partition("=")
            if not path:
                raise SystemExit(f"--run {label}: {pt!r} is not STEP=EVAL.json")
            steps.append(int(step))
            tables.append(_rates(Path(path)))
        order = sorted(range(len(steps)), key=steps.__getitem__)
        steps = [steps[i] for i in order]
        tables = [tables[i] for i in order]
        for m, (suite, metric, short) in enumerate(METRICS):
            ys = [t.get((suite, metric)) for t in tables]
            xs = [s for s, y in zip(steps, ys) if y is not None]
            ys = [y for y in ys if y is not None]
            if not ys:
                continue
            c = colours[m % len(colours)]
            ax.plot(xs, [y[0] for y in ys], STYLES[r % len(STYLES)], color=c, marker="o", ms=3,
                    label=f"{short} ({label})" if r else short)
            if r == 0:
                ax.fill_between(xs, [y[1] for y in ys], [y[2] for y in ys], color=c, alpha=0.08)
    ax.set_xlabel("SFT step")
    ax.set_ylabel("held-out rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
