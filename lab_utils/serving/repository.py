"""Triton model repositories from Python values, validated with Triton's own schema before any server starts.

A model configuration is written as plain Python values (the field names of Triton's ``ModelConfig`` protobuf,
as in ``config.pbtxt``), parsed with ``tritonclient.grpc.model_config_pb2``, then checked for what the schema
cannot see (``check_model_config``). ``validate_repository`` runs all of it over a folder laid out as Triton reads it::

    repo/<model>/config.pbtxt
    repo/<model>/<version>/model.py | model.onnx | model.plan   (version = a positive integer)

Design notes: docs/internals.md#lab_utilsservingrepositorypy
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lab_utils.serving.backend import model as triton_model

PLATFORM_FILES = {  # platform or backend -> the file each version folder must hold (Triton's defaults)
    "python": "model.py",
    "onnxruntime_onnx": "model.onnx",
    "onnxruntime": "model.onnx",
    "tensorrt_plan": "model.plan",
    "tensorrt": "model.plan",
    "pytorch_libtorch": "model.pt",
    "pytorch": "model.pt",
    "openvino": "model.xml",
}
PLATFORMS = ("tensorrt_plan", "onnxruntime_onnx", "pytorch_libtorch", "tensorflow_savedmodel",
             "tensorflow_graphdef", "ensemble")
PLATFORM_BACKEND = {"tensorrt_plan": "tensorrt", "onnxruntime_onnx": "onnxruntime", "pytorch_libtorch": "pytorch"}

NUMPY_TO_TRITON = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "float64": "TYPE_FP64", "int64": "TYPE_INT64",
                   "int32": "TYPE_INT32", "int8": "TYPE_INT8", "uint8": "TYPE_UINT8", "bool": "TYPE_BOOL",
                   "object": "TYPE_STRING", "bytes": "TYPE_STRING"}


class ConfigError(ValueError):
    """A model configuration that Triton would refuse (or mis-serve); names the model, the file and the field."""

    def __init__(self, problems: list[tuple[str, str]], model: str = "", where: str = ""):
        self.problems = problems  # [(field, why)]
        self.model, self.where = model, where
        head = f"model {model!r}" if model else "model configuration"
        loc = f" ({where})" if where else ""
        lines = "\n".join(f"  {f}: {why}" if f else f"  {why}" for f, why in problems)
        super().__init__(f"{head}{loc} is invalid:\n{lines}")

    @property
    def fields(self) -> list[str]:
        return [f for f, _ in self.problems]


def _pb() -> Any:
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError(f"Triton's model-config schema comes with the client ({err}): "
                          "pip install 'tritonclient[grpc]'") from None
    return model_config_pb2


# --- parse: schema -------------------------------------------------------------------------------------


def parse_config(source: str | Mapping[str, Any] | Any, where: str = "") -> Any:
    """A ``ModelConfig`` protobuf from ``config.pbtxt`` text, a dict of Python values, or a ``ModelConfig``.

    Raises ``ConfigError`` naming the field the schema refuses (unknown field, wrong enum, wrong type).
    """
    from google.protobuf import json_format, text_format

    pb = _pb()
    if isinstance(source, pb.ModelConfig):
        return source
    if not isinstance(source, (str, Mapping)):
        raise TypeError(f"parse_config: expected config.pbtxt text, a dict or a ModelConfig, got "
                        f"{type(source).__name__}")
    cfg = pb.ModelConfig()
    try:
        if isinstance(source, str):
            text_format.Parse(source, cfg)
        else:
            json_format.ParseDict(_jsonable(source), cfg)
    except (text_format.ParseError, json_format.ParseError) as err:
        model = "" if isinstance(source, str) else str(source.get("name", ""))
        raise ConfigError([(_field_of(str(err)), f"schema: {err}")], model=model, where=where) from None
    return cfg


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    return value


def _field_of(message: str) -> str:
    m = re.search(r'no field named "([^"]+)"', message) or re.search(r"at (?:\"?)([\w.\[\]]+)", message) \
        or re.search(r'field "?([\w.]+)"?', message)
    if not m:
        return ""
    f = m.group(1)
    return f.removeprefix("ModelConfig.").removeprefix("inference.ModelConfig.")


def config_text(config: str | Mapping[str, Any] | Any) -> str:
    """``config.pbtxt`` text for a config given as values, text or protobuf (schema-checked on the way)."""
    from google.protobuf import text_format

    return text_format.MessageToString(parse_config(config))


# --- semantics: what the schema cannot see --------------------------------------------------------------


def nvml_gpu_count() -> int:
    """GPUs a server started here could use: NVML's count, limited by ``CUDA_VISIBLE_DEVICES``; 0 without a driver."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    n = 0
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            n = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no NVML: no GPU for the server either
        return 0
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
        n = min(n, len(ids))
    return n


def check_model_config(
    config: str | Mapping[str, Any] | Any,
    *,
    gpus: int | None = None,
    model_dir: Path | None = None,
    model_shapes: Mapping[str, list[int | str | None]] | None = None,
) -> list[tuple[str, str]]:
    """Problems (field, why) that Triton would refuse or that would serve wrongly; [] when none.

    ``gpus``: GPUs the server will see (None: ask NVML). ``model_dir``: the model's folder (name and version
    folders). ``model_shapes``: input name -> full shape of the model file (batch dimension included, a
    string or None for a dynamic axis), to check ``dims`` against ``max_batch_size``.
    """
    cfg = parse_config(config)
    pb = _pb()
    p: list[tuple[str, str]] = []
    if not cfg.name:
        p.append(("name", "missing: set name to the model folder's name"))
    elif model_dir is not None and cfg.name != model_dir.name:
        p.append(("name", f"{cfg.name!r} differs from its folder {model_dir.name!r}: Triton requires them equal"))
    kind = cfg.backend or cfg.platform
    if not cfg.backend and not cfg.platform:
        p.append(("backend", "neither backend nor platform is set (e.g. backend: \"python\" or platform: "
                             "\"onnxruntime_onnx\")"))
    if cfg.platform and cfg.platform not in PLATFORMS:
        p.append(("platform", f"{cfg.platform!r} is not a Triton platform: one of {', '.join(PLATFORMS)}"))
    if cfg.platform and cfg.backend and PLATFORM_BACKEND.get(cfg.platform, cfg.backend) != cfg.backend:
        p.append(("backend", f"backend {cfg.backend!r} contradicts platform {cfg.platform!r} "
                             f"(which runs on the {PLATFORM_BACKEND.get(cfg.platform)!r} backend)"))
    if cfg.max_batch_size < 0:
        p.append(("max_batch_size", f"{cfg.max_batch_size} < 0: use 0 (no batching) or the largest batch"))
    if kind != "ensemble":
        if not cfg.input:
            p.append(("input", "no inputs: declare each input's name, data_type and dims"))
        if not cfg.output:
            p.append(("output", "no outputs: declare each output's name, data_type and dims"))
    for group in ("input", "output"):
        seen: set[str] = set()
        for i, t in enumerate(getattr(cfg, group)):
            f = f"{group}[{i}]"
            if not t.name:
                p.append((f"{f}.name", "missing"))
            elif t.name in seen:
                p.append((f"{f}.name", f"{t.name!r} appears twice"))
            seen.add(t.name)
            if t.data_type == pb.TYPE_INVALID:
                p.append((f"{f}.data_type", "missing: e.g. TYPE_FP32"))
            if not t.dims and not (cfg.max_batch_size > 0):
                p.append((f"{f}.dims", "empty: with max_batch_size 0 the dims are the full shape"))
            for j, d in enumerate(t.dims):
                if d == 0 or d < -1:
                    p.append((f"{f}.dims[{j}]", f"{d}: a dimension is a positive size or -1 (variable)"))
    # batch dimension vs max_batch_size, against the model file's shapes when known
    for i, t in enumerate(cfg.input):
        shape = (model_shapes or {}).get(t.name)
        if shape is None:
            continue
        dims = list(t.dims)
        inner = [(-1 if not isinstance(s, int) or s < 0 else s) for s in shape]
        if cfg.max_batch_size > 0:
            if dims == inner:
                p.append((f"input[{i}].dims", f"{dims} includes the batch dimension: with max_batch_size "
                                              f"{cfg.max_batch_size} Triton adds it, so use dims {inner[1:]}"))
            elif dims != inner[1:]:
                p.append((f"input[{i}].dims", f"{dims} does not match the model's input {t.name!r} of shape "
                                              f"{_shape_str(shape)}: use {inner[1:]} (batch dimension left out)"))
            elif inner and inner[0] != -1:
                p.append(("max_batch_size", f"the model's input {t.name!r} has a fixed first dimension "
                                            f"{inner[0]}: it cannot batch, so max_batch_size must be 0"))
        elif dims != inner:
            hint = (f" (with max_batch_size 0 the batch dimension is part of dims: {inner})"
                    if dims == inner[1:] else f": use {inner}")
            p.append((f"input[{i}].dims", f"{dims} does not match the model's input {t.name!r} of shape "
                                          f"{_shape_str(shape)}{hint}"))
    if model_shapes:
        for name in [t.name for t in cfg.input if t.name not in model_shapes]:
            p.append(("input", f"{name!r} is not an input of the model file (it has {sorted(model_shapes)})"))
    # dynamic batching
    if cfg.HasField("dynamic_batching"):
        db = cfg.dynamic_batching
        if cfg.max_batch_size == 0:
            p.append(("dynamic_batching", "needs max_batch_size > 0: a model that cannot batch has nothing "
                                          "to batch dynamically"))
        for j, b in enumerate(db.preferred_batch_size):
            if b < 1:
                p.append((f"dynamic_batching.preferred_batch_size[{j}]", f"{b}: a batch size is >= 1"))
            elif cfg.max_batch_size > 0 and b > cfg.max_batch_size:
                p.append((f"dynamic_batching.preferred_batch_size[{j}]",
                          f"{b} > max_batch_size {cfg.max_batch_size}: a preferred size can never be formed"))
        if db.max_queue_delay_microseconds > 10_000_000:
            p.append(("dynamic_batching.max_queue_delay_microseconds",
                      f"{db.max_queue_delay_microseconds} µs is over 10 s: every request could wait that long"))
    # instance groups
    if gpus is None and any(g.kind in (pb.ModelInstanceGroup.KIND_GPU,) or g.gpus for g in cfg.instance_group):
        gpus = nvml_gpu_count()
    for j, g in enumerate(cfg.instance_group):
        f = f"instance_group[{j}]"
        if g.count < 0:
            p.append((f"{f}.count", f"{g.count}: at least 1 instance"))
        if g.kind == pb.ModelInstanceGroup.KIND_GPU and not gpus:
            p.append((f"{f}.kind", "KIND_GPU on a machine without a GPU the server can use: use KIND_CPU "
                                   "(or KIND_AUTO, which picks the GPU when there is one)"))
        if g.kind == pb.ModelInstanceGroup.KIND_CPU and g.gpus:
            p.append((f"{f}.gpus", "gpus is set on a KIND_CPU group: drop it, or use KIND_GPU"))
        for gid in g.gpus:
            if gpus is not None and gpus and gid >= gpus:
                p.append((f"{f}.gpus", f"GPU {gid} does not exist here ({gpus} GPU(s): 0..{gpus - 1})"))
    # versions on disk
    if model_dir is not None:
        versions = model_versions(model_dir)
        if cfg.version_policy.HasField("specific"):
            for v in cfg.version_policy.specific.versions:
                if v not in versions:
                    p.append(("version_policy.specific.versions",
                              f"version {v} has no folder {model_dir.name}/{v} (there are {versions or 'none'})"))
        if cfg.version_policy.HasField("latest") and cfg.version_policy.latest.num_versions < 1:
            p.append(("version_policy.latest.num_versions", "at least 1"))
    return p


def _shape_str(shape: Any) -> str:
    return "[" + ", ".join(str(s) if isinstance(s, int) and s >= 0 else (s or "?") for s in shape) + "]"


def validate_config(
    config: str | Mapping[str, Any] | Any,
    *,
    gpus: int | None = None,
    model_dir: Path | None = None,
    model_shapes: Mapping[str, list[int | str | None]] | None = None,
    where: str = "",
) -> Any:
    """The parsed ``ModelConfig``, or ``ConfigError`` listing every problem with its field."""
    cfg = parse_config(config, where=where)
    problems = check_model_config(cfg, gpus=gpus, model_dir=model_dir, model_shapes=model_shapes)
    if problems:
        raise ConfigError(problems, model=cfg.name, where=where)
    return cfg


# --- repository ----------------------------------------------------------------------------------------


def model_versions(model_dir: Path) -> list[int]:
    """Version folders of a model (positive integers), sorted."""
    return sorted(int(d.name) for d in Path(model_dir).iterdir() if d.is_dir() and d.name.isdigit()
                  and int(d.name) > 0)


def model_file(cfg: Any) -> str | None:
    """The file each version folder must hold for this config (``default_model_filename`` or the backend's)."""
    return cfg.default_model_filename or PLATFORM_FILES.get(cfg.backend or cfg.platform)


def onnx_input_shapes(path: Path) -> dict[str, list[int | str | None]]:
    """Input name -> shape (a string for a named dynamic axis) of an ONNX file, initializers left out."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in m.graph.initializer}
    out: dict[str, list[int | str | None]] = {}
    for i in m.graph.input:
        if i.name in inits:
            continue
        out[i.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                       for d in i.type.tensor_type.shape.dim]
    return out


@dataclass
class ModelEntry:
    name: str
    config: Any  # ModelConfig
    versions: list[int]
    path: Path


def validate_model_dir(model_dir: Path, *, gpus: int | None = None, require_files: bool = True) -> ModelEntry:
    """Check one model folder: config.pbtxt (schema + semantics), version folders and their model files."""
    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.pbtxt"
    if not cfg_path.is_file():
        raise ConfigError([("", f"no config.pbtxt in {model_dir}: every model folder needs one")],
                          model=model_dir.name, where=str(cfg_path))
    cfg = parse_config(cfg_path.read_text(), where=str(cfg_path))
    versions = model_versions(model_dir)
    problems: list[tuple[str, str]] = []
    shapes = None
    if require_files:
        if not versions:
            problems.append(("", f"no version folder in {model_dir} (e.g. {model_dir.name}/1/)"))
        fname = model_file(cfg)
        for v in _served_versions(cfg, versions):
            if fname and not (model_dir / str(v) / fname).exists():
                have = sorted(p.name for p in (model_dir / str(v)).iterdir())
                problems.append(("default_model_filename" if cfg.default_model_filename else "",
                                 f"version {v}: {fname} is missing in {model_dir / str(v)} (it holds "
                                 f"{', '.join(have) or 'nothing'}); the {cfg.backend or cfg.platform} "
                                 f"backend loads <version>/{fname}"))
        onnx_files = [model_dir / str(v) / "model.onnx" for v in _served_versions(cfg, versions)]
        onnx_files = [f for f in onnx_files if f.exists()]
        if onnx_files:
            try:
                shapes = onnx_input_shapes(onnx_files[-1])
            except Exception:  # an unreadable ONNX file is the server's to report; skip the shape check
                shapes = None
    problems += check_model_config(cfg, gpus=gpus, model_dir=model_dir, model_shapes=shapes)
    if problems:
        raise ConfigError(problems, model=cfg.name or model_dir.name, where=str(cfg_path))
    return ModelEntry(cfg.name, cfg, versions, model_dir)


def _served_versions(cfg: Any, versions: list[int]) -> list[int]:
    vp = cfg.version_policy
    if vp.HasField("all"):
        return versions
    if vp.HasField("specific"):
        return [v for v in vp.specific.versions if v in versions]
    n = vp.latest.num_versions if vp.HasField("latest") else 1
    return versions[-n:]


def validate_repository(
    repo: str | os.PathLike[str],
    *,
    models: list[str] | tuple[str, ...] | None = None,
    gpus: int | None = None,
    require_files: bool = True,
) -> dict[str, ModelEntry]:
    """Validate every model folder of ``repo`` (or only ``models``); ``ConfigError`` names model, file and field."""
    repo = Path(repo)
    if not repo.is_dir():
        raise ConfigError([("", f"{repo} is not a folder")], where=str(repo))
    dirs = sorted(d for d in repo.iterdir() if d.is_dir() and not d.name.startswith("."))
    if models:
        missing = [m for m in models if not (repo / m).is_dir()]
        if missing:
            raise ConfigError([("", f"no model folder {m!r} in {repo} (it has {[d.name for d in dirs]})")
                               for m in missing], where=str(repo))
        dirs = [repo / m for m in models]
    if gpus is None:
        texts = [(d / "config.pbtxt").read_text() if (d / "config.pbtxt").is_file() else "" for d in dirs]
        gpus = nvml_gpu_count() if any("KIND_GPU" in t or "gpus" in t for t in texts) else 0
    return {d.name: validate_model_dir(d, gpus=gpus, require_files=require_files) for d in dirs}


# --- building a repository ------------------------------------------------------------------------------

# MLP sizes per tier, chosen so that one execution has a cost that barely grows with the batch, which is what
# dynamic batching amortises. On a GPU a deep, narrow MLP: at small batches the time goes to kernel launches
# and copies (one small kernel per layer). On a CPU wide layers (28 MiB of weights, more than the caches):
# a batch of one reads every weight from memory for a single row, a batch of eight reads them once for eight.
MLP_PRESETS: dict[str, dict[str, int]] = {
    "cpu": {"in_features": 64, "width": 1024, "depth": 8, "out_features": 10},
    "gpu": {"in_features": 64, "width": 256, "depth": 128, "out_features": 10},
}
INPUT_NAME, OUTPUT_NAME = "INPUT__0", "OUTPUT__0"


def export_mlp(version_dir: str | os.PathLike[str], *, in_features: int = 64, width: int = 256, depth: int = 4,
               out_features: int = 10, seed: int = 0) -> dict[str, Any]:
    """Export an MLP (``depth`` hidden layers of ``width``) to ``model.onnx`` and ``weights.npz`` in ``version_dir``.

    ``torch.onnx.export`` with a dynamic batch axis; the same weights go to ``weights.npz`` for the torch
    engine. Weights are random (seeded): serving cost does not depend on their values. Returns sizes.
    """
    import warnings

    import torch

    from lab_utils.models import make_mlp  # lazy: pulls torch

    version_dir = Path(version_dir)
    version_dir.mkdir(parents=True, exist_ok=True)
    model = make_mlp(in_features, width, depth, out_features, seed)
    x = torch.randn(2, in_features)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(model, (x,), str(version_dir / "model.onnx"), input_names=[INPUT_NAME],
                          output_names=[OUTPUT_NAME], opset_version=17, dynamo=False,
                          dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}})
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    arrays: dict[str, Any] = {f"w{i}": m.weight.detach().numpy() for i, m in enumerate(linears)}
    arrays.update({f"b{i}": m.bias.detach().numpy() for i, m in enumerate(linears)})
    np.savez(version_dir / "weights.npz", **arrays)  # type: ignore[arg-type]
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "weights_mib": params * 4 / 2**20, "layers": len(linears),
            "in_features": in_features, "out_features": out_features}


def save_mlp_weights(version_dir: str | os.PathLike[str], *, in_features: int = 4, width: int = 8, depth: int = 1,
                     out_features: int = 3, seed: int = 1) -> Path:
    """``weights.npz`` of a random MLP (as ``export_mlp`` writes it, without torch or ONNX): what the python
    model's ``numpy`` engine and ``reference_mlp`` read. Initialised as ``torch.nn.Linear`` is (uniform in
    ±1/sqrt(fan_in)), so activations stay of order one through the layers."""
    version_dir = Path(version_dir)
    version_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sizes = [in_features] + [width] * depth + [out_features]
    arrays: dict[str, Any] = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        bound = 1 / np.sqrt(fan_in)
        arrays[f"w{i}"] = rng.uniform(-bound, bound, (fan_out, fan_in)).astype(np.float32)  # [out, in] as torch
        arrays[f"b{i}"] = rng.uniform(-bound, bound, fan_out).astype(np.float32)
    path = version_dir / "weights.npz"
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


def write_python_model(repo: str | os.PathLike[str], config: Mapping[str, Any], *, sizes: Mapping[str, int],
                       source: str | None = None, seed: int = 1, gpus: int | None = 0) -> Path:
    """A python-backend model folder without torch: ``config.pbtxt`` (validated), ``1/weights.npz`` (random, seeded)
    and ``1/model.py`` (``source``, default the course's model). Give the config ``engine: numpy``. For models the
    lab's checks deploy: written in milliseconds, loaded without importing ONNX Runtime or torch."""
    model_dir = Path(repo) / str(config["name"])
    vdir = model_dir / "1"
    save_mlp_weights(vdir, seed=seed, **sizes)
    write_model_py(vdir, source if source is not None else triton_model.source())
    write_config(model_dir, config, gpus=gpus)
    return model_dir


def write_model_py(version_dir: str | os.PathLike[str], source: str, name: str = "model.py") -> Path:
    """``model.py`` (or another module ``name`` that model.py imports from its folder) with its bytecode compiled
    beside it: a stub that writes the bytecode itself changes the folder, and Triton then fully reloads the model
    on the next ``load_model`` even when nothing else changed."""
    import importlib.util
    import py_compile

    path = Path(version_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    py_compile.compile(str(path), cfile=importlib.util.cache_from_source(str(path)), doraise=True)
    return path


def reference_mlp(version_dir: str | os.PathLike[str], x: Any) -> Any:
    """The exported MLP's output for ``x`` computed with NumPy from ``weights.npz`` (the ground truth)."""
    path = Path(version_dir) / "weights.npz"
    w = _mlp_weights(path, path.stat().st_mtime_ns)
    n = len([k for k in w if k.startswith("w")])
    h = np.asarray(x, dtype=np.float32)
    for i in range(n):
        h = h @ w[f"w{i}"].T + w[f"b{i}"]
        if i < n - 1:
            h = np.maximum(h, 0)
    return h


@functools.lru_cache(maxsize=8)
def _mlp_weights(path: Path, _mtime_ns: int) -> dict[str, np.ndarray]:
    """``weights.npz`` read once per version of the file (checks call ``reference_mlp`` after every answer)."""
    with np.load(path) as w:
        return {k: w[k] for k in w.files}


def mlp_config(
    name: str = "mlp",
    *,
    in_features: int = 64,
    out_features: int = 10,
    max_batch_size: int = 64,
    dynamic_batching: bool | Mapping[str, Any] = False,
    instances: int = 1,
    kind: str = "KIND_CPU",
    engine: str = "auto",
    threads: int = 1,
    version_policy: Mapping[str, Any] | None = None,
    backend: str = "python",
    parameters: Mapping[str, str | float] | None = None,
) -> dict[str, Any]:
    """The lab model's configuration as Python values (what ``config.pbtxt`` says), one knob per argument.

    ``parameters``: more of the model's string parameters (``triton_model``'s added service time, say).

    ``dynamic_batching``: False (off), True (on, Triton's defaults), or a dict such as
    ``{"preferred_batch_size": [8, 16], "max_queue_delay_microseconds": 200}``.
    """
    cfg: dict[str, Any] = {
        "name": name,
        "backend": backend,
        "max_batch_size": max_batch_size,
        "input": [{"name": INPUT_NAME, "data_type": "TYPE_FP32",
                   "dims": [in_features] if max_batch_size > 0 else [-1, in_features]}],
        "output": [{"name": OUTPUT_NAME, "data_type": "TYPE_FP32",
                    "dims": [out_features] if max_batch_size > 0 else [-1, out_features]}],
        "instance_group": [{"kind": kind, "count": instances}],
        "parameters": {"engine": {"string_value": engine}, "threads": {"string_value": str(threads)}},
    }
    for key, value in (parameters or {}).items():
        cfg["parameters"][key] = {"string_value": f"{value:g}" if isinstance(value, float) else str(value)}
    if dynamic_batching:
        cfg["dynamic_batching"] = dict(dynamic_batching) if isinstance(dynamic_batching, Mapping) else {}
    if version_policy:
        cfg["version_policy"] = dict(version_policy)
    return cfg


def write_config(model_dir: str | os.PathLike[str], config: str | Mapping[str, Any] | Any, *,
                 gpus: int | None = None, check: bool = True) -> Path:
    """Validate ``config`` (schema + semantics) and write it as ``<model_dir>/config.pbtxt``; nothing on error."""
    model_dir = Path(model_dir)
    path = model_dir / "config.pbtxt"
    cfg = parse_config(config, where=str(path))
    model_dir.mkdir(parents=True, exist_ok=True)
    if check:
        validate_config(cfg, gpus=gpus, model_dir=model_dir, where=str(path))
    path.write_text(config_text(cfg))
    return path


def build_mlp_model(
    repo: str | os.PathLike[str],
    name: str = "mlp",
    *,
    versions: tuple[int, ...] | list[int] = (1,),
    preset: str | Mapping[str, int] = "cpu",
    gpus: int | None = None,
    **config: Any,
) -> Path:
    """A python-backend model folder: ``config.pbtxt`` (``mlp_config(**config)``) and, per version, ``model.py``,
    ``model.onnx`` and ``weights.npz`` (each version its own seed, so versions differ)."""
    sizes = dict(MLP_PRESETS[preset] if isinstance(preset, str) else preset)
    model_dir = Path(repo) / name
    cfg = mlp_config(name, in_features=sizes["in_features"], out_features=sizes["out_features"], **config)
    for v in versions:
        vdir = model_dir / str(v)
        export_mlp(vdir, seed=v, **sizes)
        write_model_py(vdir, triton_model.source())
    write_config(model_dir, cfg, gpus=gpus)
    validate_model_dir(model_dir, gpus=gpus)
    return model_dir


def ngc_configs(name: str, *, in_features: int = 64, out_features: int = 10, max_batch_size: int = 64,
                preferred: tuple[int, ...] = (16, 32), queue_delay_us: int = 200, gpu: bool = True
                ) -> dict[str, dict[str, Any]]:
    """The same MLP for the NGC server's own backends: ``onnxruntime_onnx`` and ``tensorrt_plan`` configurations."""
    def one(platform: str, suffix: str, kind: str) -> dict[str, Any]:
        return {
            "name": f"{name}_{suffix}",
            "platform": platform,
            "max_batch_size": max_batch_size,
            "input": [{"name": INPUT_NAME, "data_type": "TYPE_FP32", "dims": [in_features]}],
            "output": [{"name": OUTPUT_NAME, "data_type": "TYPE_FP32", "dims": [out_features]}],
            "dynamic_batching": {"preferred_batch_size": list(preferred),
                                 "max_queue_delay_microseconds": queue_delay_us},
            "instance_group": [{"kind": kind, "count": 1}],
        }

    return {"onnx": one("onnxruntime_onnx", "onnx", "KIND_GPU" if gpu else "KIND_CPU"),
            "trt": one("tensorrt_plan", "trt", "KIND_GPU")}


def write_ngc_repository(repo: str | os.PathLike[str], onnx_file: str | os.PathLike[str] | None = None,
                         name: str = "mlp", **kw: Any) -> dict[str, Path]:
    """An NGC-server repository: ``<name>_onnx`` (with ``model.onnx`` when given) and ``<name>_trt`` (config only:
    build ``1/model.plan`` on the serving GPU with ``trtexec``). Validated with the schema; the GPU kinds are
    checked as for a GPU machine, since that is where the NGC server runs them."""
    import shutil

    out = {}
    for key, cfg in ngc_configs(name, **kw).items():
        d = Path(repo) / cfg["name"]
        (d / "1").mkdir(parents=True, exist_ok=True)
        write_config(d, cfg, gpus=1)
        out[key] = d
    if onnx_file is not None:
        shutil.copyfile(onnx_file, out["onnx"] / "1" / "model.onnx")
    return out


TRTEXEC_HINT = ("trtexec --onnx=model.onnx --saveEngine=model.plan --minShapes=INPUT__0:1x64 "
                "--optShapes=INPUT__0:16x64 --maxShapes=INPUT__0:64x64")
