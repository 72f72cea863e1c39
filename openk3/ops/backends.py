"""Which implementation each fast-path op runs: one switch for all of them.

Ops and their backends (the automatic choice of each op is made in the op's own module, from its
inputs; this module only records an override):

* ``"kda"`` (:func:`openk3.ops.kda.kda`): ``"batched"`` (default), ``"reference"``; more via
  :func:`openk3.ops.kda.register_backend`.
* ``"attention"`` (:func:`openk3.ops.attention.causal_attention` / ``latent_attention``): ``"sdpa"``
  (default), ``"reference"``.
* ``"grouped_mm"`` (:func:`openk3.ops.grouped_mm.routed_experts`): ``"grouped_mm"``, ``"bmm"``,
  ``"static"``, ``"loop"`` (default: ``static`` while ``torch.compile`` traces, else ``grouped_mm``
  where torch's grouped GEMM applies, else ``bmm``).
* ``"mxfp4"`` (:func:`openk3.quant.packed.packed_routed_experts`): ``"native"`` (the CPU kernel of
  :mod:`openk3.quant.mxfp4_cpu`), ``"torch"`` (default: native where it applies).
* ``"decode"`` (the engine's decode step, :func:`openk3.engine.decode_step.decode_backend`):
  ``"reference"`` (the eager forward), ``"compiled"`` (the static-shape step under
  ``torch.compile``; default: compiled when ``EngineConfig.compile`` asks for it and a compiler is
  available, else reference).

Precedence: an op's explicit ``backend=`` / ``impl=`` argument, then :func:`use_backend` (in-process,
tests and benchmarks), then the environment variable ``OPENK3_<OP>_BACKEND`` (``OPENK3_KDA_BACKEND``,
``OPENK3_ATTENTION_BACKEND``, ``OPENK3_GROUPED_MM_BACKEND``, ``OPENK3_MXFP4_BACKEND``,
``OPENK3_DECODE_BACKEND``; it reaches
torchrun workers and servers), then the op's automatic choice. A forced backend that cannot run the
given inputs raises the op's ``ValueError`` rather than falling back silently.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

BACKENDS: dict[str, list[str]] = {
    "kda": ["reference", "batched"],
    "attention": ["sdpa", "reference"],
    "grouped_mm": ["grouped_mm", "bmm", "static", "loop"],
    "mxfp4": ["native", "torch"],
    "decode": ["reference", "compiled"],
}
_forced: dict[str, str | None] = {op: None for op in BACKENDS}


def env_var(op: str) -> str:
    """The environment variable that selects ``op``'s backend, e.g. ``OPENK3_KDA_BACKEND``."""
    return f"OPENK3_{op.upper()}_BACKEND"


def _check_op(op: str) -> None:
    if op not in BACKENDS:
        raise ValueError(f"op={op!r}: unknown; known: {sorted(BACKENDS)}")


def check_backend(op: str, name: str) -> None:
    """Raises ValueError naming ``backend`` and the known names unless ``name`` is one of ``op``'s."""
    _check_op(op)
    if name not in BACKENDS[op]:
        raise ValueError(f"backend={name!r}: unknown for {op}; known: {sorted(BACKENDS[op])}")


def register_backend(op: str, name: str) -> None:
    """Add ``name`` to ``op``'s known backends (the op module holds the implementation)."""
    _check_op(op)
    if name not in BACKENDS[op]:
        BACKENDS[op].append(name)


@contextlib.contextmanager
def use_backend(op: str, name: str | None) -> Iterator[None]:
    """Force ``name`` for every call of ``op`` without an explicit backend inside the ``with`` block
    (None: back to the environment / automatic choice).

    Raises:
        ValueError: unknown op or backend name.
    """
    if name is not None:
        check_backend(op, name)
    _check_op(op)
    previous = _forced[op]
    _forced[op] = name
    try:
        yield
    finally:
        _forced[op] = previous


def forced_backend(op: str) -> str | None:
    """The override in force for ``op``: :func:`use_backend`'s, else ``OPENK3_<OP>_BACKEND``'s,
    else None (the op chooses).

    Raises:
        ValueError: the environment variable names an unknown backend (naming the variable).
    """
    if _forced[op] is not None:
        return _forced[op]
    var = env_var(op)
    env = os.environ.get(var)
    if env:
        if env not in BACKENDS[op]:
            raise ValueError(f"{var}={env!r}: unknown; known: {sorted(BACKENDS[op])}")
        return env
    return None
