"""Training telemetry: JSONL metrics, a progress bar with loss / tokens/s / ETA, and a PNG plot.

* :class:`MetricsLog`: one JSON object per line (``kind`` "train" / "eval" / "error", ``step`` =
  completed steps). On resume the file is cut back to the checkpoint's step first, so the file
  always describes one consistent run (the records of steps that a crash lost are replaced).
* :class:`Progress`: tqdm when it is installed and enabled (its ETA is the remaining steps at the
  recent rate), otherwise a plain line every few seconds.
* :func:`plot_metrics`: matplotlib (Agg backend, no display) figure with the train/eval loss and
  the Quantile Balancing max/mean expert load per step.

Dependencies: tqdm (progress bar) and matplotlib (plot) are optional at import time; without them
the bar falls back to plain lines and :func:`plot_metrics` raises ``ImportError``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping


def _clean(x):
    """JSON-safe values: NaN/inf become strings, tensors/tuples become lists, int keys strings."""
    if isinstance(x, float):
        return x if math.isfinite(x) else repr(x)
    if isinstance(x, Mapping):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "tolist"):
        return _clean(x.tolist())
    return x


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All records of a metrics JSONL file (a torn last line, from a crash, is skipped)."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


class MetricsLog:
    """Append-only JSONL metrics file.

    Args:
        path: the file (parent directory must exist).
        truncate_after: keep only records with ``step <= truncate_after`` from an existing file
            (0 = start a new file); used when resuming from the checkpoint of that step.
    """

    def __init__(self, path: str | os.PathLike, truncate_after: int = 0) -> None:
        self.path = os.fspath(path)
        kept = (
            [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= truncate_after]
            if truncate_after
            else []
        )
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, record: Mapping) -> None:
        """Append one record and flush (a crash loses at most the line being written)."""
        self._f.write(json.dumps(_clean(dict(record))) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    """Progress bar over training steps with loss, tokens/s and ETA.

    Args:
        total: the step the run ends at. initial: the step it starts from (resume).
        enabled: False prints nothing.
        stream: where to write (stderr).
        min_interval: seconds between plain-text lines when tqdm is unavailable.
    """

    def __init__(
        self,
        total: int,
        initial: int = 0,
        enabled: bool = True,
        stream=None,
        min_interval: float = 5.0,
    ) -> None:
        self.total = total
        self.initial = initial
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.min_interval = min_interval
        self._t0 = time.perf_counter()
        self._last_print = 0.0
        self._bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self._bar = tqdm(
                    total=total, initial=initial, file=self.stream, unit="step", dynamic_ncols=True
                )
            except ImportError:
                self._bar = None

    def update(self, step: int, metrics: Mapping) -> None:
        """Advance to ``step`` (completed steps) and show the step's loss and throughput."""
        if not self.enabled:
            return
        tps = metrics.get("tokens_per_s", 0.0)
        qb = metrics.get("qb_max_over_mean")
        if self._bar is not None:
            post = {"loss": f"{metrics['loss']:.4f}", "tok/s": f"{tps:,.0f}"}
            if qb is not None:
                post["load"] = f"{qb:.2f}"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        now = time.perf_counter()
        if now - self._last_print < self.min_interval and step != self.total:
            return
        self._last_print = now
        done = step - self.initial
        rate = done / max(now - self._t0, 1e-9)
        eta = (self.total - step) / rate if rate > 0 else math.inf
        print(
            f"step {step}/{self.total} loss {metrics['loss']:.4f} {tps:,.0f} tok/s ETA {_fmt_eta(eta)}",
            file=self.stream,
            flush=True,
        )

    def note(self, text: str) -> None:
        """A message that does not break the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _pooled_worst(train: list[dict], window: int) -> list[tuple[int, float]]:
    """(step, worst layer's max/mean of the expert loads summed over the last ``window`` steps).
    One step's loads carry the sampling noise of few tokens per expert; pooling shows the
    balance the bias actually achieves."""
    out = []
    for i in range(window - 1, len(train)):
        recs = train[i - window + 1 : i + 1]
        if not all(r.get("expert_loads") for r in recs):
            continue
        worst = 0.0
        for layer in recs[-1]["expert_loads"]:
            sums = [sum(col) for col in zip(*(r["expert_loads"].get(layer, []) for r in recs))]
            mean = sum(sums) / max(len(sums), 1)
            if mean > 0:
                worst = max(worst, max(sums) / mean)
        out.append((train[i]["step"], worst))
    return out


def plot_metrics(
    jsonl_path: str | os.PathLike, png_path: str | os.PathLike, window: int = 20
) -> str:
    """Plot loss (train, and eval when present) and expert load (QB max/mean, per MoE layer, the
    worst layer, and the worst layer with loads pooled over ``window`` steps) against step into
    a PNG; returns ``png_path``.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: the file holds no training record.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(jsonl_path)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [
        r
        for r in records
        if r.get("kind") == "eval" and isinstance(r.get("eval_loss"), (int, float))
    ]
    if not train:
        raise ValueError(f"{os.fspath(jsonl_path)}: no training records to plot")
    fig, (ax_loss, ax_load) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="train loss")
    if evals:
        ax_loss.plot(
            [r["step"] for r in evals],
            [r["eval_loss"] for r in evals],
            "o-",
            ms=3,
            label="eval loss",
        )
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    layers = sorted({k for r in train for k in (r.get("qb_layer_max_over_mean") or {})}, key=int)
    for k in layers:
        pts = [
            (r["step"], r["qb_layer_max_over_mean"][k])
            for r in train
            if k in (r.get("qb_layer_max_over_mean") or {})
        ]
        ax_load.plot(*zip(*pts), lw=0.8, alpha=0.6, label=f"layer {k}")
    worst = [
        (r["step"], r["qb_max_over_mean"])
        for r in train
        if isinstance(r.get("qb_max_over_mean"), (int, float))
    ]
    if worst:
        ax_load.plot(*zip(*worst), color="k", lw=1.2, label="worst layer")
        pooled = _pooled_worst(train, window)
        if pooled:
            ax_load.plot(
                *zip(*pooled),
                color="tab:red",
                lw=1.5,
                label=f"worst layer, loads pooled over {window} steps",
            )
        ax_load.axhline(1.0, color="gray", ls="--", lw=0.8)
        ax_load.legend(fontsize=7, ncol=4)
    ax_load.set_ylabel("expert load max/mean")
    ax_load.set_xlabel("step")
    ax_load.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return os.fspath(png_path)


__all__ = ["MetricsLog", "Progress", "plot_metrics", "read_metrics"]
