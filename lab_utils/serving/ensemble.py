"""Lab 07's model path: the digits classifier behind a Triton ensemble (PNG bytes in, top-k labels out), its
versions, the response cache, and the clients that send encoded images.

``build_service_repository`` writes ``digits_preprocess`` (PNG bytes -> FP32 [1, 8, 8]), ``digits_classifier``
(-> logits FP32 [10]), ``digits_postprocess`` (-> top-k ``LABELS``, ``SCORES``) and the ensemble ``digits_service``
(the wheel's python models in ``numpy1_env``'s NumPy-1 environment). Units are in names: ``_s``, ``_mib``, ``_us``.

Design notes: docs/internals.md#lab_utilsservingensemblepy
"""

from __future__ import annotations

import functools
import io
import json
import math
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lab_utils.compat import numpy1_env
from lab_utils.serving import backend as backend_files
from lab_utils.serving import client as triton_client
from lab_utils.serving import repository as triton_repo
from lab_utils.serving.metrics import metric_samples
from lab_utils.serving.server import ServerNotFound, ServerSource, find_server, wheel_layout
from lab_utils.timing import cpu_cores

PREFIX = "digits"
SERVICE, PREPROCESS, CLASSIFIER, POSTPROCESS = (f"{PREFIX}_service", f"{PREFIX}_preprocess", f"{PREFIX}_classifier",
                                                f"{PREFIX}_postprocess")
IMAGE, PIXELS, LOGITS, LABELS, SCORES = "IMAGE", "PIXELS", "LOGITS", "LABELS", "SCORES"
ONNX_INPUT, ONNX_OUTPUT = "input", "logits"  # the classifier file's tensor names (export_onnx's arguments)
TORCH_FILE = "model.pt"  # TorchScript beside model.onnx: what torch_classifier loads without the model's class
CLASSIFIER_ENGINES = {"onnxruntime": "onnx_classifier", "torch": "torch_classifier"}  # engine -> backend file
PRECISIONS = ("fp32", "fp16", "bf16")  # torch_classifier's autocast; fp32: as exported
PREPROCESS_DEVICES = ("cpu", "gpu")  # where the preprocessing model decodes (gpu: nvJPEG through torchvision)
DIGIT_LABELS = tuple(str(d) for d in range(10))
DIGITS_SIZE = 8  # px: what DigitsCNN was trained on
PNG_SCALE = 4  # clients send 8 px digits upscaled to 32 px PNGs
TOP_K = 3
MAX_BATCH = 64
QUEUE_DELAY_US = 500  # dynamic batching: how long a request may wait for others (µs); well under the 100 ms SLO
# what the preprocessing model accepts: a phone's photo (a 12 Mpx camera's 4032x3024 JPEG is 2-6 MB); larger
# files and images are refused (400) from the header, before decoding. nginx's client_max_body_size sits above it
MAX_IMAGE_BYTES = 8 * 1024 * 1024
MAX_IMAGE_PIXELS = 12 * 1024 * 1024  # 12.6 Mpx: 4032x3024 and 4000x3000 fit; a 110 Mpx decompression bomb does not
MIN_IMAGE_SIDE = 8  # px: the digits' own size; a 1x1 image carries nothing to classify
CACHE_PLACES = ("service", "classifier", None)
CACHE_MIB = 64  # the local response cache's size (MiB): a digit's top-k response is about 100 bytes
CACHE_METRICS = {"hits": "nv_cache_num_hits_per_model", "misses": "nv_cache_num_misses_per_model",
                 "hit_us": "nv_cache_hit_duration_per_model", "miss_us": "nv_cache_miss_duration_per_model"}
_PY_MODEL = "nvlab_triton_model.py"  # the course's model file, beside each python model's model.py
_DRIFT_MODULE = "nvlab_drift.py"  # backend/drift_stats.py beside the preprocessing model


# --- the data: digits as raw pixels and as PNG files ----------------------------------------------------


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


# --- the classifier: trained, exported, versioned --------------------------------------------------------


def train_classifier(epochs: int = 4, seed: int = 0) -> tuple[Any, dict[str, Any]]:
    """The course's DigitsCNN trained here (``model_zoo.train_digits_cnn``: seconds on a CPU); (model, facts)."""
    from lab_utils.inference.model_zoo import train_digits_cnn  # lazy: pulls torch

    return train_digits_cnn(epochs=epochs, seed=seed)


def export_classifier(model: Any, version_dir: str | Path, image_size: int = DIGITS_SIZE, channels: int = 1,
                      torchscript: bool = False, onnx: bool = True) -> Path:
    """``model.onnx`` in ``version_dir`` with a dynamic batch (the course's ``export_onnx``); returns its path.
    ``torchscript``: ``model.pt`` beside it as well (``export_torchscript``: what the torch engine loads);
    ``onnx`` False: ``model.pt`` only (the torch engine reads nothing else), and its path is returned; then
    ``model`` may be an exported ``model.pt`` (a path), copied as it is (one export for several variants)."""
    if isinstance(model, (str, Path)):
        if onnx:
            raise ValueError(f"export_classifier({model!r}): a saved model.pt is copied only with onnx=False")
        Path(version_dir).mkdir(parents=True, exist_ok=True)
        return Path(shutil.copyfile(model, Path(version_dir) / TORCH_FILE))
    import torch

    from lab_utils.inference.onnx import export_onnx  # lazy: pulls torch and onnx

    if not onnx:
        return export_torchscript(model, version_dir, image_size, channels)
    example = torch.zeros(2, channels, image_size, image_size)
    path = export_onnx(model, Path(version_dir) / "model.onnx", example, input_name=ONNX_INPUT,
                       output_name=ONNX_OUTPUT)
    if torchscript:
        export_torchscript(model, version_dir, image_size, channels)
    return path


def export_torchscript(model: Any, version_dir: str | Path, image_size: int = DIGITS_SIZE,
                       channels: int = 1) -> Path:
    """``model.pt`` in ``version_dir``: the model traced on the CPU (``torch.jit.trace``, FP32, eval mode) and saved
    with ``torch.jit.save``, so the python backend loads it without the model's Python class and on any device
    (``map_location``). Checked here at another batch size than the trace's: a trace that froze the batch fails
    now, not in the server. Returns its path."""
    import copy
    import warnings

    import torch

    path = Path(version_dir) / TORCH_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    # a CPU copy: the caller's model stays where it is (and in its mode)
    cpu = copy.deepcopy(model).to("cpu").float().eval()
    example = torch.zeros(2, channels, image_size, image_size)
    check = torch.randn(3, channels, image_size, image_size, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():  # torch >= 2.9 flags TorchScript as deprecated; it still traces and loads
        warnings.simplefilter("ignore", DeprecationWarning)
        with torch.no_grad():
            traced = torch.jit.trace(cpu, example)
            torch.jit.save(traced, str(path))
            want = cpu(check)
            got = torch.jit.load(str(path), map_location="cpu")(check)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        path.unlink()
        raise RuntimeError(f"{path}: the traced model answers a batch of 3 differently from the model (shape "
                           f"{tuple(got.shape)} vs {tuple(want.shape)}): its forward depends on the batch size or on "
                           "Python control flow that tracing cannot record; make it shape-generic")
    return path


def broken_classifier(classes: int = 9, seed: int = 0) -> Any:
    """A DigitsCNN whose head has ``classes`` outputs (not 10): the wrong output shape a server must refuse."""
    import torch

    from lab_utils.models import make_digits_cnn  # lazy: pulls torch

    torch.manual_seed(seed)
    model = make_digits_cnn()
    model.head[-1] = torch.nn.Linear(model.head[-1].in_features, classes)
    return model.eval()


def write_classifier_version(repo: str | Path, version: int, *, epochs: int = 4, seed: int | None = None,
                             name: str = CLASSIFIER, model: Any = None) -> dict[str, Any]:
    """Train (or take ``model``) and write ``<repo>/<name>/<version>/``: ``model.onnx`` and, for the python backend,
    ``model.py``. The config is left as it is (see ``set_served_versions``). Returns the training facts
    (``accuracy`` in-process on the held-out digits), with ``version`` and ``export_s``."""
    model_dir = Path(repo) / name
    backend, engine = _classifier_kind(model_dir)
    facts: dict[str, Any] = {}
    if model is None:
        model, facts = train_classifier(epochs=epochs, seed=version - 1 if seed is None else seed)
    vdir = model_dir / str(version)
    t0 = time.perf_counter()
    export_classifier(model, vdir, torchscript=engine == "torch")
    if backend == "python":
        _write_python_files(vdir, CLASSIFIER_ENGINES[engine])
    return {**facts, "version": version, "export_s": time.perf_counter() - t0}


def write_broken_version(repo: str | Path, version: int = 2, *, name: str = CLASSIFIER, classes: int = 9) -> Path:
    """Write a version whose ONNX file outputs ``classes`` logits where the config says 10: Triton refuses it at
    load (the onnxruntime backend's check, or ``onnx_classifier``'s / ``torch_classifier``'s on the python backend).
    Returns its folder."""
    write_classifier_version(repo, version, name=name, model=broken_classifier(classes))
    return Path(repo) / name / str(version)


def set_served_versions(repo: str | Path, versions: Sequence[int] | None, *, name: str = CLASSIFIER) -> Path:
    """Rewrite ``<name>/config.pbtxt`` to serve exactly ``versions`` (``version_policy { specific }``), or the latest
    one (None). The server reads it at the next ``load_model``. Returns the config's path."""
    model_dir = Path(repo) / name
    cfg = triton_repo.parse_config((model_dir / "config.pbtxt").read_text())  # the protobuf: values round-trip
    cfg.ClearField("version_policy")
    if versions:
        cfg.version_policy.specific.versions.extend(int(v) for v in versions)
    gpus = int(any(g.kind == g.KIND_GPU for g in cfg.instance_group))
    return triton_repo.write_config(model_dir, cfg, gpus=gpus)


def _classifier_kind(model_dir: Path) -> tuple[str, str]:
    """The classifier's (backend, engine): ``python`` or ``onnxruntime``, and the python backend's ``engine``
    parameter (``onnxruntime`` for Triton's onnxruntime backend)."""
    cfg_path = model_dir / "config.pbtxt"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} does not exist: build the repository first (build_service_repository)")
    cfg = triton_repo.parse_config(cfg_path.read_text())
    if cfg.backend != "python":
        return "onnxruntime", "onnxruntime"
    engine = cfg.parameters["engine"].string_value if "engine" in cfg.parameters else ""
    return "python", engine if engine in CLASSIFIER_ENGINES else "onnxruntime"


def resolve_engine(engine: str | None, backend: str, gpus: int = 0) -> str:
    """The classifier's engine: ``engine``, or (None) ``torch`` on the python backend with a GPU (ONNX Runtime is
    CPU-only here: a GPU instance running it would leave the GPU idle), else ``onnxruntime``."""
    if engine is None:
        return "torch" if backend == "python" and gpus else "onnxruntime"
    if engine not in CLASSIFIER_ENGINES:
        raise ValueError(f"classifier_engine={engine!r}: use one of {tuple(CLASSIFIER_ENGINES)}, or None (torch "
                         "with a GPU, ONNX Runtime without)")
    if engine == "torch" and backend != "python":
        raise ValueError(f"classifier_engine='torch' runs on the python backend, not {backend!r}: give "
                         "backend='python' (or leave backend None on the wheel's server)")
    return engine


def _write_python_files(version_dir: Path, model: str) -> None:
    """``model.py`` (the backend file ``model``) and the course's model file beside it, both compiled."""
    folder = Path(backend_files.__file__).parent
    triton_repo.write_model_py(version_dir, (folder / f"{model}.py").read_text())
    triton_repo.write_model_py(version_dir, (folder / "model.py").read_text(), name=_PY_MODEL)
    if model == "preprocess_png":  # its drift statistics (NumPy only)
        triton_repo.write_model_py(version_dir, (folder / "drift_stats.py").read_text(), name=_DRIFT_MODULE)


# --- configurations --------------------------------------------------------------------------------------


MAX_QUEUE = 256  # requests waiting per step model; more are refused at once ("Exceeds maximum queue size"): an
# overload leaves no backlog behind it, so the service is back within its SLO as soon as the load falls (unbounded,
# 3 s at 4,000 req/s left minutes of queued work, and every later request timed out while it drained)


def _batching(**extra: Any) -> dict[str, Any]:
    """``dynamic_batching`` with the bounded queue (``MAX_QUEUE``)."""
    return {**extra, "default_queue_policy": {"max_queue_size": MAX_QUEUE}}


def _write_png_warmup(model_dir: Path, image_size: int, channels: int, fmt: str = "PNG") -> dict[str, Any]:
    """A blank image (``fmt``: PNG or JPEG) of the model's size as ``<model_dir>/warmup/blank_<fmt>`` (a BYTES
    element: 4-byte little-endian length, then the bytes) and the ``model_warmup`` entry that sends it: every
    preprocessing instance decodes once at load, so a server's first requests do not pay its first decode."""
    import struct

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L" if channels == 1 else "RGB", (image_size * (PNG_SCALE if image_size == DIGITS_SIZE else 1),) * 2
              ).save(buf, format=fmt)
    data, name = buf.getvalue(), f"blank_{fmt.lower()}"
    (model_dir / "warmup").mkdir(parents=True, exist_ok=True)
    (model_dir / "warmup" / name).write_bytes(struct.pack("<I", len(data)) + data)
    return {"name": name, "batch_size": 1, "count": 2,
            "inputs": {IMAGE: {"data_type": "TYPE_STRING", "dims": [1], "input_data_file": name}}}


def _warmup_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4 ... up to ``max_batch_size`` (which is included)."""
    powers = [2**i for i in range(max_batch_size.bit_length()) if 2**i < max_batch_size]
    return [*powers, max_batch_size] if max_batch_size >= 1 else []


def preprocess_instances(gpus: int = 0) -> int:
    """Preprocessing instances (CPU, one Python process each): with a GPU the decoding must keep the GPU fed, so
    half the cores up to 8; without one, 1 (the classifier shares the same cores)."""
    return max(1, min(8, cpu_cores() // 2)) if gpus else 1


def default_instances(gpus: int = 0) -> int:
    """Classifier instances worth having: 2 with a GPU or 4+ cores (one runs while the other gathers its batch),
    else 1 (on 2 cores the pre- and postprocessing stubs and the clients already share them)."""
    return 2 if gpus or cpu_cores() >= 4 else 1


def classifier_config(name: str = CLASSIFIER, *, backend: str = "python", image_size: int = DIGITS_SIZE,
                      channels: int = 1, classes: int = 10, max_batch_size: int = MAX_BATCH,
                      queue_delay_us: int = QUEUE_DELAY_US, instances: int = 1, gpus: int = 0,
                      threads: int = 1, versions: Sequence[int] | None = None, cache: bool = False,
                      engine: str | None = None, precision: str = "fp32", channels_last: bool = False,
                      cuda_graphs: bool = False) -> dict[str, Any]:
    """The classifier's configuration: ``onnxruntime`` (Triton's ONNX Runtime backend, NGC server) or ``python``
    (the course's python model), with dynamic batching. ``engine`` (python backend): ``onnxruntime`` (``model.onnx``
    on the CPU) or ``torch`` (``model.pt`` on the instance's device: the GPU with ``gpus``), None as
    ``resolve_engine`` (torch with a GPU, else ONNX Runtime); ``precision``: the torch
    engine's autocast (``fp32``: as exported); ``channels_last`` (torch: NHWC activations) and ``cuda_graphs`` (torch
    on a GPU: each batch size replayed from a CUDA graph captured at load). ``cache``: its own response cache (keyed
    by this model's version: a new version is never answered from an old one's entries)."""
    if backend not in ("python", "onnxruntime"):
        raise ValueError(f"backend={backend!r}: use 'onnxruntime' (NGC server) or 'python' (the wheel's server)")
    engine = resolve_engine(engine, backend, gpus)
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {PRECISIONS}")
    if precision != "fp32" and engine != "torch":
        raise ValueError(f"precision={precision!r} is the torch engine's autocast: give engine='torch', or fp32")
    if (channels_last or cuda_graphs) and engine != "torch":
        raise ValueError("channels_last and cuda_graphs are the torch engine's: give engine='torch'")
    if cuda_graphs and not gpus:
        raise ValueError("cuda_graphs=True needs a GPU instance: give gpus >= 1, or leave cuda_graphs False")
    cfg: dict[str, Any] = {
        "name": name, "max_batch_size": max_batch_size,
        "input": [{"name": ONNX_INPUT, "data_type": "TYPE_FP32", "dims": [channels, image_size, image_size]}],
        "output": [{"name": ONNX_OUTPUT, "data_type": "TYPE_FP32", "dims": [classes]}],
        "dynamic_batching": _batching(max_queue_delay_microseconds=queue_delay_us),
        "instance_group": [{"kind": "KIND_GPU" if gpus else "KIND_CPU", "count": instances}],
        # every batch size the batcher may form, run at load (before READY, outside the request metrics): a new
        # version's first batches (TorchScript's profiling runs, cuDNN's algorithm search) never meet a client or
        # a canary's p95
        "model_warmup": [{"name": f"batch_{b}", "batch_size": b, "count": 2,
                          "inputs": {ONNX_INPUT: {"data_type": "TYPE_FP32", "dims": [channels, image_size, image_size],
                                                  "zero_data": True}}}
                         for b in _warmup_sizes(max_batch_size)],
    }
    if backend == "python":
        cfg["backend"] = "python"
        params: dict[str, Any] = {"engine": engine, "threads": threads}
        if engine == "torch":
            params["precision"] = precision
            params.update({k: "1" for k, on in (("channels_last", channels_last), ("cuda_graphs", cuda_graphs)) if on})
        cfg["parameters"] = _params(params)
    else:
        cfg["platform"] = "onnxruntime_onnx"
    if versions:
        cfg["version_policy"] = {"specific": {"versions": list(versions)}}
    if cache:
        cfg["response_cache"] = {"enable": True}
    return cfg


def _params(values: Mapping[str, Any], stub_env: str | Path | None = None) -> dict[str, Any]:
    """A model's ``parameters``; ``stub_env`` goes as ``EXECUTION_ENV_PATH`` (the python stub's environment)."""
    env = {"EXECUTION_ENV_PATH": str(stub_env)} if stub_env else {}
    return {k: {"string_value": str(v)} for k, v in {**values, **env}.items()}


def preprocess_config(name: str = PREPROCESS, *, image_size: int = DIGITS_SIZE, channels: int = 1,
                      pixel_scale: float = 16 / 255, mean: Sequence[float] = (0.0,), std: Sequence[float] = (1.0,),
                      resample: str = "box", max_batch_size: int = MAX_BATCH, stub_env: str | Path | None = None,
                      max_image_bytes: int = MAX_IMAGE_BYTES, max_image_pixels: int = MAX_IMAGE_PIXELS,
                      min_image_side: int = MIN_IMAGE_SIDE,
                      instances: int = 1, drift_reference: Mapping[str, Any] | None = None,
                      drift_window: int = 200, device: str = "cpu", queue_delay_us: int | None = None
                      ) -> dict[str, Any]:
    """The preprocessing model's configuration (``backend/preprocess_png.py``): ``TYPE_STRING`` in, FP32 out.
    ``drift_reference`` (``drift_stats.reference_bins`` of the training images): it also exports PSI per feature
    over its last ``drift_window`` images as Triton custom metrics. ``device`` ``gpu``: ``KIND_GPU`` instances that
    decode a batch's JPEGs in one call on the GPU; ``queue_delay_us``: how long a request may wait for others."""
    if device not in PREPROCESS_DEVICES:
        raise ValueError(f"device={device!r}: use one of {PREPROCESS_DEVICES}")
    params = {"image_size": image_size, "channels": channels, "pixel_scale": repr(float(pixel_scale)),
              "mean": ",".join(repr(float(m)) for m in mean), "std": ",".join(repr(float(s)) for s in std),
              "resample": resample, "max_image_bytes": max_image_bytes, "max_image_pixels": max_image_pixels,
              "min_image_side": min_image_side}
    if drift_reference:
        params["drift_reference"] = json.dumps(drift_reference, separators=(",", ":"))
        params["drift_window"] = int(drift_window)
    return {"name": name, "backend": "python", "max_batch_size": max_batch_size,
            "input": [{"name": IMAGE, "data_type": "TYPE_STRING", "dims": [1]}],
            "output": [{"name": PIXELS, "data_type": "TYPE_FP32", "dims": [channels, image_size, image_size]}],
            # the ensemble's concurrent requests reach execute() together
            "dynamic_batching": _batching(**({} if queue_delay_us is None else
                                             {"max_queue_delay_microseconds": int(queue_delay_us)})),
            "instance_group": [{"kind": f"KIND_{device.upper()}", "count": instances}],
            "parameters": _params(params, stub_env)}


def postprocess_config(name: str = POSTPROCESS, *, labels: Sequence[str] = DIGIT_LABELS, top_k: int = TOP_K,
                       max_batch_size: int = MAX_BATCH, stub_env: str | Path | None = None) -> dict[str, Any]:
    """The postprocessing model's configuration (``backend/postprocess_topk.py``): logits in, top-k out."""
    if not 1 <= top_k <= len(labels):
        raise ValueError(f"top_k={top_k}: between 1 and the {len(labels)} classes")
    bad = [s for s in labels if "," in s]
    if bad:
        raise ValueError(f"labels {bad[:3]} contain commas: the label parameter is comma-separated")
    return {"name": name, "backend": "python", "max_batch_size": max_batch_size,
            "input": [{"name": LOGITS, "data_type": "TYPE_FP32", "dims": [len(labels)]}],
            "output": [{"name": LABELS, "data_type": "TYPE_STRING", "dims": [top_k]},
                       {"name": SCORES, "data_type": "TYPE_FP32", "dims": [top_k]}],
            "dynamic_batching": _batching(), "instance_group": [{"kind": "KIND_CPU", "count": 1}],
            "parameters": _params({"labels": ",".join(labels)}, stub_env)}


def ensemble_config(name: str = SERVICE, *, preprocess: str = PREPROCESS, classifier: str = CLASSIFIER,
                    postprocess: str = POSTPROCESS, top_k: int = TOP_K, max_batch_size: int = MAX_BATCH,
                    cache: bool = True, classifier_version: int = -1) -> dict[str, Any]:
    """The ensemble chaining the three models (``classifier_version`` -1: the newest one loaded). ``cache``: the
    response cache on the ensemble: a repeated image is answered without running any step. Its entries are keyed
    by the ensemble's name and version, not its steps': after a hot update of the classifier, images already
    cached keep getting the old version's answer (measured on Triton 2.51, a reload of the ensemble included)."""
    cfg: dict[str, Any] = {
        "name": name, "platform": "ensemble", "max_batch_size": max_batch_size,
        "input": [{"name": IMAGE, "data_type": "TYPE_STRING", "dims": [1]}],
        "output": [{"name": LABELS, "data_type": "TYPE_STRING", "dims": [top_k]},
                   {"name": SCORES, "data_type": "TYPE_FP32", "dims": [top_k]}],
        "ensemble_scheduling": {"step": [
            {"model_name": preprocess, "model_version": -1,
             "input_map": {IMAGE: IMAGE}, "output_map": {PIXELS: "pixels"}},
            {"model_name": classifier, "model_version": classifier_version,
             "input_map": {ONNX_INPUT: "pixels"}, "output_map": {ONNX_OUTPUT: "logits"}},
            {"model_name": postprocess, "model_version": -1,
             "input_map": {LOGITS: "logits"}, "output_map": {LABELS: LABELS, SCORES: SCORES}},
        ]},
    }
    if cache:
        cfg["response_cache"] = {"enable": True}
    return cfg


def ensemble_problems(repo: str | Path, config: Any) -> list[tuple[str, str]]:
    """What Triton's schema cannot see in an ensemble: each step's model exists in ``repo``, its ``input_map`` keys
    are that model's inputs and its ``output_map`` keys its outputs, every tensor a step reads was produced before
    (or is an ensemble input), and every ensemble output is produced. [] when all hold."""
    cfg = triton_repo.parse_config(config)
    problems: list[tuple[str, str]] = []
    have = {t.name for t in cfg.input}
    for i, step in enumerate(cfg.ensemble_scheduling.step):
        f = f"ensemble_scheduling.step[{i}]"
        model_cfg = Path(repo) / step.model_name / "config.pbtxt"
        if not model_cfg.is_file():
            problems.append((f"{f}.model_name", f"{step.model_name!r} has no {model_cfg}: build that model first"))
            continue
        sub = triton_repo.parse_config(model_cfg.read_text())
        ins, outs = {t.name for t in sub.input}, {t.name for t in sub.output}
        for key, tensor in step.input_map.items():
            if key not in ins:
                problems.append((f"{f}.input_map", f"{key!r} is not an input of {step.model_name} (it has "
                                                   f"{sorted(ins)})"))
            if tensor not in have:
                problems.append((f"{f}.input_map", f"{tensor!r} is read before any step produces it (ensemble "
                                                   f"inputs and earlier outputs: {sorted(have)})"))
        for key in sorted(ins - set(step.input_map)):
            problems.append((f"{f}.input_map", f"{step.model_name}'s input {key!r} is not mapped"))
        for key, tensor in step.output_map.items():
            if key not in outs:
                problems.append((f"{f}.output_map", f"{key!r} is not an output of {step.model_name} (it has "
                                                     f"{sorted(outs)})"))
            have.add(tensor)
    for t in cfg.output:
        if t.name not in have:
            problems.append(("output", f"{t.name!r} is produced by no step"))
    return problems


def write_ensemble(repo: str | Path, config: Mapping[str, Any]) -> Path:
    """Validate (schema, course checks, ``ensemble_problems``) and write an ensemble's folder with its empty ``1/``."""
    problems = ensemble_problems(repo, config)
    model_dir = Path(repo) / str(config["name"])
    if problems:
        raise triton_repo.ConfigError(problems, model=str(config["name"]), where=str(model_dir / "config.pbtxt"))
    (model_dir / "1").mkdir(parents=True, exist_ok=True)  # Triton wants a version folder, even an empty one
    return triton_repo.write_config(model_dir, config, gpus=0)


# --- the server the repository is for --------------------------------------------------------------------


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
        model, facts = train_classifier(epochs=epochs, seed=seed)
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


def random_pngs(n: int, size: int = 224, seed: int = 0) -> list[bytes]:
    """``n`` random RGB PNGs of ``size`` px (for the ResNet-50 service's speed runs)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), mode="RGB").save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


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
    out = {}
    for m in triton_client.repository_index(url, protocol):
        if m.get("name") == model and m.get("version"):
            reason = m.get("reason", "")
            out[str(m["version"])] = m.get("state", "") + (f": {reason}" if reason else "")
    return out


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
    predicted: list[str] = []
    for i in range(0, len(pngs), batch_size):
        labels, _ = classify(url, pngs[i:i + batch_size], protocol=protocol, model=model, headers=headers)
        predicted += [row[0] for row in labels]
    wall_s = time.perf_counter() - t0
    wrong = [(i, int(t), p) for i, (t, p) in enumerate(zip(y, predicted, strict=True)) if str(int(t)) != p]
    return {"accuracy": 1 - len(wrong) / len(y), "images": len(y), "wrong": wrong, "wall_s": wall_s,
            "protocol": protocol, "requests": -(-len(y) // batch_size)}
