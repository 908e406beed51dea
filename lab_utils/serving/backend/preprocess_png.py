"""Lab 07's preprocessing model (python backend): encoded images in, normalized FP32 tensors out, batch-aware.

Copied as ``<repo>/<model>/<version>/model.py`` beside ``nvlab_triton_model.py``; it imports nothing from
``lab_utils``. Input ``IMAGE``: ``TYPE_STRING``, dims [1], each item an encoded image file. Output: FP32
[channels, size, size]. ``config.pbtxt`` parameters: ``image_size`` (px), ``channels``, ``pixel_scale``,
``mean``, ``std``, ``resample``, ``max_image_bytes``, ``max_image_pixels``, ``min_image_side`` (px),
``drift_reference`` and ``drift_window`` (images). A bad item gets an error response of its own (``INVALID_ARG``);
the other requests of the batch are answered. Every image is turned upright by its EXIF orientation (a phone photo
held upright is stored sideways with a tag saying so) and 16-bit images keep their high byte (>> 8). On a
``KIND_GPU`` instance the JPEG items of a whole batch are decoded in one call on the GPU (torchvision's
``decode_jpeg``, nvJPEG), oriented, resized and normalized there (``GpuImages``); other files go through Pillow,
which decodes a large JPEG at a reduced scale (``draft``: 1/2, 1/4 or 1/8 in the DCT) when the model needs fewer
pixels.

Design notes: docs/internals.md#lab_utilsservingbackendpreprocess_pngpy
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np
from nvlab_triton_model import instance_args, to_tensor

RESAMPLE = ("box", "bilinear")
SIGNATURES = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF8": "GIF", b"BM": "BMP"}  # file magic
EXIF_ORIENTATION = 0x0112  # the EXIF tag: 1 upright, 2-8 mirrored and/or rotated (what ImageOps.exif_transpose reads)
WIDE_MODES = ("I;16", "I;16B", "I;16L", "I;16N")  # Pillow's 16-bit grey; a 16-bit PNG opens as one of these
DRAFT_GAP = 2  # a JPEG decoded at reduced scale keeps >= 2x the model's side (Pillow's thumbnail does the same), so
# the final resample still averages several pixels into each output pixel


class BadImage(ValueError):
    """An item the model cannot turn into a tensor; the message names the item and the fix."""


class TritonPythonModel:
    """``initialize`` reads the parameters (and imports Pillow: a load fails at once without it)."""

    def initialize(self, args: dict[str, str]) -> None:
        from PIL import Image  # a missing Pillow refuses the load with ImportError, not every request

        cfg, p, device, _ = instance_args(args)
        self.size = int(p.get("image_size", "8"))
        self.channels = int(p.get("channels", "1"))
        if self.channels not in (1, 3):
            raise ValueError(f"parameter channels={self.channels}: use 1 (grey) or 3 (RGB)")
        self.scale = float(p.get("pixel_scale", "1"))
        mean = [float(v) for v in p.get("mean", "0").split(",")]
        std = [float(v) for v in p.get("std", "1").split(",")]
        if len(mean) not in (1, self.channels) or len(std) not in (1, self.channels):
            raise ValueError(f"parameters mean={mean} and std={std}: one value, or one per channel ({self.channels})")
        self.mean = np.array(mean * (self.channels // len(mean)), np.float32)[:, None, None]  # [C, 1, 1]
        self.std = np.array(std * (self.channels // len(std)), np.float32)[:, None, None]
        how = p.get("resample", "box")
        if how not in RESAMPLE:
            raise ValueError(f"parameter resample={how!r}: use one of {RESAMPLE}")
        self.resample = Image.Resampling.BOX if how == "box" else Image.Resampling.BILINEAR
        self.max_bytes = int(p.get("max_image_bytes", str(8 << 20)))
        self.max_pixels = int(p.get("max_image_pixels", str(12 << 20)))
        self.min_side = int(p.get("min_image_side", "8"))
        self.input_name, self.output_name = cfg["input"][0]["name"], cfg["output"][0]["name"]
        self.mode = "L" if self.channels == 1 else "RGB"
        self.drift = None
        self.gpu = None  # a GPU instance decodes its JPEGs there
        if device != "cpu":
            self.gpu = GpuImages(device, self.size, self.channels, self.scale, self.mean, self.std, how,
                                 max_rows=max(1, int(cfg.get("max_batch_size", 1))))
        if p.get("drift_reference"):
            self._start_drift(json.loads(p["drift_reference"]), int(p.get("drift_window", "200")),
                              args.get("model_instance_name", "0"))

    def _start_drift(self, bins: dict[str, Any], size: int, instance: str) -> None:
        """Drift statistics of the images this instance decodes (raw digits, 0..16): PSI per feature against the
        training reference over its last ``size`` images, exported as Triton custom metrics (gauges on Triton's
        metrics endpoint, where Prometheus scrapes the service)."""
        import triton_python_backend_utils as pb_utils
        from nvlab_drift import PSI_METRIC, WINDOW_METRIC, Window  # copied beside this file

        if self.channels != 1 or self.size != 8:
            raise ValueError(f"parameter drift_reference: drift statistics are for 8x8 grey digits; this model "
                             f"makes {self.channels}x{self.size}x{self.size}: remove the parameter")
        self.drift = Window(bins, size)
        gauge = pb_utils.MetricFamily.GAUGE
        # the families are kept: a metric must not outlive its family
        self._psi_family = pb_utils.MetricFamily(name=PSI_METRIC, kind=gauge,
                                                 description="PSI of served images against the training reference")
        self._win_family = pb_utils.MetricFamily(name=WINDOW_METRIC, kind=gauge,
                                                 description="images in the drift window")
        self._psi = {f: self._psi_family.Metric(labels={"feature": f, "instance": instance}) for f in bins}
        self._win = self._win_family.Metric(labels={"instance": instance})

    def _observe(self, x: np.ndarray) -> None:
        """Add decoded tensors [N, 1, 8, 8] (normalized) to the window as raw digits; update the gauges."""
        raw = (x * self.std + self.mean)[:, 0]
        # back on the digits' grid: the PNG's 8 bits put a pixel of 4 at 4.016 (64/255 x 16), across the ink
        # threshold and the reference's bin edges; quarter steps undo that and keep any real shift
        self.drift.observe(np.round(raw * 4) / 4)
        for feature, value in self.drift.psi().items():
            self._psi[feature].set(value)
        self._win.set(len(self.drift))

    def open_checked(self, i: int, data: Any) -> Any:
        """Item ``i`` (encoded bytes) as a Pillow image whose header is read and checked, nothing decoded yet."""
        import warnings

        from PIL import Image, UnidentifiedImageError

        if not isinstance(data, (bytes, bytearray)):
            raise BadImage(f"{self.input_name}[{i}] is {type(data).__name__}, not bytes: send the encoded image "
                           "file as a BYTES element")
        if not data:
            raise BadImage(f"{self.input_name}[{i}] is empty: send the bytes of an image file (PNG, JPEG)")
        if len(data) > self.max_bytes:
            raise BadImage(f"{self.input_name}[{i}] is {len(data)} bytes, over this service's limit of "
                           f"{self.max_bytes} bytes ({self.max_bytes / 2**20:g} MiB): send a smaller file (a JPEG "
                           f"of at most {self.max_pixels / 1e6:.1f} Mpx)")
        try:
            with warnings.catch_warnings():  # Pillow warns past 89 Mpx; the limit below refuses far sooner
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                img = Image.open(io.BytesIO(data))  # reads the header only: the size is known before any decoding
        except Image.DecompressionBombError:  # past 2x Pillow's MAX_IMAGE_PIXELS it refuses in open itself
            raise BadImage(f"{self.input_name}[{i}] declares over {2 * Image.MAX_IMAGE_PIXELS / 1e6:.0f} Mpx, over "
                           f"this service's limit of {self.max_pixels / 1e6:.1f} Mpx: resize it before sending"
                           ) from None
        except (UnidentifiedImageError, OSError, ValueError):
            kind = next((k for sig, k in SIGNATURES.items() if bytes(data[:len(sig)]) == sig), None)
            if kind:  # the right start, then something Pillow cannot read
                raise BadImage(f"{self.input_name}[{i}]: {len(data)} bytes that start like a {kind} file but are "
                               "truncated or corrupt: send the complete file") from None
            raise BadImage(f"{self.input_name}[{i}]: {len(data)} bytes starting {bytes(data[:8])!r} are not an image "
                           "file Pillow can decode: send the encoded file (PNG or JPEG), not raw pixels or text"
                           ) from None
        w, h = img.size
        if w * h > self.max_pixels:
            raise BadImage(f"{self.input_name}[{i}] is {w}x{h} px, {w * h / 1e6:.1f} Mpx, over this service's limit "
                           f"of {self.max_pixels / 1e6:.1f} Mpx: resize it before sending (the model sees "
                           f"{self.size}x{self.size})")
        if min(w, h) < self.min_side:
            raise BadImage(f"{self.input_name}[{i}] is {w}x{h} px, under this service's minimum of {self.min_side} px "
                           "a side: send the image itself, not a thumbnail or a placeholder pixel")
        return img

    def pixels(self, i: int, img: Any) -> np.ndarray:
        """A checked Pillow image decoded (a large JPEG at reduced scale), turned upright by its EXIF orientation
        and resized here -> [channels, size, size] float32, 0..255."""
        from PIL import Image, ImageOps

        w, h = img.size
        fmt = img.format
        if fmt == "JPEG":  # the DCT scales by 1/2..1/8 for free: a 12 Mpx photo decodes in a fraction of the time
            img.draft(None, (DRAFT_GAP * self.size, DRAFT_GAP * self.size))
        try:
            img.load()  # decodes: a truncated file fails here
            ImageOps.exif_transpose(img, in_place=True)  # upright, as the camera was held (no tag: unchanged)
            if img.mode in WIDE_MODES or (img.mode == "I" and fmt == "PNG"):  # 16-bit grey, 0..65535
                # convert("L") would clip at 255 (anything above 0.4 % of full scale turns white): keep the high byte
                img = Image.fromarray((np.asarray(img).astype(np.uint32) >> 8).astype(np.uint8))  # mode L
            elif img.mode in ("I", "F"):
                raise BadImage(f"{self.input_name}[{i}] ({fmt}, {w}x{h} px) has {img.mode} pixels (32-bit "
                               "integer or float) whose range is unknown: send an 8- or 16-bit PNG or a JPEG")
            img = img.convert(self.mode)
        except BadImage:
            raise
        except (OSError, ValueError, SyntaxError) as err:
            raise BadImage(f"{self.input_name}[{i}] ({fmt}, {w}x{h} px) is corrupt or truncated ({err}): "
                           "send the complete file") from None
        if img.size != (self.size, self.size):
            img = img.resize((self.size, self.size), self.resample)
        a = np.asarray(img, dtype=np.float32)  # [S, S] or [S, S, 3], 0..255
        return a[None] if self.channels == 1 else a.transpose(2, 0, 1)  # [C, S, S]

    def decode(self, i: int, data: Any) -> np.ndarray:
        """Item ``i`` (encoded bytes) -> [channels, size, size] float32, normalized as in training (on the CPU)."""
        return (self.pixels(i, self.open_checked(i, data)) * self.scale - self.mean) / self.std

    def execute(self, requests: list[Any]) -> list[Any]:
        """One response per request, in order: its items' tensors [N, C, S, S], or its own error."""
        import triton_python_backend_utils as pb_utils

        code = getattr(pb_utils.TritonError, "INVALID_ARG", None)

        def error(message: str) -> Any:
            err = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
            return pb_utils.InferenceResponse(error=err)

        results: list[Any] = []  # per request: its rows ([N, C, S, S]) or its error message
        for r in requests:
            try:
                # BYTES arrive as an object array of bytes, [N, 1] (as_numpy: DLPack cannot carry objects)
                items = list(pb_utils.get_input_tensor_by_name(r, self.input_name).as_numpy().reshape(-1))
                if self.gpu is None:
                    results.append(np.stack([self.decode(i, item) for i, item in enumerate(items)]).astype(np.float32))
                else:  # checked now, decoded below in one call for the whole batch
                    results.append([(i, item, self.open_checked(i, item)) for i, item in enumerate(items)])
            except BadImage as err:
                results.append(str(err))
            except Exception as err:  # a bug here must fail one request, not the model
                results.append(f"preprocessing failed: {type(err).__name__}: {err}")
        if self.gpu is not None:
            results = self.gpu.decode_requests(results, self.pixels)
        responses = []
        for x in results:
            if isinstance(x, str):
                responses.append(error(x))
                continue
            if self.drift is not None:
                self._observe(x)
            responses.append(pb_utils.InferenceResponse([to_tensor(self.output_name, x)]))
        return responses


def orientation(img: Any) -> int:
    """A Pillow image's EXIF orientation (1..8, read from the header before decoding; 1 without a valid tag): what
    ``ImageOps.exif_transpose`` applies on the CPU and ``upright`` on the GPU, whose decoder ignores the tag."""
    try:
        value = int(img.getexif().get(EXIF_ORIENTATION, 1))
    except (TypeError, ValueError, OSError, SyntaxError):  # an unreadable EXIF block: as Pillow, leave it as stored
        return 1
    return value if 1 <= value <= 8 else 1


def upright(x: Any, value: int) -> Any:
    """A decoded tensor [..., H, W] turned as ``ImageOps.exif_transpose`` turns the image for EXIF orientation
    ``value`` (2: mirrored, 3: upside down, 6: the camera turned clockwise, 8: counter-clockwise, 5 and 7: those
    mirrored)."""
    import torch

    if value == 2:
        return x.flip(-1)
    if value == 3:
        return x.flip(-2, -1)
    if value == 4:
        return x.flip(-2)
    if value == 5:
        return x.transpose(-2, -1)
    if value == 6:
        return torch.rot90(x, -1, dims=(-2, -1))  # Pillow's ROTATE_270: a quarter turn clockwise
    if value == 7:
        return x.transpose(-2, -1).flip(-2, -1)
    if value == 8:
        return torch.rot90(x, 1, dims=(-2, -1))  # Pillow's ROTATE_90: a quarter turn counter-clockwise
    return x


def jpeg_complete(data: bytes) -> bool:
    """True when a JPEG ends with its end-of-image marker (FF D9): a truncated file lacks it. nvJPEG can turn a
    truncated file into grey rows without an error, so such a file goes to Pillow, which refuses it."""
    return bytes(data[-2:]) == b"\xff\xd9"


class GpuImages:
    """The JPEG items of a batch decoded on ``device`` in ONE call (``decode_jpeg``: torchvision's, nvJPEG on a GPU),
    each turned upright by its EXIF orientation (read by Pillow from the header: nvJPEG ignores it), resized
    (antialiased, as Pillow does) and the batch normalized there; any other item (PNG, a JPEG the decoder refuses or
    that lacks its end marker) is decoded by Pillow and copied up. The rows reach the response through one pinned host
    buffer (reused: a fresh pageable array costs a page fault per 4 KB, 14 ms for a batch of 32 at 224 px on an H200
    host). ``decode_jpeg``/``read_mode``: torchvision's where None (tests pass others)."""

    def __init__(self, device: str, size: int, channels: int, scale: float, mean: np.ndarray, std: np.ndarray,
                 resample: str, max_rows: int = 64, decode_jpeg: Any = None, read_mode: Any = None):
        import torch

        if decode_jpeg is None:
            from torchvision.io import ImageReadMode, decode_jpeg  # only a GPU instance needs torchvision
            read_mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.GRAY
        self.torch, self.decode_jpeg, self.read_mode = torch, decode_jpeg, read_mode
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # decode_jpeg's outputs and every kernel of this stub go there
        self.size, self.channels, self.scale = size, channels, float(scale)
        self.mean = torch.tensor(mean.reshape(1, channels, 1, 1), device=self.device)
        self.std = torch.tensor(std.reshape(1, channels, 1, 1), device=self.device)
        self.interp = {"mode": "area"} if resample == "box" else {"mode": "bilinear", "antialias": True,
                                                                    "align_corners": False}
        self.host = self._host_buffer(max_rows)

    def _host_buffer(self, rows: int) -> Any:
        shape = (rows, self.channels, self.size, self.size)
        return self.torch.empty(shape, dtype=self.torch.float32, pin_memory=self.device.type == "cuda")

    def _resized(self, img: Any) -> Any:
        """A decoded uint8 [C, H, W] on the device -> float32 [C, S, S], 0..255."""
        x = img.float()[None]
        if tuple(x.shape[-2:]) != (self.size, self.size):
            x = self.torch.nn.functional.interpolate(x, size=(self.size, self.size), **self.interp)
        return x[0]

    def _decode_all(self, datas: list[bytes]) -> list[Any]:
        """Each item decoded on the device (uint8 [C, H, W]), or None where the decoder refuses it. One call for
        the whole batch; only when it fails, one call per item to find which."""
        torch = self.torch
        if not datas:
            return []
        tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
        try:
            return list(self.decode_jpeg(tensors, mode=self.read_mode, device=self.device))
        except RuntimeError:
            out: list[Any] = []
            for t in tensors:
                try:
                    out.append(self.decode_jpeg([t], mode=self.read_mode, device=self.device)[0])
                except RuntimeError:
                    out.append(None)
            return out

    def decode_requests(self, results: list[Any], pixels: Callable[[int, Any], np.ndarray]) -> list[Any]:
        """``results`` (per request: [(index, bytes, checked Pillow image)] or an error message) -> per request
        its rows (a view of the pinned buffer, valid until the next call) or its error message. ``pixels(index,
        image)``: Pillow's decode of one item the GPU does not take (float32 [C, S, S])."""
        torch = self.torch
        jpegs = [(k, j) for k, req in enumerate(results) if not isinstance(req, str)
                 for j, (_, data, img) in enumerate(req) if img.format == "JPEG" and jpeg_complete(data)]
        decoded = dict(zip(jpegs, self._decode_all([results[k][j][1] for k, j in jpegs]), strict=True))
        rows: list[Any] = []
        spans: list[Any] = []
        for k, req in enumerate(results):
            if isinstance(req, str):
                spans.append(req)
                continue
            start, mine = len(rows), []
            try:
                for j, (i, _, img) in enumerate(req):
                    gpu_img = decoded.get((k, j))
                    if gpu_img is not None:
                        mine.append(self._resized(upright(gpu_img, orientation(img))))
                    else:  # Pillow decodes it, or names what is wrong with it
                        mine.append(torch.from_numpy(pixels(i, img)).to(self.device))
            except BadImage as err:
                spans.append(str(err))
                continue
            rows += mine
            spans.append((start, len(rows)))
        if not rows:
            return spans
        x = (torch.stack(rows) * self.scale - self.mean) / self.std
        if len(rows) > len(self.host):
            self.host = self._host_buffer(len(rows))
        host = self.host[:len(rows)]
        host.copy_(x, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        out = host.numpy()
        return [s if isinstance(s, str) else out[s[0]:s[1]] for s in spans]
