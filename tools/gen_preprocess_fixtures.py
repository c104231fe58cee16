#!/usr/bin/env python3
"""Generate the image-preprocessing fixtures for `tests/preprocess.rs`.

1. Draws small test images with PIL into tests/fixtures/images/ (plus a few bad files).
2. Runs HF transformers' Qwen image processor (the class AutoImageProcessor picks for the
   preprocessor_config.json files in models/*/) on each good image, passing the *file path* (so HF decodes
   it itself, exactly like `recall::vision::ImageSource::Path`), for both families and a few min/max pixel
   settings, and stores per case:
     - `<case>.pixel_values`   f32 [num_patches, C*T*P*P]   (only for "full" cases, to keep the file small)
     - `<case>.grid_thw`       i64 [3]
     - `<case>.resized`        u8  [H, W, 3] the resized image before rescale/normalise. It is computed by
       calling the processor's own steps (fetch_images -> process_image -> resize, i.e. torchvision's
       antialiased bicubic on the uint8 tensor) and cross-checked against un-normalising pixel_values.
   into tests/fixtures/preprocess/reference.safetensors, with the case list in reference.json.
3. Writes a table of HF `smart_resize` results (incl. round-half-to-even and error cases) to
   tests/fixtures/preprocess/smart_resize.json.

Run from the repository root:  .venv-tools/bin/python tools/gen_preprocess_fixtures.py
"""

import json
import math
import os
import struct
import zlib

import numpy as np
import torch
from PIL import Image, ImageDraw
from safetensors.torch import save_file
from transformers import AutoImageProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMG_DIR = os.path.join(ROOT, "tests", "fixtures", "images")
OUT_DIR = os.path.join(ROOT, "tests", "fixtures", "preprocess")

FAMILIES = {
    # family name -> model dir whose preprocessor_config.json selects the processor
    "qwen3_vl": os.path.join(ROOT, "models", "qwen3-vl-2b-instruct"),
    "qwen2_5_vl": os.path.join(ROOT, "models", "qwen2.5-vl-7b-instruct"),
}


# images whose normalised pixel_values are stored (the others store grid + resized image only)
FULL_IMAGES = {
    "screenshot_200x120.png",
    "rgba_64x48.png",
    "tiny_20x12.png",
}
# images also run at the "medium" setting (bigger grids)
MEDIUM_IMAGES = {"screenshot_200x120.png", "photo_96x64.jpg", "tiny_20x12.png"}


def draw_screenshot(w, h, seed=0):
    rng = np.random.default_rng(seed)
    im = Image.new("RGB", (w, h), (245, 246, 248))
    d = ImageDraw.Draw(im)
    # gradient title bar
    for x in range(w):
        c = int(40 + 180 * x / max(1, w - 1))
        d.line([(x, 0), (x, 12)], fill=(c, 90, 255 - c))
    # side panel
    d.rectangle([0, 13, w // 5, h - 1], fill=(32, 36, 44))
    for i in range(6):
        y = 20 + i * 14
        d.rectangle([4, y, w // 5 - 4, y + 8], fill=(70 + 20 * i, 120, 200 - 15 * i))
    # buttons / cards
    for i in range(5):
        x0 = w // 5 + 8 + int(rng.integers(0, max(1, w // 2)))
        y0 = int(rng.integers(0, max(1, h - 20)))
        col = tuple(int(v) for v in rng.integers(0, 256, 3))
        d.rectangle([x0, y0, x0 + int(rng.integers(12, 50)), y0 + int(rng.integers(8, 24))], fill=col, outline=(0, 0, 0))
    # text-like stripes: alternating 1px dark strokes of varying length
    for row in range(8):
        y = 24 + row * 11
        x = w // 5 + 10
        while x < w - 10:
            ln = int(rng.integers(2, 9))
            d.line([(x, y), (x + ln, y)], fill=(20, 20, 20))
            d.line([(x, y + 2), (x + ln - 1, y + 2)], fill=(60, 60, 60))
            x += ln + int(rng.integers(1, 4))
    # checkerboard (high frequency) patch
    for yy in range(h - 20, h - 4):
        for xx in range(w - 40, w - 4):
            if (xx + yy) % 2 == 0:
                im.putpixel((xx, yy), (0, 0, 0))
    return im


def noise_image(w, h, seed):
    """Gradient plus random 1-3 px blocks: small images with plenty of high-frequency content."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    im = np.dstack([xx * 255 // max(1, w - 1), yy * 255 // max(1, h - 1), (xx + yy) * 7 % 256]).astype(np.uint8)
    for _ in range(w * h // 6):
        x, y, s = int(rng.integers(0, w)), int(rng.integers(0, h)), int(rng.integers(1, 4))
        im[y : y + s, x : x + s] = rng.integers(0, 256, 3)
    return im


def make_images():
    os.makedirs(IMG_DIR, exist_ok=True)
    good = {}

    im = draw_screenshot(200, 120)
    p = os.path.join(IMG_DIR, "screenshot_200x120.png")
    im.save(p, optimize=True)
    good["screenshot_200x120.png"] = p

    # RGBA with varying alpha (HF's path decoder drops alpha, no compositing)
    base = np.array(draw_screenshot(64, 48, seed=1))
    alpha = np.tile(np.linspace(0, 255, 64).astype(np.uint8), (48, 1))
    rgba = np.dstack([base, alpha])
    p = os.path.join(IMG_DIR, "rgba_64x48.png")
    Image.fromarray(rgba, "RGBA").save(p, optimize=True)
    good["rgba_64x48.png"] = p

    # grayscale
    gy, gx = np.mgrid[0:70, 0:50]
    gray = ((gx * 5 + gy * 3) % 256).astype(np.uint8)
    gray[10:20, 10:40] = 255
    gray[30:32, :] = 0
    p = os.path.join(IMG_DIR, "gray_50x70.png")
    Image.fromarray(gray, "L").save(p, optimize=True)
    good["gray_50x70.png"] = p

    # palette image
    pal = draw_screenshot(90, 40, seed=2).convert("P", palette=Image.ADAPTIVE, colors=16)
    p = os.path.join(IMG_DIR, "palette_90x40.png")
    pal.save(p, optimize=True)
    good["palette_90x40.png"] = p

    # JPEG (4:2:0, the common case)
    p = os.path.join(IMG_DIR, "photo_96x64.jpg")
    draw_screenshot(96, 64, seed=3).save(p, quality=90)
    good["photo_96x64.jpg"] = p

    # JPEG with EXIF orientation 6 (rotate 90 CW on display)
    p = os.path.join(IMG_DIR, "exif_rot6_48x32.jpg")
    exif = Image.Exif()
    exif[0x0112] = 6
    draw_screenshot(48, 32, seed=4).save(p, quality=92, subsampling=0, exif=exif)
    good["exif_rot6_48x32.jpg"] = p

    # WebP lossless and lossy
    p = os.path.join(IMG_DIR, "lossless_80x60.webp")
    draw_screenshot(80, 60, seed=5).save(p, lossless=True)
    good["lossless_80x60.webp"] = p
    p = os.path.join(IMG_DIR, "lossy_80x60.webp")
    draw_screenshot(80, 60, seed=6).save(p, quality=80)
    good["lossy_80x60.webp"] = p

    # tiny: min_pixels must upscale
    p = os.path.join(IMG_DIR, "tiny_20x12.png")
    Image.fromarray(noise_image(20, 12, seed=7)).save(p)
    good["tiny_20x12.png"] = p

    # extreme but legal aspect ratio 150
    row = noise_image(900, 6, seed=8)
    p = os.path.join(IMG_DIR, "wide_900x6.png")
    Image.fromarray(row).save(p, optimize=True)
    good["wide_900x6.png"] = p

    # ---- bad files ----
    # aspect ratio 250 (> 200): decodes fine, smart_resize must refuse it
    Image.fromarray(np.full((4, 1000, 3), 128, np.uint8)).save(os.path.join(IMG_DIR, "bad_ratio_1000x4.png"))
    # truncated PNG
    data = open(good["screenshot_200x120.png"], "rb").read()
    open(os.path.join(IMG_DIR, "bad_truncated.png"), "wb").write(data[: len(data) // 2])
    # PNG with a corrupt IDAT (valid header, garbage compressed data)
    open(os.path.join(IMG_DIR, "bad_corrupt.png"), "wb").write(png_bytes(8, 8, b"\x00garbage-not-zlib" * 4))
    # unsupported formats
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(os.path.join(IMG_DIR, "bad_format.gif"))
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(os.path.join(IMG_DIR, "bad_format.bmp"))
    # zero-byte file
    open(os.path.join(IMG_DIR, "bad_empty.png"), "wb").close()
    # zero-size image: a PNG whose IHDR says width 0
    open(os.path.join(IMG_DIR, "bad_zero_size.png"), "wb").write(png_bytes(0, 8, zlib.compress(b"")))
    return good


def png_chunk(kind, payload):
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF)


def png_bytes(w, h, idat):
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def settings_for(family):
    f = 32 if family == "qwen3_vl" else 28
    return {
        # full: pixel_values stored; a handful of merged tokens
        "small": dict(min_pixels=4 * f * f, max_pixels=12 * f * f, full=True),
        # min == max (GUI-Owl style, scaled down)
        "fixed": dict(min_pixels=6 * f * f, max_pixels=6 * f * f, full=False),
        # bigger grids, resized image + grid only (keeps the fixture small)
        "medium": dict(min_pixels=16 * f * f, max_pixels=32 * f * f, full=False),
    }


def main():
    good = make_images()
    os.makedirs(OUT_DIR, exist_ok=True)
    tensors = {}
    cases = []
    procs = {}
    for family, model_dir in FAMILIES.items():
        proc = AutoImageProcessor.from_pretrained(model_dir)
        procs[family] = type(proc).__name__
        for setting, st in settings_for(family).items():
            size = {"shortest_edge": st["min_pixels"], "longest_edge": st["max_pixels"]}
            for name, path in good.items():
                if setting == "medium" and name not in MEDIUM_IMAGES:
                    continue
                out = proc(images=path, size=size, return_tensors="pt")
                pv = out["pixel_values"].to(torch.float32)
                grid = out["image_grid_thw"][0].to(torch.int64)
                # the processor's own steps up to (and including) the resize
                img = proc.process_image(proc.fetch_images(path), do_convert_rgb=True)[None]
                f = proc.patch_size * proc.merge_size
                resized = proc.resize(img, size=proc.size.__class__(**size), resample=proc.resample, factor=f)[0]
                resized_hwc = resized.permute(1, 2, 0).contiguous()
                assert resized_hwc.dtype == torch.uint8
                t, gh, gw = grid.tolist()
                assert (resized.shape[1], resized.shape[2]) == (gh * proc.patch_size, gw * proc.patch_size)
                # cross-check: un-normalise pixel_values (frame 0) back to uint8 and compare
                unnorm = unpatchify(pv, gh, gw, proc)
                mean = torch.tensor(proc.image_mean).view(3, 1, 1)
                std = torch.tensor(proc.image_std).view(3, 1, 1)
                back = torch.round((unnorm * std + mean) * 255).clamp(0, 255).to(torch.uint8)
                diff = (back.int() - resized.int()).abs().max().item()
                assert diff == 0, f"{name}: un-normalised pixel_values differ from resize output by {diff}"
                key = f"{family}/{setting}/{name}"
                tensors[key + ".grid_thw"] = grid.contiguous()
                tensors[key + ".resized"] = resized_hwc
                full = st["full"] and name in FULL_IMAGES
                if full:
                    tensors[key + ".pixel_values"] = pv.contiguous()
                src_w, src_h = Image.open(path).size
                cases.append(
                    dict(
                        key=key,
                        family=family,
                        setting=setting,
                        image=name,
                        min_pixels=st["min_pixels"],
                        max_pixels=st["max_pixels"],
                        grid_thw=grid.tolist(),
                        resized_hw=[int(resized.shape[1]), int(resized.shape[2])],
                        file_wh=[src_w, src_h],
                        has_pixel_values=full,
                    )
                )
    save_file(tensors, os.path.join(OUT_DIR, "reference.safetensors"))
    import transformers
    import torchvision

    meta = dict(
        transformers=transformers.__version__,
        torch=torch.__version__,
        torchvision=torchvision.__version__,
        torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
        processors=procs,
        resized_source="processor steps: fetch_images(path) -> process_image -> resize (uint8), "
        "cross-checked == round(unnormalised pixel_values * 255)",
        cases=cases,
    )
    with open(os.path.join(OUT_DIR, "reference.json"), "w") as fh:
        json.dump(meta, fh, indent=1)

    # smart_resize table
    rows = []
    rng = np.random.default_rng(42)
    base = [
        (70, 70, 28, 56 * 56, 28 * 28 * 1280),  # 70/28 = 2.5 -> 2 (half to even)
        (98, 98, 28, 56 * 56, 28 * 28 * 1280),  # 3.5 -> 4
        (80, 144, 32, 32 * 32, 32 * 32 * 1000),  # 2.5, 4.5
        (112, 208, 32, 32 * 32, 32 * 32 * 1000),  # 3.5, 6.5
        (1080, 1920, 32, 65536, 16777216),
        (1080, 1920, 28, 3136, 12845056),
        (1080, 1920, 32, 2621440, 2621440),
        (1080, 1920, 28, 2621440, 2621440),
        (2160, 3840, 32, 65536, 16777216),
        (1600, 2560, 32, 2621440, 2621440),
        (1440, 2560, 32, 2621440, 2621440),
        (2400, 1080, 32, 2621440, 2621440),
        (12, 20, 32, 65536, 16777216),
        (12, 20, 28, 3136, 12845056),
        (6, 900, 32, 65536, 16777216),
        (6, 900, 28, 3136, 12845056),
        (1, 200, 28, 3136, 12845056),
        (1, 201, 28, 3136, 12845056),  # error
        (4, 1000, 32, 65536, 16777216),  # error
        (1000, 4, 32, 65536, 16777216),  # error
        (28, 28, 28, 28 * 28, 28 * 28),
        (100000, 600, 28, 3136, 12845056),
        (600, 100000, 32, 65536, 16777216),
    ]
    for _ in range(30):
        h = int(rng.integers(1, 4000))
        w = int(rng.integers(max(1, h // 150), min(4000, h * 150) + 1))
        f = int(rng.choice([28, 32]))
        mn = int(rng.choice([3136, 65536, 4 * f * f, 2621440]))
        mx = int(rng.choice([mn, 12845056, 16777216, 256 * f * f, 2621440]))
        mx = max(mx, mn)
        base.append((h, w, f, mn, mx))
    # exact half-to-even cases near the boundary
    for k in range(1, 9):
        base.append((int((k + 0.5) * 28), int((k + 2.5) * 28), 28, 28 * 28, 28 * 28 * 4096))
    for h, w, f, mn, mx in base:
        try:
            rh, rw = smart_resize(h, w, factor=f, min_pixels=mn, max_pixels=mx)
            rows.append(dict(height=h, width=w, factor=f, min_pixels=mn, max_pixels=mx, out=[rh, rw]))
        except ValueError as e:
            rows.append(dict(height=h, width=w, factor=f, min_pixels=mn, max_pixels=mx, error=str(e)))
    with open(os.path.join(OUT_DIR, "smart_resize.json"), "w") as fh:
        json.dump(rows, fh, indent=0)

    total = sum(os.path.getsize(os.path.join(OUT_DIR, x)) for x in os.listdir(OUT_DIR))
    imgs = sum(os.path.getsize(os.path.join(IMG_DIR, x)) for x in os.listdir(IMG_DIR))
    print(f"{len(cases)} cases, {len(rows)} smart_resize rows; fixtures {total} bytes, images {imgs} bytes")


def unpatchify(pv, gh, gw, proc):
    """Invert HF's patchify for temporal frame 0: returns [C, gh*P, gw*P] float."""
    p, m, t = proc.patch_size, proc.merge_size, proc.temporal_patch_size
    x = pv.view(gh // m, gw // m, m, m, 3, t, p, p)[:, :, :, :, :, 0]
    # [gh/m, gw/m, m, m, C, p, p] -> [C, gh/m, m, p, gw/m, m, p]
    x = x.permute(4, 0, 2, 5, 1, 3, 6)
    return x.reshape(3, gh * p, gw * p)


if __name__ == "__main__":
    main()
