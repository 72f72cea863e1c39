"""Named architecture presets: the released Kimi K3, the project's default model, and small
configurations for tests (one that hits every branch of the code) and for Kimi Linear parity.

Each preset is data: a :class:`Preset` holds the ``K3Config`` keyword arguments that spell out
every dimension (unset fields keep the released K3's defaults) and, for a multimodal preset, the
``kimi_k3`` wrapper entries. :data:`PRESETS` maps names to them and :func:`openk3.config.preset`
builds one (this module imports nothing from :mod:`openk3.config`, which builds from it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from openk3.config_fields import KDA, MLA


@dataclass(frozen=True)
class Preset:
    """One named configuration.

    Attributes:
        fields: ``K3Config(**fields)`` keyword arguments.
        wrapper: None (text-only ``kimi_linear`` config) or entries set on the ``kimi_k3`` wrapper
            after :meth:`~openk3.config.K3Config.as_k3_wrapper`; ``vision_config`` names a
            :func:`openk3.vision.config.vision_preset`.
    """

    fields: dict[str, Any] = field(default_factory=dict)
    wrapper: dict[str, Any] | None = None


#: The released Kimi K3 (``../shared/k3/config.json``): text backbone + MoonViT-V2 config.
KIMI_K3 = Preset(
    {"media_placeholder_token_id": 163605},
    wrapper={"vision_config": "kimi-k3", "dtype": "bfloat16"},
)


def _k3_test_tiny() -> dict[str, Any]:
    """Hits every branch: KDA + MLA (q_lora set), dense + MoE FFNs, three AttnRes blocks."""
    return dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        linear_num_heads=4,
        linear_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=2,
        moe_intermediate_size=24,
        routed_expert_hidden_size=32,
        attn_res_block_size=2,
        layer_types=[KDA, KDA, KDA, MLA, KDA, MLA],
        bos_token_id=256,
        eos_token_id=258,
        pad_token_id=511,
        media_placeholder_token_id=277,
        max_position_embeddings=4096,
    )


def _kimi_linear_tiny() -> dict[str, Any]:
    """A tiny Kimi Linear (the K3 predecessor): softplus gate, low-rank output gate, SwiGLU,
    no AttnRes, full-width experts, MLA without output gate."""
    return dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        hidden_act="silu",
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        mla_use_output_gate=False,
        linear_num_heads=4,
        linear_head_dim=16,
        gate_lower_bound=None,
        use_full_rank_gate=False,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=24,
        routed_expert_hidden_size=None,
        latent_moe_use_norm=False,
        routed_scaling_factor=2.446,
        attn_res_block_size=None,
        layer_types=[KDA, KDA, KDA, MLA],
        bos_token_id=256,
        eos_token_id=258,
        pad_token_id=511,
        max_position_embeddings=4096,
    )


def _openk3_tiny() -> dict[str, Any]:
    """The shipped default model: every K3 component live at CPU-trainable size.

    8 layers in the K3 pattern (layers 4 and 8 gated MLA, the rest KDA with the lower-bounded
    gate and full-rank output gate), dense first layer, Stable LatentMoE (16 routed experts, top-2,
    one shared expert, latent width 64) with SiTU-GLU, four Block AttnRes blocks of 2 layers.
    Expert widths (``moe_intermediate_size``, ``routed_expert_hidden_size``) are multiples of 32
    so MXFP4 QAT applies. Vocabulary: the project's 8192-id BPE (``openk3 train-tokenizer``; its
    special block at 7936..8191: [BOS] 7936, [EOS] 7937, [PAD] 8191, <|media_pad|> 7957).
    Parameter counts and training speed: :func:`openk3.recipes.default_model.default_model`.
    """
    return dict(
        vocab_size=8192,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        linear_num_heads=4,
        linear_head_dim=32,
        n_routed_experts=16,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=64,
        routed_expert_hidden_size=64,
        attn_res_block_size=2,
        bos_token_id=7936,
        eos_token_id=7937,
        pad_token_id=8191,
        media_placeholder_token_id=7957,
        # K3's context: KDA and NoPE MLA have no positional limit, so the declared context is a
        # serving budget (one 1M-token sequence is 384 MiB of fp32 MLA latents here), not trained length.
        max_position_embeddings=1048576,
    )


PRESETS: dict[str, Preset] = {
    "kimi-k3": KIMI_K3,
    "openk3-tiny": Preset(_openk3_tiny()),
    "k3-test-tiny": Preset(_k3_test_tiny()),
    # k3-test-tiny with q_lora_rank=None (the MLA q_proj path)
    "k3-test-tiny-noqlora": Preset({**_k3_test_tiny(), "q_lora_rank": None}),
    "kimi-linear-tiny": Preset(_kimi_linear_tiny()),
}
