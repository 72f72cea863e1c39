"""Vision input for Kimi K3: MoonViT-V2 tower, patchmergerv2 projector, preprocessing, prompt expansion.

Pipeline: bytes -> :func:`process_images` (decode, resize, pad, normalise, patchify; token count
N per image) -> :func:`expand_prompt` (image blocks with N pads in the prompt ids) ->
:func:`pack_images` -> :class:`VisionModel` (tower + projector: one LM embedding per pad, in order).
Source: architecture.md §11; release notes §1.8; chat-format spec §10.

``openk3.vision.preprocess`` needs Pillow; it is imported on first use of its names so that the
model code does not depend on it.
"""

from __future__ import annotations

from typing import Any

from openk3.vision.config import VisionConfig, vision_preset
from openk3.vision.encoder import MoonViT, merged_token_counts
from openk3.vision.expand import ExpandedPrompt, expand_image_slots, expand_prompt, image_block
from openk3.vision.projector import PatchMergerV2
from openk3.vision.weights import (
    VisionModel,
    count_vision_parameters,
    init_vision_weights,
    load_vision_weights,
    vision_state_dict_to_hf,
)

_PREPROCESS = (
    "ImageError",
    "ImageProcessorConfig",
    "ProcessedImage",
    "ResizePlan",
    "decode_image",
    "image_bytes_from_data_url",
    "image_token_count",
    "navit_resize",
    "open_image",
    "pack_images",
    "process_image",
    "process_images",
)

__all__ = [
    "VisionConfig",
    "vision_preset",
    "MoonViT",
    "merged_token_counts",
    "PatchMergerV2",
    "VisionModel",
    "count_vision_parameters",
    "init_vision_weights",
    "load_vision_weights",
    "vision_state_dict_to_hf",
    "ExpandedPrompt",
    "expand_image_slots",
    "expand_prompt",
    "image_block",
    *_PREPROCESS,
]


def __getattr__(name: str) -> Any:
    if name in _PREPROCESS:
        from openk3.vision import preprocess

        return getattr(preprocess, name)
    raise AttributeError(f"module 'openk3.vision' has no attribute {name!r}")
