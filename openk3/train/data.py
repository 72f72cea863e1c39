"""Training data: documents -> packed rows with document boundaries -> batches.

Shape letters: B rows per batch, T tokens per row (``seq_len``), L tokens of one document, N
segments (documents or document pieces, plus padding) in a batch.

A :class:`Document` is token ids with **aligned next-token targets**: ``labels[t]`` is the token
that should follow position ``t`` inside the same document, or ``-100`` (no loss). Plain text gets
``labels[t] = ids[t+1]`` and ``-100`` on its last token (:func:`text_document`); a chat
conversation rendered by :func:`openk3.chat_format.render_training` keeps a target only where the
next token is assistant output (:func:`chat_document`), so the loss covers exactly what the model
generates. Targets are fixed per document *before* packing, so no label can point into another
document, however the documents are packed or cut.

:class:`PackedLoader` fills rows of ``T`` tokens with documents in a seeded per-epoch order. Each
document (piece) is one segment of ``cu_seqlens``: the model resets the KDA state and restricts MLA
attention at every boundary (``K3ForCausalLM.forward(..., cu_seqlens=...)``; architecture.md §3.4,
§3.6: no attention or state leaks across documents). Two packing modes: ``split_documents=True``
(pretraining) cuts documents at row ends and continues them in the next row, wasting nothing; the
last position of a cut piece keeps its target, which is the next token *of the same document*
(served at the start of the next row). ``False`` (SFT) starts a document that does not fit on a new
row and pads the rest (documents longer than a row are still cut). The stream position is
``(epoch, cursor, offset)``, serialisable with :meth:`PackedLoader.state_dict`; restoring it
continues with exactly the batches an uninterrupted run would produce.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

IGNORE_INDEX = -100
STATE_VERSION = 1


# ------------------------------------------------------------------------------------ documents
@dataclass(frozen=True)
class Document:
    """One document: ``ids`` [L] int64 and aligned targets ``labels`` [L] int64 (-100 = no loss)."""

    ids: np.ndarray
    labels: np.ndarray


def document_from_ids(ids: Sequence[int], loss_mask: Sequence[int] | None = None) -> Document:
    """Targets from ids: ``labels[t] = ids[t+1]`` where ``loss_mask[t+1]`` (all ones if None), the
    last position -100.

    Raises:
        ValueError: empty `ids`, or `loss_mask` of another length.
    """
    ids_a = np.asarray(ids, dtype=np.int64)
    if ids_a.ndim != 1 or ids_a.size == 0:
        raise ValueError(f"ids: expected a non-empty 1-D sequence, got shape {ids_a.shape}")
    labels = np.full_like(ids_a, IGNORE_INDEX)
    labels[:-1] = ids_a[1:]
    if loss_mask is not None:
        mask = np.asarray(loss_mask, dtype=bool)
        if mask.shape != ids_a.shape:
            raise ValueError(f"loss_mask: length {mask.size} != ids length {ids_a.size}")
        labels[:-1][~mask[1:]] = IGNORE_INDEX
    return Document(ids_a, labels)


def text_document(text: str, tokenizer: Any, *, add_eos: bool = True) -> Document:
    """A pretraining document: ``encode_text(text)`` (+ ``[EOS]`` when `add_eos` and the tokenizer
    has one, so the model learns where documents end); every next token is a target.

    Raises:
        ValueError: `text` encodes to no tokens.
    """
    ids = tokenizer.encode_text(text)
    if add_eos and tokenizer.eos_id is not None:
        ids = ids + [tokenizer.eos_id]
    return document_from_ids(ids)


def chat_document(conversation: dict | list, tokenizer: Any, *, train_on: str = "all") -> Document:
    """An SFT document: the conversation rendered by :func:`openk3.chat_format.render_training`;
    only positions whose next token is assistant output (``loss_mask == 1``) carry a target.

    Raises:
        ValueError: a malformed conversation (from the renderer) or bad `train_on`.
    """
    from openk3.chat_format import render_training

    ex = render_training(conversation, tokenizer, train_on=train_on)
    return document_from_ids(ex.token_ids, ex.loss_mask)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """16 hex digits identifying a tokenizer: a hash of the files its ``save_pretrained`` writes
    (BPE model + ``tokenizer_config.json``)."""
    import tempfile

    h = hashlib.sha256()
    with tempfile.TemporaryDirectory() as d:
        for f in sorted(tokenizer.save_pretrained(d)):
            if f.name != "chat_template.jinja":
                h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------- storage
class DocumentStore:
    """Many documents in three flat arrays: ``ids`` [sum L] int32, ``labels`` [sum L] int32 and
    ``offsets`` [D+1] int64 (document ``d`` is ``offsets[d]:offsets[d+1]``). Cheap to save, load
    and index; ``fingerprint`` identifies the contents (checked when a loader state is restored).
    """

    def __init__(self, ids: np.ndarray, labels: np.ndarray, offsets: np.ndarray):
        ids, labels, offsets = (
            np.asarray(ids, np.int32),
            np.asarray(labels, np.int32),
            np.asarray(offsets, np.int64),
        )
        if ids.shape != labels.shape or ids.ndim != 1:
            raise ValueError(
                f"ids/labels: must be equal 1-D arrays, got {ids.shape} and {labels.shape}"
            )
        if (
            offsets.ndim != 1
            or offsets.size < 1
            or offsets[0] != 0
            or offsets[-1] != ids.size
            or bool((np.diff(offsets) <= 0).any())
        ):
            raise ValueError(
                "offsets: must increase strictly from 0 to len(ids) (no empty documents)"
            )
        self.ids = ids
        self.labels = labels
        self.offsets = offsets
        h = hashlib.sha256()
        for a in (ids, labels, offsets):
            h.update(np.ascontiguousarray(a).tobytes())
        self.fingerprint = h.hexdigest()[:16]

    @classmethod
    def from_documents(cls, docs: Iterable[Document]) -> DocumentStore:
        """Store `docs` in order (empty documents are skipped).

        Raises:
            ValueError: no non-empty documents.
        """
        docs = [d for d in docs if len(d.ids)]
        if not docs:
            raise ValueError("docs: no non-empty documents")
        lengths = np.array([len(d.ids) for d in docs], dtype=np.int64)
        return cls(
            np.concatenate([d.ids for d in docs]),
            np.concatenate([d.labels for d in docs]),
            np.concatenate([[0], np.cumsum(lengths)]),
        )

    @classmethod
    def from_texts(
        cls, texts: Iterable[str], tokenizer: Any, *, add_eos: bool = True
    ) -> DocumentStore:
        """Tokenise plain texts (:func:`text_document`); empty texts are skipped."""
        return cls.from_documents(text_document(t, tokenizer, add_eos=add_eos) for t in texts if t)

    @classmethod
    def from_corpus(
        cls,
        corpus_dir: str | os.PathLike,
        tokenizer: Any,
        split: str = "train",
        *,
        add_eos: bool = True,
        cache_dir: str | os.PathLike | None = None,
    ) -> DocumentStore:
        """Tokenise one split of a corpus built by :func:`openk3.datasets.corpus.build_corpus`.

        With `cache_dir`, the store is saved under a key of (manifest, split, `add_eos`,
        :func:`tokenizer_fingerprint`) and loaded from there next time (tokenising tens of MB
        takes a minute on two cores).

        Raises:
            ValueError: not a corpus directory, or a bad `split`.
        """
        from openk3.datasets.corpus import iter_texts, load_manifest

        load_manifest(corpus_dir)
        path = None
        if cache_dir is not None:
            h = hashlib.sha256((Path(corpus_dir) / "manifest.json").read_bytes())
            h.update(f"{split}|{add_eos}|{tokenizer_fingerprint(tokenizer)}".encode())
            path = Path(cache_dir) / f"{split}-{h.hexdigest()[:16]}"
            if (path / "store.json").is_file():
                return cls.load(path)
        store = cls.from_texts(iter_texts(corpus_dir, split), tokenizer, add_eos=add_eos)
        if path is not None:
            store.save(path, meta={"corpus": str(corpus_dir), "split": split, "add_eos": add_eos})
        return store

    @classmethod
    def from_conversations(
        cls, conversations: Iterable[dict | list], tokenizer: Any, *, train_on: str = "all"
    ) -> DocumentStore:
        """Render SFT conversations (:func:`chat_document`)."""
        return cls.from_documents(
            chat_document(c, tokenizer, train_on=train_on) for c in conversations
        )

    def __len__(self) -> int:
        return self.offsets.size - 1

    def __getitem__(self, d: int) -> Document:
        a = int(self.offsets[d])
        b = int(self.offsets[d + 1])
        return Document(self.ids[a:b].astype(np.int64), self.labels[a:b].astype(np.int64))

    def doc_length(self, d: int) -> int:
        return int(self.offsets[d + 1] - self.offsets[d])

    @property
    def num_tokens(self) -> int:
        return int(self.ids.size)

    def save(self, directory: str | os.PathLike, meta: dict | None = None) -> None:
        """Write ``ids.npy``, ``labels.npy``, ``offsets.npy`` and ``store.json`` (fingerprint + `meta`)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        for name in ("ids", "labels", "offsets"):
            np.save(d / f"{name}.npy", getattr(self, name))
        (d / "store.json").write_text(
            json.dumps(
                {
                    "fingerprint": self.fingerprint,
                    "documents": len(self),
                    "tokens": self.num_tokens,
                    "meta": meta or {},
                },
                indent=2,
            )
        )

    @classmethod
    def load(cls, directory: str | os.PathLike) -> DocumentStore:
        """Read a store written by :meth:`save`.

        Raises:
            ValueError: missing files or a fingerprint mismatch (modified arrays).
        """
        d = Path(directory)
        try:
            arrays = [np.load(d / f"{n}.npy") for n in ("ids", "labels", "offsets")]
            info = json.loads((d / "store.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"DocumentStore.load: {str(d)!r} is not a saved store ({e})") from e
        store = cls(*arrays)
        if info.get("fingerprint") != store.fingerprint:
            raise ValueError(
                f"DocumentStore.load: {str(d)!r} fingerprint mismatch (arrays modified)"
            )
        return store


# ---------------------------------------------------------------------------------- the protocol
@runtime_checkable
class DataSource(Protocol):
    """What the trainer reads data from: a deterministic, resumable stream of micro-batches.

    ``RunConfig.data(run, split)`` returns one (:mod:`openk3.train.run_config`);
    :func:`openk3.train.trainer.train` draws ``grad_accum`` micro-batches per step (times the world
    size under ``torchrun``) and :class:`~openk3.train.checkpointing.CheckpointManager` saves and
    restores its position. Implemented by :class:`PackedLoader`,
    :class:`~openk3.train.vision_loader.ImageSFTLoader`,
    :class:`~openk3.train.mixed_data.MixedLoader` and :class:`~openk3.train.mixed_data.CurriculumLoader`.
    """

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next micro-batch: ``input_ids`` [B, T] int64 and ``labels`` [B, T] int64 (aligned
        next-token targets, -100 ignored), optionally ``cu_seqlens`` [N+1] (a packed row, B = 1)
        or ``lengths`` [B], and for image rows ``pixel_values`` [L, 3, P, P] + ``grid_thws`` [G, 3].

        Raises:
            StopIteration: a finite source is exhausted.
        """
        ...

    def state_dict(self) -> dict[str, Any]:
        """The stream position, JSON-serialisable (written into ``trainer_state.json``)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the following batches equal those an uninterrupted
        stream would have served.

        Raises:
            ValueError: a state of another version or source configuration (field named).
        """
        ...


# --------------------------------------------------------------------------------------- batches
@dataclass
class Batch:
    """A batch of packed rows.

    Attributes:
        input_ids: [B, T] int64.
        labels: [B, T] int64 aligned targets, -100 = ignored (padding, document ends, prompts).
        cu_seqlens: [N+1] int64 segment starts over the flattened ``B*T`` stream; every row start
            ``r*T`` is a boundary, so one row is never a continuation of the previous one.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor

    @property
    def n_tokens(self) -> int:
        """Number of targets (labels != -100)."""
        return int((self.labels != IGNORE_INDEX).sum())

    def packed(self) -> dict[str, torch.Tensor]:
        """The whole batch as one packed row for ``model(**batch.packed())``: ``input_ids`` /
        ``labels`` [1, B*T] and ``cu_seqlens``."""
        return {
            "input_ids": self.input_ids.reshape(1, -1),
            "labels": self.labels.reshape(1, -1),
            "cu_seqlens": self.cu_seqlens,
        }

    def row(self, r: int) -> dict[str, torch.Tensor]:
        """Row `r` alone (``input_ids`` / ``labels`` [1, T], its own ``cu_seqlens``), for per-row
        micro-batches: attention cost T² instead of (B·T)²."""
        T = self.input_ids.shape[1]
        cu = self.cu_seqlens
        cu = cu[(cu >= r * T) & (cu <= (r + 1) * T)] - r * T
        return {
            "input_ids": self.input_ids[r : r + 1],
            "labels": self.labels[r : r + 1],
            "cu_seqlens": cu,
        }

    def to(self, device: str | torch.device) -> Batch:
        return Batch(self.input_ids.to(device), self.labels.to(device), self.cu_seqlens.to(device))


class PackedLoader:
    """Deterministic, resumable iterator of packed :class:`Batch` es over a :class:`DocumentStore`.

    Args:
        store: the documents.
        seq_len: T, tokens per row (>= 2).
        batch_size: B, rows per batch.
        seed: shuffling seed; epoch ``e`` visits documents in ``numpy.random.default_rng([seed, e])``
            permutation order (identical on every platform).
        shuffle: False = store order every epoch (evaluation).
        split_documents: True = cut documents at row ends (no padding); False = start a document
            that does not fit on a new row and pad (``pad_id``, label -100, its own segment).
        loop: True = endless epochs; False = one pass (the last batch is padded), then StopIteration.
        pad_id: padding token id.
    Raises:
        ValueError: bad sizes.
    """

    def __init__(
        self,
        store: DocumentStore,
        seq_len: int,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        split_documents: bool = True,
        loop: bool = True,
        pad_id: int = 0,
    ):
        if seq_len < 2:
            raise ValueError(f"seq_len: must be >= 2, got {seq_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        self.store, self.seq_len, self.batch_size = store, int(seq_len), int(batch_size)
        self.seed, self.shuffle, self.split_documents = (
            int(seed),
            bool(shuffle),
            bool(split_documents),
        )
        self.loop, self.pad_id = bool(loop), int(pad_id)
        self.epoch = 0
        self.cursor = 0
        self.offset = 0
        self.batches = 0
        self._order_epoch: int | None = None
        self._order = np.arange(len(store))

    # ------------------------------------------------------------------ order and state
    def order(self, epoch: int) -> np.ndarray:
        """Document indices of `epoch`, in visiting order."""
        if not self.shuffle:
            return np.arange(len(self.store))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.store))

    def _current_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order, self._order_epoch = self.order(self.epoch), self.epoch
        return self._order

    def _config(self) -> dict[str, Any]:
        return {
            "documents": len(self.store),
            "store": self.store.fingerprint,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "split_documents": self.split_documents,
            "loop": self.loop,
            "pad_id": self.pad_id,
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position: ``epoch``, ``cursor`` (index into the epoch order), ``offset``
        (tokens of that document already served), ``batches`` served, and the loader config."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "offset": self.offset,
            "batches": self.batches,
            "config": self._config(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`.

        Raises:
            ValueError: another state version, or a state saved with a different store or config
                (the field is named).
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"state.version: expected {STATE_VERSION}, got {state.get('version')!r}"
            )
        for k, v in self._config().items():
            if state["config"].get(k) != v:
                raise ValueError(
                    f"state.config.{k}: saved {state['config'].get(k)!r}, this loader has {v!r}"
                )
        self.epoch, self.cursor, self.offset = (
            int(state["epoch"]),
            int(state["cursor"]),
            int(state["offset"]),
        )
        self.batches = int(state["batches"])

    # ---------------------------------------------------------------------- packing
    def _fill_row(self, ids: np.ndarray, labels: np.ndarray, starts: list[int], base: int) -> bool:
        """Fill one row in place; append its segment starts (flattened positions). False = the
        stream ended (loop=False) before the row got any token."""
        T = self.seq_len
        filled = 0
        while filled < T:
            if self.cursor >= len(self.store):
                if not self.loop:
                    break
                self.epoch = self.epoch + 1
                self.cursor = 0
                self.offset = 0
            d = int(self._current_order()[self.cursor])
            a = int(self.store.offsets[d]) + self.offset
            remaining = self.store.doc_length(d) - self.offset
            free = T - filled
            if remaining <= free:
                take = remaining
            elif self.split_documents or filled == 0:
                take = free
            else:
                break  # whole-document mode: this one starts the next row
            starts.append(base + filled)
            ids[filled : filled + take] = self.store.ids[a : a + take]
            labels[filled : filled + take] = self.store.labels[a : a + take]
            filled += take
            self.offset += take
            if self.offset == self.store.doc_length(d):
                self.cursor = self.cursor + 1
                self.offset = 0
        if filled < T:
            if filled == 0 and not self.loop and self.cursor >= len(self.store):
                return False
            starts.append(base + filled)  # padding is a segment of its own
            ids[filled:] = self.pad_id
            labels[filled:] = IGNORE_INDEX
        return True

    def __iter__(self) -> Iterator[Batch]:
        return self

    def next_batch(self) -> dict[str, torch.Tensor]:
        """:meth:`DataSource.next_batch`: the next batch as one packed row, :meth:`Batch.packed`
        (``input_ids`` / ``labels`` [1, B*T], ``cu_seqlens``).

        Raises:
            StopIteration: end of a single pass (``loop=False``).
        """
        return next(self).packed()

    def __next__(self) -> Batch:
        B, T = self.batch_size, self.seq_len
        ids = np.empty((B, T), dtype=np.int64)
        labels = np.empty((B, T), dtype=np.int64)
        starts: list[int] = []
        rows = 0
        for r in range(B):
            if not self._fill_row(ids[r], labels[r], starts, r * T):
                break
            rows += 1
        if rows == 0:
            raise StopIteration
        if rows < B:  # end of a single pass: pad whole rows
            for r in range(rows, B):
                starts.append(r * T)
                ids[r] = self.pad_id
                labels[r] = IGNORE_INDEX
        self.batches += 1
        cu = torch.tensor(starts + [B * T], dtype=torch.long)
        return Batch(torch.from_numpy(ids), torch.from_numpy(labels), cu)
