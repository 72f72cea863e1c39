"""VisionConfig: the MoonViT-V2 tower and ``patchmergerv2`` projector of Kimi K3.

Field names are the official ``vision_config`` ones of the released ``config.json``; every other
key of that dict (``_attn_implementation`` and the transformers ``PretrainedConfig`` defaults a
``save_pretrained`` writes) is kept verbatim in :attr:`VisionConfig.extra`, so that
``VisionConfig.from_dict(d).to_dict() == d`` for a dict that spells every field.

Sources: ``../shared/spec/architecture.md`` §1 and §11, ``../shared/spec/k3-release-notes.md`` §1.8,
the ``vision_config`` of ``../shared/k3/config.json``.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from openk3.typed_fields import check_fields

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")  # ViT MLP: tanh approximation (released) or exact erf
INTERPOLATION_MODES = ("bilinear", "bicubic")  # F.interpolate modes of the position table
# A size field's type error reads like its range error: "must be a positive integer (got '1152')".
_POSITIVE = {"expect": "a positive integer"}


def _message(name: str, value: Any, why: str) -> str:
    """The published form of a vision config error: ``vision_config.<field>: <why> (got <value!r>)``."""
    return f"vision_config.{name}: {why} (got {value!r})"


@dataclass
class VisionConfig:
    """The ``vision_config`` of a ``kimi_k3`` checkpoint (defaults = the released values).

    Attributes (official names):
        vt_num_hidden_layers, vt_hidden_size (D), vt_intermediate_size, vt_num_attention_heads:
            encoder depth and widths.
        qkv_hidden_size: attention width A (may differ from D; head dim = A / heads).
        patch_size: P, pixels per patch side (Conv2d kernel = stride = P).
        init_pos_emb_height, init_pos_emb_width: the learned position table [H0, W0, D].
        init_pos_emb_time: frames covered by the fixed sinusoidal time embedding.
        pos_emb_type ("divided_fixed"), pos_emb_interpolation_mode ("bilinear").
        merge_kernel_size: (kh, kw) spatial merge; merge_type "sd2_tpool" (time mean, then merge).
        mm_projector_type ("patchmergerv2"), mm_hidden_size (= D), text_hidden_size (LM width),
        projector_hidden_act ("gelu", exact erf), projector_ln_eps (post-norm eps).
        norm_type ("rmsnorm"), mlp_type ("mlp2"), activation_func ("gelu_pytorch_tanh").
        attn_bias, linear_bias, patch_embed_proj_bias: biases (all false in the release).
        extra: every other key of the official dict, written back unchanged.

    Raises (construction):
        ValueError: an unsupported or inconsistent value, naming the field and the value.
    """

    vt_num_hidden_layers: int = field(default=27, metadata=_POSITIVE)
    vt_hidden_size: int = field(default=1024, metadata=_POSITIVE)
    vt_intermediate_size: int = field(default=4096, metadata=_POSITIVE)
    vt_num_attention_heads: int = field(default=12, metadata=_POSITIVE)
    qkv_hidden_size: int = field(default=1536, metadata=_POSITIVE)
    patch_size: int = field(default=14, metadata=_POSITIVE)
    init_pos_emb_height: int = field(default=64, metadata=_POSITIVE)
    init_pos_emb_width: int = field(default=64, metadata=_POSITIVE)
    init_pos_emb_time: int = field(default=4, metadata=_POSITIVE)
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    merge_kernel_size: tuple[int, int] = (2, 2)
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int = field(default=1024, metadata=_POSITIVE)
    text_hidden_size: int = field(default=7168, metadata=_POSITIVE)
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    norm_type: str = "rmsnorm"
    mlp_type: str = "mlp2"
    activation_func: str = "gelu_pytorch_tanh"
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        mk = self.merge_kernel_size
        if isinstance(mk, int) and not isinstance(mk, bool):
            mk = (mk, mk)
        if not isinstance(mk, (list, tuple)) or len(mk) != 2:
            raise ValueError(
                f"vision_config.merge_kernel_size: expected [kh, kw], got {self.merge_kernel_size!r}"
            )
        self.merge_kernel_size = tuple(mk)
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def head_dim(self) -> int:
        """Per-head width K = qkv_hidden_size / vt_num_attention_heads."""
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merged_hidden_size(self) -> int:
        """Projector input width: mm_hidden_size * kh * kw (4096 in the release)."""
        return self.mm_hidden_size * self.merge_kernel_size[0] * self.merge_kernel_size[1]

    def validate(self) -> None:
        """Check every field's type (:func:`openk3.typed_fields.check_fields`), then the supported
        subset (the released variant and scaled copies of it).

        Raises:
            ValueError: ``vision_config.<field>: <why> (got <value!r>)``.
        """
        check_fields(self, message=_message)

        def bad(name: str, why: str) -> None:
            raise ValueError(_message(name, getattr(self, name), why))

        for name in (
            "vt_num_hidden_layers",
            "vt_hidden_size",
            "vt_intermediate_size",
            "vt_num_attention_heads",
            "qkv_hidden_size",
            "patch_size",
            "init_pos_emb_height",
            "init_pos_emb_width",
            "init_pos_emb_time",
            "mm_hidden_size",
            "text_hidden_size",
        ):
            if getattr(self, name) <= 0:
                bad(name, "must be a positive integer")
        if min(self.merge_kernel_size) <= 0:
            bad("merge_kernel_size", "entries must be positive")
        if self.qkv_hidden_size % self.vt_num_attention_heads:
            bad(
                "qkv_hidden_size",
                f"must be divisible by vt_num_attention_heads={self.vt_num_attention_heads}",
            )
        if self.head_dim % 4:
            bad(
                "qkv_hidden_size",
                "head dim (qkv_hidden_size / heads) must be divisible by 4 for the 2D rotary embedding",
            )
        if self.mm_hidden_size != self.vt_hidden_size:
            bad(
                "mm_hidden_size",
                f"must equal vt_hidden_size={self.vt_hidden_size} (the projector reads tower outputs)",
            )
        if self.projector_ln_eps <= 0:
            bad("projector_ln_eps", "must be a positive number")
        fixed = {
            "pos_emb_type": "divided_fixed",
            "merge_type": "sd2_tpool",
            "mm_projector_type": "patchmergerv2",
            "norm_type": "rmsnorm",
            "mlp_type": "mlp2",
            "projector_hidden_act": "gelu",
        }
        for name, want in fixed.items():
            if getattr(self, name) != want:
                bad(name, f"only {want!r} is implemented")
        if self.activation_func not in ACTIVATIONS:
            bad("activation_func", f"must be one of {ACTIVATIONS}")
        if self.pos_emb_interpolation_mode not in INTERPOLATION_MODES:
            bad("pos_emb_interpolation_mode", f"must be one of {INTERPOLATION_MODES}")

    # ------------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        """The official ``vision_config`` dict (``merge_kernel_size`` as a list, extras merged in)."""
        d = copy.deepcopy(self.extra)
        for f in dataclasses.fields(self):
            if f.name != "extra":
                d[f.name] = copy.deepcopy(getattr(self, f.name))
        d["merge_kernel_size"] = list(self.merge_kernel_size)
        return dict(sorted(d.items()))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VisionConfig":
        """Build from an official ``vision_config`` dict; unknown keys go to :attr:`extra`.

        An absent key means the ``KimiK3VisionConfig`` default (this class's defaults are those, the
        released values); ``mm_hidden_size`` null or absent means ``vt_hidden_size``, as there; any
        other null is refused.

        Raises:
            ValueError: ``d`` is not a dict, or a field value is unsupported (see :meth:`validate`).
        """
        if not isinstance(d, dict):
            raise ValueError(f"vision_config must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: copy.deepcopy(v) for k, v in d.items() if k in known}
        if (
            kwargs.get("mm_hidden_size") is None
        ):  # KimiK3VisionConfig: null or absent means vt_hidden_size
            kwargs["mm_hidden_size"] = kwargs.get("vt_hidden_size", cls.vt_hidden_size)
        kwargs["extra"] = {k: copy.deepcopy(v) for k, v in d.items() if k not in known}
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "VisionConfig":
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


def _released() -> VisionConfig:
    # The released vision_config (../shared/k3/config.json), including its one uninterpreted key.
    return VisionConfig(extra={"_attn_implementation": "flash_attention_2"})


def _tiny() -> VisionConfig:
    # Smallest tower that still exercises every branch: two layers, attention width != D, a pos
    # table smaller than typical grids (interpolation up) and larger than tiny ones (down).
    return VisionConfig(
        vt_num_hidden_layers=2,
        vt_hidden_size=32,
        vt_intermediate_size=64,
        vt_num_attention_heads=2,
        qkv_hidden_size=48,
        init_pos_emb_height=8,
        init_pos_emb_width=8,
        mm_hidden_size=32,
        text_hidden_size=64,
    )


PRESETS = {"kimi-k3": _released, "tiny": _tiny}


def vision_preset(name: str) -> VisionConfig:
    """A named vision config: ``"kimi-k3"`` (the release) or ``"tiny"`` (tests, toy models).

    Raises:
        ValueError: unknown name.
    """
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(
            f"vision preset: unknown name {name!r} (known: {', '.join(PRESETS)})"
        ) from None
