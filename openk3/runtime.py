"""Where and how the command-line tools compute: device, dtype and CPU threads, decided in one place.

* device (``--device``): ``auto`` is CUDA when ``torch.cuda.is_available()``, else CPU; an explicit
  ``cuda`` / ``cuda:N`` on a machine without it is an error, not a silent CPU run.
* dtype (``--dtype``): ``auto`` is bfloat16 on CUDA and float32 on CPU (fp32 is openk3's correctness
  gate on CPU, and CPU bf16 matmuls are slower than fp32 on most CPUs); ``float32`` / ``fp32``,
  ``bfloat16`` / ``bf16``, ``float16`` / ``fp16`` name one. Tensors the model keeps in fp32 (the KDA
  recurrent state, the released checkpoint's fp32 tensors) stay fp32 whatever the choice
  (:func:`openk3.pretrained.load_pretrained`).
* CPU threads (``--threads``): an explicit count wins; then ``OMP_NUM_THREADS``; otherwise the
  physical cores (torch's default) capped by the cores not already busy (usable CPUs minus the
  1-minute load average, at least 1). OpenMP threads that share a core with another busy process
  stall at every barrier, which on a loaded 2-core machine made training 30-50x slower than one
  thread, so the default leaves busy cores alone. :func:`configure_threads` prints the choice once.

This module imports torch only inside the functions that need it, so argument parsing stays fast.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

DEVICE_CHOICES_HELP = "auto (CUDA when available, else CPU), cpu, cuda, cuda:N"
DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
DTYPE_CHOICES = ("auto", *DTYPE_ALIASES)


def resolve_device(name: str | None = "auto") -> Any:
    """``--device`` -> ``torch.device``.

    Raises:
        ValueError: not a device string, or CUDA asked for where ``torch.cuda.is_available()`` is
            false (or the index is beyond the GPUs present).
    """
    import torch

    text = (name or "auto").strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device: {name!r} is not a device ({DEVICE_CHOICES_HELP})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {name}: CUDA is not available here (torch {torch.__version__}, "
                f"built {'with CUDA ' + torch.version.cuda if torch.version.cuda else 'for CPU only'})"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here"
            )
    elif dev.type != "cpu":
        raise ValueError(f"--device {name}: only cpu and cuda are supported")
    return dev


def resolve_dtype(name: str | None, device: Any) -> Any:
    """``--dtype`` -> ``torch.dtype``; ``auto`` (or None) is bfloat16 on CUDA, float32 elsewhere.

    Raises:
        ValueError: an unknown name (the message lists the accepted ones).
    """
    import torch

    text = (name or "auto").strip().lower()
    if text == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if text not in DTYPE_ALIASES:
        raise ValueError(f"--dtype: {name!r} is not one of {', '.join(DTYPE_CHOICES)}")
    return getattr(torch, DTYPE_ALIASES[text])


def _load1() -> float:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return 0.0


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_threads(
    *,
    physical: int | None = None,
    cpus: int | None = None,
    load: float | None = None,
    env: dict | None = None,
    local_world_size: int | None = None,
) -> tuple[int, str]:
    """The thread count used when none is given, and why (one phrase).

    Args (all for tests; None = measure this machine):
        physical: physical cores (default ``torch.get_num_threads()`` at start-up, which is
            OpenMP's count of them).
        cpus: usable CPUs (:func:`usable_cpus`). load: the 1-minute load average.
        env: environment (``OMP_NUM_THREADS``, ``LOCAL_WORLD_SIZE`` under torchrun).
        local_world_size: processes sharing this machine (default ``LOCAL_WORLD_SIZE`` or 1).
    Returns:
        ``(threads, reason)`` with ``threads >= 1``.
    """
    env = os.environ if env is None else env
    omp = (env.get("OMP_NUM_THREADS") or "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return int(omp), "OMP_NUM_THREADS"
    if physical is None:
        import torch

        physical = torch.get_num_threads()
    cpus = usable_cpus() if cpus is None else cpus
    load = _load1() if load is None else load
    ranks = local_world_size or int(env.get("LOCAL_WORLD_SIZE") or 1)
    free = max(1, int(cpus - load + 0.5))
    n = max(1, min(physical, free) // max(1, ranks))
    why = f"{physical} physical cores, {cpus} usable CPUs, 1-min load {load:.1f}"
    if ranks > 1:
        why += f", {ranks} processes"
    return n, why


_announced = False


def configure_threads(requested: int | None = None, *, stream: TextIO | None = sys.stderr) -> int:
    """Set torch's intra-op threads: `requested` if given, else :func:`default_threads`. Prints one
    line (``openk3: N CPU threads (reason; ...)``) the first time it is called in a process, unless
    `stream` is None. Returns the count.

    Raises:
        ValueError: `requested` < 1.
    """
    global _announced
    import torch

    if requested is not None:
        if not isinstance(requested, int) or requested < 1:
            raise ValueError(f"--threads: must be an integer >= 1, got {requested!r}")
        n = requested
        why = "--threads"
    else:
        n, why = default_threads()
    torch.set_num_threads(n)
    if stream is not None and not _announced:
        _announced = True
        tip = (
            ""
            if why in ("--threads", "OMP_NUM_THREADS")
            else "; --threads or OMP_NUM_THREADS to choose"
        )
        print(
            f"openk3: {n} CPU thread{'s' if n != 1 else ''} ({why}{tip})", file=stream, flush=True
        )
    return n


def add_runtime_args(parser: Any, *, threads: bool = True) -> None:
    """``--device``, ``--dtype`` (and ``--threads``) with the same spelling and help on every command."""
    parser.add_argument(
        "--device", default="auto", help=f"where to compute: {DEVICE_CHOICES_HELP}; default auto"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        metavar="DTYPE",
        help="weights and compute dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, "
        "bfloat16, float16 (short forms fp32, bf16, fp16)",
    )
    if threads:
        parser.add_argument(
            "--threads",
            type=int,
            help="CPU threads (default: OMP_NUM_THREADS, else the physical "
            "cores not already busy; printed once)",
        )


def setup(args: Any, *, announce: bool = True) -> tuple[Any, Any]:
    """Apply a command's ``--device`` / ``--dtype`` / ``--threads``: set the CPU threads (on a CPU
    device) and return ``(torch.device, torch.dtype)``.

    Raises:
        ValueError: see :func:`resolve_device`, :func:`resolve_dtype`, :func:`configure_threads`.
    """
    device = resolve_device(getattr(args, "device", "auto"))
    dtype = resolve_dtype(getattr(args, "dtype", "auto"), device)
    if device.type == "cpu" or getattr(args, "threads", None) is not None:
        configure_threads(getattr(args, "threads", None), stream=sys.stderr if announce else None)
    return device, dtype


__all__ = [
    "resolve_device",
    "resolve_dtype",
    "default_threads",
    "configure_threads",
    "usable_cpus",
    "add_runtime_args",
    "setup",
    "DTYPE_CHOICES",
]
