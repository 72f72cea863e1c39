#!/usr/bin/env python3
"""Which torch build ``make`` installs into ``.venv``, and from where (standard library only: it
runs with the system Python before the virtual environment exists).

On Linux, PyPI's ``torch`` wheel is the CUDA build and pulls ~19 ``nvidia-*`` packages (several
GB). So the bootstrap decides:

* ``TORCH_VARIANT=auto`` (default): ``cuda`` when an NVIDIA GPU is visible (``nvidia-smi -L``
  lists one, or ``/proc/driver/nvidia/gpus`` has an entry), else ``cpu``;
* ``cpu``: PyTorch's own CPU wheel index (``TORCH_CPU_INDEX``, default
  https://download.pytorch.org/whl/cpu) when it answers within a few seconds; otherwise the
  default index as pip is configured (a machine without internet access that keeps a local CPU
  wheel in pip's ``find-links`` then gets that one). Off Linux the default index already serves a
  CPU build, so it is used directly;
* ``cuda``: the default index (PyPI's Linux wheels are CUDA builds);
* ``TORCH_INDEX_URL``, when set, is used as the only index whatever the variant (e.g.
  https://download.pytorch.org/whl/cu126 for another CUDA version, or a mirror).

Usage (from the Makefile)::

    python3 scripts/torch_variant.py --variant auto --pip-args   # stdout: extra pip arguments
    python3 scripts/torch_variant.py --variant auto              # stdout: the decision, in words

Exit status 2 with a message for an unknown variant.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
VARIANTS = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Choice:
    """The decision: ``variant`` (``cpu`` / ``cuda``), the arguments to add to
    ``pip install torch==X`` and one line saying why."""

    variant: str
    pip_args: list[str] = field(default_factory=list)
    reason: str = ""


def has_nvidia_gpu() -> bool:
    """True when ``nvidia-smi -L`` lists a GPU or the NVIDIA driver reports one in /proc."""
    gpus = "/proc/driver/nvidia/gpus"
    if os.path.isdir(gpus) and os.listdir(gpus):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def index_reachable(url: str, timeout: float = 5.0) -> bool:
    """True when ``url`` answers an HTTP request within `timeout` seconds (any status: a 404 still
    proves the host is reachable). Bounded as a whole, DNS lookup included, by a daemon thread."""
    result: list[bool] = [False]

    def probe() -> None:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
                result[0] = True
        except urllib.error.HTTPError:
            result[0] = True
        except (OSError, ValueError):
            result[0] = False

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout + 1.0)
    return result[0]


def choose(variant: str | None, *, gpu: bool, reachable: Callable[[str], bool], platform: str = sys.platform,
           cpu_index: str = CPU_INDEX, index_url: str | None = None) -> Choice:
    """The torch build and pip arguments for `variant` (``auto``/``cpu``/``cuda``; None or "" = auto).

    Args:
        gpu: whether an NVIDIA GPU is visible (:func:`has_nvidia_gpu`).
        reachable: ``url -> bool``, asked only when the CPU index would be used.
        platform: ``sys.platform``; the CPU index is only needed on Linux.
        cpu_index: PyTorch's CPU wheel index (or a mirror of it).
        index_url: an explicit index that overrides the choice of index.
    Raises:
        ValueError: an unknown variant (the message lists the allowed ones).
    """
    v = (variant or "auto").strip().lower()
    if v not in VARIANTS:
        raise ValueError(f"TORCH_VARIANT: must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if v == "auto":
        v = "cuda" if gpu else "cpu"
        why = "an NVIDIA GPU is visible" if gpu else "no NVIDIA GPU is visible"
    else:
        why = f"TORCH_VARIANT={v}"
    if index_url:
        return Choice(v, ["--index-url", index_url], f"from TORCH_INDEX_URL={index_url} (that index decides the build)")
    if v == "cuda":
        return Choice(v, [], f"CUDA build ({why}) from the default index")
    if not platform.startswith("linux"):
        return Choice(v, [], f"CPU build ({why}): the default index serves CPU wheels on {platform}")
    if reachable(cpu_index):
        return Choice(v, ["--index-url", cpu_index], f"CPU build ({why}) from {cpu_index}")
    return Choice(v, [], f"CPU build wanted ({why}) but {cpu_index} is not reachable: using the default index "
                         "as pip is configured (a CPU wheel in pip's find-links, as on offline build machines, is "
                         "taken; plain PyPI gives the CUDA build; TORCH_INDEX_URL can name a reachable CPU index)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="pick the torch build for make's .venv")
    p.add_argument("--variant", default=os.environ.get("TORCH_VARIANT", "auto"), help="auto (default), cpu or cuda")
    p.add_argument("--cpu-index", default=os.environ.get("TORCH_CPU_INDEX") or CPU_INDEX)
    p.add_argument("--index-url", default=os.environ.get("TORCH_INDEX_URL") or None)
    p.add_argument("--torch-version", default="VERSION", help="only for the printed command")
    p.add_argument("--pip-args", action="store_true", help="print only the extra pip arguments (reason on stderr)")
    args = p.parse_args(argv)
    try:
        choice = choose(args.variant, gpu=has_nvidia_gpu(), reachable=index_reachable,
                        cpu_index=args.cpu_index, index_url=args.index_url)
    except ValueError as e:
        print(f"torch_variant: {e}", file=sys.stderr)
        return 2
    if args.pip_args:
        print(f"torch: {choice.reason}", file=sys.stderr)
        print(" ".join(choice.pip_args))
    else:
        print(f"torch: {choice.reason}")
        print(f"pip install torch=={args.torch_version} {' '.join(choice.pip_args)}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
