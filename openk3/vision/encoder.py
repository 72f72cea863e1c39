"""MoonViT-V2: the K3 vision tower (patch embedding, 2D-RoPE encoder, time pooling + 2x2 merge).

Shape legend: G media items (images or videos) packed in one call; (t, h, w) one item's grid of
frames x patch rows x patch columns; L packed patches (sum of t*h*w); P patch size; D
``vt_hidden_size``; A ``qkv_hidden_size``; H heads; K head dim (A / H); I ``vt_intermediate_size``;
N merged tokens (sum of h*w / (kh*kw)); M ``kh*kw*D`` (merged width).

Forward (architecture.md §11; release notes §1.8):

1. ``patch_embed.proj``: Conv2d(3, D, P, stride P), no bias, on pre-cut patches [L, 3, P, P]
   (exactly a linear map of the flattened patch).
2. ``patch_embed.pos_emb.weight`` [H0, W0, D] resized to each grid by ``F.interpolate``
   (``pos_emb_interpolation_mode``, align_corners=False; the stored table itself at the native
   grid); videos (t > 1) also add a fixed 1-D sin/cos time embedding per frame.
3. ``encoder.blocks[i]``: pre-RMSNorm bidirectional attention with 2D RoPE, then pre-RMSNorm
   ``mlp2`` (fc0 -> GELU-tanh -> fc1). Attention never crosses items: a packed call equals encoding
   each item alone. ``encoder.final_layernorm`` at the end.
4. ``sd2_tpool``: mean over frames, then each kh x kw block of patches is concatenated (row-major
   inside the block) into one M-wide token, blocks in row-major order.

2D RoPE: rotary pair j of a head (dims 2j, 2j+1) turns by angle x * theta^(-4i/K) when j = 2i
and y * theta^(-4i/K) when j = 2i + 1, with x the patch column, y the patch row, theta = 1e4:
x and y frequencies interleave. Every frame of a video gets the same spatial angles.

RMSNorm eps: the reference builds ``nn.RMSNorm(D)`` without eps, so torch uses the dtype's
machine epsilon; openk3 uses the fp32 value, 2^-23 (release notes §1.8).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from openk3.layers.norm import RMSNorm
from openk3.vision.config import VisionConfig

ROPE_THETA = 10_000.0
ROPE_MAX_SIDE = 512  # the reference precomputes its rotary table for grids up to 512 x 512 patches
VIT_NORM_EPS = torch.finfo(torch.float32).eps
ATTENTION_IMPLS = ("sdpa", "reference")
# Query rows per SDPA call: bounds the score matrix should a call fall back to the math path.
ATTN_QUERY_BLOCK = 4096

Grid = tuple[int, int, int]


def normalize_grids(grid_thws: torch.Tensor | Sequence[Sequence[int]]) -> list[Grid]:
    """Grids as a list of ``(t, h, w)`` python ints.

    Args:
        grid_thws: [G, 3] integer tensor or a sequence of 3-sequences.
    Raises:
        ValueError: wrong shape or a non-positive entry.
    """
    rows = grid_thws.tolist() if isinstance(grid_thws, torch.Tensor) else list(grid_thws)
    out: list[Grid] = []
    for i, g in enumerate(rows):
        if len(g) != 3:
            raise ValueError(f"grid_thws[{i}]: expected (t, h, w), got {g!r}")
        t, h, w = (int(v) for v in g)
        if min(t, h, w) <= 0:
            raise ValueError(f"grid_thws[{i}]: entries must be positive, got {(t, h, w)}")
        out.append((t, h, w))
    return out


def sincos_time_embedding(dim: int, frames: int) -> torch.Tensor:
    """Fixed 1-D sin/cos embedding of frame indices 0..frames-1 -> [frames, dim] fp32.

    Row f = [sin(f * w_0) ... sin(f * w_{dim/2-1}), cos(f * w_0) ... cos(f * w_{dim/2-1})] with
    w_k = 10000^(-k / (dim/2)) (the MAE-style ``get_1d_sincos_pos_embed``).
    """
    omega = 1.0 / (10_000.0 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0)))
    ang = torch.arange(frames, dtype=torch.float64)[:, None] * omega[None, :]
    return torch.cat([ang.sin(), ang.cos()], dim=1).float()


def interpolate_pos_emb(
    table: torch.Tensor, h: int, w: int, mode: str = "bilinear"
) -> torch.Tensor:
    """Resize the position table to an h x w grid -> [h*w, D] (row-major), in fp32.

    Half-pixel sampling (``align_corners=False``), no antialiasing, as ``F.interpolate`` does; at
    the native size this is the identity.

    Args:
        table: [H0, W0, D].
    """
    x = table.float().permute(2, 0, 1).unsqueeze(0)
    y = F.interpolate(x, size=(h, w), mode=mode, align_corners=False)
    return y.squeeze(0).permute(1, 2, 0).reshape(h * w, -1)


def rope_2d_angles(h: int, w: int, head_dim: int, theta: float = ROPE_THETA) -> torch.Tensor:
    """Rotation angles of the 2D RoPE for an h x w grid -> [h*w, K/2] fp32 (row-major patches).

    Column j = 2i holds x * theta^(-4i/K), column j = 2i + 1 holds y * theta^(-4i/K).

    Raises:
        ValueError: h or w above :data:`ROPE_MAX_SIDE`, or K not divisible by 4.
    """
    if head_dim % 4:
        raise ValueError(f"rope_2d_angles: head_dim must be divisible by 4, got {head_dim}")
    if h > ROPE_MAX_SIDE or w > ROPE_MAX_SIDE:
        raise ValueError(f"rope_2d_angles: grid {h}x{w} exceeds {ROPE_MAX_SIDE} patches per side")
    freqs = theta ** (-torch.arange(0, head_dim, 4, dtype=torch.float64) / head_dim)  # [K/4]
    ys, xs = torch.meshgrid(
        torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij"
    )
    ax = xs.reshape(-1, 1) * freqs  # [h*w, K/4]
    ay = ys.reshape(-1, 1) * freqs
    return torch.stack([ax, ay], dim=-1).reshape(h * w, head_dim // 2).float()


def apply_rope_2d(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (2j, 2j+1) of the last dim by ``angles[..., j]``, in fp32.

    Args:
        x: [L, H, K]. angles: [L, K/2].
    Returns:
        [L, H, K] in ``x.dtype``.
    """
    xf = x.float()
    x1 = xf[..., 0::2]
    x2 = xf[..., 1::2]
    cos = angles.cos()[:, None, :]
    sin = angles.sin()[:, None, :]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


def segment_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Sequence[tuple[int, int]]
) -> torch.Tensor:
    """Plain softmax attention inside each segment ``[start, end)``, in fp32 (readable reference).

    Args:
        q, k, v: [L, H, K]. bounds: segments covering 0..L in order.
    Returns:
        [L, H*K] in ``q.dtype``.
    """
    scale = q.shape[-1] ** -0.5
    outs = []
    for s, e in bounds:
        qs = q[s:e].float()
        ks = k[s:e].float()
        vs = v[s:e].float()
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vs))
    return torch.cat(outs).flatten(-2).to(q.dtype)


def segment_attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Sequence[tuple[int, int]]
) -> torch.Tensor:
    """Same as :func:`segment_attention_reference` through ``F.scaled_dot_product_attention``,
    one call per segment and query block (sum of L_i^2 work, never a full L x L mask).

    Memory: every call gets 4-D ``[1, H, rows, K]`` inputs. With 3-D inputs the CPU dispatcher
    takes the math path, which materialises the H x L_i x L_i scores (L_i = 30,976 patches of a
    2464 px image: 7.7 GB at H = 2); with a batch dimension it takes the fused flash kernel, which
    holds O(L_i) memory. Queries also go in blocks of :data:`ATTN_QUERY_BLOCK` rows, so that any
    fallback to the math path (a dtype or device without a fused kernel) holds at most
    H x ATTN_QUERY_BLOCK x L_i scores. Each query row's result is independent of the blocking.

    Args:
        q, k, v: [L, H, K]. bounds: segments covering 0..L in order.
    Returns:
        [L, H*K] in ``q.dtype``.
    """
    outs = []
    for s, e in bounds:
        ks, vs = (
            k[s:e].transpose(0, 1).unsqueeze(0),
            v[s:e].transpose(0, 1).unsqueeze(0),
        )  # [1, H, L_i, K]
        for a in range(s, e, ATTN_QUERY_BLOCK):
            qs = q[a : min(e, a + ATTN_QUERY_BLOCK)].transpose(0, 1).unsqueeze(0)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1))
    return torch.cat(outs).flatten(-2)


def temporal_pool_merge(
    x: torch.Tensor, grids: Sequence[Grid], kernel: tuple[int, int]
) -> torch.Tensor:
    """``sd2_tpool``: mean over frames, then concatenate each kh x kw patch block.

    Args:
        x: [L, D], items packed in order, each frame-major then row-major.
        grids: (t, h, w) per item. kernel: (kh, kw).
    Returns:
        [N, kh*kw*D]; item g contributes (h/kh)*(w/kw) rows, block rows in row-major order, and
        each row is the block's patches (row-major) concatenated.
    Raises:
        ValueError: h or w not divisible by the kernel.
    """
    kh, kw = kernel
    d = x.shape[-1]
    out = []
    pos = 0
    for i, (t, h, w) in enumerate(grids):
        if h % kh or w % kw:
            raise ValueError(
                f"grid_thws[{i}]: grid {h}x{w} is not divisible by merge_kernel_size {kh}x{kw}"
            )
        seq = x[pos : pos + t * h * w].reshape(t, h // kh, kh, w // kw, kw, d)
        pos += t * h * w
        seq = seq.permute(0, 1, 3, 2, 4, 5).mean(dim=0)
        out.append(seq.reshape((h // kh) * (w // kw), kh * kw * d))
    return torch.cat(out)


class PosEmbDividedFixed(nn.Module):
    """Learned 2-D table (``weight`` [H0, W0, D]) resized per grid, plus a fixed time embedding for
    videos (``pos_emb_type = "divided_fixed"``)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(
                config.init_pos_emb_height, config.init_pos_emb_width, config.vt_hidden_size
            )
        )
        self.num_frames = config.init_pos_emb_time
        self.mode = config.pos_emb_interpolation_mode

    def forward(self, grids: Sequence[Grid]) -> torch.Tensor:
        """Position embeddings for the packed items -> [L, D] fp32.

        Raises:
            ValueError: a video with more frames than ``init_pos_emb_time``.
        """
        embs = []
        for i, (t, h, w) in enumerate(grids):
            if t > self.num_frames:
                raise ValueError(
                    f"grid_thws[{i}]: {t} frames > init_pos_emb_time={self.num_frames}"
                )
            if (h, w) == tuple(self.weight.shape[:2]):
                e2d = self.weight.float().reshape(
                    h * w, -1
                )  # the stored table, not a resampled copy
            else:
                e2d = interpolate_pos_emb(self.weight, h, w, self.mode)
            if t > 1:  # images get no time term: row 0 of the sin/cos table is not zero
                time = sincos_time_embedding(e2d.shape[-1], t).to(e2d.device)
                e2d = (e2d.unsqueeze(0) + time.unsqueeze(1)).reshape(t * h * w, -1)
            embs.append(e2d)
        return torch.cat(embs)


class PatchEmbed(nn.Module):
    """``patch_embed``: ``proj`` (Conv2d weight [D, 3, P, P]) and ``pos_emb``."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        p = config.patch_size
        self.proj = nn.Conv2d(
            3, config.vt_hidden_size, kernel_size=p, stride=p, bias=config.patch_embed_proj_bias
        )
        self.pos_emb = PosEmbDividedFixed(config)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """pixel_values [L, 3, P, P] -> [L, D] (param dtype)."""
        w = self.proj.weight
        x = F.linear(pixel_values.to(w.dtype).flatten(1), w.flatten(1), self.proj.bias)
        return (x.float() + self.pos_emb(grids)).to(w.dtype)


class MLP2(nn.Module):
    """``mlp``: fc0 (D -> I) -> GELU (tanh or exact, ``activation_func``) -> fc1 (I -> D)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc0 = nn.Linear(
            config.vt_hidden_size, config.vt_intermediate_size, bias=config.linear_bias
        )
        self.fc1 = nn.Linear(
            config.vt_intermediate_size, config.vt_hidden_size, bias=config.linear_bias
        )
        self.approximate = "tanh" if config.activation_func == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[L, D] -> [L, D]."""
        return self.fc1(F.gelu(self.fc0(x), approximate=self.approximate))


class EncoderLayer(nn.Module):
    """``encoder.blocks[i]``: norm0, wqkv [3A, D], wo [D, A], norm1, mlp."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        d = config.vt_hidden_size
        a = config.qkv_hidden_size
        self.num_heads = config.vt_num_attention_heads
        self.head_dim = config.head_dim
        self.norm0 = RMSNorm(d, eps=VIT_NORM_EPS)
        self.wqkv = nn.Linear(d, 3 * a, bias=config.attn_bias)
        self.wo = nn.Linear(a, d, bias=config.attn_bias)
        self.norm1 = RMSNorm(d, eps=VIT_NORM_EPS)
        self.mlp = MLP2(config)

    def attention(
        self,
        x: torch.Tensor,
        angles: torch.Tensor,
        bounds: Sequence[tuple[int, int]],
        impl: str = "sdpa",
    ) -> torch.Tensor:
        """Bidirectional 2D-RoPE attention within each segment: [L, D] -> [L, D].

        The wqkv output splits as [q | k | v], each [A] = H heads of K.
        """
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(dim=1)
        q, k = apply_rope_2d(q, angles), apply_rope_2d(k, angles)
        attend = segment_attention_sdpa if impl == "sdpa" else segment_attention_reference
        return self.wo(attend(q, k, v, bounds))

    def forward(
        self,
        x: torch.Tensor,
        angles: torch.Tensor,
        bounds: Sequence[tuple[int, int]],
        impl: str = "sdpa",
    ) -> torch.Tensor:
        """[L, D] -> [L, D]."""
        x = x + self.attention(self.norm0(x), angles, bounds, impl)
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    """``encoder``: ``blocks`` and ``final_layernorm``."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.blocks = nn.ModuleList(
            EncoderLayer(config) for _ in range(config.vt_num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(config.vt_hidden_size, eps=VIT_NORM_EPS)

    def forward(self, x: torch.Tensor, grids: Sequence[Grid], impl: str = "sdpa") -> torch.Tensor:
        """[L, D] -> [L, D]; one attention segment per item (all its frames together)."""
        angles = torch.cat(
            [rope_2d_angles(h, w, self.head_dim).repeat(t, 1) for t, h, w in grids]
        ).to(x.device)
        bounds = []
        pos = 0
        for t, h, w in grids:
            bounds.append((pos, pos + t * h * w))
            pos += t * h * w
        for block in self.blocks:
            x = block(x, angles, bounds, impl)
        return self.final_layernorm(x)


class MoonViT(nn.Module):
    """The vision tower (checkpoint prefix ``vision_tower.``): pixels -> merged patch features.

    Build with a :class:`VisionConfig`; parameters are uninitialised (``torch.empty``) until
    weights are loaded (:func:`openk3.vision.weights.load_vision_weights`) or
    :func:`openk3.vision.weights.init_vision_weights` runs.
    """

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.encoder = Encoder(config)

    def encode(
        self,
        pixel_values: torch.Tensor,
        grid_thws: torch.Tensor | Sequence[Sequence[int]],
        attn_impl: str = "sdpa",
    ) -> torch.Tensor:
        """Per-patch features before merging: [L, 3, P, P] -> [L, D].

        Raises:
            ValueError: ``pixel_values`` shape disagrees with the grids, a grid side above 512,
                more frames than ``init_pos_emb_time``, or an unknown ``attn_impl``.
        """
        if attn_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attn_impl: must be one of {ATTENTION_IMPLS}, got {attn_impl!r}")
        grids = normalize_grids(grid_thws)
        p = self.config.patch_size
        total = sum(t * h * w for t, h, w in grids)
        if (
            pixel_values.dim() != 4
            or tuple(pixel_values.shape[1:]) != (3, p, p)
            or pixel_values.shape[0] != total
        ):
            raise ValueError(
                f"pixel_values: expected [{total}, 3, {p}, {p}] for grids {grids}, "
                f"got {list(pixel_values.shape)}"
            )
        x = self.patch_embed(pixel_values, grids)
        return self.encoder(x, grids, attn_impl)

    def forward(
        self,
        pixel_values: torch.Tensor,
        grid_thws: torch.Tensor | Sequence[Sequence[int]],
        attn_impl: str = "sdpa",
    ) -> torch.Tensor:
        """[L, 3, P, P] -> merged features [N, kh*kw*D] (the projector's input), items in order.

        Raises:
            ValueError: see :meth:`encode`; a grid side not divisible by the merge kernel.
        """
        grids = normalize_grids(grid_thws)
        x = self.encode(pixel_values, grids, attn_impl)
        return temporal_pool_merge(x, grids, self.config.merge_kernel_size)


def tower_activation_bytes(
    config: VisionConfig, grids: int | Sequence[Sequence[int]], itemsize: int = 4
) -> int:
    """Upper estimate of the peak memory (bytes) that encoding a request's images with
    :func:`encode_in_pieces` (one image at a time, the projector included) adds, pixels included.

    Held for the whole request: every image's pixel patches (3 P^2 per patch) and its projected
    features (E per merged token). Held while one image of L patches is encoded: the position
    embedding and RoPE angles (fp32, D + K/2 per patch), the residual x (D), q, k, v (3 A), the
    copies of k and v the fused SDPA kernel may make (2 A), the merged output (kh kw D per token),
    plus the temporaries of one row block of at most :data:`ATTN_QUERY_BLOCK` rows (the widest
    piece: norm, residual and MLP hidden before and after the GELU, 4 D + A + 2 I; the RoPE
    temporaries, 8 A in fp32; the projector, 2 M + E per merged row). Times 1.25 for allocator
    slack. The attention scores never exist whole (fused kernel, see
    :func:`segment_attention_sdpa`). ``tests/vision/test_encoder.py`` measures the peak RSS growth
    of the shipped tiny tower on a 2464 px image against this estimate.

    Args:
        grids: the images' (t, h, w) grids, or a packed patch count L (one image).
        itemsize: bytes per element of the tower's dtype.
    """
    p = config.patch_size
    d = config.vt_hidden_size
    a = config.qkv_hidden_size
    i = config.vt_intermediate_size
    kh, kw = config.merge_kernel_size
    m = config.merged_hidden_size
    e = config.text_hidden_size
    sizes = (
        [(int(grids), int(grids))]
        if isinstance(grids, int)
        else [(t * h * w, h * w) for t, h, w in grids]
    )
    held = sum(L * 3 * p * p + n // (kh * kw) * e for L, n in sizes) * itemsize
    work = 0
    for L, n in sizes:
        rows = min(L, ATTN_QUERY_BLOCK)
        per_patch = (d + config.head_dim // 2) * 4 + (d + 3 * a + 2 * a + d) * itemsize
        per_row = (4 * d + a + 2 * i) * itemsize + 8 * a * 4 + (2 * m + e) * itemsize // (kh * kw)
        work = max(work, L * per_patch + rows * per_row)
    return int(1.25 * (held + work))


def merged_token_counts(
    grid_thws: torch.Tensor | Sequence[Sequence[int]], kernel: tuple[int, int]
) -> list[int]:
    """Merged tokens per item: (h/kh) * (w/kw) (frames are pooled, so t does not count)."""
    return [(h // kernel[0]) * (w // kernel[1]) for _, h, w in normalize_grids(grid_thws)]


def _row_blocks(n: int, rows: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + rows)) for a in range(0, n, rows)]


def encode_in_pieces(
    tower: MoonViT,
    pixel_values: torch.Tensor,
    grid: Sequence[int],
    projector=None,
    *,
    piece_flops: int = 1 << 28,
):
    """The tower (and optionally the projector) on one item as resumable work: a generator that
    runs one bounded piece per ``next()``, yields that piece's multiply-add FLOPs, and returns
    the features (``StopIteration.value``). Same math as :meth:`MoonViT.forward` (then
    ``projector``), piece by piece:

    - patch embedding, a block of rows per piece;
    - per encoder layer: norm0 + wqkv + 2D RoPE for a block of rows per piece (q, k, v of every
      row are kept), then, per query block, the segment attention of those rows against all keys
      (fused SDPA, :func:`segment_attention_sdpa`), wo, the residual, norm1 and the MLP — every
      step after attention is row-wise, so each block's rows of the layer output are final at
      once and overwrite the residual in place;
    - the final norm, ``sd2_tpool`` and the projector.

    A caller (the engine) runs pieces between its decode steps under a FLOPs budget; dropping the
    generator at any point frees everything it holds.

    Args:
        tower: the :class:`MoonViT`. pixel_values: [L, 3, P, P] of this one item.
        grid: its (t, h, w). projector: optional ``[N, M] -> [N, E]`` module applied last.
        piece_flops: FLOPs (2 per multiply-add) one piece aims at; the row blocks are sized from
            it (a power of two, at least 64 rows, at most :data:`ATTN_QUERY_BLOCK`), so a piece
            may exceed it when 64 rows already do.
    Yields:
        int FLOPs of the piece just run.
    Returns:
        [N, kh*kw*D] merged features, or [N, E] with the projector.
    Memory: besides the pixels and the output, x [L, D] and q, k, v [L, A] each, plus the
    temporaries of one row block (:func:`tower_activation_bytes`).
    Raises:
        ValueError: as :meth:`MoonViT.forward` (checked before the first piece runs).
    """
    cfg = tower.config
    ((t, h, w),) = normalize_grids([grid])
    p = cfg.patch_size
    L = t * h * w
    if pixel_values.dim() != 4 or tuple(pixel_values.shape) != (L, 3, p, p):
        raise ValueError(
            f"pixel_values: expected [{L}, 3, {p}, {p}] for grid {(t, h, w)}, "
            f"got {list(pixel_values.shape)}"
        )
    kh, kw = cfg.merge_kernel_size
    if h % kh or w % kw:
        raise ValueError(
            f"grid_thws[0]: grid {h}x{w} is not divisible by merge_kernel_size {kh}x{kw}"
        )
    pos = tower.patch_embed.pos_emb([(t, h, w)])  # also checks the frame count
    angles = rope_2d_angles(h, w, tower.encoder.head_dim).repeat(t, 1).to(pixel_values.device)
    return _pieces(tower, pixel_values, (t, h, w), pos, angles, projector, piece_flops)


def _pieces(tower, pixel_values, grid, pos, angles, projector, piece_flops):
    cfg = tower.config
    t, h, w = grid
    L = t * h * w
    d = cfg.vt_hidden_size
    a = cfg.qkv_hidden_size
    i = cfg.vt_intermediate_size
    heads = cfg.vt_num_attention_heads
    k_dim = cfg.head_dim

    def rows_for(per_row: int) -> int:
        # Powers of two from 64 up: measured on CPU, row blocks of these sizes give the same bits as
        # one full-length matmul / 4096-row SDPA call (odd sizes, e.g. 130 query rows, do not).
        rows = max(1, piece_flops // max(1, per_row))
        return max(64, min(ATTN_QUERY_BLOCK, 1 << (rows.bit_length() - 1)))

    proj = tower.patch_embed.proj.weight
    x = torch.empty(L, d, dtype=proj.dtype, device=pixel_values.device)
    per = 2 * 3 * cfg.patch_size**2 * d
    for s, e in _row_blocks(L, rows_for(per)):
        y = F.linear(
            pixel_values[s:e].to(proj.dtype).flatten(1),
            proj.flatten(1),
            tower.patch_embed.proj.bias,
        )
        x[s:e] = (y.float() + pos[s:e]).to(proj.dtype)
        yield per * (e - s)
    del pos
    q = torch.empty(L, heads, k_dim, dtype=x.dtype, device=x.device)
    k = torch.empty_like(q)
    v = torch.empty_like(q)
    qkv_per = 2 * d * 3 * a
    attn_per = 4 * L * a + 2 * a * d + 4 * d * i
    for block in tower.encoder.blocks:
        for s, e in _row_blocks(L, rows_for(qkv_per)):
            qs, ks, vs = block.wqkv(block.norm0(x[s:e])).view(e - s, 3, heads, k_dim).unbind(dim=1)
            q[s:e], k[s:e], v[s:e] = (
                apply_rope_2d(qs, angles[s:e]),
                apply_rope_2d(ks, angles[s:e]),
                vs,
            )
            yield qkv_per * (e - s)
        kt, vt = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, H, L, K]
        for s, e in _row_blocks(L, rows_for(attn_per)):
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1).unsqueeze(0), kt, vt)[
                0
            ].transpose(0, 1)
            xs = x[s:e] + block.wo(o.flatten(-2))
            x[s:e] = xs + block.mlp(block.norm1(xs))
            yield attn_per * (e - s)
    del q, k, v
    for s, e in _row_blocks(L, rows_for(4 * d)):
        x[s:e] = tower.encoder.final_layernorm(x[s:e])
        yield 4 * d * (e - s)
    merged = temporal_pool_merge(x, [grid], cfg.merge_kernel_size)
    del x
    if projector is None:
        return merged
    m = merged.shape[-1]
    e_dim = projector.proj[2].out_features
    per = 2 * m * m + 2 * m * e_dim
    outs = []
    for s, e in _row_blocks(merged.shape[0], rows_for(per)):
        outs.append(projector(merged[s:e]))
        yield per * (e - s)
    return torch.cat(outs)
