"""Lab 07's step models: their names and limits, each model's ``config.pbtxt`` as Python values and the ensemble
chaining them (with what Triton's schema cannot see in it, ``ensemble_problems``), and the classifier exported into a
version folder (ONNX with a dynamic batch, TorchScript for the torch engine) with its python-backend files, and the
versions a repository serves. ``lab_utils.serving.ensemble`` re-exports these names.

Design notes: docs/internals.md#lab_utilsservingensemblepy
"""

from __future__ import annotations

import io
import json
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lab_utils.serving import backend as backend_files
from lab_utils.serving import repository as triton_repo
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
_PY_MODEL = "nvlab_triton_model.py"  # the course's model file, beside each python model's model.py
_DRIFT_MODULE = "nvlab_drift.py"  # backend/drift_stats.py beside the preprocessing model


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
                      threads: int = 1, cache: bool = False,
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
              "resample": resample, "max_image_bytes": MAX_IMAGE_BYTES, "max_image_pixels": MAX_IMAGE_PIXELS,
              "min_image_side": MIN_IMAGE_SIDE}
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
                    cache: bool = True) -> dict[str, Any]:
    """The ensemble chaining the three models (each the newest version loaded: -1). ``cache``: the
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
            {"model_name": classifier, "model_version": -1,
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
    return problems + [("output", f"{t.name!r} is produced by no step") for t in cfg.output if t.name not in have]


def write_ensemble(repo: str | Path, config: Mapping[str, Any]) -> Path:
    """Validate (schema, course checks, ``ensemble_problems``) and write an ensemble's folder with its empty ``1/``."""
    problems = ensemble_problems(repo, config)
    model_dir = Path(repo) / str(config["name"])
    if problems:
        raise triton_repo.ConfigError(problems, model=str(config["name"]), where=str(model_dir / "config.pbtxt"))
    (model_dir / "1").mkdir(parents=True, exist_ok=True)  # Triton wants a version folder, even an empty one
    return triton_repo.write_config(model_dir, config, gpus=0)


# --- the classifier: exported into a version folder, versioned ---------------------------------------------


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
            # check_trace off: torch's check re-traces and reruns the model (most of a ResNet-50's tracing time, 15 of
            # 19 s on 2 cores); the batch-3 comparison with the model below checks what matters, and more
            traced = torch.jit.trace(cpu, example, check_trace=False)
            torch.jit.save(traced, str(path))
            want = cpu(check)
            got = torch.jit.load(str(path), map_location="cpu")(check)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        path.unlink()
        raise RuntimeError(f"{path}: the traced model answers a batch of 3 differently from the model (shape "
                           f"{tuple(got.shape)} vs {tuple(want.shape)}): its forward depends on the batch size or on "
                           "Python control flow that tracing cannot record; make it shape-generic")
    return path


def write_classifier_version(repo: str | Path, version: int, *, epochs: int = 4, seed: int | None = None,
                             name: str = CLASSIFIER, model: Any = None) -> dict[str, Any]:
    """Train (or take ``model``) and write ``<repo>/<name>/<version>/``: ``model.onnx`` and, for the python backend,
    ``model.py``. The config is left as it is (see ``set_served_versions``). Returns the training facts
    (``accuracy`` in-process on the held-out digits), with ``version`` and ``export_s``."""
    model_dir = Path(repo) / name
    backend, engine = _classifier_kind(model_dir)
    facts: dict[str, Any] = {}
    if model is None:
        from lab_utils.inference.model_zoo import trained_digits  # lazy: pulls torch; once per process (seconds)

        model, facts = trained_digits(epochs, version - 1 if seed is None else seed)
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
    import torch

    from lab_utils.models import make_digits_cnn  # lazy: pulls torch

    torch.manual_seed(0)
    model = make_digits_cnn()  # a DigitsCNN whose head has ``classes`` outputs: the wrong shape a server must refuse
    model.head[-1] = torch.nn.Linear(model.head[-1].in_features, classes)
    write_classifier_version(repo, version, name=name, model=model.eval())
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


def _write_python_files(version_dir: Path, model: str) -> None:
    """``model.py`` (the backend file ``model``) and the course's model file beside it, both compiled."""
    folder = Path(backend_files.__file__).parent
    triton_repo.write_model_py(version_dir, (folder / f"{model}.py").read_text())
    triton_repo.write_model_py(version_dir, (folder / "model.py").read_text(), name=_PY_MODEL)
    if model == "preprocess_png":  # its drift statistics (NumPy only)
        triton_repo.write_model_py(version_dir, (folder / "drift_stats.py").read_text(), name=_DRIFT_MODULE)
