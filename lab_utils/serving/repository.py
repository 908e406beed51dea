"""Triton model repositories from Python values, validated with Triton's own schema before any server starts.

Each ``config.pbtxt`` is checked by ``lab_utils.serving.model_config`` (schema, then what the schema cannot see;
its names are re-exported here). ``validate_repository`` runs it over a folder laid out as Triton reads it, with
the model files each version needs::

    repo/<model>/config.pbtxt
    repo/<model>/<version>/model.py | model.onnx | model.plan   (version = a positive integer)

Design notes: docs/internals.md#lab_utilsservingrepositorypy
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lab_utils.serving.backend import model as triton_model
from lab_utils.serving.model_config import (  # also the lab's and the tests' triton_repo.* names
    ConfigError,
    check_model_config,
    config_text,
    model_versions,
    nvml_gpu_count,
    parse_config,
    validate_config,
)

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


# --- repository ----------------------------------------------------------------------------------------


def model_file(cfg: Any) -> str | None:
    """The file each version folder must hold for this config (``default_model_filename`` or the backend's)."""
    return cfg.default_model_filename or PLATFORM_FILES.get(cfg.backend or cfg.platform)


def onnx_input_shapes(path: Path) -> dict[str, list[int | str | None]]:
    """Input name -> shape (a string for a named dynamic axis) of an ONNX file, initializers left out."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in m.graph.initializer}
    return {i.name: [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                     for d in i.type.tensor_type.shape.dim] for i in m.graph.input if i.name not in inits}


@dataclass
class ModelEntry:
    name: str
    config: Any  # ModelConfig
    versions: list[int]
    path: Path


def validate_model_dir(model_dir: Path, *, gpus: int | None = None) -> ModelEntry:
    """Check one model folder: config.pbtxt (schema + semantics), version folders and their model files."""
    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.pbtxt"
    if not cfg_path.is_file():
        raise ConfigError([("", f"no config.pbtxt in {model_dir}: every model folder needs one")],
                          model=model_dir.name, where=str(cfg_path))
    cfg = parse_config(cfg_path.read_text(), where=str(cfg_path))
    versions = model_versions(model_dir)
    problems: list[tuple[str, str]] = []
    if not versions:
        problems.append(("", f"no version folder in {model_dir} (e.g. {model_dir.name}/1/)"))
    fname = model_file(cfg)
    served = _served_versions(cfg, versions)
    for v in served:
        if fname and not (model_dir / str(v) / fname).exists():
            have = sorted(p.name for p in (model_dir / str(v)).iterdir())
            problems.append(("default_model_filename" if cfg.default_model_filename else "",
                             f"version {v}: {fname} is missing in {model_dir / str(v)} (it holds "
                             f"{', '.join(have) or 'nothing'}); the {cfg.backend or cfg.platform} "
                             f"backend loads <version>/{fname}"))
    onnx_files = [f for v in served if (f := model_dir / str(v) / "model.onnx").exists()]
    shapes = None
    if onnx_files:
        with contextlib.suppress(Exception):  # an unreadable ONNX file is the server's to report: no shape check
            shapes = onnx_input_shapes(onnx_files[-1])
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
    return {d.name: validate_model_dir(d, gpus=gpus) for d in dirs}


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


def write_ngc_repository(repo: str | os.PathLike[str], onnx_file: str | os.PathLike[str] | None = None
                         ) -> dict[str, Path]:
    """An NGC-server repository of the same MLP for the server's own backends: ``mlp_onnx`` (``onnxruntime_onnx``,
    with ``model.onnx`` when given) and ``mlp_trt`` (``tensorrt_plan``, config only: build ``1/model.plan`` on the
    serving GPU with ``trtexec``). Validated with the schema; the GPU kinds are checked as for a GPU machine, since
    that is where the NGC server runs them."""
    import shutil

    out = {}
    for key, platform in (("onnx", "onnxruntime_onnx"), ("trt", "tensorrt_plan")):
        d = Path(repo) / f"mlp_{key}"
        (d / "1").mkdir(parents=True, exist_ok=True)
        write_config(d, {
            "name": d.name,
            "platform": platform,
            "max_batch_size": 64,
            "input": [{"name": INPUT_NAME, "data_type": "TYPE_FP32", "dims": [64]}],
            "output": [{"name": OUTPUT_NAME, "data_type": "TYPE_FP32", "dims": [10]}],
            "dynamic_batching": {"preferred_batch_size": [16, 32], "max_queue_delay_microseconds": 200},
            "instance_group": [{"kind": "KIND_GPU", "count": 1}],
        }, gpus=1)
        out[key] = d
    if onnx_file is not None:
        shutil.copyfile(onnx_file, out["onnx"] / "1" / "model.onnx")
    return out


TRTEXEC_HINT = ("trtexec --onnx=model.onnx --saveEngine=model.plan --minShapes=INPUT__0:1x64 "
                "--optShapes=INPUT__0:16x64 --maxShapes=INPUT__0:64x64")
