"""Atomic, resumable training checkpoints.

Layout of ``<dir>/step-0000120/`` (``<dir>`` is ``<out>/checkpoints``):

* ``config.json`` + ``model.safetensors`` (or shards): the model in the official
  ``save_pretrained`` format, so any checkpoint loads with ``load_pretrained`` (the Quantile
  Balancing bias is the model buffer ``e_score_correction_bias``);
* ``trainer_state.pt``: optimizer state (Muon momenta, AdamW moments, ``initial_lr``), each
  balancer's state, torch / Python RNG states (read back with ``torch.load(weights_only=True)``);
* ``trainer_state.json``: step, data-stream position
  (:meth:`~openk3.train.data.DataSource.state_dict`, must be JSON), the run configuration and
  the last metrics, readable by people and scripts;
* ``checksums.sha256``: the SHA-256 of every other file, in ``sha256sum`` format (so
  ``sha256sum -c checksums.sha256`` checks a copy by hand); :meth:`CheckpointManager.load`
  verifies them before reading anything, and a mismatch is an error naming the file. A
  checkpoint written before this file existed loads unverified.

Atomicity: everything is written into ``<dir>/.tmp-step-0000120-<pid>/``, flushed, and the
directory is renamed to ``step-0000120`` in one ``os.rename`` (atomic on POSIX within a file
system); only then is the ``latest`` pointer replaced (``os.replace``) and old checkpoints pruned.
A crash at any point leaves either the previous checkpoint or the new one complete, never a
half-written directory under a ``step-*`` name; leftover ``.tmp-*`` directories are ignored and
removed by the next save.

One trainer per run directory: :class:`RunLock` holds an exclusive ``flock`` on ``<out>/.lock``
(which records the holder's pid) for the whole run; a second trainer on the same directory is
refused naming that pid. The kernel drops the lock when the holder exits, however it exits, so a
killed run never leaves a stale lock behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import random
import re
import shutil
from collections.abc import Mapping

import torch
from torch import nn

from openk3.checkpoint import from_hf_state_dict, read_safetensors
from openk3.train.data import DataSource

STATE_PT = "trainer_state.pt"
STATE_JSON = "trainer_state.json"
CHECKSUMS = "checksums.sha256"
LATEST = "latest"
LOCK = ".lock"
_WHAT = {STATE_PT: "optimizer state", STATE_JSON: "training state"}
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    """``step-0000120`` for step 120 (zero-padded so names sort by step)."""
    return f"step-{step:07d}"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for fn in files:
            with open(os.path.join(root, fn), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(root)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_checksums(directory: str) -> None:
    """``checksums.sha256`` over every file under `directory` (relative paths, sorted)."""
    lines = []
    for root, _, files in os.walk(directory):
        for fn in files:
            rel = os.path.relpath(os.path.join(root, fn), directory)
            if rel != CHECKSUMS:
                lines.append(f"{_sha256(os.path.join(directory, rel))}  {rel}\n")
    with open(os.path.join(directory, CHECKSUMS), "w", encoding="utf-8") as f:
        f.writelines(sorted(lines, key=lambda line: line[66:]))


def verify_checksums(directory: str | os.PathLike) -> bool:
    """Check every file listed in ``<directory>/checksums.sha256``; returns False when there is
    no such file (a checkpoint from before checksums were written), True when all match.

    Raises:
        ValueError: a listed file that is missing or whose SHA-256 differs (named, with what it
            holds), or a malformed checksum file.
    """
    directory = os.fspath(directory)
    manifest = os.path.join(directory, CHECKSUMS)
    if not os.path.isfile(manifest):
        return False
    try:
        with open(manifest, encoding="utf-8") as f:
            entries = [line.rstrip("\n").split("  ", 1) for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{manifest}: cannot be read ({e})") from None
    for entry in entries:
        if len(entry) != 2 or len(entry[0]) != 64:
            raise ValueError(f"{manifest}: malformed line {'  '.join(entry)[:80]!r}")
        want, rel = entry
        path = os.path.join(directory, rel)
        what = _WHAT.get(
            rel, "model weights" if rel.endswith(".safetensors") else "checkpoint file"
        )
        if not os.path.isfile(path):
            raise ValueError(f"{path}: missing from the checkpoint ({what}; listed in {CHECKSUMS})")
        if _sha256(path) != want:
            raise ValueError(
                f"{path}: damaged {what}: its SHA-256 differs from the one recorded in {CHECKSUMS} "
                "when the checkpoint was saved"
            )
    return True


class RunLock:
    """An exclusive lock on a run directory for as long as a trainer runs in it.

    ``flock(LOCK_EX | LOCK_NB)`` on ``<out_dir>/.lock``, which then holds the holder's pid. The
    kernel releases the lock when the holder's file is closed, which includes the process
    dying, so no stale lock can outlive a killed run. Use as a context manager, or
    :meth:`acquire` / :meth:`release`.

    Raises (acquire):
        ValueError: another process holds the lock (its pid named, as recorded in the file).
    """

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.path = os.path.join(os.fspath(out_dir), LOCK)
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            try:
                holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            finally:
                os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ValueError(
                    f"out_dir {os.path.dirname(self.path)!r}: cannot lock {self.path} ({e.strerror})"
                ) from None
            raise ValueError(
                f"out_dir {os.path.dirname(self.path)!r} is in use by another trainer (pid {holder}, "
                f"lock {self.path}); wait for it to finish or stop it first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd = self._fd
            self._fd = None
            os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _jsonable(x):
    """Run-config values for ``trainer_state.json``: callables by qualified name."""
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if callable(x):
        return f"{getattr(x, '__module__', '?')}:{getattr(x, '__qualname__', repr(x))}"
    return repr(x)


def load_model_weights_(
    model: nn.Module, path: str | os.PathLike, *, allow_missing_vision: bool = False
) -> None:
    """Copy a ``save_pretrained``-format checkpoint's weights into ``model`` in place, bit for bit.

    The text tensors are read with the file's own ``config.json`` (a text-only ``kimi_linear``
    file loads into the text part of a ``K3ForConditionalGeneration``, whose wrapper config would
    expect ``language_model.`` names); a model with a vision tower also takes the file's
    ``vision_tower.*`` / ``mm_projector.*`` tensors (strict, :func:`openk3.vision.weights.
    load_vision_weights`).

    Args:
        allow_missing_vision: a file without any vision tensor leaves the model's tower and
            projector as they are (a vision stage initialised from a text checkpoint).
    Raises:
        ValueError: a missing / unexpected / mis-shaped tensor (named).
        FileNotFoundError: no config or weights in ``path``.
    """
    from openk3.config import K3Config
    from openk3.multimodal import VISION_PREFIXES

    path = os.fspath(path)
    tensors = read_safetensors(path)
    file_config = (
        K3Config.from_pretrained(path)
        if os.path.isfile(os.path.join(path, "config.json"))
        else model.config
    )
    # A tied file stores the shared matrix once, as embed_tokens (save_pretrained skips lm_head).
    tied = file_config.tie_word_embeddings
    expected = {
        k: v.shape
        for k, v in model.state_dict().items()
        if not k.startswith(VISION_PREFIXES) and not (tied and k == "lm_head.weight")
    }
    state = from_hf_state_dict(tensors, file_config, expected)
    if tied and "lm_head.weight" in model.state_dict():
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.no_grad():
        own = model.state_dict()
        for k, v in state.items():
            own[k].copy_(v)
        if hasattr(model, "vision_tower"):
            vision = {k: v for k, v in tensors.items() if k.startswith(VISION_PREFIXES)}
            if vision or not allow_missing_vision:
                from openk3.vision.weights import load_vision_weights

                for module in (model.vision_tower, model.mm_projector):
                    load_vision_weights(module, vision)


class CheckpointManager:
    """Saves, finds and loads training checkpoints under one directory.

    Args:
        directory: where ``step-*`` directories go (created on first save).
        keep: how many complete checkpoints to keep (oldest pruned first); None keeps all.
    Raises:
        ValueError: ``keep`` < 1.
    """

    def __init__(self, directory: str | os.PathLike, keep: int | None = 3) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep={keep!r}: must be >= 1 or None")
        self.directory = os.fspath(directory)
        self.keep = keep

    # ----------------------------------------------------------------------------- discovery
    def complete(self) -> list[tuple[int, str]]:
        """``[(step, path)]`` of every complete checkpoint, ascending by step."""
        if not os.path.isdir(self.directory):
            return []
        found = []
        for name in os.listdir(self.directory):
            m = _STEP_DIR.match(name)
            path = os.path.join(self.directory, name)
            if m and os.path.isfile(os.path.join(path, STATE_JSON)):
                found.append((int(m.group(1)), path))
        return sorted(found)

    def latest(self) -> str | None:
        """Path of the newest complete checkpoint (the ``latest`` pointer if it names a complete
        one, else the highest step found), or None."""
        pointer = os.path.join(self.directory, LATEST)
        if os.path.isfile(pointer):
            with open(pointer, encoding="utf-8") as f:
                name = f.read().strip()
            path = os.path.join(self.directory, name)
            if _STEP_DIR.match(name) and os.path.isfile(os.path.join(path, STATE_JSON)):
                return path
        found = self.complete()
        return found[-1][1] if found else None

    # ---------------------------------------------------------------------------------- save
    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        balancers: Mapping[int, object],
        data: DataSource | None = None,
        run=None,
        metrics: Mapping | None = None,
    ) -> str:
        """Write the checkpoint of ``step`` (completed steps) atomically; returns its path.

        Args:
            step: completed optimizer steps. model: ``K3ForCausalLM`` (``save_pretrained``).
            optimizer: its ``state_dict()`` is saved. balancers: {layer: QuantileBalancer}.
            data: the run's :class:`~openk3.train.data.DataSource` (its ``state_dict()``, the
                stream position, must be JSON-serialisable), or None.
            run: the run configuration (recorded as JSON for people; not read back).
            metrics: last metrics to record.
        Raises:
            ValueError: the data state is not JSON-serialisable.
            OSError: from the file system; the previous checkpoint is untouched.
        """
        os.makedirs(self.directory, exist_ok=True)
        self._remove_stale_tmp()
        name = step_dir_name(step)
        final = os.path.join(self.directory, name)
        data_state = data.state_dict() if data is not None else None
        try:
            data_json = json.dumps(data_state)
        except TypeError as e:
            raise ValueError(f"data.state_dict(): must be JSON-serialisable ({e})") from None
        tmp = os.path.join(self.directory, f".tmp-{name}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            model.save_pretrained(tmp)
            torch.save(
                {
                    "step": step,
                    "optimizer": optimizer.state_dict(),
                    "balancers": {int(k): b.state_dict() for k, b in balancers.items()},
                    "rng": _rng_state(),
                },
                os.path.join(tmp, STATE_PT),
            )
            record = {
                "step": step,
                "data": json.loads(data_json),
                "run": _jsonable(run.to_dict() if hasattr(run, "to_dict") else run),
                "metrics": _jsonable(dict(metrics or {})),
            }
            # Written last: its presence marks a complete checkpoint for :meth:`complete`.
            with open(os.path.join(tmp, STATE_JSON), "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1)
            _write_checksums(tmp)
            _fsync_tree(tmp)
            trash = None
            if os.path.exists(final):
                # Same step saved before (e.g. a resumed run with other settings): move the old
                # one aside first, so a crash here still leaves a complete directory behind.
                trash = os.path.join(self.directory, f".tmp-old-{name}-{os.getpid()}")
                os.rename(final, trash)
            os.rename(tmp, final)
            _fsync_dir(self.directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        self._point_latest(name)
        self._prune()
        return final

    def _point_latest(self, name: str) -> None:
        tmp = os.path.join(self.directory, f".{LATEST}.tmp-{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.directory, LATEST))
        _fsync_dir(self.directory)

    def _prune(self) -> None:
        if self.keep is None:
            return
        found = self.complete()
        latest = self.latest()
        for _, path in found[: -self.keep]:
            if path != latest:
                shutil.rmtree(path, ignore_errors=True)

    def _remove_stale_tmp(self) -> None:
        for name in os.listdir(self.directory):
            if name.startswith((".tmp-step-", ".tmp-old-")):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    # ---------------------------------------------------------------------------------- load
    def load(
        self,
        path: str | os.PathLike,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        balancers: Mapping[int, object] | None = None,
        data: DataSource | None = None,
        *,
        restore_rng: bool = True,
    ) -> dict:
        """Restore a checkpoint in place into freshly built training objects.

        The model must have the checkpoint's architecture and the optimizer the same parameter
        groups (both come from the same recipe). Parameters and buffers are copied bit for bit.

        Args:
            path: a checkpoint directory. model, optimizer, balancers, data: restored when given.
            restore_rng: also restore the torch / Python RNG states.
        Returns:
            The ``trainer_state.json`` record (``step``, ``data``, ``run``, ``metrics``).
        Raises:
            FileNotFoundError: not a complete checkpoint.
            ValueError: a file whose SHA-256 differs from ``checksums.sha256`` (named; checked
                before anything is read, :func:`verify_checksums`), the checkpoint does not fit the
                model (shape / name, via :func:`~openk3.checkpoint.from_hf_state_dict`), the
                balancer layers differ, or the optimizer groups differ.
        """
        path = os.fspath(path)
        if not os.path.isfile(os.path.join(path, STATE_JSON)):
            raise FileNotFoundError(
                f"{path!r} is not a complete training checkpoint (no {STATE_JSON})"
            )
        verify_checksums(path)
        try:
            with open(os.path.join(path, STATE_JSON), encoding="utf-8") as f:
                record = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(
                f"{os.path.join(path, STATE_JSON)}: damaged training state ({e})"
            ) from None
        load_model_weights_(model, path)
        try:
            blob = torch.load(os.path.join(path, STATE_PT), map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise ValueError(
                f"{os.path.join(path, STATE_PT)}: damaged optimizer state, not a readable torch "
                f"file ({type(e).__name__})"
            ) from None
        if optimizer is not None:
            optimizer.load_state_dict(blob["optimizer"])
        if balancers is not None:
            saved = blob.get("balancers", {})
            if set(map(int, saved)) != set(map(int, balancers)):
                raise ValueError(
                    f"balancers: checkpoint has MoE layers {sorted(map(int, saved))}, "
                    f"model has {sorted(map(int, balancers))}"
                )
            for k, b in balancers.items():
                b.load_state_dict(saved[int(k)])
        if data is not None and record.get("data") is not None:
            data.load_state_dict(record["data"])
        if restore_rng and "rng" in blob:
            _set_rng_state(blob["rng"])
        return record


__all__ = [
    "CheckpointManager",
    "RunLock",
    "check_out_dir",
    "step_dir_name",
    "verify_checksums",
    "STATE_PT",
    "STATE_JSON",
    "CHECKSUMS",
    "LATEST",
    "LOCK",
]


def check_out_dir(out_dir: str, resume: bool, lock: bool = False) -> RunLock | None:
    """Create ``out_dir``; refuse a path that is not a directory, and an earlier run there unless
    ``resume`` (a fresh start would truncate its metrics and mix its checkpoints with the new ones).
    With ``lock``, first take the directory's :class:`RunLock` (before looking for an earlier
    run, so that a second trainer learns who holds it) and return it, held.

    Raises:
        ValueError: naming the path (or the pid of the trainer holding the lock).
    """
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"out_dir {out_dir!r}: exists and is not a directory")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"out_dir {out_dir!r}: cannot be created ({e.strerror or e})") from None
    held = RunLock(out_dir).acquire() if lock else None
    if resume:
        return held
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    earlier = [
        n
        for n in (os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else [])
        if n.startswith("step-")
    ]
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if earlier or (os.path.isfile(metrics) and os.path.getsize(metrics) > 0):
        if held is not None:
            held.release()
        what = f"checkpoints {sorted(earlier)[-1]}" if earlier else "metrics.jsonl"
        raise ValueError(
            f"out_dir {out_dir!r} already holds a training run ({what}): pass --resume to continue "
            "it, or choose another --out (or remove the directory) to start over"
        )
    return held
