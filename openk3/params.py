"""Parameter accounting (``openk3 info``): total and active counts by component.

Counts come from modules built on the meta device (no memory), so the full 2.78T configuration
is counted from the same code that runs the tiny ones. "Active" is what one token touches:
every non-expert parameter, ``num_experts_per_tok`` routed experts per MoE layer, and **one**
vocabulary matrix (the embedding lookup is not a matmul; architecture.md §12).
"""

from __future__ import annotations

import torch

from openk3.config import K3Config

COMPONENTS = (
    "embedding",
    "lm_head",
    "kda",
    "mla",
    "dense_ffn",
    "routed_experts",
    "shared_experts",
    "router",
    "latent_proj",
    "norms_attn_res",
)


def _component(name: str) -> str:
    if name.startswith("model.embed_tokens"):
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    if ".block_sparse_moe.experts." in name:
        return "routed_experts"
    if ".block_sparse_moe.shared_experts." in name:
        return "shared_experts"
    if ".block_sparse_moe.gate." in name:
        return "router"
    if ".block_sparse_moe.routed_expert_" in name:
        return "latent_proj"
    if ".mlp." in name:
        return "dense_ffn"
    if ".self_attn." in name:
        return "attn"
    return "norms_attn_res"


def count_parameters(config: K3Config) -> dict:
    """Total and active parameter counts, by component.

    Returns:
        ``{"total": int, "active": int, "by_component": {name: {"total", "active"}}}``; buffers
        that are part of the checkpoint (``e_score_correction_bias``) count as parameters.
    """
    from openk3.model import K3ForCausalLM

    with torch.device("meta"):
        model = K3ForCausalLM(config)
    by: dict[str, dict[str, int]] = {c: {"total": 0, "active": 0} for c in COMPONENTS}
    k = config.num_experts_per_tok
    E = config.n_routed_experts
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in tensors:
        comp = _component(name)
        if comp == "attn":
            layer = int(name.split(".")[2])
            comp = "kda" if config.layer_types[layer] == "linear_attention" else "mla"
        n = t.numel()
        by[comp]["total"] += n
        if comp == "routed_experts":
            by[comp]["active"] += n // E * k
        elif comp == "embedding" and not config.tie_word_embeddings:
            pass  # a lookup, not a matmul: active counts one vocabulary matrix (the head)
        # (tied: named_parameters lists the shared matrix once, as the embedding, and it is active)
        else:
            by[comp]["active"] += n
    total = sum(v["total"] for v in by.values())
    active = sum(v["active"] for v in by.values())
    return {"total": total, "active": active, "by_component": by}


def estimate_parameters(config: K3Config) -> int:
    """The text model's parameter count (checkpoint buffers included, as :func:`count_parameters`
    counts them) without building its layers: one decoder layer of each kind (mixer type x FFN
    type) is built on the meta device and counted once per layer of that kind, plus the
    embedding, the head (once when tied) and the final norms. Cost independent of depth, so a
    config with ``num_hidden_layers: 1000000`` is counted in milliseconds. A vision tower is not
    counted (a lower bound for such configs).
    """
    from openk3.model import DecoderLayer

    V, D = config.vocab_size, config.hidden_size
    total = V * D * (1 if config.tie_word_embeddings else 2) + D  # embedding, head, final norm
    if config.use_attn_res:
        total += 2 * D  # the output AttnRes site: norm + 1 x D projection
    kinds: dict[tuple[str, str], list[int]] = {}
    for i, key in enumerate(zip(config.layer_types, config.mlp_layer_types)):
        kinds.setdefault(key, []).append(i)
    for layers in kinds.values():
        with torch.device("meta"):
            layer = DecoderLayer(config, layers[0])
        n = sum(t.numel() for t in layer.parameters()) + sum(t.numel() for t in layer.buffers())
        total += n * len(layers)
    return total
