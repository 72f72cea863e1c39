"""Packed training rows with their images, for the vision stage.

Shape legend: T tokens per row (``seq_len``), N segments of a row, L patches of the row's images,
P patch size, G images of the row.

:func:`image_chat_document` renders a conversation with image parts through the K3 chat format
(:func:`openk3.chat_format.render_training`, assistant-only loss) and expands each image slot
into its official block (:func:`openk3.vision.expand.image_block`: ``<|media_begin|>image WxH
<|media_content|>`` + N ``<|media_pad|>`` + ``<|media_end|>``); the block positions never carry a
target. :class:`ImageSFTLoader` packs whole documents into rows of T tokens (padding the rest, as
:class:`~openk3.train.data.PackedLoader` with ``split_documents=False``) and returns, besides the
``input_ids`` / ``labels`` / ``cu_seqlens`` of the packed row, the row's images as
``pixel_values`` [L, 3, P, P] + ``grid_thws`` [G, 3] in the order of their pad runs, which is what
``K3ForConditionalGeneration.forward`` consumes. Images are kept as encoded PNG bytes and
preprocessed when a row is served (:func:`openk3.vision.preprocess.process_image`), so memory
stays small. Its position ``(epoch, cursor, batches)`` is JSON state: a resumed run continues with
exactly the rows an uninterrupted run would get.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from openk3.train.data import IGNORE_INDEX, document_from_ids

LOADER_STATE_VERSION = 1


@dataclass(frozen=True)
class ImageDocument:
    """One conversation: ``ids`` [L] int64, aligned ``labels`` [L] (-100 = no loss), and its
    ``images`` (encoded bytes, in pad-run order)."""

    ids: np.ndarray
    labels: np.ndarray
    images: tuple[bytes, ...]


def _image_bytes(part: dict) -> bytes:
    from openk3.vision.preprocess import image_bytes_from_data_url

    ref = part.get("image_url", part.get("image"))
    return image_bytes_from_data_url(ref.get("url") if isinstance(ref, dict) else ref)


def image_chat_document(
    conversation: dict | list, tokenizer: Any, image_config=None
) -> ImageDocument:
    """Render + expand a conversation whose user messages may hold images (base64 data URLs).

    Raises:
        ValueError / ImageError: a malformed conversation, an undecodable image, or a tokenizer
            without the media tokens.
    """
    from openk3.chat_format import render_training
    from openk3.vision.expand import image_block
    from openk3.vision.preprocess import DEFAULT_CONFIG, decode_image, navit_resize

    cfg = image_config or DEFAULT_CONFIG
    ex = render_training(conversation, tokenizer)
    request = {"messages": conversation} if isinstance(conversation, list) else conversation
    parts = [
        p
        for m in request["messages"]
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if isinstance(p, dict) and p.get("type") in ("image", "image_url")
    ]
    if len(parts) != len(ex.image_slots):
        raise ValueError(
            f"conversation: {len(parts)} image parts but {len(ex.image_slots)} rendered slots"
        )
    ids: list[int] = []
    mask: list[int] = []
    images: list[bytes] = []
    prev = 0
    for slot, part in zip(ex.image_slots, parts):
        data = _image_bytes(part)
        w, h = decode_image(data, cfg).size
        block = image_block(tokenizer, w, h, navit_resize(w, h, cfg).num_tokens)
        ids += ex.token_ids[prev:slot] + block
        mask += list(ex.loss_mask[prev:slot]) + [0] * len(block)
        images.append(data)
        prev = slot + 1
    ids += ex.token_ids[prev:]
    mask += list(ex.loss_mask[prev:])
    doc = document_from_ids(ids, mask)
    return ImageDocument(doc.ids, doc.labels, tuple(images))


class ImageSFTLoader:
    """Deterministic, resumable packed rows (batch size 1) of :class:`ImageDocument` s.

    Args:
        docs: the documents (each at most ``seq_len`` tokens).
        seq_len: T.
        seed: epoch ``e`` visits documents in ``numpy.random.default_rng([seed, e])`` order.
        shuffle: False = document order every epoch (evaluation).
        pad_id: padding id (label -100, its own segment).
        image_config: :class:`openk3.vision.preprocess.ImageProcessorConfig` (default: released).
    Raises:
        ValueError: no documents, ``seq_len`` < 2, or a document longer than ``seq_len`` (named).
    """

    def __init__(
        self,
        docs: list[ImageDocument],
        seq_len: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        pad_id: int = 0,
        image_config=None,
    ):
        from openk3.vision.preprocess import DEFAULT_CONFIG

        if not docs:
            raise ValueError("docs: needs at least one document")
        if seq_len < 2:
            raise ValueError(f"seq_len: must be >= 2, got {seq_len}")
        for i, d in enumerate(docs):
            if len(d.ids) > seq_len:
                raise ValueError(f"docs[{i}]: {len(d.ids)} tokens exceed seq_len={seq_len}")
        self.docs, self.seq_len, self.seed, self.shuffle = (
            docs,
            int(seq_len),
            int(seed),
            bool(shuffle),
        )
        self.pad_id = int(pad_id)
        self.image_config = image_config or DEFAULT_CONFIG
        self.epoch = 0
        self.cursor = 0
        self.batches = 0
        self._order_epoch: int | None = None
        self._order = np.arange(len(docs))
        h = hashlib.sha256()
        for d in docs:
            h.update(d.ids.tobytes())
            for im in d.images:
                h.update(hashlib.sha256(im).digest())
        self.fingerprint = h.hexdigest()[:16]

    def _current_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order = (
                np.random.default_rng([self.seed, self.epoch]).permutation(len(self.docs))
                if self.shuffle
                else np.arange(len(self.docs))
            )
            self._order_epoch = self.epoch
        return self._order

    def _config(self) -> dict[str, Any]:
        return {
            "documents": len(self.docs),
            "store": self.fingerprint,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "pad_id": self.pad_id,
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON position: ``epoch``, ``cursor`` (index into the epoch order), ``batches``, config."""
        return {
            "version": LOADER_STATE_VERSION,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "batches": self.batches,
            "config": self._config(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`.

        Raises:
            ValueError: another version or a different document set / config (field named).
        """
        if not isinstance(state, dict) or state.get("version") != LOADER_STATE_VERSION:
            raise ValueError(
                f"state.version: expected {LOADER_STATE_VERSION}, got "
                f"{state.get('version') if isinstance(state, dict) else state!r}"
            )
        for k, v in self._config().items():
            if state["config"].get(k) != v:
                raise ValueError(
                    f"state.config.{k}: saved {state['config'].get(k)!r}, this loader has {v!r}"
                )
        self.epoch, self.cursor, self.batches = (
            int(state["epoch"]),
            int(state["cursor"]),
            int(state["batches"]),
        )

    def next_doc_indices(self) -> list[int]:
        """Advance over one row's documents and return their indices (in row order)."""
        T = self.seq_len
        filled = 0
        out = []
        while True:
            if self.cursor >= len(self.docs):
                self.epoch = self.epoch + 1
                self.cursor = 0
            d = int(self._current_order()[self.cursor])
            n = len(self.docs[d].ids)
            if filled + n > T:
                return out
            out.append(d)
            filled += n
            self.cursor += 1

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next packed row: ``input_ids`` / ``labels`` [1, T] int64, ``cu_seqlens`` [N+1],
        and, when the row has images, ``pixel_values`` [L, 3, P, P] float32 and ``grid_thws``
        [G, 3] int64 in pad order."""
        from openk3.vision.preprocess import pack_images, process_image

        T = self.seq_len
        ids = np.full(T, self.pad_id, dtype=np.int64)
        labels = np.full(T, IGNORE_INDEX, dtype=np.int64)
        starts = []
        pos = 0
        images = []
        for d in self.next_doc_indices():
            doc = self.docs[d]
            starts.append(pos)
            ids[pos : pos + len(doc.ids)] = doc.ids
            labels[pos : pos + len(doc.ids)] = doc.labels
            pos += len(doc.ids)
            images += [process_image(im, self.image_config) for im in doc.images]
        if pos < T:
            starts.append(pos)  # padding is a segment of its own
        self.batches += 1
        out = {
            "input_ids": torch.from_numpy(ids).reshape(1, T),
            "labels": torch.from_numpy(labels).reshape(1, T),
            "cu_seqlens": torch.tensor(starts + [T], dtype=torch.long),
        }
        if images:
            out["pixel_values"], out["grid_thws"] = pack_images(images)
        return out


__all__ = ["ImageDocument", "image_chat_document", "ImageSFTLoader", "LOADER_STATE_VERSION"]
