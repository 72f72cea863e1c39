"""Named architecture presets: the released Kimi K3, the project's default model, and small
configurations for tests (one that hits every branch of the code) and for Kimi Linear parity.

Each preset is a plain function that spells out every dimension; :data:`PRESETS` maps names to
them and :func:`preset` builds one.
"""

from __future__ import annotations

from openk3.config import KDA, MLA, K3Config

def _kimi_k3() -> K3Config:
    """The released Kimi K3 (``../shared/k3/config.json``): text backbone + MoonViT-V2 config."""
    from openk3.vision.config import vision_preset

    cfg = K3Config(media_placeholder_token_id=163605).as_k3_wrapper()
    cfg.wrapper["vision_config"] = vision_preset("kimi-k3").to_dict()
    cfg.wrapper["dtype"] = "bfloat16"
    return cfg


def _k3_test_tiny() -> K3Config:
    """Hits every branch: KDA + MLA (q_lora set), dense + MoE FFNs, three AttnRes blocks."""
    return K3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        linear_num_heads=4, linear_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=24,
        routed_expert_hidden_size=32, attn_res_block_size=2,
        layer_types=[KDA, KDA, KDA, MLA, KDA, MLA],
        bos_token_id=256, eos_token_id=258, pad_token_id=511, media_placeholder_token_id=277,
        max_position_embeddings=4096,
    )


def _k3_test_tiny_noqlora() -> K3Config:
    """Same as ``k3-test-tiny`` with ``q_lora_rank=None`` (MLA ``q_proj`` path)."""
    return _k3_test_tiny().replace(q_lora_rank=None)


def _kimi_linear_tiny() -> K3Config:
    """A tiny Kimi Linear (the K3 predecessor): softplus gate, low-rank output gate, SwiGLU,
    no AttnRes, full-width experts, MLA without output gate."""
    return K3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, hidden_act="silu",
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        mla_use_output_gate=False,
        linear_num_heads=4, linear_head_dim=16, gate_lower_bound=None, use_full_rank_gate=False,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=24,
        routed_expert_hidden_size=None, latent_moe_use_norm=False, routed_scaling_factor=2.446,
        attn_res_block_size=None,
        layer_types=[KDA, KDA, KDA, MLA],
        bos_token_id=256, eos_token_id=258, pad_token_id=511, max_position_embeddings=4096,
    )


def _openk3_tiny() -> K3Config:
    """The shipped default model (issue 8): every K3 component live at CPU-trainable size.

    8 layers in the K3 pattern (layers 4 and 8 gated MLA, the rest KDA with the lower-bounded
    gate and full-rank output gate), dense first layer, Stable LatentMoE (16 routed experts, top-2,
    one shared expert, latent width 64) with SiTU-GLU, four Block AttnRes blocks of 2 layers.
    Expert widths (``moe_intermediate_size``, ``routed_expert_hidden_size``) are multiples of 32
    so MXFP4 QAT applies. Vocabulary: the project's 8192-id BPE (``openk3 train-tokenizer``; its
    special block at 7936..8191: [BOS] 7936, [EOS] 7937, [PAD] 8191, <|media_pad|> 7957).
    Parameter counts and training speed: :func:`openk3.train.default_model.default_model`.
    """
    return K3Config(
        vocab_size=8192, hidden_size=128, intermediate_size=384, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        linear_num_heads=4, linear_head_dim=32,
        n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64,
        routed_expert_hidden_size=64, attn_res_block_size=2,
        bos_token_id=7936, eos_token_id=7937, pad_token_id=8191, media_placeholder_token_id=7957,
        # K3's context: KDA and NoPE MLA have no positional limit, so the declared context is a
        # serving budget (one 1M-token sequence is 384 MiB of fp32 MLA latents here), not trained length.
        max_position_embeddings=1048576,
    )


PRESETS = {
    "kimi-k3": _kimi_k3,
    "openk3-tiny": _openk3_tiny,
    "k3-test-tiny": _k3_test_tiny,
    "k3-test-tiny-noqlora": _k3_test_tiny_noqlora,
    "kimi-linear-tiny": _kimi_linear_tiny,
}


def preset(name: str) -> K3Config:
    """Build a named preset.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
