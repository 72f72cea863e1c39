"""Image preprocessing: the documented token-count formula on landscape / portrait / square / tiny /
huge images, the pixels the tower sees (patch layout, padding, normalisation, bicubic resize,
transparent backgrounds, modes, formats) and the errors bad images raise."""

from __future__ import annotations

import base64
import io
import math
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from openk3.vision import VisionModel, init_vision_weights, merged_token_counts, vision_preset
from openk3.vision.preprocess import (
    ImageError, ImageProcessorConfig, decode_image, image_bytes_from_data_url, image_token_count, navit_resize,
    pack_images, process_image, process_images,
)


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _rgb(w: int, h: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _norm(a) -> np.ndarray:
    return (np.asarray(a, dtype=np.float32) / 255.0 - 0.5) / 0.5


def _unpatchify(pv: torch.Tensor, gh: int, gw: int) -> np.ndarray:
    """[gh*gw, 3, P, P] -> [gh*P, gw*P, 3]."""
    p = pv.shape[-1]
    return pv.reshape(gh, gw, 3, p, p).permute(0, 3, 1, 4, 2).reshape(gh * p, gw * p, 3).numpy()


# ----------------------------------------------------------------------------- token counts

@pytest.mark.parametrize("size,tokens", [
    ((224, 224), 64),        # fits: 224 = 8 * 28, no pad -> 8 * 8
    ((1000, 500), 648),      # landscape: 71*35 patches < 65536, pads to 1008x504 -> 36 * 18
    ((500, 1000), 648),      # portrait: the transpose
    ((1, 1), 1),             # tiny: one 28x28 padded block
    ((37, 53), 4),           # primes: pads to 56x56 -> 2 * 2
    ((2800, 2800), 10_000),  # square: 200*200 patches fit; 100 * 100 (a port's release check gives the same)
    ((8000, 6000), 16_428),  # huge: s = sqrt(65536 / (571*428)) = 0.51784 -> 4142x3107 -> 4144x3108 -> 148 * 111
    ((7168, 7168), 16_384),  # largest square allowed: s = 0.5 -> 3584x3584 (the report's max input) -> 128 * 128
    ((20000, 100), 512),     # panorama: one-side limit, s = 7168/20000 -> 7168x35 -> 7168x56 -> 256 * 2
])
def test_token_count_formula(size, tokens):
    assert image_token_count(*size) == tokens
    plan = navit_resize(*size)
    assert plan.num_tokens == (plan.grid_h // 2) * (plan.grid_w // 2)
    assert (plan.width, plan.height) == size


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 30000), st.integers(1, 30000))
def test_resize_plan_invariants(w, h):
    plan = navit_resize(w, h)
    assert plan.grid_h <= 512 and plan.grid_w <= 512 and plan.grid_h % 2 == 0 and plan.grid_w % 2 == 0
    assert plan.new_width + plan.pad_width == plan.grid_w * 14 and plan.new_height + plan.pad_height == plan.grid_h * 14
    assert 0 <= plan.pad_width < 28 and 0 <= plan.pad_height < 28
    assert 1 <= plan.new_width <= w and 1 <= plan.new_height <= h  # never upscaled
    if (w // 14) * (h // 14) <= 65536 and max(w, h) <= 7168:
        assert (plan.new_width, plan.new_height) == (w, h)  # within the limits: only padded
    else:  # one common scale: aspect ratio kept up to the floor of each side
        s = min(math.sqrt(65536 / (max(1, w // 14) * max(1, h // 14))), 7168 / w, 7168 / h)
        assert abs(plan.new_width - w * s) <= 1 + 1e-6 * w and abs(plan.new_height - h * s) <= 1 + 1e-6 * h
    assert plan.num_tokens == image_token_count(w, h) >= 1


def test_pipeline_token_count_equals_grid_and_tower_rows():
    imgs = [_encode(Image.fromarray(_rgb(w, h)), "PNG") for w, h in [(90, 40), (30, 70), (28, 28)]]
    processed = process_images(imgs)
    assert [p.num_tokens for p in processed] == [image_token_count(w, h) for w, h in [(90, 40), (30, 70), (28, 28)]]
    pixels, grids = pack_images(processed)
    assert pixels.shape == (4 * sum(p.num_tokens for p in processed), 3, 14, 14) and pixels.dtype == torch.float32
    model = VisionModel(vision_preset("tiny"))
    init_vision_weights(model, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(pixels, grids)
    assert out.shape == (sum(p.num_tokens for p in processed), 64)
    assert merged_token_counts(grids, (2, 2)) == [p.num_tokens for p in processed]


# ----------------------------------------------------------------------------- pixels

def test_patch_layout_normalisation_and_padding():
    arr = _rgb(61, 30)  # pads to 84 x 56: grid 4 x 6
    p = process_image(_encode(Image.fromarray(arr), "PNG"))
    assert p.grid_thw == (1, 4, 6) and (p.width, p.height) == (61, 30) and p.num_tokens == 6
    # patch k is the 14x14 crop at (row k // 6, col k % 6), channels first
    for k in (0, 5, 13, 23):
        y, x = divmod(k, 6)
        crop = _norm(np.pad(arr, ((0, 26), (0, 23), (0, 0)))[y * 14:(y + 1) * 14, x * 14:(x + 1) * 14])
        np.testing.assert_allclose(p.pixel_values[k].numpy(), crop.transpose(2, 0, 1), atol=1e-6)
    full = _unpatchify(p.pixel_values, 4, 6)
    np.testing.assert_allclose(full[:30, :61], _norm(arr), atol=1e-6)
    assert (full[30:] == -1).all() and (full[:, 61:] == -1).all()  # black padding, bottom and right


def test_downscale_is_pillow_bicubic():
    cfg = ImageProcessorConfig(in_patch_limit=64)
    img = Image.fromarray(_rgb(300, 150))
    p = process_image(_encode(img, "PNG"), cfg)
    plan = p.plan
    assert plan.new_width < 300 and plan.num_tokens <= 64 // 4 + 4
    expect = np.asarray(img.resize((plan.new_width, plan.new_height), Image.Resampling.BICUBIC))
    full = _unpatchify(p.pixel_values, plan.grid_h, plan.grid_w)
    np.testing.assert_allclose(full[:plan.new_height, :plan.new_width], _norm(expect), atol=1e-6)


@pytest.mark.parametrize("fmt,kw,tol", [("PNG", {}, 0), ("JPEG", {"quality": 95}, 6), ("WEBP", {"lossless": True}, 0),
                                         ("GIF", {}, 0)])
def test_formats_decode(fmt, kw, tol):
    color = (200, 40, 90)
    data = _encode(Image.new("RGB", (50, 20), color), fmt, **kw)
    p = process_image(data)
    full = _unpatchify(p.pixel_values, p.grid_thw[1], p.grid_thw[2])
    assert (p.width, p.height) == (50, 20)
    np.testing.assert_allclose(full[:20, :50], np.broadcast_to(_norm(color), (20, 50, 3)), atol=tol / 127.5 + 1e-6)


def test_animated_gif_uses_first_frame():
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50)
    img = decode_image(buf.getvalue())
    assert getattr(img, "n_frames", 1) == 2
    p = process_image(buf.getvalue())
    np.testing.assert_allclose(_unpatchify(p.pixel_values, 2, 2)[:16, :16], np.broadcast_to(_norm((255, 0, 0)), (16, 16, 3)))


def _chessboard(h: int, w: int) -> np.ndarray:
    gray = ((np.arange(h)[:, None] // 8 + np.arange(w)[None, :] // 8) % 2) == 1  # top-left square white
    return np.where(gray[..., None], 180, 255).astype(np.float32).repeat(3, axis=2)


def test_transparency_composites_on_chessboard():
    rgba = np.zeros((28, 28, 4), dtype=np.uint8)
    rgba[:, :14, :3] = (10, 200, 30)
    rgba[:, :14, 3] = 128  # half transparent on the left, fully transparent on the right
    p = process_image(_encode(Image.fromarray(rgba, "RGBA"), "PNG"))
    a = rgba[:, :, 3:4].astype(np.float32) / np.float32(255.0)
    expect = (a * rgba[:, :, :3].astype(np.float32) + (1 - a) * _chessboard(28, 28)).astype(np.uint8)
    np.testing.assert_allclose(_unpatchify(p.pixel_values, 2, 2), _norm(expect), atol=1e-6)
    # palette transparency counts as alpha too
    pal = Image.new("P", (28, 28), 0)
    pal.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    pal.info["transparency"] = 0
    q = process_image(_encode(pal, "PNG"))
    np.testing.assert_allclose(_unpatchify(q.pixel_values, 2, 2), _norm(_chessboard(28, 28)), atol=1e-6)
    # with no background configured, alpha is dropped
    r = process_image(_encode(Image.fromarray(rgba, "RGBA"), "PNG"), ImageProcessorConfig(transparent_bg_config=None))
    np.testing.assert_allclose(_unpatchify(r.pixel_values, 2, 2), _norm(rgba[:, :, :3]), atol=1e-6)


def test_grayscale_is_replicated():
    g = np.random.default_rng(1).integers(0, 256, (20, 20), dtype=np.uint8)
    p = process_image(_encode(Image.fromarray(g, "L"), "PNG"))
    np.testing.assert_allclose(_unpatchify(p.pixel_values, 2, 2)[:20, :20], _norm(np.repeat(g[..., None], 3, 2)))


def test_content_hash_tracks_bytes():
    a, b = (_encode(Image.fromarray(_rgb(20, 20, s)), "PNG") for s in (0, 1))
    assert process_image(a).content_hash == process_image(a).content_hash != process_image(b).content_hash


# ----------------------------------------------------------------------------- bad images

def _huge_png_header(w: int, h: int) -> bytes:
    """A PNG whose IHDR claims w x h (the pixel data is a 1x1 image's): detectable before decoding."""
    data = bytearray(_encode(Image.new("RGB", (1, 1)), "PNG"))
    ihdr = struct.pack(">II", w, h) + bytes(data[24:29])
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr) & 0xFFFFFFFF)
    return bytes(data)


@pytest.mark.parametrize("data,code", [
    (b"", "empty"),
    (b"definitely not an image", "corrupt"),
    (_encode(Image.fromarray(_rgb(64, 64)), "PNG")[:400], "corrupt"),  # truncated
    (_encode(Image.new("RGB", (8, 8)), "BMP"), "unsupported_format"),
    (_huge_png_header(100_000, 100_000), "too_large"),
    (_huge_png_header(7169, 7168), "too_large"),
])
def test_bad_images_raise(data, code):
    with pytest.raises(ImageError) as e:
        process_image(data)
    assert e.value.code == code and isinstance(e.value, ValueError)


def test_limits_and_indices():
    good = _encode(Image.new("RGB", (10, 10)), "PNG")
    with pytest.raises(ImageError, match="exceeds the limit") as e:
        process_image(good, ImageProcessorConfig(max_image_bytes=10))
    assert e.value.code == "too_large"
    with pytest.raises(ImageError) as e:
        process_images([good] * 17)
    assert e.value.code == "too_many"
    with pytest.raises(ImageError, match="^image 1: ") as e:
        process_images([good, b"junk"])
    assert e.value.index == 1 and e.value.code == "corrupt"
    with pytest.raises(ImageError) as e:
        process_image(Image.new("RGB", (0, 5)))
    assert e.value.code == "empty"


def test_data_urls():
    good = _encode(Image.new("RGB", (10, 10)), "PNG")
    assert image_bytes_from_data_url("data:image/png;base64," + base64.b64encode(good).decode()) == good
    for url, code in [("https://example.com/a.png", "bad_url"), ("data:image/png,rawbytes", "bad_url"),
                      ("data:image/png;base64,@@@not-base64", "corrupt")]:
        with pytest.raises(ImageError) as e:
            image_bytes_from_data_url(url, index=2)
        assert e.value.code == code and e.value.index == 2


def test_processor_config_round_trip_and_errors():
    official = {"patch_size": 14, "merge_kernel_size": [2, 2], "in_patch_limit": 65536, "patch_limit_on_one_side": 512,
                "fixed_output_tokens": None, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8,
                                          "chessboard_square_on_top_left": True, "chessboard_white_value": 255,
                                          "chessboard_gray_value": 180},
                "transparent_bg_fill_stage": "after_resize", "some_future_key": 1}
    cfg = ImageProcessorConfig.from_dict(official)
    assert cfg.merge_kernel_size == 2 and cfg.extra == {"some_future_key": 1}
    assert ImageProcessorConfig.from_dict(cfg.to_dict()) == cfg
    for key, value in [("fixed_output_tokens", 256), ("merge_kernel_size", [2, 3]), ("patch_size", 0),
                       ("transparent_bg_fill_stage", "never")]:
        with pytest.raises(ValueError, match=key):
            ImageProcessorConfig.from_dict({**official, key: value})
