"""K3Config: the architecture of a Kimi K3 (or Kimi Linear) text backbone.

Field names are the transformers / DeepSeek-V3 ones (``hidden_size``, ``kv_lora_rank``,
``n_routed_experts``, ``num_experts_per_tok``, ...). The released checkpoint spells some of them
differently (``num_experts``, ``num_experts_per_token``, ``num_shared_experts``,
``moe_renormalize``, ``num_expert_group``) and nests the KDA settings in ``linear_attn_config``
with **1-based** layer lists. Reading and writing ``config.json`` is driven by one declarative
table, :data:`openk3.config_fields.TEXT_FIELDS`: each field's official key and other spellings,
what absence means (the official config class's default) and what null means (what the official
modeling code makes of it). Every other key is kept and written back unchanged, so
``K3Config.from_dict(d).to_dict() == d`` for any config openk3 loads; the rest of openk3 sees
0-based ``layer_types`` only.

Sources: ``../shared/spec/architecture.md`` §1, ``../shared/spec/k3-release-notes.md`` §1, the K3
reference's ``configuration_kimi_k3.py`` / ``modeling_kimi_linear.py`` (see
:mod:`openk3.config_fields`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from openk3.config_fields import (  # noqa: F401 - the layer-type values are part of the config API
    DENSE,
    KDA,
    LAYER_FIELDS,
    MISSING,
    MLA,
    REFUSED,
    SPARSE,
    TEXT_FIELDS,
    WRAPPER_FIELDS,
    Field,
)
from openk3.presets import PRESETS
from openk3.typed_fields import check_fields

#: ``hidden_act`` values openk3 implements (``swiglu`` is read as ``silu``).
ACTIVATIONS = ("situ", "silu", "gelu", "gelu_pytorch_tanh")

_LA = "linear_attn_config"
_log = logging.getLogger("openk3.config")


@dataclass
class K3Config:
    """Architecture of the K3 text backbone (also covers the predecessor Kimi Linear).

    Defaults are the released Kimi K3 values (what ``K3Config()`` builds); what a field means when
    a ``config.json`` omits it or writes null is the table :data:`openk3.config_fields.TEXT_FIELDS`.

    Layer structure is data: ``layer_types[l]`` is ``"linear_attention"`` (KDA) or
    ``"full_attention"`` (gated MLA) and ``mlp_layer_types[l]`` is ``"dense"`` or ``"sparse"``
    (LatentMoE), both 0-based. Kimi-Linear behaviour is selected by the K3 flags being off:
    ``gate_lower_bound=None`` (softplus decay gate), ``use_full_rank_gate=False`` (low-rank
    output gate), ``hidden_act="silu"`` (SwiGLU), ``attn_res_block_size=None`` (plain residual),
    ``routed_expert_hidden_size=None`` (experts at full width), ``mla_use_output_gate=False``.
    Width fields of a layer kind the model does not have may be None (``kv_lora_rank`` etc.
    without MLA layers, ``linear_*`` without KDA layers, ``n_routed_experts=None``: no MoE).

    Raises:
        ValueError: a field whose value does not have its annotated type
            (:func:`openk3.typed_fields.check_fields`: ``K3Config.field=value: must be ...``), or a
            range / consistency error from :meth:`validate`; both name the field and its value.
    """

    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 33792
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    num_key_value_heads: int | None = 96
    rms_norm_eps: float = 1e-5
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float | None = 25.0
    initializer_range: float = 0.02
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 163584
    eos_token_id: int | None = 163586
    pad_token_id: int | None = 163839
    media_placeholder_token_id: int | None = None
    num_nextn_predict_layers: int = 0

    # Gated MLA (NoPE)
    q_lora_rank: int | None = 1536
    kv_lora_rank: int | None = 512
    qk_nope_head_dim: int | None = 128
    qk_rope_head_dim: int | None = 64
    v_head_dim: int | None = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True

    # Kimi Delta Attention (official: linear_attn_config)
    linear_num_heads: int | None = 96
    linear_head_dim: int | None = 128
    linear_conv_kernel_dim: int | None = 4
    gate_lower_bound: float | None = -5.0
    use_full_rank_gate: bool = True

    # Mixture of experts; n_routed_experts=None: no MoE layer.
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    n_routed_experts: int | None = 896
    num_experts_per_tok: int | None = 16
    n_shared_experts: int | None = 2
    moe_intermediate_size: int | None = 3072
    routed_expert_hidden_size: int | None = 3584
    latent_moe_use_norm: bool = True
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    moe_router_activation_func: str = "sigmoid"
    n_group: int = 1
    topk_group: int = 1

    # Block Attention Residuals; None = plain residual stream (Kimi Linear).
    attn_res_block_size: int | None = 12

    layer_types: list[str] = field(default_factory=list)
    mlp_layer_types: list[str] = field(default_factory=list)

    # Round-trip carriers: fields of the official files openk3 does not interpret.
    extra_text_config: dict[str, Any] = field(default_factory=dict, repr=False)
    wrapper: dict[str, Any] | None = field(default=None, repr=False)
    # How each table field was spelled in the file this config was read from (attr -> (keys
    # found, raw value)); None for a config built in code. Only :meth:`to_dict` reads it.
    source: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Types first (bools are not ints, strings not numbers, sizes within int64), so that
        # nothing derived below is built from a wrongly typed field.
        check_fields(self)
        for name in ("num_hidden_layers", "moe_layer_freq"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"K3Config.{name}={getattr(self, name)!r}: must be a positive integer"
                )
        if not self.layer_types:
            # The K3 pattern: every 4th layer (1-based) and the last layer are MLA.
            self.layer_types = [
                MLA if (i + 1) % 4 == 0 or i == self.num_hidden_layers - 1 else KDA
                for i in range(self.num_hidden_layers)
            ]
        if not self.mlp_layer_types:
            self.mlp_layer_types = self.derived_mlp_layer_types()
        self.layer_types = list(self.layer_types)
        self.mlp_layer_types = list(self.mlp_layer_types)
        self.validate()

    # ------------------------------------------------------------------ derived
    def derived_mlp_layer_types(self) -> list[str]:
        """The FFN schedule the official code builds from ``n_routed_experts``,
        ``first_k_dense_replace`` and ``moe_layer_freq``: layer l (0-based) is MoE iff experts
        exist, ``l >= first_k_dense_replace`` and ``l % moe_layer_freq == 0``."""
        return [
            SPARSE
            if self.n_routed_experts is not None
            and i >= self.first_k_dense_replace
            and i % self.moe_layer_freq == 0
            else DENSE
            for i in range(self.num_hidden_layers)
        ]

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of MLA: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def linear_proj_dim(self) -> int:
        """KDA projection width P = ``linear_num_heads * linear_head_dim`` (0 without KDA settings)."""
        return (self.linear_num_heads or 0) * (self.linear_head_dim or 0)

    @property
    def kda_state_dims(self) -> tuple[int, int, int]:
        """(H, K, W) of the KDA decode state; (0, 0, 1) for a model without KDA settings."""
        return (
            self.linear_num_heads or 0,
            self.linear_head_dim or 0,
            self.linear_conv_kernel_dim or 1,
        )

    @property
    def mla_cache_dims(self) -> tuple[int, int]:
        """(C, R) = (``kv_lora_rank``, ``qk_rope_head_dim``) of the MLA cache; 0 without MLA settings."""
        return self.kv_lora_rank or 0, self.qk_rope_head_dim or 0

    @property
    def moe_latent_size(self) -> int:
        """Width the routed experts run at (the latent width, or ``hidden_size`` if not latent)."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def is_k3(self) -> bool:
        """True for the K3 variant (lower-bounded KDA gate), False for Kimi Linear."""
        return self.gate_lower_bound is not None

    @property
    def use_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    def is_kda_layer(self, idx: int) -> bool:
        return self.layer_types[idx] == KDA

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Check ranges and consistency (widths of a layer kind are required only when the model
        has layers of that kind).

        Raises:
            ValueError: naming the offending field and value.
        """

        def bad(name: str, why: str) -> None:
            raise ValueError(f"K3Config.{name}={getattr(self, name)!r}: {why}")

        def positive(*names: str) -> None:
            for name in names:
                v = getattr(self, name)
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    bad(name, "must be a positive integer")

        positive(
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "moe_layer_freq",
            "max_position_embeddings",
            "n_group",
            "topk_group",
        )
        for name in ("first_k_dense_replace", "num_nextn_predict_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                bad(name, "must be a non-negative integer")
        if self.num_key_value_heads is not None:
            positive("num_key_value_heads")
        if self.n_shared_experts is not None and self.n_shared_experts < 0:
            bad("n_shared_experts", "must be a non-negative integer or None")
        if not self.rms_norm_eps > 0:
            bad("rms_norm_eps", "must be > 0")
        if not self.initializer_range >= 0:
            bad("initializer_range", "must be >= 0")
        if not self.routed_scaling_factor > 0:
            bad("routed_scaling_factor", "must be > 0")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < self.vocab_size:
                bad(name, f"outside the vocabulary [0, vocab_size={self.vocab_size})")
        media = self.media_placeholder_token_id
        if media is not None:
            # The KimiK3Config default (163605) is kept for any vocabulary; it must name a real id only
            # where images can enter the model.
            has_vision = self.wrapper is not None and self.wrapper.get("vision_config") is not None
            if media < 0 or (has_vision and media >= self.vocab_size):
                bad(
                    "media_placeholder_token_id",
                    f"outside the vocabulary [0, vocab_size={self.vocab_size})",
                )
        if self.hidden_act not in ACTIVATIONS:
            bad(
                "hidden_act",
                f"must be one of {', '.join(map(repr, ACTIVATIONS))} (other activations are not "
                "implemented)",
            )
        if self.hidden_act == "situ":
            if not self.activation_situ_beta > 0:
                bad("activation_situ_beta", "SiTU betas must be > 0")
            if (
                self.activation_situ_linear_beta is not None
                and not self.activation_situ_linear_beta > 0
            ):
                bad("activation_situ_linear_beta", "SiTU betas must be > 0 (or None: no cap)")
        if self.gate_lower_bound is not None and not self.gate_lower_bound < 0:
            bad("gate_lower_bound", "must be negative (log-decay floor) or None")
        if len(self.layer_types) != self.num_hidden_layers:
            bad("layer_types", f"needs {self.num_hidden_layers} entries (num_hidden_layers)")
        for i, t in enumerate(self.layer_types):
            if t not in (KDA, MLA):
                raise ValueError(f"K3Config.layer_types[{i}]={t!r}: must be {KDA!r} or {MLA!r}")
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            bad("mlp_layer_types", f"needs {self.num_hidden_layers} entries (num_hidden_layers)")
        for i, t in enumerate(self.mlp_layer_types):
            if t not in (DENSE, SPARSE):
                raise ValueError(
                    f"K3Config.mlp_layer_types[{i}]={t!r}: must be {DENSE!r} or {SPARSE!r}"
                )
        if MLA in self.layer_types:
            positive("kv_lora_rank", "qk_nope_head_dim", "v_head_dim")
            v = self.qk_rope_head_dim
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                bad("qk_rope_head_dim", "must be a non-negative integer (required with MLA layers)")
            if self.q_lora_rank is not None:
                positive("q_lora_rank")
            if self.mla_use_nope is not True:
                bad(
                    "mla_use_nope",
                    "rotary MLA is not used by K3 or Kimi Linear; only NoPE is implemented",
                )
        if KDA in self.layer_types:
            positive("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")
        if SPARSE in self.mlp_layer_types:
            positive("n_routed_experts", "moe_intermediate_size")
            if not (
                isinstance(self.num_experts_per_tok, int)
                and 0 < self.num_experts_per_tok <= self.n_routed_experts
            ):
                bad(
                    "num_experts_per_tok",
                    f"must be in [1, n_routed_experts={self.n_routed_experts}]",
                )
            if self.n_routed_experts % self.n_group:
                bad("n_group", f"must divide n_routed_experts={self.n_routed_experts}")
            if not (1 <= self.topk_group <= self.n_group):
                bad("topk_group", f"must be in [1, n_group={self.n_group}]")
            if self.moe_router_activation_func not in ("sigmoid", "softmax"):
                bad("moe_router_activation_func", "must be 'sigmoid' or 'softmax'")
        if self.routed_expert_hidden_size is not None and self.routed_expert_hidden_size <= 0:
            bad("routed_expert_hidden_size", "must be positive or None")
        if self.attn_res_block_size is not None and (
            not isinstance(self.attn_res_block_size, int) or self.attn_res_block_size <= 0
        ):
            bad(
                "attn_res_block_size",
                "must be a positive integer (decoder layers per block) or None",
            )

    # ------------------------------------------------------------- serialization
    def to_text_dict(self) -> dict[str, Any]:
        """The ``text_config`` (model_type ``kimi_linear``) in the official spelling.

        Driven by :data:`~openk3.config_fields.TEXT_FIELDS`. For a config read from a file, a field is
        written the way the file spelled it (same key, null kept) while its meaning is unchanged, and
        left out if the file left it out and it still has the absence meaning; a config built in code
        writes every field under its official key (None as null, except inside ``linear_attn_config``,
        which holds only the keys that are set, as the official class writes it).
        """
        d: dict[str, Any] = copy.deepcopy(self.extra_text_config)
        src = self.source
        for f in TEXT_FIELDS:
            if f.attr is None or f.attr in LAYER_FIELDS:
                continue
            _write_field(d, f, getattr(self, f.attr), src)
        self._write_layers(d)
        d["model_type"] = "kimi_linear"
        d.setdefault("architectures", ["KimiLinearForCausalLM"])
        return dict(sorted(d.items()))

    def _write_layers(self, d: dict[str, Any]) -> None:
        src = self.source or {}
        layout = src.get("__layers__", {})
        kda = [i + 1 for i, t in enumerate(self.layer_types) if t == KDA]
        full = [i + 1 for i, t in enumerate(self.layer_types) if t == MLA]
        if (
            self.source is None
            or "linear_attn_config" in layout
            or (kda and "layer_types" not in layout)
        ):
            lin = d.setdefault(_LA, {})
            raw = layout.get("linear_attn_config")
            if raw is not None and _layer_types_of(raw, self.num_hidden_layers) == self.layer_types:
                lin.update(copy.deepcopy(raw))  # the file's own lists, same meaning
            else:
                lin["kda_layers"] = kda
                lin["full_attn_layers"] = full
            d[_LA] = dict(sorted(lin.items()))
        if "layer_types" in layout:
            d["layer_types"] = list(self.layer_types)
        if "mlp_layer_types" in layout or self.mlp_layer_types != self.derived_mlp_layer_types():
            d["mlp_layer_types"] = list(
                self.mlp_layer_types
            )  # transformers' spelling of a custom schedule

    def to_dict(self) -> dict[str, Any]:
        """The full ``config.json``: the ``kimi_k3`` wrapper when this config came from one (or
        was made with :meth:`as_k3_wrapper`), otherwise the bare ``kimi_linear`` text config."""
        text = self.to_text_dict()
        if self.wrapper is None:
            return text
        out = copy.deepcopy(self.wrapper)
        out["text_config"] = text
        out["model_type"] = "kimi_k3"
        for f in WRAPPER_FIELDS:
            if f.attr is not None:
                _write_field(
                    out, f, getattr(self, f.attr), self.source, absent=_absent_meaning(f, self)
                )
        return out

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write ``config.json`` into directory ``path`` (atomically)."""
        os.makedirs(path, exist_ok=True)
        target = os.path.join(path, "config.json")
        tmp = target + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_json_string())
        os.replace(tmp, target)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "K3Config":
        """Build from an official ``config.json`` dict (``kimi_k3`` wrapper or bare text config),
        reading every field as :data:`~openk3.config_fields.TEXT_FIELDS` says.

        Raises:
            ValueError: a malformed config, or a value openk3 does not implement, naming the field.
        """
        if not isinstance(d, dict):
            raise ValueError(f"config must be a JSON object, got {type(d).__name__}")
        if d.get("model_type") == "kimi_k3" or "text_config" in d:
            if d.get("model_type", "kimi_k3") != "kimi_k3":
                # A wrapper of another multimodal model (kimi_vl, ...) has other weights and towers.
                raise ValueError(
                    f"config.model_type={d['model_type']!r}: expected 'kimi_k3' for a config with a "
                    "text_config"
                )
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise ValueError("config.text_config: missing or not an object in a kimi_k3 config")
            wrapper = {k: copy.deepcopy(v) for k, v in d.items() if k != "text_config"}
            kwargs, source = _read_fields(d, WRAPPER_FIELDS, "config")
            return _from_hf_text(
                text, wrapper=wrapper, wrapper_kwargs=kwargs, wrapper_source=source
            )
        return _from_hf_text(d)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "K3Config":
        """Read ``config.json`` from a checkpoint directory (or a path to the JSON file itself),
        or build a named preset (see :data:`PRESETS`).

        Raises:
            FileNotFoundError: no such file and no such preset.
            ValueError: malformed config, naming the field.
        """
        p = os.fspath(path)
        if not os.path.exists(p) and p in PRESETS:
            return preset(p)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        if not os.path.exists(p):  # something else than a file there: read_json names it
            raise FileNotFoundError(
                f"no config.json at {path!r} and no preset of that name ({', '.join(PRESETS)})"
            )
        from openk3.files import read_json

        data = read_json(p)  # a regular file under a size cap; any failure names the file
        if not isinstance(data, dict):
            raise ValueError(f"{p}: cannot load: expected a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    def as_k3_wrapper(self) -> "K3Config":
        """A copy that serializes as the multimodal ``kimi_k3`` wrapper (``language_model.`` names).

        The official ``KimiK3ForConditionalGeneration`` needs a ``vision_config``; set
        ``wrapper["vision_config"]`` for a model with a vision tower (a text-only model is saved as
        its bare text config, see :meth:`openk3.model.K3ForCausalLM.save_pretrained`)."""
        c = copy.deepcopy(self)
        if c.wrapper is None:
            c.wrapper = {
                "architectures": ["KimiK3ForConditionalGeneration"],
                "model_type": "kimi_k3",
                "bos_token_id": self.bos_token_id,
                "eos_token_id": self.eos_token_id,
                "pad_token_id": self.pad_token_id,
                "tie_word_embeddings": self.tie_word_embeddings,
                "dtype": "float32",
            }
        return c

    def text_only(self) -> "K3Config":
        """A copy without the ``kimi_k3`` wrapper (the bare ``kimi_linear`` text config)."""
        c = copy.deepcopy(self)
        c.wrapper = None
        return c

    def replace(self, **changes: Any) -> "K3Config":
        """A validated copy with ``changes`` applied (layer lists are rebuilt if the depth or the
        MoE schedule fields change)."""
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if "num_hidden_layers" in changes and "layer_types" not in changes:
            d["layer_types"] = []
        schedule = (
            "num_hidden_layers",
            "first_k_dense_replace",
            "moe_layer_freq",
            "n_routed_experts",
        )
        if (
            any(k in changes and changes[k] != d[k] for k in schedule)
            and "mlp_layer_types" not in changes
        ):
            d["mlp_layer_types"] = []
        d.update(changes)
        return K3Config(**d)


# ----------------------------------------------------------------------------- reading
def _get(t: dict[str, Any], key: str) -> Any:
    """The value of a table key (``linear_attn_config.x`` looks inside that object), or MISSING."""
    if key.startswith(_LA + "."):
        lin = t.get(_LA)
        sub = key[len(_LA) + 1 :]
        return lin[sub] if isinstance(lin, dict) and sub in lin else MISSING
    return t[key] if key in t else MISSING


def _put(d: dict[str, Any], key: str, value: Any) -> None:
    if key.startswith(_LA + "."):
        lin = d.get(_LA)
        if not isinstance(lin, dict):
            lin = d[_LA] = {}
        lin[key[len(_LA) + 1 :]] = copy.deepcopy(value)
    else:
        d[key] = copy.deepcopy(value)


def _meaning(f: Field, raw: Any) -> Any:
    """What a present raw value means (null -> the field's null meaning)."""
    if raw is None:
        return f.null
    if f.attr == "hidden_act" and raw == "swiglu":
        return "silu"
    return raw


def _same(a: Any, b: Any) -> bool:
    return (
        type(a) is type(b)
        and a == b
        or (
            isinstance(a, (int, float))
            and not isinstance(a, bool)
            and isinstance(b, (int, float))
            and not isinstance(b, bool)
            and a == b
        )
    )


def _absent_meaning(f: Field, cfg_or_kwargs: Any) -> Any:
    """What a missing key means. ``media_placeholder_token_id``: KimiK3Config's 163605, which for a
    vocabulary that does not reach it can match no input id, i.e. no image placeholder (None)."""
    if f.attr == "media_placeholder_token_id":
        vocab = (
            cfg_or_kwargs.get("vocab_size")
            if isinstance(cfg_or_kwargs, dict)
            else cfg_or_kwargs.vocab_size
        )
        return f.absent if isinstance(vocab, int) and f.absent < vocab else None
    return f.absent


def _write_field(
    d: dict[str, Any], f: Field, value: Any, src: dict[str, Any] | None, absent: Any = MISSING
) -> None:
    absent = f.absent if absent is MISSING else absent
    if src is not None and f.attr in src:
        keys, raw = src[f.attr]
        if raw is MISSING:
            if _same(value, absent):
                return
        elif _same(_meaning(f, raw), value):
            for key in keys:
                _put(d, key, raw)
            return
        else:
            for key in keys:
                _put(d, key, value)
            return
    if f.key.startswith(_LA + ".") and value is None:
        return
    _put(d, f.key, value)


def _read_fields(t: dict[str, Any], fields: tuple[Field, ...], where: str) -> tuple[dict, dict]:
    """Read the table fields of one object: {attr: value}, {attr: (keys found, raw)}.

    Raises:
        ValueError: two spellings of one field disagree, or a null the official code cannot run with.
    """
    kwargs: dict[str, Any] = {}
    source: dict[str, Any] = {}
    for f in fields:
        if f.attr is None or f.attr in LAYER_FIELDS:
            continue
        found = [(k, v) for k in f.keys if (v := _get(t, k)) is not MISSING]
        for k, v in found[1:]:
            if not _same(v, found[0][1]):
                raise ValueError(
                    f"{where}.{found[0][0]}={found[0][1]!r} and {where}.{k}={v!r}: two spellings of "
                    f"{f.attr} disagree"
                )
        if not found:
            kwargs[f.attr] = f.absent
            source[f.attr] = ((), MISSING)
            continue
        raw = found[0][1]
        value = _meaning(f, raw)
        if value is REFUSED:
            raise ValueError(
                f"{where}.{found[0][0]}=None: a value is required (the official code computes with it)"
            )
        kwargs[f.attr], source[f.attr] = (
            copy.deepcopy(value),
            (tuple(k for k, _ in found), copy.deepcopy(raw)),
        )
    return kwargs, source


def _layer_types_of(lin: dict[str, Any], n: int) -> list[str]:
    """0-based layer types from a ``linear_attn_config``: KDA iff the 1-based number is in
    ``kda_layers`` (the reference's ``is_kda_layer``), MLA otherwise.

    Raises:
        ValueError: a list that is not a list of 1-based layer numbers in 1..n.
    """
    for key in ("kda_layers", "full_attn_layers"):
        value = lin.get(key)
        if value is None:
            # KimiLinearConfig asserts both lists are set (a missing key is a KeyError there), so a
            # linear_attn_config without one is no model the official code builds.
            raise ValueError(
                f"config.linear_attn_config.{key}=None: a list of 1-based layer numbers is required "
                "(the official KimiLinearConfig asserts it)"
            )
        if not isinstance(value, list):
            raise ValueError(
                f"config.linear_attn_config.{key}={value!r}: must be a list of 1-based layer numbers"
            )
        for one_based in value:
            if (
                isinstance(one_based, bool)
                or not isinstance(one_based, int)
                or not 1 <= one_based <= n
            ):
                raise ValueError(
                    f"config.linear_attn_config.{key}: layer {one_based!r} outside 1..{n} "
                    "(lists are 1-based)"
                )
    kda = set(lin.get("kda_layers") or [])
    return [KDA if i + 1 in kda else MLA for i in range(n)]


# Keys the table reads that never go to extra_text_config (rebuilt on write).
_TABLE_KEYS = {
    k for f in TEXT_FIELDS if f.attr is not None for k in f.keys if not k.startswith(_LA + ".")
}


def _from_hf_text(
    t: dict[str, Any],
    *,
    wrapper: dict[str, Any] | None = None,
    wrapper_kwargs: dict[str, Any] | None = None,
    wrapper_source: dict[str, Any] | None = None,
) -> K3Config:
    """Translate an official text config (model_type ``kimi_linear``) into a :class:`K3Config`."""
    if t.get("model_type", "kimi_linear") not in ("kimi_linear", "kimi_k3_text"):
        raise ValueError(
            f"config.model_type={t.get('model_type')!r}: expected 'kimi_linear' or 'kimi_k3'"
        )
    lin = t.get(_LA)
    if lin is not None and not isinstance(lin, dict):
        raise ValueError(f"config.linear_attn_config: must be an object, got {type(lin).__name__}")
    if t.get("attention_bias") not in (None, False):
        raise ValueError(
            f"config.attention_bias={t['attention_bias']!r}: MLA projection biases are not "
            "implemented (no official Kimi model has them)"
        )
    kwargs, source = _read_fields(t, TEXT_FIELDS, "config")
    if (
        t.get("topk_group", 1) is None
        and isinstance(kwargs["n_group"], int)
        and kwargs["n_group"] > 1
    ):
        raise ValueError("config.topk_group=None: a value is required when num_expert_group > 1")
    n = kwargs["num_hidden_layers"]
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"config.num_hidden_layers={n!r}: must be a positive integer")
    layout: dict[str, Any] = {}
    if isinstance(lin, dict):
        kwargs["layer_types"] = _layer_types_of(lin, n)
        layout["linear_attn_config"] = {
            k: copy.deepcopy(lin[k]) for k in ("kda_layers", "full_attn_layers") if k in lin
        }
        if "layer_types" in t and t["layer_types"] != kwargs["layer_types"]:
            raise ValueError(
                f"config.layer_types={t['layer_types']!r} and config.linear_attn_config disagree"
            )
    elif "layer_types" in t:
        kwargs["layer_types"] = copy.deepcopy(t["layer_types"])  # transformers' 0-based list
    else:
        kwargs["layer_types"] = [MLA] * n  # no linear_attn_config: every layer is full attention
    if "layer_types" in t:
        layout["layer_types"] = True
        if not isinstance(t["layer_types"], list):
            raise ValueError(f"config.layer_types={t['layer_types']!r}: must be a list")
    if "mlp_layer_types" in t:
        if not isinstance(t["mlp_layer_types"], list):
            raise ValueError(f"config.mlp_layer_types={t['mlp_layer_types']!r}: must be a list")
        kwargs["mlp_layer_types"] = copy.deepcopy(t["mlp_layer_types"])
        layout["mlp_layer_types"] = True
    source["__layers__"] = layout
    if wrapper_kwargs:
        for f in WRAPPER_FIELDS:
            if (
                f.attr in wrapper_kwargs
                and (wrapper_source or {}).get(f.attr, ((), None))[1] is MISSING
            ):
                wrapper_kwargs[f.attr] = _absent_meaning(f, kwargs)
        kwargs.update(wrapper_kwargs)
        source.update(wrapper_source or {})
    extra = {
        k: copy.deepcopy(v)
        for k, v in t.items()
        if k not in _TABLE_KEYS and k not in ("layer_types", "mlp_layer_types")
    }
    cfg = K3Config(**kwargs, extra_text_config=extra, wrapper=wrapper, source=source)
    if (
        "mlp_layer_types" in t
        and any(k in t for k in ("first_k_dense_replace", "moe_layer_freq"))
        and cfg.mlp_layer_types != cfg.derived_mlp_layer_types()
    ):
        raise ValueError(
            f"config.mlp_layer_types={t['mlp_layer_types']!r} disagrees with first_k_dense_replace / "
            "moe_layer_freq / num_experts (the official code reads those)"
        )
    if cfg.num_nextn_predict_layers > 0:
        _log.warning(
            "config.num_nextn_predict_layers=%d: multi-token prediction is not implemented; the main "
            "model is built without MTP layers (as the official reference code does) and MTP tensors "
            "in a checkpoint are skipped",
            cfg.num_nextn_predict_layers,
        )
    return cfg


def preset(name: str) -> K3Config:
    """Build a named preset (:data:`openk3.presets.PRESETS`).

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        spec = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
    cfg = K3Config(**copy.deepcopy(spec.fields))
    if spec.wrapper is not None:
        cfg = cfg.as_k3_wrapper()
        for key, value in spec.wrapper.items():
            if key == "vision_config":
                from openk3.vision.config import vision_preset

                value = vision_preset(value).to_dict()
            cfg.wrapper[key] = value
    return cfg
