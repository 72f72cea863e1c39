"""Image inputs of an engine request: where the features go, where they come from, how they salt
the prefix-cache keys.

Shape legend: N image tokens of one image (its ``<|media_pad|>`` run), D LM hidden size, L patches
of one image, P patch size.

A request carries a list of :class:`ImageInput`, one per image, each naming the contiguous run of
pad positions in the prompt ids that its N projected features replace (the engine never sees the
tokenizer: the caller expands the prompt, e.g. :func:`openk3.vision.expand_prompt`). Features are
either precomputed ([N, D]) or computed by the engine from pixel values with the model's
``encode_images`` (``K3ForConditionalGeneration``) the first time a prefill piece reaches the image.

Prefix cache: a block's key must identify its *inputs*, and a pad position's input is the image
feature, not the pad id. Every block (or unaligned tail) that overlaps an image therefore hashes,
besides its token ids, the image's content hash and its position (:meth:`ImageSpan.key`); blocks
without images hash exactly as before. Same text + different images never share the image blocks;
same text + same image does.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class ImageInput:
    """One image of a request.

    Attributes:
        positions: the pad positions in the prompt ids, a contiguous ``range(start, start + N)``.
        content_hash: identifies the image content (e.g. sha256 hex of the encoded bytes,
            :attr:`openk3.vision.ProcessedImage.content_hash`); keys the prefix cache.
        pixel_values: [L, 3, P, P] float patches for the model's tower, with
        grid_thw: (t, h, w) of those patches; or
        features: [N, D] precomputed projected features (then no tower is needed).
    """

    positions: range
    content_hash: str | bytes
    pixel_values: torch.Tensor | None = None
    grid_thw: tuple[int, int, int] | None = None
    features: torch.Tensor | None = None

    @classmethod
    def from_processed(cls, processed, positions: range) -> "ImageInput":
        """From an :class:`openk3.vision.ProcessedImage` (anything with ``pixel_values``,
        ``grid_thw``, ``content_hash``) and its pad positions."""
        return cls(
            positions, processed.content_hash, processed.pixel_values, tuple(processed.grid_thw)
        )


@dataclass(frozen=True)
class ImageSpan:
    """What the engine keeps of an image after prefill: its pad run and its hash key material."""

    start: int
    stop: int
    key: bytes


def image_span(im: ImageInput) -> ImageSpan:
    """The :class:`ImageSpan` of a validated image: key = ``b"I" + sha256(content) + start + N``."""
    h = (
        im.content_hash.encode("utf-8")
        if isinstance(im.content_hash, str)
        else bytes(im.content_hash)
    )
    key = (
        b"I"
        + hashlib.sha256(h).digest()
        + struct.pack("<qq", im.positions.start, len(im.positions))
    )
    return ImageSpan(im.positions.start, im.positions.stop, key)


def spans_salt(spans: Sequence[ImageSpan], start: int, end: int) -> bytes:
    """Key material of the images overlapping token positions ``[start, end)`` (b"" if none)."""
    return b"".join(s.key for s in spans if s.start < end and start < s.stop)


def merged_count(grid_thw: Sequence[int], kernel: Sequence[int]) -> int:
    """Image tokens of a (t, h, w) patch grid under a (kh, kw) merge: (h/kh) * (w/kw)."""
    _, h, w = (int(v) for v in grid_thw)
    return (h // int(kernel[0])) * (w // int(kernel[1]))


def check_images(
    images,
    prompt_ids: Sequence[int],
    *,
    hidden_size: int,
    pad_id: int | None,
    merge_kernel: Sequence[int] | None,
    patch_size: int | None,
) -> list[ImageInput]:
    """Validate a request's images against its prompt and the model.

    Args:
        images: a sequence of :class:`ImageInput` (or None: no images).
        prompt_ids: the expanded prompt ids.
        hidden_size: D. pad_id: ``media_placeholder_token_id`` (checked at every position when set).
        merge_kernel, patch_size: the model's vision config (None: the model has no tower, so
            only precomputed features are accepted).
    Returns:
        The images as a list, ordered by position.
    Raises:
        ValueError: naming ``mm_inputs[i]`` and the problem (positions out of range, overlapping,
            not pads, feature shape, pixel shape vs grid, pixel values for a model without tower).
    """
    if images is None:
        return []
    if not isinstance(images, (list, tuple)):
        raise ValueError(f"mm_inputs: expected a list of ImageInput, got {type(images).__name__}")
    out = sorted(images, key=lambda im: getattr(getattr(im, "positions", None), "start", -1))
    prev = 0
    n_ids = len(prompt_ids)
    for i, im in enumerate(out):
        where = f"mm_inputs[{i}]"
        if not isinstance(im, ImageInput):
            raise ValueError(f"{where}: expected ImageInput, got {type(im).__name__}")
        pos = im.positions
        if not isinstance(pos, range) or pos.step != 1 or len(pos) == 0:
            raise ValueError(
                f"{where}.positions: expected a non-empty contiguous range, got {pos!r}"
            )
        if pos.start < prev or pos.stop > n_ids:
            raise ValueError(
                f"{where}.positions: {pos!r} overlaps another image or lies outside the "
                f"{n_ids} prompt ids"
            )
        prev = pos.stop
        if pad_id is not None and any(prompt_ids[p] != pad_id for p in pos):
            raise ValueError(
                f"{where}.positions: every position must hold the media pad id {pad_id}"
            )
        if not im.content_hash:
            raise ValueError(f"{where}.content_hash: required (keys the prefix cache)")
        n = len(pos)
        if im.features is not None:
            if im.pixel_values is not None:
                raise ValueError(f"{where}: give pixel_values or features, not both")
            f = im.features
            if (
                not isinstance(f, torch.Tensor)
                or not f.is_floating_point()
                or tuple(f.shape) != (n, hidden_size)
            ):
                shape = list(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__
                raise ValueError(
                    f"{where}.features: expected a float [{n}, {hidden_size}] tensor, got {shape}"
                )
            continue
        if im.pixel_values is None:
            raise ValueError(f"{where}: needs pixel_values (with grid_thw) or features")
        if merge_kernel is None:
            raise ValueError(
                f"{where}.pixel_values: the model has no vision tower; pass precomputed features"
            )
        g = im.grid_thw
        if g is None or len(g) != 3 or min(int(v) for v in g) < 1:
            raise ValueError(f"{where}.grid_thw: expected (t, h, w) positive, got {g!r}")
        t, h, w = (int(v) for v in g)
        pv = im.pixel_values
        want = (t * h * w, 3, patch_size, patch_size)
        if not isinstance(pv, torch.Tensor) or tuple(pv.shape) != want:
            shape = list(pv.shape) if isinstance(pv, torch.Tensor) else type(pv).__name__
            raise ValueError(
                f"{where}.pixel_values: expected {list(want)} for grid {(t, h, w)}, got {shape}"
            )
        if (
            h % int(merge_kernel[0])
            or w % int(merge_kernel[1])
            or merged_count(g, merge_kernel) != n
        ):
            raise ValueError(
                f"{where}: grid {(t, h, w)} gives {merged_count(g, merge_kernel)} image tokens under "
                f"merge {tuple(merge_kernel)}, but positions hold {n}"
            )
    return out
