"""Lab 07's preprocessing questions: q2 the python backend's ``preprocess(items) -> [N, 1, 8, 8] float32`` (PNG bytes
to the digits classifier's input, graded against the running service's preprocessing model), q5 the GPU decode step
``gpu_preprocess(items, decode_jpeg, device) -> torch.Tensor [N, 3, 64, 64]``."""

from __future__ import annotations

import contextlib
import io
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from lab_utils.exercises.framework import CodeExercise, NotApplicable, References, Wrong, run_student, source_as
from lab_utils.exercises.lab07.service import bound_service
from lab_utils.serving import client as triton_client
from lab_utils.serving import ensemble as ens

SIZE = 8  # px: what the classifier was trained on
PIXEL_SCALE = 16 / 255  # PNG grey 0..255 -> the digits' 0..16
MAX_PIXELS = ens.MAX_IMAGE_PIXELS  # px (12.6 M): a larger image is refused, as the service refuses it
Q5_SIZE = 64  # px: the side q5's check asks for (the ResNet-50 service's is 224)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # per RGB channel, on the 0..1 scale


# --- q2: the preprocessing ----------------------------------------------------------------------------------


def pixel_stats() -> tuple[float, float]:
    """(mean, std) of the training digits in 0..16 units: what the preprocessing normalizes with."""
    raw = ens.digits_raw_split()
    return raw["mean"], raw["std"]


def reference_preprocess(items: Any) -> np.ndarray:
    """Encoded images -> [N, 1, 8, 8] float32 as in training; ``ValueError`` naming a bad item."""
    from PIL import Image

    mean, std = pixel_stats()
    out = []
    for i, data in enumerate(np.asarray(items, dtype=object).reshape(-1)):
        try:
            img = Image.open(io.BytesIO(bytes(data)))
            img.load()
        except Exception:
            raise ValueError(f"item {i} is not an image file: send PNG or JPEG bytes") from None
        if img.size[0] * img.size[1] > MAX_PIXELS:
            raise ValueError(f"item {i} is {img.size[0]}x{img.size[1]} px, over {MAX_PIXELS / 1e6:.1f} Mpx: resize it")
        img = img.convert("L").resize((SIZE, SIZE), Image.Resampling.BOX)  # BOX: the mean of each block
        x = np.asarray(img, np.float32)[None] * PIXEL_SCALE  # [1, 8, 8] in the digits' 0..16
        out.append((x - mean) / std)
    return np.stack(out).astype(np.float32)


def _q2_images(seed: int) -> list[bytes]:
    """Held-out digits as 32 px PNGs, and the same digits at other sizes and as RGB (drawn at random)."""
    from PIL import Image

    rng = random.Random(seed)
    x_test = ens.digits_raw_split()["x_test"]
    out = [ens.encode_png(x_test[i], (4, 2, 3, 8)[k % 4]) for k, i in enumerate(rng.sample(range(len(x_test)), 8))]
    for k in range(2, len(out), 3):  # every third one as RGB
        buf = io.BytesIO()
        Image.open(io.BytesIO(out[k])).convert("RGB").save(buf, format="PNG")
        out[k] = buf.getvalue()
    return out


def _grade_preprocess(fn: Any) -> str:
    images = _q2_images(random.randrange(10**6))
    items = ens.image_batch(images)
    got = run_student(fn, items, what="preprocess", call="preprocess(items)", timeout_s=60,
                      returns=np.ndarray, returns_text="a NumPy array [N, 1, 8, 8]")
    n = len(images)
    if got.shape != (n, 1, SIZE, SIZE):
        extra = (" (the channel axis is missing: [N, 1, 8, 8], as the classifier's input dims [1, 8, 8] plus the "
                 "batch)" if got.shape == (n, SIZE, SIZE) else "")
        raise Wrong(f"for {n} images it returned shape {tuple(got.shape)}; expected ({n}, 1, 8, 8){extra}")
    if got.dtype != np.float32:
        raise Wrong(f"dtype {got.dtype}: the classifier's input is TYPE_FP32 (np.float32)")
    where = "the service's preprocessing model"
    try:
        svc = bound_service()
        want = triton_client.infer(svc.servers[0].grpc_url, ens.PREPROCESS, {ens.IMAGE: items})[ens.PIXELS]
    except NotApplicable:
        want, where = reference_preprocess(items), "the reference preprocessing"
    err = float(np.abs(got - want).max())
    if err > 1e-3:
        mean, std = pixel_stats()
        ref_raw = want * std + mean  # the reference before normalizing: 0..16
        if np.abs(got - ref_raw).max() < 1e-2:
            raise Wrong("the values are the raw 0..16 pixels: normalize them, (x - mean) / std with the training "
                        "set's mean and std (ex.pixel_stats())")
        if min(np.abs(got * std + mean - ref_raw / PIXEL_SCALE).max(), np.abs(got - ref_raw / PIXEL_SCALE).max()) < 0.2:
            raise Wrong("the values are on the 0..255 scale: multiply by 16/255 (ex.PIXEL_SCALE) first, since the "
                        "digits were trained on 0..16, then normalize")
        raise Wrong(f"differs from {where} by up to {err:.3g} (normalized units). Resize with "
                    "Image.Resampling.BOX to 8x8 (the mean of each block: the exact inverse of the upscale; "
                    "bilinear differs), convert to grey ('L') first")
    for what, data in [("text, not an image", b"hello, this is not an image"), ("an empty item", b""),
                       ("a 15 Mpx image", ens.decompression_bomb(15_000_000))]:
        batch = ens.image_batch([images[0], images[1], data])
        try:
            run_student(fn, batch, what="preprocess", call=f"preprocess(items) with {what} as item 2",
                        timeout_s=60)
        except Wrong as w:
            text = str(w)
            if "ValueError" not in text:
                raise Wrong(f"with {what} as item 2 it raised something other than ValueError ({text[:200]}): "
                            "catch the decoder's error and raise ValueError naming the item, so the service "
                            "answers 400 (the client's fault), not 500") from None
            if "2" not in text.split("ValueError", 1)[1]:
                raise Wrong(f"with {what} as item 2 the ValueError does not name the item ({text[:200]}): say which "
                            "item (2) and what to send instead") from None
            continue
        raise Wrong(f"with {what} as item 2 it returned an answer: refuse it with ValueError naming the item (the "
                    f"service refuses images over {MAX_PIXELS / 1e6:.1f} Mpx; a decoded huge image costs memory for "
                    "nothing)")
    return f"its tensors match {where} on {n} PNGs (three sizes, grey and RGB), and bad items are refused."


q2 = CodeExercise(
    name="07.2 the preprocessing step",
    var="preprocess",
    references=References("decode, resize and normalize the images yourself",
                          "lab_utils.exercises.lab07.reference_preprocess"),
    grade=_grade_preprocess,
    signature="preprocess(items) -> np.ndarray [N, 1, 8, 8] float32",
    hints=(
        "For each item: Image.open(io.BytesIO(bytes(item))), .convert('L'), .resize((8, 8), "
        "Image.Resampling.BOX); np.asarray(..., np.float32) * ex.PIXEL_SCALE; then (x - mean) / std; stack with "
        "a channel axis: [N, 1, 8, 8].",
        "Bad items: wrap Image.open (and img.load(), which decodes) in try/except and raise "
        "ValueError(f\"item {i} ...\"); check img.size[0] * img.size[1] > ex.MAX_PIXELS before resizing.",
    ),
    solution_text=source_as(reference_preprocess, "preprocess"),
)


# --- q5: the GPU decode step ----------------------------------------------------------------------------------


def decode_jpeg(data: list[Any], mode: Any = None, device: Any = "cpu") -> list[Any]:
    """torchvision's batched ``decode_jpeg`` done by Pillow, for a machine without torchvision or a GPU: encoded
    JPEGs (uint8 tensors) -> uint8 [3, H, W] tensors on ``device`` (``mode`` is accepted and RGB is given)."""
    import torch
    from PIL import Image

    if isinstance(data, torch.Tensor):
        return decode_jpeg([data], mode, device)[0]
    rgbs = (np.array(Image.open(io.BytesIO(t.cpu().numpy().tobytes())).convert("RGB")) for t in data)
    return [torch.from_numpy(rgb).permute(2, 0, 1).contiguous().to(device) for rgb in rgbs]


def jpeg_decoder() -> tuple[Callable[..., Any], str]:
    """(decode_jpeg, device): torchvision's nvJPEG decode on ``cuda`` where torchvision and a GPU are there, else
    this module's Pillow ``decode_jpeg`` on the CPU (the same call, so the same answer works on both)."""
    import torch

    if torch.cuda.is_available():
        with contextlib.suppress(ImportError, RuntimeError):
            from torchvision.io import decode_jpeg as nvjpeg  # optional: not in the CPU environment
            return nvjpeg, "cuda"
    return decode_jpeg, "cpu"


def reference_gpu_preprocess(items: Any, decode_jpeg: Callable[..., Any], device: Any, size: int = Q5_SIZE) -> Any:
    import torch
    import torch.nn.functional as F

    data = [torch.frombuffer(bytearray(bytes(item)), dtype=torch.uint8)
            for item in np.asarray(items, dtype=object).reshape(-1)]
    images = decode_jpeg(data, device=device)  # ONE call: nvJPEG decodes the batch together
    x = torch.stack([F.interpolate(img[None].float(), size=(size, size), mode="bilinear", antialias=True,
                                   align_corners=False)[0] for img in images])
    mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
    return (x / 255 - mean) / std


def _grade_gpu_preprocess(fn: Any) -> str:
    import torch

    decode, device = jpeg_decoder()
    calls: list[int] = []

    def counted(data: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(data) if isinstance(data, (list, tuple)) else 1)
        return decode(data, *args, **kwargs)

    photos = ens.photo_jpegs(6, (80, 300), seed=random.randrange(10**6))
    items = ens.image_batch(photos)
    got = run_student(fn, items, counted, device, what="gpu_preprocess", call="gpu_preprocess(items, decode_jpeg, "
                      f"{device!r})", timeout_s=60, returns=torch.Tensor, returns_text="a torch tensor [N, 3, 64, 64]")
    n = len(photos)
    if len(calls) != 1:
        raise Wrong(f"decode_jpeg was called {len(calls)} times for {n} images: pass the whole list in ONE call "
                    "(decode_jpeg(list_of_tensors, device=device)); nvJPEG decodes a batch together, one call per "
                    "image pays its launch and synchronization every time")
    if tuple(got.shape) != (n, 3, Q5_SIZE, Q5_SIZE):
        raise Wrong(f"for {n} images it returned shape {tuple(got.shape)}; expected ({n}, 3, {Q5_SIZE}, {Q5_SIZE}): "
                    "resize each decoded [3, H, W] image to 64x64 and torch.stack them")
    if got.dtype != torch.float32:
        raise Wrong(f"dtype {got.dtype}: the classifier's input is float32 (img.float() before resizing)")
    if got.device.type != torch.device(device).type:
        raise Wrong(f"the tensor is on {got.device}, not {device}: keep the work where decode_jpeg put the images "
                    "(a copy to the CPU and back costs more than the decode)")
    want = reference_gpu_preprocess(items, decode, device)
    err = float((got - want).abs().mean())
    if err <= 0.02:
        return (f"its tensors match the reference on {n} JPEG photographs ({device}), decoded in one call, "
                f"mean difference {err:.4f}.")
    mean = torch.tensor(IMAGENET_MEAN, device=want.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=want.device).view(1, 3, 1, 1)
    pixels = (want * std + mean) * 255  # the reference before normalizing: 0..255
    slips = [(pixels / 255, "the values are on the 0..1 scale, not normalized: subtract ex.IMAGENET_MEAN and divide "
              "by ex.IMAGENET_STD per channel (view(1, 3, 1, 1))"),
             (pixels, "the values are the raw 0..255 pixels: divide by 255, then normalize with ex.IMAGENET_MEAN "
              "and ex.IMAGENET_STD"),
             ((pixels - mean) / std, "the 0..255 pixels were normalized with the 0..1 mean and std: divide by 255 "
              "first")]
    for value, why in slips:
        if float((got - value).abs().mean()) < 0.05:
            raise Wrong(why)
    raise Wrong(f"differs from the reference by {err:.3g} on average (normalized units): resize each image with "
                "F.interpolate(img[None].float(), size=(64, 64), mode='bilinear', antialias=True) (antialias, as "
                "Pillow does when it shrinks), on the 0..255 values, then (x / 255 - mean) / std")


q5 = CodeExercise(
    name="07.5 the GPU decode step",
    var="gpu_preprocess",
    references=References("decode the batch, resize and normalize it yourself",
                          "lab_utils.exercises.lab07.reference_gpu_preprocess"),
    grade=_grade_gpu_preprocess,
    signature="gpu_preprocess(items, decode_jpeg, device) -> torch.Tensor [N, 3, 64, 64] float32 on device",
    hints=(
        "Each item is JPEG bytes: torch.frombuffer(bytearray(bytes(item)), dtype=torch.uint8) for every item of "
        "np.asarray(items, dtype=object).reshape(-1); then ONE decode_jpeg(list, device=device) call.",
        "Per decoded [3, H, W] uint8 image: F.interpolate(img[None].float(), size=(64, 64), mode='bilinear', "
        "antialias=True)[0]; torch.stack them; then (x / 255 - mean) / std with ex.IMAGENET_MEAN and "
        "ex.IMAGENET_STD as tensors of shape (1, 3, 1, 1) on the same device.",
    ),
    solution_text=source_as(reference_gpu_preprocess, "gpu_preprocess"),
)
