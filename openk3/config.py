"""K3Config: the architecture of a Kimi K3 (or Kimi Linear) text backbone.

Field names are the transformers / DeepSeek-V3 ones (``hidden_size``, ``kv_lora_rank``,
``n_routed_experts``, ``num_experts_per_tok``, ...). The released checkpoint spells some of them
differently (``num_experts``, ``num_experts_per_token``, ``num_shared_experts``,
``moe_renormalize``, ``num_expert_group``) and nests the KDA settings in ``linear_attn_config``
with **1-based** layer lists; both are translated in exactly one place, :func:`_from_hf_text` /
:meth:`K3Config.to_dict`, so the rest of openk3 sees 0-based ``layer_types`` only.

Sources: ``../shared/spec/architecture.md`` §1 and ``../shared/spec/k3-release-notes.md`` §1.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

KDA = "linear_attention"
MLA = "full_attention"
DENSE = "dense"
SPARSE = "sparse"

# Official text-config name -> openk3 (DeepSeek-V3 / transformers) name.
_HF_ALIASES = {
    "num_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
    "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group",
}
_HF_NAMES = {v: k for k, v in _HF_ALIASES.items()}

# Fields written into ``linear_attn_config`` rather than the text config itself.
_LINEAR_KEYS = {
    "num_heads": "linear_num_heads",
    "head_dim": "linear_head_dim",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
    "gate_lower_bound": "gate_lower_bound",
    "use_full_rank_gate": "use_full_rank_gate",
}

# Fields an official text config always carries; a file without them is not silently given the
# 2.78T defaults.
_REQUIRED_HF = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")

# Derived fields: rebuilt from others, never written.
_DERIVED = {"layer_types", "mlp_layer_types"}


@dataclass
class K3Config:
    """Architecture of the K3 text backbone (also covers the predecessor Kimi Linear).

    Layer structure is data: ``layer_types[l]`` is ``"linear_attention"`` (KDA) or
    ``"full_attention"`` (gated MLA) and ``mlp_layer_types[l]`` is ``"dense"`` or ``"sparse"``
    (LatentMoE), both 0-based. Kimi-Linear behaviour is selected by the K3 flags being off:
    ``gate_lower_bound=None`` (softplus decay gate), ``use_full_rank_gate=False`` (low-rank
    output gate), ``hidden_act="silu"`` (SwiGLU), ``attn_res_block_size=None`` (plain residual),
    ``routed_expert_hidden_size=None`` (experts at full width), ``mla_use_output_gate=False``.

    Raises:
        ValueError: from :meth:`validate`, naming the field and its value.
    """

    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 33792
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    rms_norm_eps: float = 1e-5
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
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
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True

    # Kimi Delta Attention (official: linear_attn_config)
    linear_num_heads: int = 96
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    gate_lower_bound: float | None = -5.0
    use_full_rank_gate: bool = True

    # Mixture of experts
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    n_routed_experts: int = 896
    num_experts_per_tok: int = 16
    n_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int | None = 3584
    latent_moe_use_norm: bool = True
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    moe_router_activation_func: str = "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True

    # Block Attention Residuals; None = plain residual stream (Kimi Linear).
    attn_res_block_size: int | None = 12

    layer_types: list[str] = field(default_factory=list)
    mlp_layer_types: list[str] = field(default_factory=list)

    # Round-trip carriers: fields of the official files openk3 does not interpret.
    extra_text_config: dict[str, Any] = field(default_factory=dict, repr=False)
    wrapper: dict[str, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._check_types()
        for name in ("num_hidden_layers", "moe_layer_freq"):
            if getattr(self, name) <= 0:
                raise ValueError(f"K3Config.{name}={getattr(self, name)!r}: must be a positive integer")
        if not self.layer_types:
            # The K3 pattern: every 4th layer (1-based) and the last layer are MLA.
            self.layer_types = [
                MLA if (i + 1) % 4 == 0 or i == self.num_hidden_layers - 1 else KDA
                for i in range(self.num_hidden_layers)
            ]
        if not self.mlp_layer_types:
            self.mlp_layer_types = [
                SPARSE
                if i >= self.first_k_dense_replace and (i - self.first_k_dense_replace) % self.moe_layer_freq == 0
                else DENSE
                for i in range(self.num_hidden_layers)
            ]
        self.layer_types = list(self.layer_types)
        self.mlp_layer_types = list(self.mlp_layer_types)
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of MLA: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def linear_proj_dim(self) -> int:
        """KDA projection width P = ``linear_num_heads * linear_head_dim``."""
        return self.linear_num_heads * self.linear_head_dim

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
    def _check_types(self) -> None:
        """Every field has the JSON type its annotation says (bools are not ints, strings are not
        numbers), before anything derived from it is built.

        Raises:
            ValueError: naming the field and the value.
        """
        hints = typing.get_type_hints(K3Config)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            hint = hints[f.name]
            is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
            args = typing.get_args(hint) if is_union else ()
            optional = type(None) in args
            base = next(a for a in args if a is not type(None)) if is_union else hint
            if value is None:
                if optional:
                    continue
                raise ValueError(f"K3Config.{f.name}=None: a value is required")
            origin = typing.get_origin(base) or base
            if origin is bool:
                ok = isinstance(value, bool)
            elif origin is int:
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif origin is float:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            elif origin in (str, list, dict):
                ok = isinstance(value, origin)
            else:
                ok = True
            if not ok:
                want = getattr(origin, "__name__", str(origin))
                raise ValueError(f"K3Config.{f.name}={value!r}: must be {want}{' or None' if optional else ''}")

    def validate(self) -> None:
        """Check ranges and consistency.

        Raises:
            ValueError: naming the offending field and value.
        """

        def bad(name: str, why: str) -> None:
            raise ValueError(f"K3Config.{name}={getattr(self, name)!r}: {why}")

        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
            "qk_nope_head_dim", "v_head_dim", "linear_num_heads", "linear_head_dim",
            "linear_conv_kernel_dim", "intermediate_size", "moe_layer_freq", "num_key_value_heads",
            "max_position_embeddings", "n_group", "topk_group",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(name, "must be a positive integer")
        for name in ("qk_rope_head_dim", "first_k_dense_replace", "num_nextn_predict_layers", "n_shared_experts"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                bad(name, "must be a non-negative integer")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            bad("q_lora_rank", "must be a positive integer or None")
        if not self.rms_norm_eps > 0:
            bad("rms_norm_eps", "must be > 0")
        if not self.initializer_range >= 0:
            bad("initializer_range", "must be >= 0")
        if not self.routed_scaling_factor > 0:
            bad("routed_scaling_factor", "must be > 0")
        if self.topk_method != "noaux_tc":
            bad("topk_method", "only 'noaux_tc' (sigmoid scores + e_score_correction_bias) is implemented")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < self.vocab_size:
                bad(name, f"outside the vocabulary [0, vocab_size={self.vocab_size})")
        if self.hidden_act not in ("situ", "silu"):
            bad("hidden_act", "must be 'situ' (SiTU-GLU) or 'silu' (SwiGLU)")
        if self.hidden_act == "situ" and not (self.activation_situ_beta > 0 and self.activation_situ_linear_beta > 0):
            bad("activation_situ_beta", "SiTU betas must be > 0")
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
                raise ValueError(f"K3Config.mlp_layer_types[{i}]={t!r}: must be {DENSE!r} or {SPARSE!r}")
        if SPARSE in self.mlp_layer_types:
            if not isinstance(self.n_routed_experts, int) or self.n_routed_experts <= 0:
                bad("n_routed_experts", "must be a positive integer")
            if not (0 < self.num_experts_per_tok <= self.n_routed_experts):
                bad("num_experts_per_tok", f"must be in [1, n_routed_experts={self.n_routed_experts}]")
            if self.moe_intermediate_size <= 0:
                bad("moe_intermediate_size", "must be positive")
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
            bad("attn_res_block_size", "must be a positive integer (decoder layers per block) or None")
        if not self.mla_use_nope:
            bad("mla_use_nope", "rotary MLA is not used by K3 or Kimi Linear; only NoPE is implemented")

    # ------------------------------------------------------------- serialization
    def to_text_dict(self) -> dict[str, Any]:
        """The ``text_config`` (model_type ``kimi_linear``) in the official spelling."""
        d: dict[str, Any] = copy.deepcopy(self.extra_text_config)
        own = {f.name for f in dataclasses.fields(self)} - _DERIVED - {"extra_text_config", "wrapper"}
        linear_fields = set(_LINEAR_KEYS.values())
        for name in sorted(own - linear_fields - {"media_placeholder_token_id"}):
            d[_HF_NAMES.get(name, name)] = copy.deepcopy(getattr(self, name))
        if self.q_lora_rank is None:
            d["q_lora_rank"] = None
        if self.attn_res_block_size is None:
            d.pop("attn_res_block_size", None)
        if self.routed_expert_hidden_size is None:
            d.pop("routed_expert_hidden_size", None)
            d.pop("latent_moe_use_norm", None)
        lin = dict(d.get("linear_attn_config") or {})
        for hf_key, name in _LINEAR_KEYS.items():
            lin[hf_key] = getattr(self, name)
        if self.gate_lower_bound is None:
            lin.pop("gate_lower_bound", None)
        lin["kda_layers"] = [i + 1 for i, t in enumerate(self.layer_types) if t == KDA]
        lin["full_attn_layers"] = [i + 1 for i, t in enumerate(self.layer_types) if t == MLA]
        d["linear_attn_config"] = lin
        d["model_type"] = "kimi_linear"
        d.setdefault("architectures", ["KimiLinearForCausalLM"])
        return dict(sorted(d.items()))

    def to_dict(self) -> dict[str, Any]:
        """The full ``config.json``: the ``kimi_k3`` wrapper when this config came from one (or
        was made with :meth:`as_k3_wrapper`), otherwise the bare ``kimi_linear`` text config."""
        text = self.to_text_dict()
        if self.wrapper is None:
            return text
        out = copy.deepcopy(self.wrapper)
        out["text_config"] = text
        out["model_type"] = "kimi_k3"
        if self.media_placeholder_token_id is not None:
            out["media_placeholder_token_id"] = self.media_placeholder_token_id
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
        """Build from an official ``config.json`` dict (``kimi_k3`` wrapper or bare text config)."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a JSON object, got {type(d).__name__}")
        if d.get("model_type") == "kimi_k3" or "text_config" in d:
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise ValueError("config.text_config: missing or not an object in a kimi_k3 config")
            wrapper = {k: copy.deepcopy(v) for k, v in d.items() if k != "text_config"}
            cfg = _from_hf_text(text)
            cfg.wrapper = wrapper
            if d.get("media_placeholder_token_id") is not None:
                cfg.media_placeholder_token_id = d["media_placeholder_token_id"]
            return cfg
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
        if not os.path.isfile(p):
            raise FileNotFoundError(f"no config.json at {path!r} and no preset of that name ({', '.join(PRESETS)})")
        with open(p, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def as_k3_wrapper(self) -> "K3Config":
        """A copy that serializes as the multimodal ``kimi_k3`` wrapper (``language_model.`` names)."""
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

    def replace(self, **changes: Any) -> "K3Config":
        """A validated copy with ``changes`` applied (layer lists are rebuilt if the depth changes)."""
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if "num_hidden_layers" in changes or "first_k_dense_replace" in changes:
            d.setdefault("layer_types", [])
            if "layer_types" not in changes:
                d["layer_types"] = []
            if "mlp_layer_types" not in changes:
                d["mlp_layer_types"] = []
        d.update(changes)
        return K3Config(**d)


def _from_hf_text(t: dict[str, Any]) -> K3Config:
    """Translate an official text config (model_type ``kimi_linear``) into a :class:`K3Config`."""
    if t.get("model_type", "kimi_linear") not in ("kimi_linear", "kimi_k3_text"):
        raise ValueError(f"config.model_type={t.get('model_type')!r}: expected 'kimi_linear' or 'kimi_k3'")
    for key in _REQUIRED_HF:
        if key not in t:
            raise ValueError(f"config.{key}: missing (an official text config always has it)")
    known = {f.name for f in dataclasses.fields(K3Config)} - _DERIVED - {"extra_text_config", "wrapper"}
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in t.items():
        name = _HF_ALIASES.get(key, key)
        if key == "linear_attn_config":
            extra[key] = copy.deepcopy(value)  # kept for unknown sub-keys; layer lists are rebuilt
        elif name in known and name not in _LINEAR_KEYS.values():
            kwargs[name] = copy.deepcopy(value)
        else:
            extra[key] = copy.deepcopy(value)
    # transformers-style spellings of the KDA fields, if a config carries them at top level.
    for key, name in (("linear_num_heads", "linear_num_heads"), ("linear_head_dim", "linear_head_dim"),
                      ("linear_conv_kernel_dim", "linear_conv_kernel_dim")):
        if key in extra:
            kwargs[name] = extra.pop(key)
    lin = t.get("linear_attn_config") or {}
    if not isinstance(lin, dict):
        raise ValueError("config.linear_attn_config: must be an object")
    for key in ("kda_layers", "full_attn_layers"):
        if key in lin and not isinstance(lin[key], list):
            raise ValueError(f"config.linear_attn_config.{key}={lin[key]!r}: must be a list of 1-based layer numbers")
    for hf_key, name in _LINEAR_KEYS.items():
        if hf_key in lin:
            kwargs[name] = lin[hf_key]
    if "gate_lower_bound" not in lin:
        kwargs["gate_lower_bound"] = None  # Kimi Linear: softplus decay gate
    if "use_full_rank_gate" not in lin:
        kwargs["use_full_rank_gate"] = False
    if "attn_res_block_size" not in t:
        kwargs["attn_res_block_size"] = None
    if "routed_expert_hidden_size" not in t:
        kwargs["routed_expert_hidden_size"] = None
        kwargs.setdefault("latent_moe_use_norm", False)
    n = kwargs.get("num_hidden_layers", K3Config.num_hidden_layers)
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"config.num_hidden_layers={n!r}: must be a positive integer")
    if "kda_layers" in lin or "full_attn_layers" in lin:
        types: list[str | None] = [None] * n
        for key, kind in (("kda_layers", KDA), ("full_attn_layers", MLA)):
            for one_based in lin.get(key, []):
                if not isinstance(one_based, int) or not 1 <= one_based <= n:
                    raise ValueError(
                        f"config.linear_attn_config.{key}: layer {one_based!r} outside 1..{n} (lists are 1-based)"
                    )
                if types[one_based - 1] is not None:
                    raise ValueError(f"config.linear_attn_config.{key}: layer {one_based} listed twice")
                types[one_based - 1] = kind
        # The reference decides by `is_kda_layer`: anything not listed as KDA is full attention.
        kwargs["layer_types"] = [t_ if t_ is not None else MLA for t_ in types]
    elif "layer_types" in t:
        kwargs["layer_types"] = list(t["layer_types"])
    if "mlp_layer_types" in t and isinstance(t["mlp_layer_types"], list):
        kwargs["mlp_layer_types"] = list(t["mlp_layer_types"])
        extra.pop("mlp_layer_types", None)
    extra.pop("layer_types", None)
    kwargs["extra_text_config"] = extra
    if kwargs.get("hidden_act") == "swiglu":
        kwargs["hidden_act"] = "silu"
    return K3Config(**kwargs)


# Presets live in openk3/presets.py; re-exported here because they are part of the config API
# (``K3Config.from_pretrained("kimi-k3")``). Imported last: presets build K3Config objects.
from openk3.presets import PRESETS, preset  # noqa: E402
