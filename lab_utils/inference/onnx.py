"""Lab 03's ONNX half: export from PyTorch with a dynamic batch, the file's checks and contents, and ONNX Runtime on the
CPU: sessions at each graph optimization level, predictions, parity with PyTorch, and what each level fuses and costs.

Units are in names: ``_ms`` milliseconds, ``_s`` seconds, ``images_per_s`` images per second of wall time. onnxruntime
is imported where a session is made (its annotations under TYPE_CHECKING), so the export half imports without it."""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import re
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import pandas as pd
import torch
from numpy.typing import ArrayLike
from torch import nn
from torch.fx.experimental.optimization import fuse

from lab_utils.inference.compare import agreement
from lab_utils.timing import Timing, benchmark, cpu_cores

if TYPE_CHECKING:
    import onnxruntime

# ONNX Runtime's graph optimization levels, weakest first. "layout" (NCHWc layouts on x86) appeared in
# ONNX Runtime 1.22; ``ort_levels()`` lists the ones this onnxruntime has.
ORT_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",  # constant folding, redundant node removal, Conv+BatchNorm/Mul/Add folding
    "extended": "ORT_ENABLE_EXTENDED",  # operator fusion: Conv+Relu -> FusedConv, Gemm+Relu, GELU, attention...
    "layout": "ORT_ENABLE_LAYOUT",  # layout transforms: NCHW -> NCHWc blocked convolutions
    "all": "ORT_ENABLE_ALL"}

ONNX_OPSET = 18  # the dynamo exporter's own default; TensorRT 10 and 11 parse it
MAX_BATCH = 4096  # upper bound of the exported batch dimension (the engines' profiles choose their own)

# ONNX Runtime graph rewrites that assume a quantized type has no negative values (wrong for FP8)
ORT_FP8_UNSAFE_REWRITES = ("ReluQuantRewrite",)

_ORT_INSTALL = "pip install onnxruntime (or pip install -e '.[lab]')"


# --- ONNX export ----------------------------------------------------------------------------------


class OnnxExportError(RuntimeError):
    """The export failed; ``operator`` names the operator that has no ONNX translation (None if unknown)."""

    def __init__(self, message: str, operator: str | None = None):
        super().__init__(message)
        self.operator = operator


_OP_PATTERNS = (re.compile(r"OpOverload\(op='([\w.:]+)', overload='(\w+)'\)"),  # torch.export-based exporter
                re.compile(r"target=torch\.ops\.([\w.]+)"),
                re.compile(r"Unsupported FX nodes: \{'call_function': \['([\w.:]+)'"),
                re.compile(r"Exporting the operator '?([\w:.]+)'? to ONNX"),  # TorchScript-based exporter
                re.compile(r"(aten::\w+)"))


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def failed_operator(message: str) -> str | None:
    """The operator an exporter error message blames (``aten._linalg_svd.default``), or None."""
    for pattern in _OP_PATTERNS:
        if m := pattern.search(message):
            return ".".join(g for g in m.groups() if g)
    return None


@contextlib.contextmanager
def quiet_exporter() -> Iterator[None]:
    """The exporter's informational warnings (torchvision ops it skips, deprecations) are not the lab's news."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch._export", "torch.export", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def export_onnx(model: nn.Module, path: str | os.PathLike[str], example: torch.Tensor | np.ndarray, *,
                input_name: str = "input", output_name: str = "logits") -> Path:
    """Export ``model`` to ONNX with torch's torch.export-based exporter (``dynamo=True``) and check it.

    The batch dimension is dynamic (``batch``, 1..MAX_BATCH); an ``example`` batch of 1 is repeated to 2
    (torch.export specialises size-1 dimensions). BatchNorms are folded into their convolutions first
    (``torch.fx.experimental.optimization.fuse``, eval-mode arithmetic). The file passes ``onnx.checker``'s full
    check; a failed export raises ``OnnxExportError`` naming the operator."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not hasattr(example, "shape"):
        raise TypeError(f"export_onnx(example=...): pass one input batch as a tensor, got {type(example).__name__}")
    x = torch.as_tensor(example).detach().float().cpu()  # exported on the CPU: the same file from any machine
    original, was_training = model, model.training
    model = _cpu_copy(model)  # in eval mode
    if x.shape[0] < 2:
        x = x.expand(2, *x.shape[1:]).contiguous()
    # BatchNorms folded; a model symbolic tracing cannot follow (data-dependent control flow) is exported as is
    with contextlib.suppress(Exception):
        model = fuse(model, inplace=False)
    dynamic = ({0: torch.export.Dim("batch", min=1, max=MAX_BATCH)},)
    try:
        with quiet_exporter(), torch.no_grad():
            torch.onnx.export(model, (x,), str(path), input_names=[input_name], output_names=[output_name],
                              opset_version=ONNX_OPSET, dynamo=True, verbose=False, dynamic_shapes=dynamic)
    except ImportError as err:  # onnxscript: the exporter imports it when it runs
        raise ImportError(f"ONNX export needs onnx and onnxscript ({err}): pip install onnx onnxscript") from err
    except Exception as err:
        text = _ANSI.sub("", f"{err}\n{err.__cause__ or ''}")
        op = failed_operator(text)
        where = f"operator {op} has no ONNX translation" if op else "the exporter failed"
        said = [re.sub(r"^<class '[\w.]+'>: ", "", ln.strip()) for ln in text.splitlines()
                if "No ONNX function found" in ln or "not supported" in ln]
        said = said or [ln.strip() for ln in text.splitlines() if ln.strip()][:1] or [type(err).__name__]
        raise OnnxExportError(f"ONNX export of {type(original).__name__} failed: {where}. Replace it with supported "
                              "operations, register a translation (torch.onnx's custom_translation_table) or, for "
                              f"TensorRT, a plugin. The exporter said: {said[0]}", op) from err
    finally:
        original.train(was_training)
    onnx.checker.check_model(str(path), full_check=True)  # full_check: types and shapes inferred and checked
    return path


class Whitening(nn.Module):
    """Input (B, n, n) -> the left singular vectors (B, n, n), through ``torch.linalg.svd``, which ONNX cannot
    express: the model that shows what a failed export says."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.svd(x)[0]


unsupported_model = Whitening  # the lab's name for it: ``unsupported_model()`` is the model whose export fails


def onnx_io(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Inputs and outputs of an ONNX file: name, kind, element type and shape (symbolic dims by name)."""
    model = onnx.load(str(path), load_external_data=False)
    rows = []
    for kind, values in (("input", model.graph.input), ("output", model.graph.output)):
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_param or d.dim_value for d in t.shape.dim]
            rows.append({"kind": kind, "name": v.name, "dtype": onnx.TensorProto.DataType.Name(t.elem_type).lower(),
                         "shape": tuple(dims)})
    return pd.DataFrame(rows)


def op_counts(model_or_path: onnx.ModelProto | str | os.PathLike[str]) -> Counter[str]:
    """Operator types of an ONNX graph (a path or a ModelProto) and how often each occurs.

    Operators outside the standard ONNX domain carry it in brackets: ``FusedConv[microsoft]``, and the
    blocked-layout convolutions of ONNX Runtime's layout level ``Conv[nchwc]``."""
    model = (model_or_path if isinstance(model_or_path, onnx.ModelProto)
             else onnx.load(str(model_or_path), load_external_data=False))
    return Counter(n.op_type if n.domain in ("", "ai.onnx") else f"{n.op_type}[{n.domain.split('.')[-1]}]"
                   for n in model.graph.node)


# --- ONNX Runtime ---------------------------------------------------------------------------------


def _onnxruntime() -> Any:
    """The onnxruntime module, imported when a session is made (the export half runs without it)."""
    try:
        import onnxruntime
    except ImportError as err:
        raise ImportError(f"lab 03 runs ONNX files in ONNX Runtime ({err}): {_ORT_INSTALL}") from err
    return onnxruntime


def ort_levels() -> list[str]:
    """The graph optimization levels (keys of ``ORT_LEVELS``) this onnxruntime has, weakest first."""
    ort = _onnxruntime()
    return [k for k, v in ORT_LEVELS.items() if hasattr(ort.GraphOptimizationLevel, v)]


def ort_session(path: str | os.PathLike[str], level: str = "all", threads: int | None = None,
                optimized_path: str | os.PathLike[str] | None = None) -> onnxruntime.InferenceSession:
    """An ONNX Runtime session on the CPU provider at graph optimization ``level``.

    ``threads``: intra-op threads (default: torch's thread count, so both frameworks get the same cores).
    ``optimized_path``: where ONNX Runtime writes the graph it will run (to count what it fused)."""
    ort = _onnxruntime()
    if level not in ORT_LEVELS:
        raise ValueError(f"ort_session(level={level!r}): use one of {list(ORT_LEVELS)}")
    if not hasattr(ort.GraphOptimizationLevel, ORT_LEVELS[level]):
        raise ValueError(f"ort_session(level={level!r}): this onnxruntime {ort.__version__} has no "
                         f"{ORT_LEVELS[level]}; available: {ort_levels()}")
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, ORT_LEVELS[level])
    so.intra_op_num_threads = threads or torch.get_num_threads()
    so.log_severity_level = 3  # errors only: the NCHWc "hardware specific" notice is expected here
    if optimized_path is not None:
        so.optimized_model_filepath = str(optimized_path)
    # ONNX Runtime's ReluQuantRewrite (level "extended" and up) deletes a Relu that feeds a QuantizeLinear,
    # valid only where the quantized type cannot hold negatives; FP8 can, so on an FP8 Q/DQ model it lets
    # negative activations through and the logits go wrong (relative error ~1 instead of ~0.01).
    disabled = list(ORT_FP8_UNSAFE_REWRITES) if level != "disable" and has_fp8_qdq(path) else None
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)


def has_fp8_qdq(path: str | os.PathLike[str]) -> bool:
    """Whether an ONNX file quantizes to an FP8 type (a QuantizeLinear with a float8 zero point)."""
    model = onnx.load(str(path), load_external_data=False)
    fp8 = {t for t in (getattr(onnx.TensorProto, n, None) for n in
                       ("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ")) if t is not None}
    inits = {i.name: i.data_type for i in model.graph.initializer}
    return any(n.op_type == "QuantizeLinear" and len(n.input) > 2 and inits.get(n.input[2]) in fp8
               for n in model.graph.node)


def cpu_threads() -> int:
    """Threads for CPU inference in the lab: half the cores this process may use (at least 1).

    Leaves room for the notebook, the OS and ONNX Runtime's own scheduling; on a busy 2-core machine a
    second spinning OpenMP thread costs far more than it brings."""
    return max(1, cpu_cores() // 2)


_NP_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


def _feed(session: onnxruntime.InferenceSession, x: torch.Tensor | ArrayLike) -> tuple[str, np.ndarray]:
    """(input name, ``x`` as a numpy array of the input's type): cast once, outside any timed loop."""
    inp = session.get_inputs()[0]
    arr = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return inp.name, arr.astype(_NP_TYPES.get(inp.type, np.float32), copy=False)


def ort_predict(session: onnxruntime.InferenceSession, x: torch.Tensor | ArrayLike,
                batch_size: int | None = None) -> np.ndarray:
    """Logits (float32) of ``session`` on ``x`` (numpy or torch, cast to the input's type), in batches of
    ``batch_size`` (all at once when None)."""
    name, arr = _feed(session, x)
    chunks = [arr] if batch_size is None else [arr[i:i + batch_size] for i in range(0, len(arr), batch_size)]
    outs = [session.run(None, {name: c})[0] for c in chunks]
    return np.concatenate(outs).astype(np.float32)


def parity(model: nn.Module, onnx_path: str | os.PathLike[str],
           inputs: Sequence[torch.Tensor | ArrayLike]) -> pd.DataFrame:
    """Largest absolute difference between PyTorch (fp32, CPU) and ONNX Runtime outputs, per input batch.

    Several batch sizes prove the dynamic batch dimension: one export, any batch."""
    session = ort_session(onnx_path, "all")
    rows = []
    cpu_model = _cpu_copy(model)
    for x in inputs:
        xt = torch.as_tensor(x, dtype=torch.float32)
        with torch.no_grad():
            ref = cpu_model(xt).numpy()
        out = ort_predict(session, xt)
        rows.append({"batch": int(xt.shape[0]), "output_shape": tuple(out.shape),
                     "max_abs_diff": float(np.abs(out - ref).max()),
                     "max_abs_output": float(np.abs(ref).max()), "top1_agreement": agreement(out, ref)})
    return pd.DataFrame(rows)


def _cpu_copy(model: nn.Module) -> nn.Module:
    """The model in eval mode, FP32 on the CPU: itself when it already is, else a copy."""
    p = next(model.parameters(), None)
    if p is None or (p.device.type == "cpu" and p.dtype == torch.float32):
        return model.eval()
    return copy.deepcopy(model).float().cpu().eval()


def fusion_table(onnx_path: str | os.PathLike[str], workdir: str | os.PathLike[str], example: ArrayLike,
                 reps: int = 10, warmup: int = 2) -> pd.DataFrame:
    """What each ONNX Runtime optimization level leaves of the graph, and what it costs to run.

    Per level: the number of nodes ONNX Runtime will execute, the fused operators among them (FusedConv,
    NCHWc Conv...), the most common operators, session creation time, and the p50 latency of ``example``
    (a batch) with the course's timing helper."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    x = np.asarray(example, dtype=np.float32)
    rows = []
    for level in ort_levels():
        opt_path = workdir / f"{Path(onnx_path).stem}.ort-{level}.onnx"
        t0 = time.perf_counter()
        session = ort_session(onnx_path, level, optimized_path=opt_path)
        create_s = time.perf_counter() - t0
        counts = op_counts(opt_path)
        opt_path.unlink()  # only counted: a full ResNet-50 would leave 100 MB per level behind
        t = time_ort(session, x, reps, warmup, f"ort-{level}")
        fused = {k: v for k, v in counts.items() if "[" in k}  # ONNX Runtime's own fused and layout operators
        rows.append({"level": level, "nodes": sum(counts.values()),
                     "conv_nodes": sum(v for k, v in counts.items() if k.split("[")[0] in ("Conv", "FusedConv")),
                     "fused": ", ".join(f"{k} {v}" for k, v in sorted(fused.items())),
                     "top_ops": ", ".join(f"{k} {v}" for k, v in counts.most_common(4)), "session_s": create_s,
                     "batch": int(x.shape[0]), "p50_ms": t.median_ms, "images_per_s": x.shape[0] / (t.median_ms / 1e3)})
    df = pd.DataFrame(rows)
    df["speedup_vs_disable"] = df["p50_ms"].iloc[0] / df["p50_ms"]
    return df


def time_ort(session: onnxruntime.InferenceSession, x: torch.Tensor | ArrayLike, reps: int = 10, warmup: int = 2,
             name: str = "onnxruntime") -> Timing:
    """Time ``session.run`` on the batch ``x`` (cast to the input's type once, outside the timed loop); ms."""
    feed = dict([_feed(session, x)])
    return benchmark(functools.partial(session.run, None, feed), reps=reps, warmup=warmup, device="cpu", name=name)
