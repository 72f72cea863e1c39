"""The one table of every ``config.json`` field openk3 reads, and what each one means.

Each :class:`Field` names the official key (first) and the other spellings openk3 accepts (the
transformers / DeepSeek-V3 ones), its JSON type, what **absence** means (the default of the
official config class: ``KimiLinearConfig`` / ``KimiK3Config`` in the released K3 reference code
``configuration_kimi_k3.py``, which for the fields they share equals the Kimi-Linear-48B-A3B
release's ``configuration_kimi.py``), what **null** means (what the official modeling code makes of
it: a value, or an error where that code cannot run with null), and how openk3 handles it:

* ``honoured``: read into :class:`~openk3.config.K3Config` and implemented;
* ``ignored``: no effect on outputs in the official code (it never reads the field, or the value
  cannot change a result); kept verbatim and written back;
* values openk3 does not implement are refused with a ``ValueError`` naming the field (the
  ``meaning`` column says which).

:func:`openk3.config.K3Config.from_dict` and :meth:`~openk3.config.K3Config.to_dict` are driven by
:data:`TEXT_FIELDS` / :data:`WRAPPER_FIELDS`; every key not in the table is kept verbatim
(``extra_text_config`` / ``wrapper``) and written back. :func:`fields_markdown` renders the table
for the README (a test keeps the two equal).

Sources: ``configuration_kimi_k3.py`` and ``modeling_kimi_linear.py`` of the K3 reference
(PipeNetwork/kimi-k3-mlx ``reference/`` at 20a4fb1, the code that wrote ``../shared/fixtures``),
``configuration_kimi.py`` / ``modeling_kimi.py`` of moonshotai/Kimi-Linear-48B-A3B-Instruct,
transformers' ``KimiLinearConfig``, vLLM's ``kimi_linear``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Values of ``layer_types`` / ``mlp_layer_types`` (re-exported by openk3.config).
KDA = "linear_attention"
MLA = "full_attention"
DENSE = "dense"
SPARSE = "sparse"

HONOURED = "honoured"
IGNORED = "ignored"


class _Marker:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


#: ``null``: the official code cannot run with null here (it computes with the value): an error.
REFUSED = _Marker("error")
#: Sentinel for "key not present" in a parsed source.
MISSING = _Marker("missing")


@dataclass(frozen=True)
class Field:
    """One config field.

    Attributes:
        attr: the :class:`~openk3.config.K3Config` attribute (transformers / DeepSeek-V3 name), or
            None for an ``ignored`` field that stays in the carried dict.
        keys: official key first, then accepted spellings; ``"linear_attn_config.num_heads"`` is a
            key inside the ``linear_attn_config`` object.
        type: JSON type as written in the table (``"int"``, ``"float | null"``, ...).
        absent: the value a missing key means (the official class default).
        null: the value a null means, or :data:`REFUSED`.
        status: :data:`HONOURED` or :data:`IGNORED`.
        meaning: what the field does, what openk3 supports, what it refuses.
    """

    attr: str | None
    keys: tuple[str, ...]
    type: str
    absent: Any
    null: Any
    status: str
    meaning: str

    @property
    def key(self) -> str:
        return self.keys[0]


def _f(attr, keys, type_, absent, null, meaning, status=HONOURED) -> Field:
    return Field(
        attr,
        tuple(keys) if isinstance(keys, (list, tuple)) else (keys,),
        type_,
        absent,
        null,
        status,
        meaning,
    )


_LA = "linear_attn_config."

#: The text config (``model_type: kimi_linear``; the ``text_config`` of a ``kimi_k3`` wrapper).
TEXT_FIELDS: tuple[Field, ...] = (
    _f(
        "vocab_size",
        "vocab_size",
        "int",
        163840,
        REFUSED,
        "Vocabulary size V (embedding and lm_head rows).",
    ),
    _f("hidden_size", "hidden_size", "int", 4096, REFUSED, "Model width D."),
    _f(
        "intermediate_size",
        "intermediate_size",
        "int",
        11008,
        REFUSED,
        "Dense-FFN width (layers that are not MoE).",
    ),
    _f("num_hidden_layers", "num_hidden_layers", "int", 32, REFUSED, "Decoder layers L."),
    _f("num_attention_heads", "num_attention_heads", "int", 32, REFUSED, "MLA query heads."),
    _f(
        "num_key_value_heads",
        "num_key_value_heads",
        "int | null",
        None,
        None,
        "No effect: MLA keys and values are per head (kv_b_proj), and the reference forces flash attention, "
        "where the group count does not matter. Kept; null/absent means num_attention_heads.",
        IGNORED,
    ),
    _f(
        "hidden_act",
        "hidden_act",
        "str",
        "silu",
        REFUSED,
        "GLU activation of every MLP and expert: `situ` (SiTU-GLU), `silu` (SwiGLU), `gelu` (erf), "
        "`gelu_pytorch_tanh`; `swiglu` is read as `silu`. Other ACT2FN names are refused.",
    ),
    _f(
        "activation_situ_beta",
        "activation_situ_beta",
        "float | null",
        1.0,
        1.0,
        "SiTU gate cap beta1 (only with `situ`). The reference uses `beta or 1.0`: null or absent is 1.0.",
    ),
    _f(
        "activation_situ_linear_beta",
        "activation_situ_linear_beta",
        "float | null",
        None,
        None,
        "SiTU up-branch cap beta2 (only with `situ`). Null or absent: the up branch is not capped.",
    ),
    _f(
        "initializer_range",
        "initializer_range",
        "float",
        0.02,
        REFUSED,
        "Std of the random init (no effect on a loaded checkpoint).",
    ),
    _f(
        "rms_norm_eps",
        "rms_norm_eps",
        "float",
        1e-6,
        REFUSED,
        "Eps of every RMSNorm except MLA's q_a/kv_a norms (fixed 1e-6 in the reference). The official class "
        "default is 1e-6, not the release's 1e-5.",
    ),
    _f(
        "max_position_embeddings",
        ("max_position_embeddings", "model_max_length"),
        "int",
        4096,
        REFUSED,
        "Longest sequence openk3 serves or trains (the model is NoPE, so no math depends on it). "
        "`model_max_length` is the Kimi-Linear-48B-A3B / transformers spelling.",
    ),
    _f(
        "tie_word_embeddings",
        "tie_word_embeddings",
        "bool",
        False,
        False,
        "lm_head shares the embedding matrix.",
    ),
    _f(
        "bos_token_id",
        "bos_token_id",
        "int | null",
        1,
        None,
        "BOS id (training data; the tokenizer decides at serving time).",
    ),
    _f(
        "eos_token_id",
        "eos_token_id",
        "int | null",
        2,
        None,
        "EOS id (training data; stops come from the tokenizer / generation_config).",
    ),
    _f("pad_token_id", "pad_token_id", "int | null", 0, None, "Padding id (training batches)."),
    _f(
        "num_nextn_predict_layers",
        "num_nextn_predict_layers",
        "int",
        0,
        0,
        "Multi-token-prediction layers. Not implemented, and the official reference builds none either: a value "
        "> 0 loads the main model, logs a warning, and skips MTP tensors (`model.layers.{L}...` and above).",
    ),
    # Gated MLA
    _f(
        "q_lora_rank",
        "q_lora_rank",
        "int | null",
        None,
        None,
        "Query low-rank width (q_a_proj, q_a_layernorm, q_b_proj); null: a full-rank q_proj.",
    ),
    _f(
        "kv_lora_rank",
        "kv_lora_rank",
        "int | null",
        None,
        None,
        "Latent KV width C (required with MLA layers).",
    ),
    _f(
        "qk_nope_head_dim",
        "qk_nope_head_dim",
        "int | null",
        None,
        None,
        "Per-head NoPE q/k width (required with MLA layers).",
    ),
    _f(
        "qk_rope_head_dim",
        "qk_rope_head_dim",
        "int | null",
        None,
        None,
        "Per-head shared-key slice width; never rotated (required with MLA layers).",
    ),
    _f(
        "v_head_dim",
        "v_head_dim",
        "int | null",
        None,
        None,
        "Per-head value width (required with MLA layers).",
    ),
    _f(
        "mla_use_nope",
        "mla_use_nope",
        "bool",
        True,
        False,
        "Must be true with MLA layers (rotary MLA is not implemented; the reference asserts it). Absent is read "
        "as true: transformers' KimiLinear does not write it and is NoPE (the K3 class default false would make "
        "its own MLA assert).",
    ),
    _f(
        "mla_use_output_gate",
        "mla_use_output_gate",
        "bool",
        False,
        False,
        "Gated MLA: sigmoid(g_proj x) times the head outputs before o_proj. Null or absent: no gate (Kimi Linear).",
    ),
    # Kimi Delta Attention
    _f(
        "linear_num_heads",
        (_LA + "num_heads", "linear_num_heads"),
        "int",
        None,
        REFUSED,
        "KDA heads H (required with KDA layers). `linear_num_heads` is the transformers top-level spelling.",
    ),
    _f(
        "linear_head_dim",
        (_LA + "head_dim", "linear_head_dim"),
        "int",
        None,
        REFUSED,
        "KDA head width K = V (required with KDA layers).",
    ),
    _f(
        "linear_conv_kernel_dim",
        (_LA + "short_conv_kernel_size", "linear_conv_kernel_dim"),
        "int",
        None,
        REFUSED,
        "Short-conv kernel W of q, k, v (required with KDA layers).",
    ),
    _f(
        "gate_lower_bound",
        (_LA + "gate_lower_bound", "gate_lower_bound"),
        "float | null",
        None,
        None,
        "K3 decay gate `lower_bound * sigmoid(exp(A_log) (z + dt_bias))`; null or absent: the Kimi Linear "
        "softplus gate `-exp(A_log) softplus(z + dt_bias)`. The top-level spelling is read too (never dropped).",
    ),
    _f(
        "use_full_rank_gate",
        (_LA + "use_full_rank_gate", "use_full_rank_gate"),
        "bool",
        False,
        False,
        "KDA output gate g_proj (full rank, K3); null or absent: low-rank g_a_proj/g_b_proj (Kimi Linear).",
    ),
    _f(
        "layer_types",
        (_LA + "kda_layers", _LA + "full_attn_layers", "layer_types"),
        "list",
        None,
        REFUSED,
        "Layer schedule. A layer is KDA iff its 1-based number is in `kda_layers` (a layer in both lists is KDA, "
        "as in the reference); every other layer is MLA; both lists are required in a `linear_attn_config` (the official "
        "class asserts them); no `linear_attn_config`: all MLA. A number outside "
        "1..L is refused (a 0-based list). transformers' 0-based `layer_types` list is read when there is no "
        "`linear_attn_config`.",
    ),
    # Mixture of experts
    _f(
        "first_k_dense_replace",
        "first_k_dense_replace",
        "int",
        0,
        REFUSED,
        "Layers before this index are dense. A layer is MoE iff num_experts is set, layer >= "
        "first_k_dense_replace and layer % moe_layer_freq == 0 (0-based).",
    ),
    _f(
        "moe_layer_freq",
        "moe_layer_freq",
        "int",
        1,
        REFUSED,
        "MoE every moe_layer_freq-th layer (see above).",
    ),
    _f(
        "mlp_layer_types",
        "mlp_layer_types",
        "list",
        None,
        REFUSED,
        "transformers' explicit dense/sparse list; when present it is the schedule (it wins over the three fields "
        "above, as in transformers).",
    ),
    _f(
        "n_routed_experts",
        ("num_experts", "n_routed_experts", "num_local_experts"),
        "int | null",
        None,
        None,
        "Routed experts E; null or absent: no MoE layer at all (every FFN dense).",
    ),
    _f(
        "num_experts_per_tok",
        ("num_experts_per_token", "num_experts_per_tok"),
        "int | null",
        None,
        None,
        "Experts per token k (required with MoE layers).",
    ),
    _f(
        "n_shared_experts",
        ("num_shared_experts", "n_shared_experts"),
        "int | null",
        0,
        None,
        "Shared experts, stored fused as one MLP of width n * moe_intermediate_size. null: no shared MLP; 0: a "
        "zero-width shared MLP (zero-size tensors, no contribution), as the reference builds it.",
    ),
    _f(
        "moe_intermediate_size",
        "moe_intermediate_size",
        "int | null",
        None,
        None,
        "Expert FFN width F (required with MoE layers).",
    ),
    _f(
        "routed_expert_hidden_size",
        "routed_expert_hidden_size",
        "int | null",
        None,
        None,
        "LatentMoE width L (routed_expert_down_proj / up_proj); null or absent: experts at full width D.",
    ),
    _f(
        "latent_moe_use_norm",
        "latent_moe_use_norm",
        "bool",
        False,
        False,
        "routed_expert_norm (RMSNorm) after the latent weighted sum.",
    ),
    _f(
        "routed_scaling_factor",
        "routed_scaling_factor",
        "float",
        1.0,
        REFUSED,
        "Multiplies the combine weights.",
    ),
    _f(
        "norm_topk_prob",
        ("moe_renormalize", "norm_topk_prob"),
        "bool",
        True,
        False,
        "Renormalise the chosen scores to sum 1 (when k > 1).",
    ),
    _f(
        "moe_router_activation_func",
        "moe_router_activation_func",
        "str",
        "sigmoid",
        REFUSED,
        "Router scores: `sigmoid` or `softmax` (the reference accepts only these).",
    ),
    _f(
        "n_group",
        ("num_expert_group", "n_group"),
        "int",
        1,
        REFUSED,
        "Expert groups G: with G > topk_group only the best topk_group groups (sum of their two best biased "
        "scores) are eligible.",
    ),
    _f(
        "topk_group",
        "topk_group",
        "int",
        1,
        1,
        "Eligible groups (read only when num_expert_group > 1; null is refused then).",
    ),
    _f(
        None,
        "use_grouped_topk",
        "bool",
        True,
        None,
        "Not read by the official gates (K3 reference, Kimi-Linear-48B-A3B): grouping happens whenever "
        "num_expert_group > topk_group. Kept.",
        IGNORED,
    ),
    _f(
        None,
        "topk_method",
        "str",
        "noaux_tc",
        None,
        "Not read by the official gates: selection is always top-k of scores + e_score_correction_bias. Kept.",
        IGNORED,
    ),
    # Block Attention Residuals
    _f(
        "attn_res_block_size",
        "attn_res_block_size",
        "int | null",
        None,
        None,
        "Block AttnRes: decoder layers per block; null or absent: the plain residual stream (Kimi Linear).",
    ),
    # Ignored
    _f(
        None,
        "head_dim",
        "int",
        None,
        None,
        "Derived hidden_size / num_attention_heads; read by no layer. Kept.",
        IGNORED,
    ),
    _f(
        None,
        ("rope_theta", "rope_scaling", "rope_parameters"),
        "any",
        None,
        None,
        "NoPE: no rotary embedding anywhere (the reference sets rotary_emb = None). Kept.",
        IGNORED,
    ),
    _f(
        None,
        "attention_bias",
        "bool",
        False,
        None,
        "transformers' MLA projection biases: false has no effect; true is refused (no official Kimi code has "
        "them).",
        IGNORED,
    ),
    _f(
        None,
        "quantization_config",
        "object | null",
        None,
        None,
        "Read by openk3.checkpoint at load: compressed-tensors `mxfp4-pack-quantized` (the release) is honoured, "
        "any other method is refused. Kept.",
        IGNORED,
    ),
    _f(
        None,
        "model_type",
        "str",
        "kimi_linear",
        REFUSED,
        "Must be `kimi_linear` for a text config.",
        IGNORED,
    ),
    _f(
        None,
        "(any other key)",
        "any",
        None,
        None,
        "PretrainedConfig bookkeeping (architectures, auto_map, dtype, transformers_version, ...) and unknown "
        "keys: kept verbatim and written back.",
        IGNORED,
    ),
)

#: The multimodal ``kimi_k3`` wrapper (``KimiK3Config``).
WRAPPER_FIELDS: tuple[Field, ...] = (
    _f(
        None,
        "model_type",
        "str",
        "kimi_k3",
        REFUSED,
        "Must be `kimi_k3` when a `text_config` is present (another wrapper, e.g. `kimi_vl`, is refused); absent: "
        "read as `kimi_k3` and written back with it (loaders pick the model class by it).",
        IGNORED,
    ),
    _f(
        None,
        "text_config",
        "object",
        None,
        REFUSED,
        "The kimi_linear text config (table above). Required.",
        IGNORED,
    ),
    _f(
        None,
        "vision_config",
        "object | null",
        None,
        None,
        "MoonViT-V2 tower + projector (openk3.vision.config.VisionConfig, official field names; absent fields mean "
        "the KimiK3VisionConfig defaults, which are the released values; `mm_hidden_size` null or absent means "
        "`vt_hidden_size`; other nulls and unimplemented types are refused). Null or absent: text-only; the "
        "official KimiK3ForConditionalGeneration cannot be built without it, so openk3 writes a text-only model "
        "as the bare kimi_linear text config.",
        IGNORED,
    ),
    _f(
        "media_placeholder_token_id",
        "media_placeholder_token_id",
        "int | null",
        163605,
        None,
        "The <|media_pad|> id image features replace (KimiK3Config default 163605).",
    ),
    _f(
        None,
        (
            "ignore_index",
            "pad_token_id",
            "bos_token_id",
            "eos_token_id",
            "tie_word_embeddings",
            "image_placeholder",
            "(any other key)",
        ),
        "any",
        None,
        None,
        "Wrapper copies of text fields and training-only settings: kept verbatim; openk3 reads the text "
        "config's.",
        IGNORED,
    ),
)

#: K3Config attributes that are derived from other fields and never read or written by themselves.
LAYER_FIELDS = ("layer_types", "mlp_layer_types")


def text_field(attr: str) -> Field:
    """The :data:`TEXT_FIELDS` / :data:`WRAPPER_FIELDS` entry of ``attr``.

    Raises:
        KeyError: no such attribute in the table.
    """
    for f in TEXT_FIELDS + WRAPPER_FIELDS:
        if f.attr == attr:
            return f
    raise KeyError(attr)


def _cell(v: Any) -> str:
    if v is None:
        return "null"
    if v is REFUSED:
        return "error"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f"`{v}`"
    return f"{v}"


def fields_markdown() -> str:
    """The table as Markdown (README "Config fields"): key(s), type, absent, null, handling, meaning."""
    rows = [
        "| key (other spellings) | type | absent | null | openk3 | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for section, fields in (("text config", TEXT_FIELDS), ("kimi_k3 wrapper", WRAPPER_FIELDS)):
        rows.append(f"| **{section}** | | | | | |")
        for f in fields:
            keys = ", ".join(f"`{k}`" if not k.startswith("(") else k for k in f.keys)
            absent = "—" if f.status == IGNORED else _cell(f.absent)
            null = "—" if f.status == IGNORED else _cell(f.null)
            cells = (keys, f.type, absent, null, f.status, f.meaning)
            # A bare "|" inside a cell ("int | null", "<|media_pad|>") would split it into two columns.
            rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
