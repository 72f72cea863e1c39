"""MoonViT-V2 tower + patchmergerv2 projector: strict loading of the fixture's official tensors,
parity with an independent float64 reference written here from architecture.md §11 (complex-number
RoPE, block-diagonal masked softmax, hand-written bilinear resampling and merge), and the invariants
of issue 9 (native-grid position table, packing == encoding alone, RoPE closed form)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from openk3.vision import (
    MoonViT, VisionConfig, VisionModel, count_vision_parameters, init_vision_weights, load_vision_weights,
    merged_token_counts, vision_preset, vision_state_dict_to_hf,
)
from openk3.vision.encoder import (
    apply_rope_2d, interpolate_pos_emb, rope_2d_angles, segment_attention_reference, segment_attention_sdpa,
    sincos_time_embedding,
)
from tests.conftest import assert_close, shared_path

FIXTURE = ("fixtures", "k3-ref-tiny-a")


def _fixture():
    """(vision_config dict, official vision tensors) of the tiny K3 checkpoint."""
    cfg = json.loads(shared_path(*FIXTURE, "config.json").read_text())["vision_config"]
    with safe_open(str(shared_path(*FIXTURE, "model.safetensors")), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith(("vision_tower.", "mm_projector."))}
    return cfg, tensors


def _tiny_model(seed: int = 0) -> VisionModel:
    m = VisionModel(vision_preset("tiny"))
    init_vision_weights(m, torch.Generator().manual_seed(seed), std=0.2)  # O(1) logits: attention not uniform
    return m.eval()


# ----------------------------------------------------------------------------- independent reference

def _bilinear(table: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Half-pixel bilinear resampling of [H0, W0, D] -> [h, w, D], written out per axis."""
    def axis(n_in: int, n_out: int):
        src = ((torch.arange(n_out, dtype=torch.float64) + 0.5) * (n_in / n_out) - 0.5).clamp(min=0)
        i0 = src.floor().long().clamp(max=n_in - 1)
        i1 = (i0 + 1).clamp(max=n_in - 1)
        return i0, i1, src - i0
    r0, r1, fr = axis(table.shape[0], h)
    c0, c1, fc = axis(table.shape[1], w)
    t = table.double()
    rows = t[r0] * (1 - fr)[:, None, None] + t[r1] * fr[:, None, None]
    return rows[:, c0] * (1 - fc)[None, :, None] + rows[:, c1] * fc[None, :, None]


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _reference(tensors: dict, cfg: dict, pixels: torch.Tensor, grids: list) -> torch.Tensor:
    """Tower + projector in float64, one formula at a time (architecture.md §11)."""
    T = {k: v.double() for k, v in tensors.items()}
    D, heads = cfg["vt_hidden_size"], cfg["vt_num_attention_heads"]
    K = cfg["qkv_hidden_size"] // heads
    eps = torch.finfo(torch.float32).eps
    x = pixels.double().reshape(pixels.shape[0], -1) @ T["vision_tower.patch_embed.proj.weight"].reshape(D, -1).T
    table = T["vision_tower.patch_embed.pos_emb.weight"]
    pos, freqs, seg = [], [], []
    for g, (t, h, w) in enumerate(grids):
        p2 = _bilinear(table, h, w).reshape(h * w, D)
        if t > 1:
            k = torch.arange(D // 2, dtype=torch.float64)
            ang = torch.arange(t, dtype=torch.float64)[:, None] / 10000 ** (k / (D / 2))[None, :]
            p2 = (p2[None] + torch.cat([ang.sin(), ang.cos()], 1)[:, None, :]).reshape(t * h * w, D)
        pos.append(p2)
        # freqs_cis[y, x, j]: e^{i x θ_i} at j = 2i, e^{i y θ_i} at j = 2i + 1, θ_i = 1e4^(-4i/K)
        theta = 1e4 ** (-torch.arange(0, K, 4, dtype=torch.float64) / K)
        cis = torch.empty(h, w, K // 2, dtype=torch.complex128)
        for yy in range(h):
            for xx in range(w):
                cis[yy, xx, 0::2] = torch.polar(torch.ones_like(theta), xx * theta)
                cis[yy, xx, 1::2] = torch.polar(torch.ones_like(theta), yy * theta)
        freqs.append(cis.reshape(h * w, K // 2).repeat(t, 1))
        seg += [g] * (t * h * w)
    x = x + torch.cat(pos)
    cis = torch.cat(freqs)[:, None, :]
    seg = torch.tensor(seg)
    mask = seg[:, None] == seg[None, :]
    L = x.shape[0]

    def rot(v):
        c = torch.view_as_complex(v.reshape(L, heads, K // 2, 2).contiguous()) * cis
        return torch.view_as_real(c).reshape(L, heads, K)

    nb = cfg["vt_num_hidden_layers"]
    for i in range(nb):
        p = f"vision_tower.encoder.blocks.{i}."
        hN = _rms(x, T[p + "norm0.weight"], eps)
        q, k, v = (hN @ T[p + "wqkv.weight"].T).reshape(L, 3, heads, K).unbind(1)
        s = torch.einsum("qhd,khd->hqk", rot(q), rot(k)) / math.sqrt(K)
        a = torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v).reshape(L, -1)
        x = x + a @ T[p + "wo.weight"].T
        u = _rms(x, T[p + "norm1.weight"], eps) @ T[p + "mlp.fc0.weight"].T
        u = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
        x = x + u @ T[p + "mlp.fc1.weight"].T
    x = _rms(x, T["vision_tower.encoder.final_layernorm.weight"], eps)
    kh, kw = cfg["merge_kernel_size"]
    rows, off = [], 0
    for t, h, w in grids:
        frames = x[off:off + t * h * w].reshape(t, h, w, D).mean(0)
        off += t * h * w
        for by in range(h // kh):
            for bx in range(w // kw):
                rows.append(torch.cat([frames[by * kh + dy, bx * kw + dx] for dy in range(kh) for dx in range(kw)]))
    m = torch.stack(rows) @ T["mm_projector.proj.0.weight"].T
    m = 0.5 * m * (1 + torch.erf(m / math.sqrt(2)))
    m = m @ T["mm_projector.proj.2.weight"].T
    return _rms(m, T["mm_projector.post_norm.weight"], cfg["projector_ln_eps"])


# ----------------------------------------------------------------------------- fixture: names, shapes, parity

def test_fixture_loads_strictly_and_round_trips():
    cfg, tensors = _fixture()
    model = VisionModel.from_state_dict(tensors, cfg)
    expected = dict(vision_state_dict_to_hf(model))
    assert sorted(expected) == sorted(tensors)  # every official name, nothing else
    for name, t in tensors.items():
        assert torch.equal(expected[name], t), name
    # the full checkpoint (language_model.* too) loads the same: other prefixes are ignored
    with safe_open(str(shared_path(*FIXTURE, "model.safetensors")), "pt") as f:
        full = {k: f.get_tensor(k) for k in f.keys()}
    assert any(not k.startswith(("vision_tower.", "mm_projector.")) for k in full)
    VisionModel.from_state_dict(full, cfg)
    # tower and projector alone take the same official names
    tower = MoonViT(VisionConfig.from_dict(cfg))
    load_vision_weights(tower, tensors)
    assert set(vision_state_dict_to_hf(tower)) == {k for k in tensors if k.startswith("vision_tower.")}


def test_fixture_load_rejects_missing_unexpected_and_misshaped():
    cfg, tensors = _fixture()
    name = "vision_tower.encoder.blocks.0.wo.weight"
    with pytest.raises(ValueError, match=f"missing.*{name}"):
        VisionModel.from_state_dict({k: v for k, v in tensors.items() if k != name}, cfg)
    with pytest.raises(ValueError, match="unexpected.*vision_tower.encoder.blocks.1.wo.weight"):
        VisionModel.from_state_dict({**tensors, "vision_tower.encoder.blocks.1.wo.weight": tensors[name]}, cfg)
    with pytest.raises(ValueError, match="shape mismatch.*mm_projector.proj.2.weight"):
        VisionModel.from_state_dict({**tensors, "mm_projector.proj.2.weight": torch.zeros(64, 32)}, cfg)


def test_fixture_weights_match_independent_reference():
    cfg, tensors = _fixture()
    # The stored weights are N(0, 0.02): rescale the attention and position tensors so that the
    # softmax, the rotary angles and the interpolated table all move the output measurably.
    tensors = dict(tensors)
    tensors["vision_tower.encoder.blocks.0.wqkv.weight"] = tensors["vision_tower.encoder.blocks.0.wqkv.weight"] * 25
    tensors["vision_tower.patch_embed.pos_emb.weight"] = tensors["vision_tower.patch_embed.pos_emb.weight"] * 50
    model = VisionModel.from_state_dict(tensors, cfg).eval()
    grids = [(1, 4, 6), (1, 2, 2), (2, 4, 4), (1, 4, 4)]  # native 4x4 table, resampled up/down, a video
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3, 14, 14)
    ref = _reference(tensors, cfg, pixels, grids)
    with torch.no_grad():
        for impl in ("sdpa", "reference"):
            out = model(pixels, grids, attn_impl=impl)
            assert out.shape == (sum(merged_token_counts(grids, (2, 2))), cfg["text_hidden_size"])
            assert_close(out, ref, atol=2e-5, rtol=1e-5, what=f"vision forward ({impl})")


# ----------------------------------------------------------------------------- invariants

def test_position_table_is_identity_at_native_grid():
    released = torch.randn(64, 64, 8)  # the released 64x64 grid (few channels keep it fast)
    assert torch.equal(interpolate_pos_emb(released, 64, 64), released.reshape(64 * 64, 8))
    cfg, tensors = _fixture()
    table = tensors["vision_tower.patch_embed.pos_emb.weight"]
    h0, w0 = cfg["init_pos_emb_height"], cfg["init_pos_emb_width"]
    assert torch.equal(interpolate_pos_emb(table, h0, w0), table.reshape(h0 * w0, -1))
    model = VisionModel.from_state_dict(tensors, cfg)
    assert torch.equal(model.vision_tower.patch_embed.pos_emb([(1, h0, w0)]), table.reshape(h0 * w0, -1))


@pytest.mark.parametrize("size", [(5, 7), (130, 3), (2, 2), (64, 96)])
def test_position_table_interpolation_is_half_pixel_bilinear(size):
    table = torch.randn(64, 64, 4)
    # torch computes the source coordinates in fp32: ~1e-6 relative error of a 64-wide coordinate
    assert_close(interpolate_pos_emb(table, *size), _bilinear(table, *size).reshape(size[0] * size[1], 4),
                 atol=5e-5, what=f"bilinear {size}")


def test_rope_matches_closed_form():
    h, w, K = 5, 7, 16
    angles = rope_2d_angles(h, w, K)
    for y, x, i in [(0, 0, 0), (3, 6, 1), (4, 2, 3)]:
        theta = 1e4 ** (-4 * i / K)
        assert math.isclose(angles[y * w + x, 2 * i].item(), x * theta, rel_tol=1e-6, abs_tol=1e-7)
        assert math.isclose(angles[y * w + x, 2 * i + 1].item(), y * theta, rel_tol=1e-6, abs_tol=1e-7)
    q = torch.randn(h * w, 3, K)
    rotated = apply_rope_2d(q, angles)
    expect = torch.view_as_real(torch.view_as_complex(q.double().reshape(h * w, 3, K // 2, 2).contiguous())
                                * torch.polar(torch.ones_like(angles.double()), angles.double())[:, None, :])
    assert_close(rotated, expect.reshape(h * w, 3, K), atol=1e-5, what="rope vs complex rotation")
    # relative: <R(p) q, R(p') k> depends only on p - p' (shift both by (dy, dx) = (1, 2))
    qv, kv = torch.randn(K), torch.randn(K)
    big = rope_2d_angles(8, 8, K)

    def dot(pq, pk):
        a = apply_rope_2d(qv.expand(1, 1, K), big[pq[0] * 8 + pq[1]][None])
        b = apply_rope_2d(kv.expand(1, 1, K), big[pk[0] * 8 + pk[1]][None])
        return (a * b).sum().item()
    assert math.isclose(dot((1, 3), (4, 2)), dot((2, 5), (5, 4)), rel_tol=1e-5, abs_tol=1e-5)
    assert not math.isclose(dot((1, 3), (4, 2)), dot((1, 3), (2, 4)), rel_tol=1e-3)
    with pytest.raises(ValueError, match="512"):
        rope_2d_angles(513, 2, K)


def test_packing_equals_encoding_each_alone():
    model = _tiny_model()
    grids = [(1, 4, 6), (1, 6, 4), (2, 4, 4), (1, 2, 2)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3, 14, 14)
    with torch.no_grad():
        packed = model(pixels, grids)
        alone, off = [], 0
        for g in grids:
            n = g[0] * g[1] * g[2]
            alone.append(model(pixels[off:off + n], [g]))
            off += n
    assert_close(packed, torch.cat(alone), atol=1e-5, what="packed vs alone")
    # and the packing really isolates items: perturbing item 0 leaves the others unchanged
    pixels2 = pixels.clone()
    pixels2[:24] += 1.0
    with torch.no_grad():
        packed2 = model(pixels2, grids)
    n0 = merged_token_counts(grids[:1], (2, 2))[0]
    assert not torch.allclose(packed2[:n0], packed[:n0])
    assert torch.allclose(packed2[n0:], packed[n0:], atol=1e-6)


def test_sdpa_matches_reference_attention():
    q, k, v = (torch.randn(30, 3, 8) for _ in range(3))
    bounds = [(0, 7), (7, 23), (23, 30)]
    assert_close(segment_attention_sdpa(q, k, v, bounds), segment_attention_reference(q, k, v, bounds),
                 atol=1e-5, what="sdpa vs reference")


def test_sdpa_query_blocks_match_reference(monkeypatch):
    """Query blocks that cut through segments give the reference result (rows are independent)."""
    import openk3.vision.encoder as enc

    monkeypatch.setattr(enc, "ATTN_QUERY_BLOCK", 5)
    q, k, v = (torch.randn(30, 3, 8) for _ in range(3))
    bounds = [(0, 7), (7, 23), (23, 30)]
    assert_close(segment_attention_sdpa(q, k, v, bounds), segment_attention_reference(q, k, v, bounds),
                 atol=1e-5, what="blocked sdpa vs reference")


_PEAK_SCRIPT = """
import resource, torch
torch.set_num_threads(1)
from openk3.vision.encoder import segment_attention_sdpa
L, H, K = 16384, 2, 32
q, k, v = (torch.randn(L, H, K) for _ in range(3))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = segment_attention_sdpa(q, k, v, [(0, L)])
assert out.shape == (L, H * K) and bool(torch.isfinite(out).all())
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""


def test_sdpa_attention_memory_is_linear_in_patches():
    """One 16,384-patch segment (a 1792 px image) at H = 2: the H x L x L scores would be 2 GiB;
    the tower's attention must stay within a small multiple of its [L, H, K] inputs (measured as
    the peak RSS growth of a fresh process)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    grown = int(out.stdout.split()[-1])
    scores = 2 * 16384 * 16384 * 4
    assert grown < 64 * 2**20, f"attention grew RSS by {grown / 2**20:.0f} MiB (full scores: {scores / 2**30:.0f} GiB)"


_TOWER_SCRIPT = """
import json, torch
torch.set_num_threads(1)
from openk3.vision import VisionConfig, VisionModel, init_vision_weights
from openk3.vision.encoder import encode_in_pieces, tower_activation_bytes
cfg = VisionConfig.from_dict(json.load(open("openk3/shipped/openk3-tiny/config.json"))["vision_config"])
m = VisionModel(cfg).eval()
init_vision_weights(m, torch.Generator().manual_seed(0))
h = w = 176  # a 2464 px image: 30,976 patches, 7,744 image tokens
def kb(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])
base = kb("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
pv = torch.randn(h * w, 3, 14, 14)
with torch.inference_mode():
    gen = encode_in_pieces(m.vision_tower, pv, (1, h, w), m.mm_projector, piece_flops=1 << 40)
    try:
        while True:
            next(gen)
    except StopIteration as done:
        out = done.value
assert out.shape == (h * w // 4, cfg.text_hidden_size)
print((kb("VmHWM:") - base) * 1024, tower_activation_bytes(cfg, [(1, h, w)]))
"""


def test_tower_peak_memory_is_within_its_estimate():
    """The shipped tiny tower on a 2464 px image (30,976 patches), encoded as the engine does
    (:func:`encode_in_pieces`, largest pieces): the measured peak RSS growth (pixels and output
    included) stays below :func:`tower_activation_bytes`, the estimate the server admits requests
    by, and the estimate is tight (within 2x)."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    out = subprocess.run([sys.executable, "-c", _TOWER_SCRIPT], capture_output=True, text=True, timeout=300,
                         cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    grown, estimate = (int(v) for v in out.stdout.split()[-2:])
    assert grown <= estimate <= 2 * grown, (grown, estimate)


def test_video_time_embedding_and_limits():
    model = _tiny_model()
    pe = model.vision_tower.patch_embed.pos_emb
    img, vid = pe([(1, 4, 4)]), pe([(3, 4, 4)])
    time = sincos_time_embedding(32, 3)
    assert torch.equal(time[0], torch.cat([torch.zeros(16), torch.ones(16)]))  # sin(0), cos(0)
    assert_close(vid.reshape(3, 16, 32), img[None] + time[:, None, :], atol=1e-6, what="time embedding")
    with pytest.raises(ValueError, match="init_pos_emb_time"):
        pe([(5, 4, 4)])
    with pytest.raises(ValueError, match="merge_kernel_size"):
        model(torch.randn(15, 3, 14, 14), [(1, 3, 5)])
    with pytest.raises(ValueError, match="pixel_values"):
        model(torch.randn(15, 3, 14, 14), [(1, 4, 4)])


def test_param_count_released_config():
    counts = count_vision_parameters(vision_preset("kimi-k3"))
    assert counts["vision_tower"] == 401_214_464  # architecture.md §11, report Table 1 (401M)
    by = counts["by_component"]
    assert by["blocks"] == 27 * 14_682_112 and by["patch_embed"] == 602_112
    assert by["pos_emb"] == 4_194_304 and by["final_norm"] == 1_024
    assert counts["mm_projector"] == 4096 * 4096 + 4096 * 7168 + 7168 == 46_144_512
    tiny = VisionModel(vision_preset("tiny"))
    assert count_vision_parameters(vision_preset("tiny"))["total"] == sum(p.numel() for p in tiny.parameters())


@pytest.mark.parametrize("grid", [(1, 8, 8), (1, 36, 52), (2, 12, 16), (1, 96, 80)])
def test_tower_in_pieces_equals_one_call(grid):
    """The resumable tower (row blocks, per-layer query blocks) gives exactly the bits of one
    ``VisionModel`` call in fp32, whatever the piece size; every piece reports positive FLOPs and
    smaller pieces mean more of them (beyond one 64-row block)."""
    from openk3.vision.encoder import encode_in_pieces

    model = _tiny_model(3)
    t, h, w = grid
    pv = torch.randn(t * h * w, 3, model.config.patch_size, model.config.patch_size,
                     generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        want = model(pv, [grid])
        counts = []
        for piece_flops in (1 << 18, 1 << 24, 1 << 62):
            gen = encode_in_pieces(model.vision_tower, pv, grid, model.mm_projector, piece_flops=piece_flops)
            n = 0
            while True:
                try:
                    assert next(gen) > 0
                    n += 1
                except StopIteration as done:
                    got = done.value
                    break
            assert got.dtype == torch.float32 and torch.equal(got, want), (grid, piece_flops)
            counts.append(n)
    assert counts[0] >= counts[1] >= counts[2]
    assert counts[0] > counts[2] or t * h * w <= 64  # 64 rows is the smallest block


def test_tower_in_pieces_validates_before_running():
    from openk3.vision.encoder import encode_in_pieces

    model = _tiny_model()
    with pytest.raises(ValueError, match=r"pixel_values: expected \[24, 3, 14, 14\]"):
        encode_in_pieces(model.vision_tower, torch.zeros(23, 3, 14, 14), (1, 4, 6))
    with pytest.raises(ValueError, match="not divisible by merge_kernel_size"):
        encode_in_pieces(model.vision_tower, torch.zeros(15, 3, 14, 14), (1, 3, 5))
