"""Triton model configurations from Python values, checked with Triton's own schema and for what it cannot see.

A configuration is written as plain Python values (the field names of Triton's ``ModelConfig`` protobuf, as in
``config.pbtxt``), parsed with ``tritonclient.grpc.model_config_pb2`` (``parse_config``), then checked for what the
schema cannot see (``check_model_config``); ``validate_config`` does both. ``lab_utils.serving.repository`` runs them
over a whole repository folder.

Design notes: docs/internals.md#lab_utilsservingrepositorypy
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PLATFORMS = ("tensorrt_plan", "onnxruntime_onnx", "pytorch_libtorch", "tensorflow_savedmodel",
             "tensorflow_graphdef", "ensemble")
PLATFORM_BACKEND = {"tensorrt_plan": "tensorrt", "onnxruntime_onnx": "onnxruntime", "pytorch_libtorch": "pytorch"}


class ConfigError(ValueError):
    """A model configuration that Triton would refuse (or mis-serve); names the model, the file and the field."""

    def __init__(self, problems: list[tuple[str, str]], model: str = "", where: str = ""):
        self.problems = problems  # [(field, why)]
        self.model, self.where = model, where
        head = f"model {model!r}" if model else "model configuration"
        loc = f" ({where})" if where else ""
        lines = "\n".join(f"  {f}: {why}" if f else f"  {why}" for f, why in problems)
        super().__init__(f"{head}{loc} is invalid:\n{lines}")


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
    return m.group(1).removeprefix("ModelConfig.").removeprefix("inference.ModelConfig.") if m else ""


def config_text(config: str | Mapping[str, Any] | Any) -> str:
    """``config.pbtxt`` text for a config given as values, text or protobuf (schema-checked on the way)."""
    from google.protobuf import text_format

    return text_format.MessageToString(parse_config(config))


# --- semantics: what the schema cannot see --------------------------------------------------------------


def nvml_gpu_count() -> int:
    """GPUs a server started here could use: NVML's count, limited by ``CUDA_VISIBLE_DEVICES``; 0 without a driver."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
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
    if not kind:
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
        p += [("input", f"{t.name!r} is not an input of the model file (it has {sorted(model_shapes)})")
              for t in cfg.input if t.name not in model_shapes]
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
    if gpus is None and any(g.kind == pb.ModelInstanceGroup.KIND_GPU or g.gpus for g in cfg.instance_group):
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
        p += [(f"{f}.gpus", f"GPU {gid} does not exist here ({gpus} GPU(s): 0..{gpus - 1})")
              for gid in g.gpus if gpus and gid >= gpus]
    # versions on disk
    if model_dir is not None:
        versions = model_versions(model_dir)
        if cfg.version_policy.HasField("specific"):
            p += [("version_policy.specific.versions",
                   f"version {v} has no folder {model_dir.name}/{v} (there are {versions or 'none'})")
                  for v in cfg.version_policy.specific.versions if v not in versions]
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


def model_versions(model_dir: Path) -> list[int]:
    """Version folders of a model (positive integers), sorted."""
    return sorted(int(d.name) for d in Path(model_dir).iterdir() if d.is_dir() and d.name.isdigit()
                  and int(d.name) > 0)
