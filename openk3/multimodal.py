"""``K3ForConditionalGeneration``: the K3 text model plus the MoonViT-V2 tower and projector.

Shape legend: B batch rows, T tokens, D LM hidden size (= ``vision_config.text_hidden_size``), V
vocabulary, N image tokens (``<|media_pad|>`` positions) of a call, L packed patches, P patch size.

Layering: the class *is* a :class:`~openk3.model.K3ForCausalLM` (same ``model.*`` / ``lm_head``
modules, same ``forward`` for text, so the engine, the trainers and the checkpoint code treat it
like the text model) with two more top-level modules under their official checkpoint names:
``vision_tower`` (:class:`~openk3.vision.MoonViT`) and ``mm_projector``
(:class:`~openk3.vision.PatchMergerV2`). It is built when the ``kimi_k3`` wrapper of the config
carries a ``vision_config`` (:func:`vision_config_of`); a text-only config builds the plain
``K3ForCausalLM``, exactly as before.

Images enter the LM by replacing token embeddings (architecture.md §11; release notes §1.8): the
prompt holds one ``<|media_pad|>`` id (``media_placeholder_token_id``) per merged patch, and
:meth:`K3ForConditionalGeneration.embed_with_images` writes the projected features there, image
after image, in row-major order of the pad positions. The LM itself is unchanged (causal
attention over text and image positions alike).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from openk3.config import K3Config
from openk3.model import K3ForCausalLM, K3Output
from openk3.vision.config import VisionConfig
from openk3.vision.encoder import MoonViT
from openk3.vision.projector import PatchMergerV2

VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def vision_config_of(config: K3Config) -> VisionConfig | None:
    """The :class:`VisionConfig` of a ``kimi_k3`` wrapper config, or None (text-only config).

    Raises:
        ValueError: a malformed ``vision_config``, or ``text_hidden_size`` != ``hidden_size``.
    """
    wrapper = config.wrapper
    raw = wrapper.get("vision_config") if wrapper is not None else None
    if raw is None:
        return None
    vc = raw if isinstance(raw, VisionConfig) else VisionConfig.from_dict(raw)
    if vc.text_hidden_size != config.hidden_size:
        raise ValueError(
            f"vision_config.text_hidden_size: {vc.text_hidden_size} must equal the LM hidden_size "
            f"{config.hidden_size} (the projector writes LM embeddings)"
        )
    return vc


def model_class_for(config: K3Config) -> type[K3ForCausalLM]:
    """``K3ForConditionalGeneration`` when the config has a vision tower, else ``K3ForCausalLM``."""
    return K3ForConditionalGeneration if vision_config_of(config) is not None else K3ForCausalLM


class K3ForConditionalGeneration(K3ForCausalLM):
    """K3 with image input: ``model.*`` + ``lm_head`` (text, as :class:`K3ForCausalLM`),
    ``vision_tower.*`` and ``mm_projector.*`` (official names, no ``language_model.`` prefix in the
    file; :mod:`openk3.checkpoint` writes them as they are).

    Raises (construction):
        ValueError: no ``vision_config`` in the config, or see :func:`vision_config_of`.
    """

    def __init__(self, config: K3Config) -> None:
        if vision_config_of(config) is None:
            raise ValueError(
                "config: K3ForConditionalGeneration needs a kimi_k3 wrapper with a vision_config"
            )
        super().__init__(config)

    def _build_modules(self) -> None:
        """The text modules, then ``vision_tower`` and ``mm_projector`` (initialised with the rest)."""
        super()._build_modules()
        self.vision_config = vc = vision_config_of(self.config)
        self.vision_tower = MoonViT(vc)
        self.mm_projector = PatchMergerV2(vc)

    @property
    def media_pad_id(self) -> int | None:
        """The ``<|media_pad|>`` id (``media_placeholder_token_id``), None if the config has none."""
        return self.config.media_placeholder_token_id

    def encode_images(
        self,
        pixel_values: torch.Tensor,
        grid_thws: torch.Tensor | Sequence[Sequence[int]],
        attn_impl: str = "sdpa",
    ) -> torch.Tensor:
        """Tower + projector: packed patches [L, 3, P, P] of G images -> [N, D] LM embeddings,
        image after image, each image's rows in the order of its pad tokens (param dtype).

        Raises:
            ValueError: see :meth:`openk3.vision.MoonViT.forward`.
        """
        return self.mm_projector(self.vision_tower(pixel_values, grid_thws, attn_impl))

    def embed_with_images(
        self,
        input_ids: torch.Tensor,
        image_features: torch.Tensor,
        pad_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings with the pad positions replaced by image features.

        Args:
            input_ids: [B, T] int64.
            image_features: [N, D], consumed in row-major order of the pad positions.
            pad_mask: [B, T] bool positions to replace (default ``input_ids == media_pad_id``).
        Returns:
            [B, T, D] in the embedding dtype; rows where ``pad_mask`` is false are exactly
            ``embed_tokens(input_ids)``, the others exactly ``image_features`` (cast).
        Raises:
            ValueError: ids outside the vocabulary, no pad id configured, wrong shapes, or N
                different from the number of pad positions.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [B, T], got {list(input_ids.shape)}")
        v = self.config.vocab_size
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= v):
            raise ValueError(
                f"input_ids: values must be in [0, vocab_size={v}), got "
                f"[{int(input_ids.min())}, {int(input_ids.max())}]"
            )
        if pad_mask is None:
            if self.media_pad_id is None:
                raise ValueError(
                    "config.media_placeholder_token_id: not set; pass pad_mask explicitly"
                )
            pad_mask = input_ids == self.media_pad_id
        if pad_mask.shape != input_ids.shape:
            raise ValueError(
                f"pad_mask: shape {list(pad_mask.shape)} != input_ids {list(input_ids.shape)}"
            )
        embeds = self.model.embed_tokens(input_ids)
        n = int(pad_mask.sum())
        if image_features.dim() != 2 or image_features.shape != (n, embeds.shape[-1]):
            raise ValueError(
                f"image_features: expected [{n}, {embeds.shape[-1]}] for {n} pad positions, "
                f"got {list(image_features.shape)}"
            )
        # masked_scatter fills the selected rows in row-major order and keeps autograd to both inputs
        return embeds.masked_scatter(pad_mask.unsqueeze(-1), image_features.to(embeds.dtype))

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        cache=None,
        *,
        pixel_values: torch.Tensor | None = None,
        grid_thws: torch.Tensor | Sequence[Sequence[int]] | None = None,
        image_features: torch.Tensor | None = None,
        **kwargs,
    ) -> K3Output:
        """:meth:`K3ForCausalLM.forward`, optionally with images.

        Args:
            input_ids: [B, T] with one ``<|media_pad|>`` per image token.
            pixel_values, grid_thws: packed images for :meth:`encode_images`; or
            image_features: [N, D] precomputed projected features (one of the two, or neither).
            kwargs: as :meth:`K3ForCausalLM.forward` (``labels``, ``lengths``, ``inputs_embeds`` for
                a call without images, ...).
        Raises:
            ValueError: both image inputs, images without ``input_ids`` or together with
                ``inputs_embeds``, or see :meth:`embed_with_images`.
        """
        if pixel_values is None and image_features is None:
            return super().forward(input_ids, cache, **kwargs)
        if pixel_values is not None and image_features is not None:
            raise ValueError("pass pixel_values (with grid_thws) or image_features, not both")
        if input_ids is None or kwargs.get("inputs_embeds") is not None:
            raise ValueError("images need input_ids (the pad positions) and no inputs_embeds")
        if image_features is None:
            if grid_thws is None:
                raise ValueError("grid_thws: required with pixel_values")
            image_features = self.encode_images(pixel_values, grid_thws)
        kwargs["inputs_embeds"] = self.embed_with_images(input_ids, image_features)
        return super().forward(None, cache, **kwargs)
