"""Image parts of a request: locate, decode, preprocess, expand into the prompt, count.

The renderer leaves one ``<|media_pad|>`` slot per image part (chat-format spec §10). Here each
slot's ``data:`` URL is decoded and preprocessed (:mod:`openk3.vision.preprocess`, the released
``media_proc_cfg``), the slot is expanded into the official image block
(``<|media_begin|>image {W}x{H}<|media_content|>`` + N pads + ``<|media_end|>``,
:func:`openk3.vision.expand_image_slots`) and, for generation, one
:class:`~openk3.engine.mm.ImageInput` per image carries the pixels, the pad positions and the
content hash to the engine. ``usage.prompt_tokens`` is the expanded length minus the generation
stub, so the token-count endpoints, the response usage and the engine's prompt length agree.

Errors are 400s naming where the image is: ``messages[i].content[j]`` of the body as sent (for the
Anthropic surface the location of the original block), as the parsed request recorded it
(``Prompt.image_locations``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from openk3.server.protocol import bad_request


@dataclass
class ExpandedImages:
    """The prompt with its images expanded.

    Attributes:
        token_ids: expanded prompt ids (what the engine receives).
        prompt_tokens: ``usage.prompt_tokens`` (expanded length minus the pending stub, §12).
        mm_inputs: one ``ImageInput`` per image (empty when ``pixels=False``).
    """

    token_ids: list[int]
    prompt_tokens: int
    mm_inputs: list = field(default_factory=list)


def _url(part: dict) -> str:
    ref = part.get("image_url", part.get("image"))
    return ref.get("url") if isinstance(ref, dict) else ref


def expand_images(
    prompt: Any,
    tokenizer: Any,
    config: Any,
    *,
    pixels: bool,
    check: Callable[[int, list[tuple[int, int, int]]], None] | None = None,
) -> ExpandedImages:
    """Expand the prompt's image slots, then (``pixels``) decode and preprocess the images.

    Order, so that a request refused for its size never pays for a decode: every image's header
    is read (format and size only, :func:`openk3.vision.preprocess.open_image`), the token counts
    follow from the sizes (:func:`~openk3.vision.preprocess.navit_resize`), the slots are
    expanded, ``check(len(expanded ids), grids)`` runs (the caller's context and memory limits;
    grids are the tower's ``(1, gh, gw)`` per image), and only then are pixels decoded.

    Args:
        prompt: the rendered :class:`~openk3.chat_format.render.Prompt` (image URLs already checked
            to be base64 data URLs and the model to support images); errors name each image at
            its ``Prompt.image_locations`` entry.
        tokenizer: the model's tokenizer. config: :class:`openk3.vision.ImageProcessorConfig`.
        pixels: also decode / resize / normalise / patchify for the engine (False: sizes from the
            headers only, for counting; no pixel is decoded).
        check: called before any decode, also for a prompt without images (grids ``[]``); it
            raises to refuse the request.
    Raises:
        APIError: 400 for too many images or an image that cannot be used (corrupt, empty, too
            large, unsupported format), naming ``messages[i].content[j]``; whatever ``check`` raises.
    """
    if not prompt.image_slots:
        if check is not None:
            check(len(prompt.token_ids), [])
        return ExpandedImages(list(prompt.token_ids), prompt.prompt_tokens)
    from openk3.vision.expand import expand_image_slots
    from openk3.vision.preprocess import (
        ImageError,
        image_bytes_from_data_url,
        navit_resize,
        open_image,
        process_image,
    )

    if len(prompt.images) > config.max_images:
        raise bad_request(
            f"messages: at most {config.max_images} images per request, got {len(prompt.images)}"
        )
    where = prompt.image_locations
    datas = []
    sizes = []
    plans = []
    locs = []
    for k, part in enumerate(prompt.images):
        loc = where[k] if k < len(where) and where[k] else f"image {k}"
        try:
            data = image_bytes_from_data_url(_url(part))
            w, h = open_image(data, config).size
        except ImageError as e:
            raise bad_request(f"{loc}: invalid image ({e.code}): {e}") from None
        datas.append(data)
        locs.append(loc)
        sizes.append((w, h))
        plans.append(navit_resize(w, h, config))
    try:
        expanded = expand_image_slots(
            prompt.token_ids, prompt.image_slots, sizes, [p.num_tokens for p in plans], tokenizer
        )
    except ValueError as e:
        raise bad_request(f"Invalid request: {e}") from None
    if check is not None:
        check(len(expanded.token_ids), [(1, p.grid_h, p.grid_w) for p in plans])
    prompt_tokens = prompt.prompt_tokens_with_images(expanded.image_token_counts)
    mm = []
    if pixels:
        from openk3.engine.mm import ImageInput

        for data, loc, pos in zip(datas, locs, expanded.pad_positions):
            try:
                im = process_image(data, config)
            except ImageError as e:
                raise bad_request(f"{loc}: invalid image ({e.code}): {e}") from None
            mm.append(ImageInput.from_processed(im, pos))
    return ExpandedImages(expanded.token_ids, prompt_tokens, mm)


def image_config_for(model: Any, checkpoint: str | None = None) -> Any:
    """The preprocessing config of a vision model: the checkpoint's ``preprocessor_config.json``
    ``media_proc_cfg`` when present, else the released defaults with the tower's patch and merge
    sizes; None for a text-only model.

    Raises:
        ValueError: an unreadable or invalid ``preprocessor_config.json``.
    """
    vc = getattr(model, "vision_config", None)
    if vc is None:
        return None
    import json
    import os

    from openk3.vision.preprocess import ImageProcessorConfig

    path = os.path.join(checkpoint, "preprocessor_config.json") if checkpoint else None
    if path and os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not readable JSON ({e})") from None
        cfg = ImageProcessorConfig.from_dict(
            raw.get("media_proc_cfg", raw) if isinstance(raw, dict) else raw
        )
        if cfg.patch_size != vc.patch_size or (cfg.merge_kernel_size,) * 2 != tuple(
            vc.merge_kernel_size
        ):
            raise ValueError(
                f"{path}: patch_size {cfg.patch_size} / merge_kernel_size {cfg.merge_kernel_size} "
                f"disagree with vision_config ({vc.patch_size}, {list(vc.merge_kernel_size)})"
            )
        return cfg
    return ImageProcessorConfig(
        patch_size=vc.patch_size, merge_kernel_size=list(vc.merge_kernel_size)
    )
