"""``openk3 train`` on the command line: recipe lookup, ``--set`` overrides, exit statuses.

Works the same in one process and under ``torchrun`` (``torchrun --nproc-per-node 2 -m
openk3.cli train --recipe smoke --out runs/x``): :func:`openk3.train.trainer.train` detects the
launch (see :mod:`openk3.train.distributed_run`).
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Sequence


def _rank0() -> bool:
    """True in a single process and on rank 0 of a torchrun job (``RANK``)."""
    return os.environ.get("RANK", "0") == "0"


def _parse_overrides(items: Sequence[str]) -> dict:
    """``["lr=0.01", "qat=mxfp4", "warmup_steps=null"]`` -> {field: value}; values are JSON when
    they parse as JSON, strings otherwise. Raises ValueError for an item without ``=``."""
    import json

    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


def cli_train(args) -> int:
    """``openk3 train``: run a recipe (arguments: see ``openk3 train --help``).

    Returns the exit status: 0 done, 1 stopped on a non-finite value, 2 bad arguments,
    128 + signal number after a SIGTERM/SIGINT (a checkpoint was saved; ``--resume`` continues).
    Under ``torchrun`` every rank returns the same status; only rank 0 prints the outcome.
    """
    from openk3.train.recipes import RECIPES, get_recipe
    from openk3.train.trainer import TrainingStopped, train

    if args.list:
        width = max(map(len, RECIPES)) + 2
        for name, fn in sorted(RECIPES.items()):
            first = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
            # docstrings use reST roles / literals and cite issues; the listing shows plain text
            first = re.sub(r":\w+:`~?([^`]+)`", r"\1", first).replace("``", "")
            first = re.sub(r"\s*\(issue [^)]*\)", "", first)
            print(f"{name:<{width}}{first}")
        return 0
    if not args.recipe:
        print("openk3 train: give --recipe NAME (see --list)", file=sys.stderr)
        return 2
    try:
        overrides = _parse_overrides(args.set)
        if args.threads is not None:
            overrides["threads"] = args.threads
        run = get_recipe(args.recipe, **overrides)
        if args.max_steps is not None and args.max_steps < 0:
            raise ValueError(f"--max-steps={args.max_steps}: must be >= 0")
    except (ValueError, TypeError) as e:
        print(f"openk3 train: {e}", file=sys.stderr)
        return 2
    from openk3.runtime import configure_threads

    # the recipe's or --threads' count, else the cores not already busy (OMP_NUM_THREADS honoured)
    configure_threads(run.threads, stream=sys.stderr if _rank0() else None)
    out = args.out or os.path.join("runs", run.name)
    if args.resume and _rank0() and run.prepare is None:
        from openk3.train.checkpointing import CheckpointManager

        if not os.path.isdir(os.path.join(out, "checkpoints")) or CheckpointManager(
                os.path.join(out, "checkpoints")).latest() is None:
            print(f"openk3 train: --resume: no checkpoint in {os.path.join(out, 'checkpoints')}; starting at step 0",
                  file=sys.stderr)
    try:
        result = train(run, out, resume=args.resume, max_steps=args.max_steps, progress=not args.no_progress)
    except TrainingStopped as e:
        if _rank0():  # every rank stops with the same message
            print(f"openk3 train: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        print(f"openk3 train: {e}", file=sys.stderr)
        return 2
    if result.signal is not None:
        if not _rank0():
            return 128 + result.signal
        name = signal.Signals(result.signal).name
        print(f"openk3 train: stopped by {name} after step {result.step}; checkpoint {result.checkpoint} "
              f"(continue with --resume)", file=sys.stderr)
        return 128 + result.signal
    if not _rank0():
        return 0
    last = result.last_metrics
    loss = f", loss {last['loss']:.4f}" if last else ""
    print(f"openk3 train: {run.name} finished at step {result.step}/{result.end_step}{loss}; "
          f"checkpoint {result.checkpoint}; metrics {os.path.join(out, 'metrics.jsonl')}", file=sys.stderr)
    return 0


__all__ = ["cli_train"]
