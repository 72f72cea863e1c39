"""Image preprocessing for MoonViT-V2: decode, convert, resize, composite, pad, normalise, patchify.

Shape legend: W x H original size (pixels); w' x h' resized size; gh x gw patch grid; P patch size;
L = gh * gw patches; N = L / m^2 image tokens (m = ``merge_kernel_size``).

Follows the released K3 preprocessor (``preprocessor_config.json`` ``media_proc_cfg``: patch 14,
merge 2, ``in_patch_limit`` 65,536, ``patch_limit_on_one_side`` 512, mean = std = 0.5, transparent
pixels composited onto an 8-px 255/180 chessboard after the resize), as read in the public K3
ports (sglang ``kimi_k3`` processor, vLLM ``kimi_k25`` media preprocessing, PipeNetwork's
reference processor; architecture.md §11, chat-format spec §10).

Token count (:func:`navit_resize`), with S = ``patch_limit_on_one_side``, p = ``patch_size``,
m = ``merge_kernel_size``, B = ``in_patch_limit``, all divisions real unless written //::

    scale = min(1, sqrt(B / (max(1, W // p) * max(1, H // p))), S*p / W, S*p / H)
    w'    = min(max(1, floor(W * scale)), S*p)         h' likewise with H
    pad   = (-w') mod (m*p)                            (and for h'; zero pixels, bottom/right)
    gw    = (w' + pad_w) / p,  gh = (h' + pad_h) / p   (patches; never above S per side)
    N     = (gh / m) * (gw / m)                        (<|media_pad|> tokens in the prompt)

The image is resized to w' x h' (Pillow bicubic, aspect ratio kept up to the floor), then padded
with black (0) pixels on the right and bottom to a multiple of m*p; padded pixels normalise to -1.
Examples: 224x224 -> 64; 1000x500 -> 36x18 = 648; 2800x2800 -> 10,000; 1x1 -> 1 (a 28x28 pad).
The padding can lift N slightly above B / m^2 (8000x6000 -> 16,428 > 16,384); the vLLM and sglang
K3 ports keep that count, and so does openk3 (one other wrapper shrinks B until N <= B / m^2).

Pixel details: the image is converted first (RGB, or RGBA when it has transparency) and then
resized, as the sglang K3 processor does, so palette images are resampled bicubically too; EXIF
orientation is not applied (the released processor does not either).

Bad input raises :class:`ImageError` (a ``ValueError``; the server maps it to HTTP 400).
"""

from __future__ import annotations

import base64
import binascii
import copy
import dataclasses
import hashlib
import io
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
BG_PATTERNS = ("chessboard", "white", "black", "gray")
FILL_STAGES = ("before_resize", "after_resize")


class ImageError(ValueError):
    """A request image that cannot be used (HTTP 400).

    Attributes:
        code: ``"empty"``, ``"corrupt"``, ``"unsupported_format"``, ``"too_large"``, ``"too_many"``
            or ``"bad_url"``.
        index: position of the image in the request (None when unknown).
    """

    def __init__(self, message: str, *, code: str, index: int | None = None) -> None:
        self.code = code
        self.index = index
        super().__init__(message if index is None else f"image {index}: {message}")


def _default_bg() -> dict[str, Any]:
    return {
        "pattern": "chessboard",
        "chessboard_square_size": 8,
        "chessboard_square_on_top_left": True,
        "chessboard_white_value": 255,
        "chessboard_gray_value": 180,
    }


@dataclass
class ImageProcessorConfig:
    """``media_proc_cfg`` of the released ``preprocessor_config.json`` plus openk3's request limits.

    Official fields: patch_size, merge_kernel_size, in_patch_limit, patch_limit_on_one_side,
    fixed_output_tokens (must be None: a fixed count would not match the grid), image_mean,
    image_std, transparent_bg_config (None = drop alpha), transparent_bg_fill_stage.
    openk3 limits [P]: max_image_bytes (encoded size, 32 MiB as in the K3 ports),
    max_image_pixels (W*H before decoding, (S*p)^2 = 51,380,224), max_images (per request).
    Unknown keys of a ``media_proc_cfg`` dict are kept in ``extra``.

    Raises (construction):
        ValueError: a bad value, naming the field.
    """

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    fixed_output_tokens: int | None = None
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    transparent_bg_config: dict[str, Any] | None = field(default_factory=_default_bg)
    transparent_bg_fill_stage: str = "after_resize"
    max_image_bytes: int = 32 * 1024 * 1024
    max_image_pixels: int = (512 * 14) ** 2
    max_images: int = 16
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        mk = self.merge_kernel_size
        if isinstance(mk, (list, tuple)):
            if len(mk) != 2 or mk[0] != mk[1]:
                raise ValueError(
                    f"media_proc_cfg.merge_kernel_size: only square kernels are supported, got {mk!r}"
                )
            self.merge_kernel_size = int(mk[0])
        self.image_mean = tuple(float(v) for v in self.image_mean)
        self.image_std = tuple(float(v) for v in self.image_std)
        for name in (
            "patch_size",
            "merge_kernel_size",
            "in_patch_limit",
            "patch_limit_on_one_side",
            "max_image_bytes",
            "max_image_pixels",
            "max_images",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"media_proc_cfg.{name}: must be a positive integer, got {v!r}")
        if self.fixed_output_tokens is not None:
            raise ValueError(
                f"media_proc_cfg.fixed_output_tokens: only None is supported, got {self.fixed_output_tokens!r}"
            )
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError(
                f"media_proc_cfg.image_mean/image_std: need 3 values each, std > 0 "
                f"(got {self.image_mean}, {self.image_std})"
            )
        if self.transparent_bg_fill_stage not in FILL_STAGES:
            raise ValueError(
                f"media_proc_cfg.transparent_bg_fill_stage: must be one of {FILL_STAGES}, "
                f"got {self.transparent_bg_fill_stage!r}"
            )
        bg = self.transparent_bg_config
        if bg is not None and bg.get("pattern", "black") not in BG_PATTERNS:
            raise ValueError(
                f"media_proc_cfg.transparent_bg_config.pattern: must be one of {BG_PATTERNS}, "
                f"got {bg.get('pattern')!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """``media_proc_cfg`` dict (official keys, openk3 limits and extras)."""
        d = copy.deepcopy(self.extra)
        for f in dataclasses.fields(self):
            if f.name != "extra":
                d[f.name] = copy.deepcopy(getattr(self, f.name))
        d["image_mean"], d["image_std"] = list(self.image_mean), list(self.image_std)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ImageProcessorConfig":
        """From a ``media_proc_cfg`` dict (missing keys take the released defaults).

        Raises:
            ValueError: not a dict, or a bad value.
        """
        if not isinstance(d, dict):
            raise ValueError(f"media_proc_cfg must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: copy.deepcopy(v) for k, v in d.items() if k in known}
        kwargs["extra"] = {k: copy.deepcopy(v) for k, v in d.items() if k not in known}
        return cls(**kwargs)


DEFAULT_CONFIG = ImageProcessorConfig()


@dataclass(frozen=True)
class ResizePlan:
    """Result of :func:`navit_resize` for one W x H image (see the module docstring)."""

    width: int
    height: int
    new_width: int
    new_height: int
    pad_width: int
    pad_height: int
    grid_h: int
    grid_w: int
    num_tokens: int


def navit_resize(
    width: int, height: int, config: ImageProcessorConfig = DEFAULT_CONFIG
) -> ResizePlan:
    """Resize, pad and token count of a W x H image (formula in the module docstring).

    Raises:
        ImageError: width or height < 1 (code ``"empty"``).
    """
    if width < 1 or height < 1:
        raise ImageError(f"zero-size image {width}x{height}", code="empty")
    p = config.patch_size
    m = config.merge_kernel_size
    side = config.patch_limit_on_one_side
    # Same float operations, in the same order, as the released processor: int() truncation of
    # W * scale decides the grid, so a different but equivalent expression could differ by one.
    s_total = math.sqrt(config.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p)))
    scale = min(1.0, s_total, side * p / width, side * p / height)
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    f = m * p
    pad_w = (f - new_w % f) % f
    pad_h = (f - new_h % f) % f
    gw = (new_w + pad_w) // p
    gh = (new_h + pad_h) // p
    return ResizePlan(width, height, new_w, new_h, pad_w, pad_h, gh, gw, (gh // m) * (gw // m))


def image_token_count(
    width: int, height: int, config: ImageProcessorConfig = DEFAULT_CONFIG
) -> int:
    """N, the number of ``<|media_pad|>`` tokens for a W x H image (see :func:`navit_resize`)."""
    return navit_resize(width, height, config).num_tokens


@dataclass
class ProcessedImage:
    """One image ready for the tower.

    Attributes:
        pixel_values: [L, 3, P, P] float32, patches row-major over the gh x gw grid.
        grid_thw: (1, gh, gw).
        num_tokens: N = gh*gw / m^2.
        width, height: original size (the ``image {W}x{H}`` text of the prompt).
        plan: the :class:`ResizePlan`.
        content_hash: sha256 hex of the encoded bytes (or of the pixels for a PIL input); prefix
            caches key image positions on it.
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    num_tokens: int
    width: int
    height: int
    plan: ResizePlan
    content_hash: str


def image_bytes_from_data_url(url: str, index: int | None = None) -> bytes:
    """Bytes of a ``data:[mime];base64,...`` URL.

    Raises:
        ImageError: not a base64 data URL (code ``"bad_url"``: http(s) URLs are not fetched), or
            invalid base64 (``"corrupt"``).
    """
    if not isinstance(url, str) or not url.startswith("data:"):
        shown = url[:40] if isinstance(url, str) else type(url).__name__
        raise ImageError(
            f"only base64 data: URLs are accepted, got {shown!r}", code="bad_url", index=index
        )
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ImageError(
            "data URL is not base64-encoded (expected 'data:<mime>;base64,<data>')",
            code="bad_url",
            index=index,
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"invalid base64 image data ({e})", code="corrupt", index=index) from None


def open_image(
    data: bytes, config: ImageProcessorConfig = DEFAULT_CONFIG, index: int | None = None
) -> Image.Image:
    """Read an encoded image's header only: format and size, no pixel decoded (Pillow opens
    lazily). Callers plan the token count and the memory of a request from these sizes before
    paying for any decode (:func:`decode_image` then loads the pixels).

    Raises:
        ImageError: empty, over ``max_image_bytes`` or ``max_image_pixels``, zero-size, not an
            image, or another format.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageError(
            f"image data must be bytes, got {type(data).__name__}", code="corrupt", index=index
        )
    if len(data) == 0:
        raise ImageError("empty image data", code="empty", index=index)
    if len(data) > config.max_image_bytes:
        raise ImageError(
            f"{len(data)} bytes exceeds the limit of {config.max_image_bytes}",
            code="too_large",
            index=index,
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(bytes(data)))
    except Image.DecompressionBombError as e:
        raise ImageError(f"image too large ({e})", code="too_large", index=index) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(
            f"cannot identify image data ({type(e).__name__})", code="corrupt", index=index
        ) from None
    if img.format not in ALLOWED_FORMATS:
        raise ImageError(
            f"unsupported image format {img.format!r} (PNG, JPEG, WebP, GIF)",
            code="unsupported_format",
            index=index,
        )
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageError(f"zero-size image {w}x{h}", code="empty", index=index)
    if w * h > config.max_image_pixels:
        raise ImageError(
            f"{w}x{h} = {w * h} pixels exceeds the limit of {config.max_image_pixels}",
            code="too_large",
            index=index,
        )
    return img


def decode_image(
    data: bytes, config: ImageProcessorConfig = DEFAULT_CONFIG, index: int | None = None
) -> Image.Image:
    """Decode PNG / JPEG / WebP / GIF bytes (GIF: first frame) into a loaded Pillow image.

    The size is checked from the header before any pixel is decoded (:func:`open_image`;
    decompression bombs).

    Raises:
        ImageError: see :func:`open_image`; corrupt / truncated pixel data.
    """
    img = open_image(data, config, index)
    try:
        img.seek(0)  # animated GIF / WebP: the first frame
        img.load()
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:
        raise ImageError(f"corrupt image data ({e})", code="corrupt", index=index) from None
    return img


def _has_alpha(img: Image.Image) -> bool:
    # An alpha band (LA, PA, RGBA, ...) or palette / single-colour transparency. The reference tests
    # "A" in getbands(), which would also catch the a* band of LAB images; Pillow's own test does not.
    return img.mode != "RGB" and img.has_transparency_data


def _background(h: int, w: int, bg: dict[str, Any]) -> np.ndarray:
    """[h, w, 3] uint8 background for transparent pixels."""
    pattern = bg.get("pattern", "black")
    if pattern == "chessboard":
        s = int(bg.get("chessboard_square_size", 16))
        white = int(bg.get("chessboard_white_value", 255))
        gray = int(bg.get("chessboard_gray_value", 200))
        parity = (np.arange(h)[:, None] // s + np.arange(w)[None, :] // s) % 2
        # The square at the top-left corner is white when chessboard_square_on_top_left is true.
        gray_mask = parity == (1 if bg.get("chessboard_square_on_top_left", True) else 0)
        out = np.full((h, w, 3), white, dtype=np.uint8)
        out[gray_mask] = gray
        return out
    value = {"white": 255, "black": 0, "gray": 128}[pattern]
    return np.full((h, w, 3), value, dtype=np.uint8)


def _fill_transparent(img: Image.Image, bg: dict[str, Any] | None) -> Image.Image:
    """Composite alpha onto the configured background (truncated to uint8); RGB otherwise."""
    if img.mode == "RGB":
        return img
    if bg is None or not _has_alpha(img):
        return img.convert("RGB")
    rgba = np.asarray(img.convert("RGBA"))
    alpha = rgba[:, :, 3:4].astype(np.float32) / 255.0
    out = alpha * rgba[:, :, :3] + (1.0 - alpha) * _background(rgba.shape[0], rgba.shape[1], bg)
    return Image.fromarray(out.astype(np.uint8), mode="RGB")


def resized_pixels(
    img: Image.Image, plan: ResizePlan, config: ImageProcessorConfig = DEFAULT_CONFIG
) -> np.ndarray:
    """The padded uint8 image the tower sees -> [gh*P, gw*P, 3].

    Mode handling: RGB as is; images with alpha (an A band or palette transparency) keep it through
    the bicubic resize and are composited at ``transparent_bg_fill_stage``; others are converted
    to RGB (grayscale replicated, CMYK converted, 16-bit clipped as Pillow does).
    """
    bg = config.transparent_bg_config
    img = (
        img.convert("RGBA") if _has_alpha(img) else img.convert("RGB") if img.mode != "RGB" else img
    )
    size = (plan.new_width, plan.new_height)
    if config.transparent_bg_fill_stage == "before_resize":
        img = _fill_transparent(img, bg).resize(size, resample=Image.Resampling.BICUBIC)
    else:
        img = _fill_transparent(img.resize(size, resample=Image.Resampling.BICUBIC), bg)
    arr = np.asarray(img)
    return np.pad(
        arr, ((0, plan.pad_height), (0, plan.pad_width), (0, 0)), mode="constant", constant_values=0
    )


def normalize_and_patchify(
    arr: np.ndarray, config: ImageProcessorConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """uint8 [gh*P, gw*P, 3] -> float32 [gh*gw, 3, P, P]: (x/255 - mean) / std, patches row-major.

    Raises:
        ValueError: a side not a multiple of P.
    """
    p = config.patch_size
    h, w, c = arr.shape
    if h % p or w % p or c != 3:
        raise ValueError(
            f"normalize_and_patchify: expected [k*{p}, k*{p}, 3], got {list(arr.shape)}"
        )
    x = arr.astype(np.float32) / np.float32(255.0)
    x = (x - np.asarray(config.image_mean, dtype=np.float32)) * (
        1.0 / np.asarray(config.image_std, dtype=np.float32)
    )
    x = x.reshape(h // p, p, w // p, p, c).transpose(0, 2, 4, 1, 3).reshape(-1, c, p, p)
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def process_image(
    image: bytes | Image.Image,
    config: ImageProcessorConfig = DEFAULT_CONFIG,
    index: int | None = None,
) -> ProcessedImage:
    """Decode (bytes) or take a Pillow image, and produce the tower input.

    Raises:
        ImageError: see :func:`decode_image`; a zero-size or oversized Pillow image.
    """
    if isinstance(image, Image.Image):
        img = image
        w, h = img.size
        if w < 1 or h < 1:
            raise ImageError(f"zero-size image {w}x{h}", code="empty", index=index)
        if w * h > config.max_image_pixels:
            raise ImageError(
                f"{w}x{h} = {w * h} pixels exceeds the limit of {config.max_image_pixels}",
                code="too_large",
                index=index,
            )
        digest = hashlib.sha256(f"{img.mode}:{w}x{h}:".encode() + img.tobytes()).hexdigest()
    else:
        img = decode_image(image, config, index)
        digest = hashlib.sha256(bytes(image)).hexdigest()
    plan = navit_resize(img.size[0], img.size[1], config)
    pixels = normalize_and_patchify(resized_pixels(img, plan, config), config)
    return ProcessedImage(
        pixels,
        (1, plan.grid_h, plan.grid_w),
        plan.num_tokens,
        plan.width,
        plan.height,
        plan,
        digest,
    )


def process_images(
    images: Sequence[bytes | Image.Image], config: ImageProcessorConfig = DEFAULT_CONFIG
) -> list[ProcessedImage]:
    """:func:`process_image` for every image of a request, in order.

    Raises:
        ImageError: more than ``max_images`` (code ``"too_many"``), or the first bad image (with
            its index).
    """
    if len(images) > config.max_images:
        raise ImageError(
            f"{len(images)} images in one request exceeds the limit of {config.max_images}",
            code="too_many",
        )
    return [process_image(im, config, i) for i, im in enumerate(images)]


def pack_images(images: Sequence[ProcessedImage]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate for one tower call -> (pixel_values [sum L, 3, P, P], grid_thws [G, 3] int64).

    Raises:
        ValueError: no images.
    """
    if not images:
        raise ValueError("pack_images: no images")
    return (
        torch.cat([im.pixel_values for im in images]),
        torch.tensor([im.grid_thw for im in images], dtype=torch.int64),
    )
