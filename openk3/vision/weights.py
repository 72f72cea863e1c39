"""Vision tower + projector as one module in the official layout: loading, saving, init, counting.

Official tensor names (checkpoint, release notes §1.8), D = ``vt_hidden_size``, A =
``qkv_hidden_size``, I = ``vt_intermediate_size``, P = ``patch_size``, M = merged width, E =
``text_hidden_size``::

    vision_tower.patch_embed.proj.weight                 [D, 3, P, P]
    vision_tower.patch_embed.pos_emb.weight              [H0, W0, D]
    vision_tower.encoder.blocks.{i}.norm0.weight         [D]
    vision_tower.encoder.blocks.{i}.wqkv.weight          [3A, D]
    vision_tower.encoder.blocks.{i}.wo.weight            [D, A]
    vision_tower.encoder.blocks.{i}.norm1.weight         [D]
    vision_tower.encoder.blocks.{i}.mlp.fc0.weight       [I, D]
    vision_tower.encoder.blocks.{i}.mlp.fc1.weight       [D, I]
    vision_tower.encoder.final_layernorm.weight          [D]
    mm_projector.proj.0.weight                           [M, M]
    mm_projector.proj.2.weight                           [E, M]
    mm_projector.post_norm.weight                        [E]

openk3's module attributes carry exactly these names, so no renaming happens anywhere.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from openk3.vision.config import VisionConfig
from openk3.vision.encoder import MoonViT
from openk3.vision.projector import PatchMergerV2

TOWER_PREFIX = "vision_tower."
PROJECTOR_PREFIX = "mm_projector."


class VisionModel(nn.Module):
    """``vision_tower`` (:class:`MoonViT`) + ``mm_projector`` (:class:`PatchMergerV2`):
    preprocessed patches -> one LM embedding per ``<|media_pad|>`` position."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = MoonViT(config)
        self.mm_projector = PatchMergerV2(config)

    def forward(
        self,
        pixel_values: torch.Tensor,
        grid_thws: torch.Tensor | Sequence[Sequence[int]],
        attn_impl: str = "sdpa",
    ) -> torch.Tensor:
        """[L, 3, P, P] patches of G packed items -> [N, E] features, item after item, each item's
        rows in the order of its pad tokens.

        Raises:
            ValueError: see :meth:`MoonViT.forward`.
        """
        return self.mm_projector(self.vision_tower(pixel_values, grid_thws, attn_impl))

    @classmethod
    def from_state_dict(
        cls,
        tensors: Mapping[str, torch.Tensor],
        vision_config: VisionConfig | dict,
        *,
        dtype: torch.dtype = torch.float32,
    ) -> "VisionModel":
        """Build and strictly load from official names (other prefixes in ``tensors`` are ignored).

        Raises:
            ValueError: a missing, unexpected or wrongly shaped ``vision_tower.*`` /
                ``mm_projector.*`` tensor (all of them listed), or a bad config.
        """
        config = (
            vision_config
            if isinstance(vision_config, VisionConfig)
            else VisionConfig.from_dict(vision_config)
        )
        with torch.device("meta"):
            model = cls(config)
        load_vision_weights(model, tensors, assign=True, dtype=dtype)
        return model


def _official_names(module: nn.Module) -> dict[str, str]:
    """module state-dict key -> official name, for a VisionModel, MoonViT or PatchMergerV2."""
    keys = list(module.state_dict().keys())
    if isinstance(module, VisionModel):
        return {k: k for k in keys}
    if isinstance(module, MoonViT):
        return {k: TOWER_PREFIX + k for k in keys}
    if isinstance(module, PatchMergerV2):
        return {k: PROJECTOR_PREFIX + k for k in keys}
    raise ValueError(
        f"module: expected VisionModel, MoonViT or PatchMergerV2, got {type(module).__name__}"
    )


def _prefixes(module: nn.Module) -> tuple[str, ...]:
    if isinstance(module, MoonViT):
        return (TOWER_PREFIX,)
    if isinstance(module, PatchMergerV2):
        return (PROJECTOR_PREFIX,)
    return (TOWER_PREFIX, PROJECTOR_PREFIX)


def load_vision_weights(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    *,
    assign: bool = False,
    dtype: torch.dtype | None = None,
) -> None:
    """Strictly load official tensors into a :class:`VisionModel`, :class:`MoonViT` or
    :class:`PatchMergerV2`: every expected name present with its exact shape, no unexpected name
    under the module's prefixes (``vision_tower.`` and/or ``mm_projector.``); other keys (the
    ``language_model.*`` tensors of a full checkpoint) are ignored.

    Args:
        assign: replace the parameters by the given tensors (needed for a meta-device module).
        dtype: cast the tensors to this dtype first (default: keep the module's / file's dtype).
    Raises:
        ValueError: listing every missing, unexpected and mis-shaped name.
    """
    names = _official_names(module)
    prefixes = _prefixes(module)
    expected = dict(module.state_dict())
    wanted = {official: key for key, official in names.items()}
    missing = sorted(o for o in wanted if o not in tensors)
    unexpected = sorted(n for n in tensors if n.startswith(prefixes) and n not in wanted)
    shapes = sorted(
        f"{o}: file {list(tensors[o].shape)} != model {list(expected[k].shape)}"
        for o, k in wanted.items()
        if o in tensors and tuple(tensors[o].shape) != tuple(expected[k].shape)
    )
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unexpected:
            parts.append(f"unexpected {unexpected}")
        if shapes:
            parts.append(f"shape mismatch {shapes}")
        raise ValueError("vision weights: " + "; ".join(parts))
    state = {}
    for key, official in names.items():
        t = tensors[official]
        if dtype is not None:
            t = t.to(dtype)
        elif assign is False:
            t = t.to(expected[key].dtype)
        state[key] = t
    module.load_state_dict(state, strict=True, assign=assign)


def vision_state_dict_to_hf(module: nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """Official name -> tensor for a VisionModel / MoonViT / PatchMergerV2 (detached, contiguous).

    Raises:
        ValueError: another module type.
    """
    names = _official_names(module)
    return OrderedDict((names[k], t.detach().contiguous()) for k, t in module.state_dict().items())


@torch.no_grad()
def init_vision_weights(
    module: nn.Module, generator: torch.Generator | None = None, std: float = 0.02
) -> None:
    """Fresh-training init [P] (the official recipe is not public): N(0, std) for linears, the patch
    projection and the position table; ones for RMSNorm weights; zero biases."""
    for name, p in module.named_parameters():
        if (
            name.endswith("norm0.weight")
            or name.endswith("norm1.weight")
            or "layernorm" in name
            or "post_norm" in name
        ):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.copy_(
                torch.randn(p.shape, generator=generator, dtype=torch.float32).mul_(std).to(p.dtype)
            )


def _component(name: str) -> str:
    if name.startswith(PROJECTOR_PREFIX):
        return "mm_projector"
    if ".pos_emb." in name:
        return "pos_emb"
    if ".patch_embed." in name:
        return "patch_embed"
    if ".blocks." in name:
        return "blocks"
    return "final_norm"


def count_vision_parameters(vision_config: VisionConfig | dict) -> dict:
    """Parameter counts of the tower and the projector, from modules built on the meta device.

    Returns:
        ``{"vision_tower": int, "mm_projector": int, "total": int, "by_component": {"patch_embed",
        "pos_emb", "blocks", "final_norm", "mm_projector": int}}``. The released config gives
        vision_tower = 401,214,464 (architecture.md §11) and mm_projector = 46,144,512.
    """
    config = (
        vision_config
        if isinstance(vision_config, VisionConfig)
        else VisionConfig.from_dict(vision_config)
    )
    with torch.device("meta"):
        model = VisionModel(config)
    by = {c: 0 for c in ("patch_embed", "pos_emb", "blocks", "final_norm", "mm_projector")}
    for name, p in model.named_parameters():
        by[_component(name)] += p.numel()
    tower = sum(v for c, v in by.items() if c != "mm_projector")
    return {
        "vision_tower": tower,
        "mm_projector": by["mm_projector"],
        "total": tower + by["mm_projector"],
        "by_component": by,
    }
