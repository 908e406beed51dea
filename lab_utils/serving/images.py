"""Lab 07's images: the held-out digits as PNG files (what the service receives), random PNGs and JPEG
photographs for the ResNet-50 service's speed runs, and a decompression bomb it must refuse from its header.

Design notes: docs/internals.md#lab_utilsservingensemblepy
"""

from __future__ import annotations

import functools
import io
import math
from typing import Any

import numpy as np

DIGITS_SIZE = 8  # px: what DigitsCNN was trained on
PNG_SCALE = 4  # clients send 8 px digits upscaled to 32 px PNGs



# The split and the PNG encoding live in lab_utils.models (lab 06's data loader reads the same files); imported
# when called, so importing this module does not import torch.
def digits_raw_split() -> dict[str, Any]:
    """``lab_utils.models.digits_raw_split``: the fixed split as raw pixels 0..16, with the training mean/std."""
    from lab_utils import models  # lazy: pulls torch

    return models.digits_raw_split()


def encode_png(image: np.ndarray, scale: int = PNG_SCALE, vmax: float = 16.0) -> bytes:
    """``lab_utils.models.encode_png`` at the service's scale (8 px digits → 32 px PNGs, nearest neighbour)."""
    from lab_utils import models  # lazy: pulls torch

    return models.encode_png(image, scale, vmax)


def digits_pngs(split: str = "test", n: int | None = None, scale: int = PNG_SCALE) -> tuple[list[bytes], np.ndarray]:
    """Held-out (``test``, 357) or training digits as PNG bytes (32x32 px by default) and their labels."""
    if split not in ("test", "train"):
        raise ValueError(f"split={split!r}: use 'test' (held out) or 'train'")
    data = digits_raw_split()
    x, y = data[f"x_{split}"][:n], data[f"y_{split}"][:n]
    return [encode_png(img, scale) for img in x], y



def photo_jpegs(n: int, size: tuple[int, int] = (224, 512), quality: int = 90, seed: int = 0,
                shape: tuple[int, int] | None = None) -> list[bytes]:
    """``n`` JPEG photographs (quality ``quality``, each side drawn from ``size`` px, or exactly ``shape`` (width,
    height) px: (4000, 3000) is a 12 Mpx phone photo, 2-3 MB): random crops, flips and scales of the two photographs
    scikit-learn ships (``load_sample_images``: 427x640 px), so an image service receives what cameras send (a few
    tens of KB at 224-512 px) with no download. Reproducible per ``seed``."""
    from PIL import Image

    lo, hi = size
    if not (isinstance(n, int) and n >= 0 and 16 <= lo <= hi):
        raise ValueError(f"photo_jpegs(n={n!r}, size={size!r}): n >= 0 images, sides 16 <= low <= high px")
    photos = _sample_photos()
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        img = photos[int(rng.integers(len(photos)))]
        w, h = img.size
        side = int(rng.integers(min(w, h) // 2, min(w, h) + 1))  # a crop of half to all of the short side
        x, y = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
        crop = img.crop((x, y, x + side, y + side))
        out_w, out_h = shape or (int(v) for v in rng.integers(lo, hi + 1, 2))
        crop = crop.resize((out_w, out_h), Image.Resampling.BILINEAR)
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        buf = io.BytesIO()
        crop.save(buf, format="JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


@functools.lru_cache(maxsize=1)
def _sample_photos() -> tuple[Any, ...]:
    """scikit-learn's two shipped photographs as Pillow images, read once."""
    from PIL import Image
    from sklearn.datasets import load_sample_images  # lazy: scikit-learn is the lab extra's

    return tuple(Image.fromarray(a) for a in load_sample_images().images)


@functools.lru_cache(maxsize=4)  # a second encoding of 110 Mpixels takes another second for the same bytes
def decompression_bomb(pixels: int = 110_000_000) -> bytes:
    """A PNG of a few KB whose header declares ``pixels`` (one-bit, all black): what a service must refuse from its
    header, before decoding (decoded as RGB floats it would take 12 bytes a pixel)."""
    from PIL import Image

    side = int(math.isqrt(pixels))
    buf = io.BytesIO()
    Image.new("1", (side + 1, pixels // side)).save(buf, format="PNG", optimize=True)
    return buf.getvalue()
