"""What the official reference loader requires of a checkpoint: tensor names and shapes.

An independent statement of the official modeling code's ``__init__`` shapes, written from its
source (``modeling_kimi_linear.py`` of the K3 reference, PipeNetwork/kimi-k3-mlx ``reference/`` at
20a4fb1; ``modeling_kimi.py`` of Kimi-Linear-48B-A3B-Instruct for the ``A_log`` layout), reading a
``config.json`` dict the way ``KimiLinearConfig`` does (a missing key takes the class default). It
shares no code with openk3. ``tests/test_official_configs.py`` checks it against every checkpoint
the reference wrote (``../shared/fixtures``) before trusting it for openk3's own files.

Shapes (D hidden_size, V vocab_size, prefix ``model.layers.{i}.``):

* always: ``model.embed_tokens.weight`` [V, D], ``model.norm.weight`` [D], ``lm_head.weight``
  [V, D] (absent when ``tie_word_embeddings``: transformers stores the tied matrix once);
  per layer ``input_layernorm.weight`` / ``post_attention_layernorm.weight`` [D].
* ``attn_res_block_size`` set: ``model.output_attn_res_norm.weight`` [D],
  ``model.output_attn_res_proj.weight`` [1, D]; per layer ``self_attention_res_norm.weight``,
  ``mlp_res_norm.weight`` [D], ``self_attention_res_proj.weight``, ``mlp_res_proj.weight`` [1, D].
* KDA layer (1-based number in ``linear_attn_config.kda_layers``), H ``num_heads``, K
  ``head_dim``, P = H K, W ``short_conv_kernel_size``: ``self_attn.{q,k,v}_proj.weight`` [P, D],
  ``self_attn.{q,k,v}_conv1d.weight`` [P, 1, W], ``self_attn.A_log`` [H] (K3 reference) or
  [1, 1, H, 1] (Kimi Linear's ``modeling_kimi.py``), ``self_attn.f_a_proj.weight`` [K, D],
  ``self_attn.f_b_proj.weight`` [P, K], ``self_attn.dt_bias`` [P], ``self_attn.b_proj.weight``
  [H, D], ``use_full_rank_gate``: ``self_attn.g_proj.weight`` [P, D], else
  ``self_attn.g_a_proj.weight`` [K, D] + ``self_attn.g_b_proj.weight`` [P, K];
  ``self_attn.o_norm.weight`` [K], ``self_attn.o_proj.weight`` [D, P].
* MLA layer (every other layer), Hq ``num_attention_heads``, n/r/v the nope/rope/v head dims, C
  ``kv_lora_rank``: ``q_lora_rank`` Q set: ``self_attn.q_a_proj.weight`` [Q, D],
  ``self_attn.q_a_layernorm.weight`` [Q], ``self_attn.q_b_proj.weight`` [Hq (n+r), Q], else
  ``self_attn.q_proj.weight`` [Hq (n+r), D]; ``self_attn.kv_a_proj_with_mqa.weight`` [C + r, D],
  ``self_attn.kv_a_layernorm.weight`` [C], ``self_attn.kv_b_proj.weight`` [Hq (n+v), C],
  ``self_attn.o_proj.weight`` [D, Hq v]; ``mla_use_output_gate``: ``self_attn.g_proj.weight``
  [Hq v, D].
* FFN: MoE iff ``num_experts`` is not null, ``i >= first_k_dense_replace`` and
  ``i % moe_layer_freq == 0``. Dense: ``mlp.{gate,up}_proj.weight`` [I, D], ``mlp.down_proj.weight``
  [D, I]. MoE (E experts, F ``moe_intermediate_size``, L ``routed_expert_hidden_size`` or D):
  ``block_sparse_moe.experts.{e}.w1.weight`` / ``w3`` [F, L], ``w2`` [L, F] (compressed-tensors
  MXFP4: ``.weight_packed`` uint8 [O, K/2] + ``.weight_scale`` uint8 [O, K/32] instead),
  ``block_sparse_moe.gate.weight`` [E, D], ``block_sparse_moe.gate.e_score_correction_bias`` [E];
  ``num_shared_experts`` S not null: ``block_sparse_moe.shared_experts.{gate,up}_proj.weight``
  [S F, D], ``down_proj`` [D, S F] (S = 0 gives zero-size tensors); latent:
  ``block_sparse_moe.routed_expert_down_proj.weight`` [L, D], ``routed_expert_up_proj.weight``
  [D, L], and with ``latent_moe_use_norm`` ``routed_expert_norm.weight`` [L].
* ``kimi_k3`` wrapper: every text name above prefixed with ``language_model.``.
"""

from __future__ import annotations


def reference_shapes(config: dict, *, a_log: str = "per_head", mxfp4: bool = False) -> dict[str, tuple]:
    """Names -> shapes the reference loads for ``config`` (a ``kimi_linear`` dict or a ``kimi_k3``
    wrapper dict; vision tensors are not listed). ``a_log``: ``"per_head"`` [H] (K3 reference) or
    ``"unsqueezed"`` [1, 1, H, 1] (Kimi Linear's own code)."""
    pre = ""
    if config.get("model_type") == "kimi_k3":
        config, pre = config["text_config"], "language_model."
    g = config.get
    D, V, n_layers = g("hidden_size", 4096), g("vocab_size", 163840), g("num_hidden_layers", 32)
    out: dict[str, tuple] = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not g("tie_word_embeddings", False):
        out["lm_head.weight"] = (V, D)
    attn_res = g("attn_res_block_size") is not None
    if attn_res:
        out["model.output_attn_res_norm.weight"] = (D,)
        out["model.output_attn_res_proj.weight"] = (1, D)
    lin = g("linear_attn_config")
    kda_layers = set(lin["kda_layers"]) if lin is not None else set()
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (D,)
        out[p + "post_attention_layernorm.weight"] = (D,)
        if attn_res:
            for site in ("self_attention", "mlp"):
                out[p + f"{site}_res_norm.weight"] = (D,)
                out[p + f"{site}_res_proj.weight"] = (1, D)
        a = p + "self_attn."
        if i + 1 in kda_layers:
            H, K, W = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
            P = H * K
            for x in "qkv":
                out[a + f"{x}_proj.weight"] = (P, D)
                out[a + f"{x}_conv1d.weight"] = (P, 1, W)
            out[a + "A_log"] = (H,) if a_log == "per_head" else (1, 1, H, 1)
            out[a + "f_a_proj.weight"], out[a + "f_b_proj.weight"] = (K, D), (P, K)
            out[a + "dt_bias"], out[a + "b_proj.weight"] = (P,), (H, D)
            if lin.get("use_full_rank_gate", False):
                out[a + "g_proj.weight"] = (P, D)
            else:
                out[a + "g_a_proj.weight"], out[a + "g_b_proj.weight"] = (K, D), (P, K)
            out[a + "o_norm.weight"], out[a + "o_proj.weight"] = (K,), (D, P)
        else:
            Hq, q_lora, C = g("num_attention_heads", 32), g("q_lora_rank"), g("kv_lora_rank")
            nope, rope, v = g("qk_nope_head_dim"), g("qk_rope_head_dim"), g("v_head_dim")
            if q_lora is not None:
                out[a + "q_a_proj.weight"], out[a + "q_a_layernorm.weight"] = (q_lora, D), (q_lora,)
                out[a + "q_b_proj.weight"] = (Hq * (nope + rope), q_lora)
            else:
                out[a + "q_proj.weight"] = (Hq * (nope + rope), D)
            out[a + "kv_a_proj_with_mqa.weight"], out[a + "kv_a_layernorm.weight"] = (C + rope, D), (C,)
            out[a + "kv_b_proj.weight"], out[a + "o_proj.weight"] = (Hq * (nope + v), C), (D, Hq * v)
            if g("mla_use_output_gate", False):
                out[a + "g_proj.weight"] = (Hq * v, D)
        E = g("num_experts")
        if E is not None and i >= g("first_k_dense_replace", 0) and i % g("moe_layer_freq", 1) == 0:
            m = p + "block_sparse_moe."
            F, L = g("moe_intermediate_size"), g("routed_expert_hidden_size") or D
            for e in range(E):
                for w, (o, k) in (("w1", (F, L)), ("w3", (F, L)), ("w2", (L, F))):
                    if mxfp4:
                        out[m + f"experts.{e}.{w}.weight_packed"] = (o, k // 2)
                        out[m + f"experts.{e}.{w}.weight_scale"] = (o, k // 32)
                    else:
                        out[m + f"experts.{e}.{w}.weight"] = (o, k)
            out[m + "gate.weight"], out[m + "gate.e_score_correction_bias"] = (E, D), (E,)
            S = g("num_shared_experts", 0)
            if S is not None:
                out[m + "shared_experts.gate_proj.weight"] = (S * F, D)
                out[m + "shared_experts.up_proj.weight"] = (S * F, D)
                out[m + "shared_experts.down_proj.weight"] = (D, S * F)
            if g("routed_expert_hidden_size") is not None:
                out[m + "routed_expert_down_proj.weight"], out[m + "routed_expert_up_proj.weight"] = (L, D), (D, L)
                if g("latent_moe_use_norm", False):
                    out[m + "routed_expert_norm.weight"] = (L,)
        else:
            I = g("intermediate_size", 11008)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = (I, D), (I, D)
            out[p + "mlp.down_proj.weight"] = (D, I)
    return {pre + k: v for k, v in out.items()}
