"""Pool views of the caches: a ``PagedMLACache`` over scattered physical blocks and a
``SlotKDAState`` over pool rows give the layers exactly what the dense caches give."""

from __future__ import annotations

import pytest
import torch

import openk3
from openk3.cache import KDALayerState, MLALayerCache, PagedMLACache, SlotKDAState
from openk3.layers.kda import KimiDeltaAttention
from openk3.layers.mla import GatedMLA
from tests.conftest import assert_close


@torch.no_grad()
@pytest.mark.parametrize("stacked", [False, True])
def test_paged_mla_equals_dense_cache(stacked):
    """Per-layer pools, or layer 1 of pools stacked over 3 layers (the others stay zero)."""
    cfg = openk3.preset("k3-test-tiny")
    mla = GatedMLA(cfg, 3)
    B, L, NB, MB = 3, 4, 20, 5
    dense = MLALayerCache.zeros(cfg, B, MB * L)
    lead = (3,) if stacked else ()
    latent_pool = torch.zeros(*lead, NB, L, cfg.kv_lora_rank)
    k_rope_pool = torch.zeros(*lead, NB, L, cfg.qk_rope_head_dim)
    perm = torch.randperm(NB)[: B * MB].view(B, MB)  # every row's blocks scattered over the pool
    paged = PagedMLACache(latent_pool, k_rope_pool, perm, layer=1 if stacked else None)
    past = torch.zeros(B, dtype=torch.long)
    for T, lens in ((7, [7, 3, 5]), (1, [1, 1, 1]), (6, [6, 2, 0])):  # prefill, decode, ragged chunk
        x = torch.randn(B, T, cfg.hidden_size)
        lens = torch.tensor(lens)
        y_dense = mla(x, dense, lengths=lens, past_lengths=past)
        y_paged = mla(x, paged, lengths=lens, past_lengths=past)
        assert_close(y_paged, y_dense, atol=0, what=f"paged vs dense MLA output (T={T})")
        past = past + lens
    lat, kr = paged.read(int(past.max()))
    for b in range(B):
        n = int(past[b])
        assert_close(lat[b, :n], dense.latent[b, :n], atol=0, what="stored latents")
        assert_close(kr[b, :n], dense.k_rope[b, :n], atol=0, what="stored k_rope")
    if stacked:
        assert bool(latent_pool[1].any()) and not latent_pool[[0, 2]].any() and not k_rope_pool[[0, 2]].any()


@torch.no_grad()
@pytest.mark.parametrize("stacked", [False, True])
def test_slot_kda_state_equals_dense_state(stacked):
    """Per-layer pools, or layer 1 of pools stacked over 2 layers (layer 0 untouched)."""
    cfg = openk3.preset("k3-test-tiny")
    kda = KimiDeltaAttention(cfg, 0)
    B, N = 2, 5
    slots = torch.tensor([3, 1])
    lead = (2,) if stacked else ()
    conv_stack = torch.randn(*lead, N, 3, cfg.linear_proj_dim, cfg.linear_conv_kernel_dim - 1)
    rec_stack = torch.randn(*lead, N, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_head_dim)
    other = (conv_stack[0].clone(), rec_stack[0].clone()) if stacked else None
    conv_pool, rec_pool = (conv_stack[1], rec_stack[1]) if stacked else (conv_stack, rec_stack)
    dense = KDALayerState(conv_pool[slots].clone(), rec_pool[slots].clone())
    pooled = SlotKDAState(conv_stack, rec_stack, slots, layer=1 if stacked else None)
    untouched = conv_pool[[0, 2, 4]].clone(), rec_pool[[0, 2, 4]].clone()
    for T, mode in ((9, "chunk"), (1, "recurrent")):
        x = torch.randn(B, T, cfg.hidden_size)
        assert_close(kda(x, pooled, mode=mode), kda(x, dense, mode=mode), atol=0, what=f"KDA output ({mode})")
        assert_close(conv_pool[slots], dense.conv, atol=0, what="conv tails written back")
        assert_close(rec_pool[slots], dense.recurrent, atol=0, what="recurrent state written back")
    assert_close(conv_pool[[0, 2, 4]], untouched[0], atol=0, what="other slots")
    assert_close(rec_pool[[0, 2, 4]], untouched[1], atol=0, what="other slots")
    if stacked:
        assert_close(conv_stack[0], other[0], atol=0, what="the other layer's conv tails")
        assert_close(rec_stack[0], other[1], atol=0, what="the other layer's states")
