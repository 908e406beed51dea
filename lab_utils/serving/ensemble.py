"""Lab 07's model path: the digits classifier behind a Triton ensemble (PNG bytes in, top-k labels out), the
images it receives, the response cache, and the clients that send encoded images. The model names, limits and
configurations and the classifier's export and versions (``ensemble_models``) are re-exported here.

``build_service_repository`` writes ``digits_preprocess`` (PNG bytes -> FP32 [1, 8, 8]), ``digits_classifier``
(-> logits FP32 [10]), ``digits_postprocess`` (-> top-k ``LABELS``, ``SCORES``) and the ensemble ``digits_service``
(the wheel's python models in ``numpy1_env``'s NumPy-1 environment). Units are in names: ``_s``, ``_mib``, ``_us``.

Design notes: docs/internals.md#lab_utilsservingensemblepy
"""

from __future__ import annotations

import functools
import io
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lab_utils.compat import numpy1_env
from lab_utils.serving import client as triton_client
from lab_utils.serving import repository as triton_repo
from lab_utils.serving.ensemble_models import (  # noqa: F401  (re-exported: ens.* in the labs, lab_utils and the tests)
    CLASSIFIER,
    CLASSIFIER_ENGINES,
    DIGIT_LABELS,
    DIGITS_SIZE,
    IMAGE,
    LABELS,
    MAX_BATCH,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_QUEUE,
    MIN_IMAGE_SIDE,
    ONNX_INPUT,
    ONNX_OUTPUT,
    PIXELS,
    PNG_SCALE,
    POSTPROCESS,
    PREFIX,
    PREPROCESS,
    SCORES,
    SERVICE,
    TOP_K,
    TORCH_FILE,
    _write_png_warmup,
    _write_python_files,
    classifier_config,
    default_instances,
    ensemble_config,
    ensemble_problems,
    export_classifier,
    postprocess_config,
    preprocess_config,
    preprocess_instances,
    resolve_engine,
    set_served_versions,
    write_broken_version,
    write_classifier_version,
    write_ensemble,
)
from lab_utils.serving.metrics import metric_samples
from lab_utils.serving.server import ServerNotFound, ServerSource, find_server, wheel_layout

CACHE_PLACES = ("service", "classifier", None)
CACHE_MIB = 64  # the local response cache's size (MiB): a digit's top-k response is about 100 bytes
CACHE_METRICS = {"hits": "nv_cache_num_hits_per_model", "misses": "nv_cache_num_misses_per_model",
                 "hit_us": "nv_cache_hit_duration_per_model", "miss_us": "nv_cache_miss_duration_per_model"}


def server_source() -> ServerSource | None:
    """The server the repository is for (``find_server``: ``TRITON_URL``, the NGC binary, the wheel's), or None
    when there is none here (the repository is then written for the NGC server)."""
    try:
        return find_server()
    except ServerNotFound:
        return None


# --- the whole repository --------------------------------------------------------------------------------


@dataclass
class ServiceRepo:
    """A built service repository: its folder, model names, and how to start a server on it."""

    path: Path
    service: str
    preprocess: str
    classifier: str
    postprocess: str
    backend: str  # the classifier's: "python" or "onnxruntime"
    stub_env: Path | None
    facts: dict[str, Any] = field(default_factory=dict)  # version 1's training facts
    note: str = ""
    engine: str = "onnxruntime"  # the classifier's on the python backend: "onnxruntime" or "torch"

    @property
    def models(self) -> tuple[str, ...]:
        return (self.preprocess, self.classifier, self.postprocess, self.service)

    def server_kwargs(self, cache_mib: int | None = CACHE_MIB) -> dict[str, Any]:
        """``TritonServer`` arguments: explicit model control loading the ensemble (and with it its steps), and the
        local response cache of ``cache_mib`` MiB (None: no cache)."""
        extra = (f"--cache-config=local,size={int(cache_mib) * 2**20}",) if cache_mib else ()
        return {"model_control": "explicit", "load_models": (self.service,), "extra_args": extra}


def build_service(repo: str | Path, model: Any, *, prefix: str, labels: Sequence[str], image_size: int,
                  channels: int, pixel_scale: float, mean: Sequence[float], std: Sequence[float],
                  resample: str = "box", top_k: int = TOP_K, backend: str | None = None, gpus: int = 0,
                  instances: int | None = None, cache: str | None = "service", source: ServerSource | None = None,
                  build_env: bool = True, note: str = "", classifier_engine: str | None = None,
                  classifier_precision: str = "fp32", drift_reference: Mapping[str, Any] | None = None,
                  drift_window: int = 200, preprocess_device: str = "cpu", preprocess_count: int | None = None,
                  preprocess_delay_us: int | None = None, channels_last: bool = False,
                  cuda_graphs: bool = False, onnx: bool | None = True) -> ServiceRepo:
    """The four model folders of a service ``<prefix>_{preprocess,classifier,postprocess,service}`` for a trained
    ``model`` (a torch module, (B, channels, size, size) -> (B, classes)), every config validated.

    ``source``: the server it is for (default ``server_source()``). ``backend`` None: ``python`` on the wheel's
    server (it has no onnxruntime backend), else ``onnxruntime``. ``classifier_engine`` (``resolve_engine``): None
    runs torch on the GPU with ``gpus`` >= 1 on the python backend, ONNX Runtime on the CPU otherwise; ``"torch"``
    with ``gpus=0`` runs torch on the CPU (the tests' way to check it without a GPU). ``classifier_precision``:
    the torch engine's autocast (``fp32``, ``fp16``, ``bf16``); ``channels_last``, ``cuda_graphs``: its memory
    format and graphs (``classifier_config``). ``preprocess_device`` ``gpu`` (with ``gpus``): JPEGs decoded on the
    GPU in ``preprocess_count`` instances (default 2; on the CPU ``preprocess_instances``), batched with a wait of
    ``preprocess_delay_us``. ``onnx``: export ``model.onnx`` (None: only where the engine reads it, not torch's).
    ``cache``: where the response cache is on: ``"service"`` (the ensemble: a hit skips every step),
    ``"classifier"`` (a hit skips the model only, and a new version starts with no entries) or None."""
    if cache not in CACHE_PLACES:
        raise ValueError(f"cache={cache!r}: use one of {CACHE_PLACES}")
    repo = Path(repo)
    source = source or server_source()
    if backend is None:
        wheel = source is not None and source.kind == "wheel"
        backend = "python" if wheel or classifier_engine == "torch" else "onnxruntime"
    engine = resolve_engine(classifier_engine, backend, gpus)
    env = numpy1_env.stub_env(source, build=build_env)
    names = {k: f"{prefix}_{k}" for k in ("preprocess", "classifier", "postprocess", "service")}
    instances = default_instances(gpus) if instances is None else instances

    if preprocess_device == "gpu" and not gpus:
        raise ValueError("preprocess_device='gpu' needs a GPU: give gpus >= 1, or preprocess_device='cpu'")
    pre_dir = repo / names["preprocess"]
    _write_python_files(pre_dir / "1", "preprocess_png")
    count = preprocess_count or (2 if preprocess_device == "gpu" else preprocess_instances(gpus))
    pre_cfg = preprocess_config(
        names["preprocess"], image_size=image_size, channels=channels, pixel_scale=pixel_scale, mean=mean, std=std,
        resample=resample, stub_env=env, instances=count, drift_reference=drift_reference,
        drift_window=drift_window, device=preprocess_device, queue_delay_us=preprocess_delay_us)
    pre_cfg["model_warmup"] = [_write_png_warmup(pre_dir, image_size, channels, fmt)
                               for fmt in (("PNG", "JPEG") if preprocess_device == "gpu" else ("PNG",))]
    triton_repo.write_config(pre_dir, pre_cfg, gpus=gpus if preprocess_device == "gpu" else 0)

    cls_dir = repo / names["classifier"]
    t0 = time.perf_counter()
    export_classifier(model, cls_dir / "1", image_size, channels, torchscript=engine == "torch",
                      onnx=engine != "torch" if onnx is None else onnx)
    if backend == "python":
        _write_python_files(cls_dir / "1", CLASSIFIER_ENGINES[engine])
    triton_repo.write_config(cls_dir, classifier_config(
        names["classifier"], backend=backend, image_size=image_size, channels=channels, classes=len(labels),
        instances=instances, gpus=gpus, cache=cache == "classifier", engine=engine,
        precision=classifier_precision, channels_last=channels_last, cuda_graphs=cuda_graphs), gpus=gpus)
    export_s = time.perf_counter() - t0

    post_dir = repo / names["postprocess"]
    _write_python_files(post_dir / "1", "postprocess_topk")
    triton_repo.write_config(post_dir, postprocess_config(names["postprocess"], labels=labels, top_k=top_k,
                                                          stub_env=env), gpus=0)

    write_ensemble(repo, ensemble_config(names["service"], preprocess=names["preprocess"],
                                         classifier=names["classifier"], postprocess=names["postprocess"],
                                         top_k=top_k, cache=cache == "service"))
    triton_repo.validate_repository(repo, models=list(names.values()), gpus=gpus)
    return ServiceRepo(repo, names["service"], names["preprocess"], names["classifier"], names["postprocess"],
                       backend, env, {"export_s": export_s}, note, engine)


def build_service_repository(repo: str | Path, *, epochs: int = 4, seed: int = 0, model: Any = None,
                             **knobs: Any) -> ServiceRepo:
    """The digits service: DigitsCNN trained here (seconds; or ``model``, a DigitsCNN given), exported to ONNX (and
    TorchScript for the torch engine), behind the PNG ensemble; ``knobs`` are ``build_service``'s (``cache``,
    ``gpus``, ``classifier_engine``, ``drift_reference``...). Its ``facts`` hold the in-process held-out accuracy,
    to compare with ``service_accuracy`` through Triton."""
    facts: dict[str, Any] = {}
    if model is None:
        from lab_utils.inference.model_zoo import trained_digits  # lazy: pulls torch; once per process (seconds)

        model, facts = trained_digits(epochs, seed)
    raw = digits_raw_split()
    svc = build_service(repo, model, prefix=PREFIX, labels=DIGIT_LABELS, image_size=DIGITS_SIZE, channels=1,
                        pixel_scale=16 / 255, mean=(raw["mean"],), std=(raw["std"],), resample="box", **knobs)
    svc.facts.update(facts)
    return svc


def build_resnet50_service(repo: str | Path, *, image_size: int = 224, width: int = 64, top_k: int = 5,
                           cache: str | None = None, prefix: str = "resnet50", exported: ServiceRepo | None = None,
                           **knobs: Any) -> ServiceRepo:
    """``resnet50_*``: a ResNet-50 (``model_zoo.make_resnet50``; torchvision's where it imports, else the course's
    same-layout ``BottleneckResNet``) with RANDOM WEIGHTS, for speed only: its labels mean nothing. RGB
    ``image_size`` px, ImageNet normalization, 1000 classes. The export takes tens of seconds on a CPU. With
    ``gpus`` >= 1 on the wheel's server the classifier runs in torch on the GPU; ``knobs`` are ``build_service``'s
    (``gpus``, ``source``, ``classifier_engine``, ``preprocess_device``, ``cuda_graphs``...). ``prefix``: the
    models' names, one per variant in one repository. ``exported``: an earlier variant of the same size on the torch
    engine, whose ``model.pt`` is copied (the same weights, no new export)."""
    from lab_utils.inference.model_zoo import make_resnet50  # lazy: pulls torch

    if exported is not None:  # its file and facts: no second model built (its BatchNorm settling takes seconds)
        if exported.engine != "torch":
            raise ValueError(f"exported={exported.service}: its classifier runs on {exported.engine}; only a "
                             "torch-engine variant has a model.pt to copy (leave exported=None to export)")
        model: Any = exported.path / exported.classifier / "1" / TORCH_FILE
        note, facts = exported.note, {k: exported.facts[k] for k in ("model", "params_m", "gflop_per_image")}
    else:
        model, info = make_resnet50("cpu", width=width, image_size=image_size)
        note = f"random weights, speed only: {info}"
        facts = {"model": str(info), "params_m": info.params_m, "gflop_per_image": info.gflop_per_image}
    svc = build_service(repo, model, prefix=prefix, labels=[f"class_{i}" for i in range(1000)],
                        image_size=image_size, channels=3, pixel_scale=1 / 255, mean=(0.485, 0.456, 0.406),
                        std=(0.229, 0.224, 0.225), resample="bilinear", top_k=top_k, cache=cache, note=note,
                        onnx=None, **knobs)
    svc.facts.update(facts)
    return svc

# --- images: the digits as PNG files, JPEG photographs, a decompression bomb ------------------------------


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


# --- the server side: cache, versions --------------------------------------------------------------------


def cache_library(source: ServerSource | None = None) -> Path | None:
    """The local response cache's library of the server binary (``caches/local/libtritoncache_local.so``), or None
    when that build has none (or the server is remote: ``TRITON_URL``)."""
    source = source or server_source()
    if source is None or source.kind == "url":
        return None
    tree = wheel_layout(Path(source.location))["tree"] if source.kind == "wheel" else Path(source.location).parents[1]
    lib = tree / "caches" / "local" / "libtritoncache_local.so"
    return lib if lib.is_file() else None


def cache_stats(metrics_url: str, model: str = SERVICE) -> dict[str, float]:
    """The response cache's counters for ``model`` from Triton's metrics: ``hits``, ``misses`` (counts), ``hit_us``
    and ``miss_us`` (total µs spent on lookups and insertions), and ``hit_ratio`` (NaN before any lookup).
    Absent metrics (no cache, or the model has no ``response_cache``) count as 0."""
    out = dict.fromkeys(CACHE_METRICS, 0.0)
    for labels, value in metric_samples(metrics_url):
        for key, metric in CACHE_METRICS.items():
            if labels.get("__name__") == metric and labels.get("model") == model:
                out[key] += value
    lookups = out["hits"] + out["misses"]
    out["hit_ratio"] = out["hits"] / lookups if lookups else float("nan")
    return out


def version_states(url: str, model: str = CLASSIFIER, protocol: str = "grpc") -> dict[str, str]:
    """``{version: state}`` of ``model`` from the repository index (READY, UNAVAILABLE with a reason...)."""
    return {str(m["version"]): m.get("state", "") + (f": {m['reason']}" if m.get("reason") else "")
            for m in triton_client.repository_index(url, protocol) if m.get("name") == model and m.get("version")}


# --- clients ---------------------------------------------------------------------------------------------


def image_batch(pngs: Sequence[bytes]) -> np.ndarray:
    """Encoded images as the ensemble's input: an object array of bytes, shape [N, 1] (datatype BYTES)."""
    arr = np.empty((len(pngs), 1), dtype=object)
    arr[:, 0] = [bytes(b) for b in pngs]
    return arr


def classify(url: str, pngs: Sequence[bytes], *, protocol: str = "grpc", model: str = SERVICE,
             version: str = "", timeout_s: float = 30.0,
             headers: Mapping[str, str] | None = None) -> tuple[list[list[str]], np.ndarray]:
    """Send ``pngs`` (encoded images) in one request (``headers``: the API key through nginx); (top-k labels per
    image, best first; scores [N, k])."""
    out = triton_client.infer(url, model, {IMAGE: image_batch(pngs)}, protocol=protocol, outputs=[LABELS, SCORES],
                              version=version, timeout_s=timeout_s, headers=headers)
    labels = [[b.decode() if isinstance(b, bytes) else str(b) for b in row] for row in out[LABELS]]
    return labels, np.asarray(out[SCORES], dtype=np.float32)


def service_accuracy(url: str, *, protocol: str = "grpc", n: int | None = None, batch_size: int = 16,
                     model: str = SERVICE, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Top-1 accuracy on the held-out digits sent through the whole service as PNG bytes (``batch_size`` images a
    request); with the wrong predictions (index, label, predicted) and the wall time (s)."""
    pngs, y = digits_pngs("test", n)
    t0 = time.perf_counter()
    predicted = [row[0] for i in range(0, len(pngs), batch_size)  # each image's top label
                 for row in classify(url, pngs[i:i + batch_size], protocol=protocol, model=model, headers=headers)[0]]
    wall_s = time.perf_counter() - t0
    wrong = [(i, int(t), p) for i, (t, p) in enumerate(zip(y, predicted, strict=True)) if str(int(t)) != p]
    return {"accuracy": 1 - len(wrong) / len(y), "images": len(y), "wrong": wrong, "wall_s": wall_s,
            "protocol": protocol, "requests": -(-len(y) // batch_size)}
