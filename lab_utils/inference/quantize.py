"""Lab 03 precision in the graph, the TensorRT 11 way: ModelOpt AutoCast (FP16/BF16) and explicit
quantization (INT8/FP8 Q/DQ nodes) of ONNX files, calibrated on real inputs, checked in ONNX Runtime.

``autocast`` converts FP32 nodes to FP16/BF16 where their values fit; ``quantize_onnx`` inserts Q/DQ pairs whose
scales come from calibration data. ``modelopt_status`` says whether ModelOpt's ONNX path imports here and why
not; without it the ModelOpt calls raise ``ModelOptMissing`` (an ImportError), and ``skip_line`` is the one line a
lab prints for what it skips.

Design notes: docs/internals.md#lab_utilsinferencequantizepy"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import pandas as pd
from onnx import TensorProto, helper

from lab_utils.course.probe import MODELOPT_INSTALL, MODELOPT_ONNX_NEEDS, tensorrt_runtime_present
from lab_utils.inference.compare import accuracy, logit_error
from lab_utils.inference.onnx import ort_predict, ort_session
from lab_utils.plotting import new_axes, require_columns

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

QUANT_MODES = ("int8", "fp8")
CALIBRATION_METHODS = ("max", "entropy")  # ModelOpt's int8/fp8 calibrators: max (absmax) and entropy (KL)
HIGH_PRECISION = ("fp32", "fp16", "bf16")  # what the nodes left unquantized run in
LOW_PRECISION = ("fp16", "bf16")
FP8_MIN_CAPABILITY = (8, 9)  # Ada (8.9) and Hopper (9.0) and later have FP8 tensor cores


class CalibrationDataError(ValueError):
    """Calibration data that the model cannot take: the message names what was given and what is expected."""


class QuantizationError(RuntimeError):
    """ModelOpt failed; the message carries the tail of what it printed."""


class ModelOptMissing(ImportError):
    """ModelOpt's ONNX path does not import here; the message says why and what to install."""


def modelopt_status() -> tuple[bool, str]:
    """(usable, why): whether ModelOpt's ONNX path (AutoCast and quantization) imports here, and when not, the
    import's failure and the ``pip install`` that fixes it. The first call imports it: a second or two."""
    try:
        import modelopt.onnx.autocast  # noqa: F401
        import modelopt.onnx.quantization  # noqa: F401
    except Exception as err:  # ImportError, or an install whose native library does not load (lief)
        missing = (getattr(err, "name", None) or "").split(".")[0]
        fix = f"pip install {MODELOPT_ONNX_NEEDS[missing]}" if missing in MODELOPT_ONNX_NEEDS else MODELOPT_INSTALL
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return False, f"ModelOpt's ONNX path does not import here ({first}); `{fix}` to get it"
    import modelopt

    return True, f"ModelOpt {getattr(modelopt, '__version__', '?')}"


def skip_line(what: str) -> str:
    """The one line a lab prints where it skips ``what`` for want of ModelOpt: what, why, and how to get it."""
    _, why = modelopt_status()
    return f"Skipped: {what}. {why}."


@contextlib.contextmanager
def quiet_modelopt() -> Iterator[io.StringIO]:
    """Run ModelOpt quietly: its log, ONNX Runtime's calibration progress bars and polygraphy's notices go to the
    yielded buffer; a stub-only ``tensorrt`` package is not taken for the TensorRT runtime. Exceptions pass
    through unchanged (``_modelopt_session`` adds ModelOpt's last messages to them)."""
    ok, why = modelopt_status()
    if not ok:
        raise ModelOptMissing(f"lab_utils.inference.quantize needs NVIDIA ModelOpt's ONNX path: {why}")
    import onnxruntime as ort
    from modelopt.onnx import trt_utils

    saved_flag = trt_utils.TRT_PYTHON_AVAILABLE
    if not tensorrt_runtime_present():  # tensorrt-stubs' namespace package: ModelOpt would call trt.Logger
        trt_utils.TRT_PYTHON_AVAILABLE = False
    loggers = [logging.getLogger(n) for n in ("modelopt", "modelopt.onnx", "modelopt.onnx.autocast")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    ort.set_default_logger_severity(3)
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            yield buf
    finally:
        trt_utils.TRT_PYTHON_AVAILABLE = saved_flag
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
            # ModelOpt re-adds a handler bound to the captured stream each call: drop it
            for h in list(lg.handlers):
                if getattr(h, "stream", None) is buf:
                    lg.removeHandler(h)


@contextlib.contextmanager
def _modelopt_session(what: str) -> Iterator[io.StringIO]:
    """``quiet_modelopt``, and a failure raised as ``QuantizationError`` with the tail of what ModelOpt printed."""
    with quiet_modelopt() as buf:
        try:
            yield buf
        except Exception as err:
            tail = "\n".join(buf.getvalue().strip().splitlines()[-15:])
            raise QuantizationError(f"{what} failed: {type(err).__name__}: {err}"
                                    + (f"\nModelOpt's last messages:\n{tail}" if tail else "")) from err


# --- Inputs and calibration data ------------------------------------------------------------------


# ONNX element type -> numpy type; 16 = bfloat16 has none
_ONNX_TO_NP: dict[int, type[np.floating[Any]] | None] = {1: np.float32, 10: np.float16, 11: np.float64, 16: None}


def onnx_input(path: str | os.PathLike[str]) -> tuple[str, tuple[int | None, ...], type[np.floating[Any]] | None]:
    """(name, shape, numpy type) of the model's single input; symbolic dimensions are None, and so is the type
    of a bfloat16 input (numpy has none)."""
    model = onnx.load(str(path), load_external_data=False)
    init = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in init]
    if len(inputs) != 1:
        raise ValueError(f"{path}: expected one input, found {[i.name for i in inputs]}")
    t = inputs[0].type.tensor_type
    shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
    return inputs[0].name, shape, _ONNX_TO_NP.get(t.elem_type, np.float32)


def check_calibration_data(data: Any, onnx_path: str | os.PathLike[str], min_images: int = 1) -> np.ndarray:
    """``data`` as the array calibration will feed, or ``CalibrationDataError`` naming the expected shape and type.

    Calibration runs the model on these images and records the range of every tensor that gets a Q/DQ pair;
    images of another shape or scale would set scales for inputs the model never sees. So: a numpy array
    (or a torch tensor) with the model's input shape, the batch dimension first, and its dtype exactly
    (no silent casts: float64 pixels usually mean the preprocessing was skipped)."""
    name, shape, dtype = onnx_input(onnx_path)
    dims = ", ".join("N" if d is None else str(d) for d in shape)
    expected = f"({dims}) {np.dtype(dtype).name if dtype is not None else 'bfloat16'}"
    if hasattr(data, "detach"):
        data = data.detach().cpu().numpy()
    if not isinstance(data, np.ndarray):
        raise CalibrationDataError(f"calibration data for input {name!r} must be a numpy array of shape "
                                   f"{expected}, got {type(data).__name__}")
    if data.ndim != len(shape) or any(d is not None and d != g for d, g in zip(shape, data.shape, strict=False)):
        hint = " (a channel axis is missing: x[:, None] adds it)" if data.ndim == len(shape) - 1 else ""
        raise CalibrationDataError(f"calibration data for input {name!r} has shape {data.shape}; expected "
                                   f"{expected}{hint}")
    if dtype is not None and data.dtype != dtype:
        raise CalibrationDataError(f"calibration data for input {name!r} has dtype {data.dtype}; expected "
                                   f"{expected} (convert with .astype(np.{np.dtype(dtype).name}) after the "
                                   "model's own preprocessing)")
    if data.shape[0] < min_images:
        raise CalibrationDataError(f"calibration data for input {name!r} holds {data.shape[0]} images; at least "
                                   f"{min_images} are needed")
    if not np.isfinite(data).all():
        raise CalibrationDataError(f"calibration data for input {name!r} contains NaN or infinite values")
    return data


# --- AutoCast and explicit quantization -----------------------------------------------------------


def autocast(onnx_path: str | os.PathLike[str], out_path: str | os.PathLike[str], precision: str = "fp16",
             keep_io_types: bool = True) -> Path:
    """FP16 (or BF16) mixed precision with ModelOpt AutoCast; nodes whose values would overflow stay FP32.

    ``keep_io_types`` keeps the inputs and outputs FP32, so callers feed the same arrays as before."""
    if precision not in LOW_PRECISION:
        raise ValueError(f"autocast(precision={precision!r}): use one of {LOW_PRECISION}")
    out_path = Path(out_path)
    with _modelopt_session(f"ModelOpt AutoCast to {precision} of {Path(onnx_path).name}"):
        from modelopt.onnx.autocast import convert_to_mixed_precision

        converted = convert_to_mixed_precision(onnx_path=str(onnx_path), low_precision_type=precision,
                                               keep_io_types=keep_io_types, providers=["cpu"])
        onnx.save(converted, str(out_path))
    return out_path


def quantize_onnx(onnx_path: str | os.PathLike[str], out_path: str | os.PathLike[str], calibration_data: Any,
                  mode: str = "int8", method: str | None = None, high_precision: str = "fp32") -> Path:
    """Explicit quantization: Q/DQ pairs in ``mode`` (int8 or fp8) with scales calibrated on ``calibration_data``.

    ``method``: ModelOpt's calibrator (``max`` or ``entropy``; None is ModelOpt's default for the mode).
    ``high_precision``: the type of what stays unquantized (fp32 runs fastest in ONNX Runtime on a CPU; for a
    TensorRT engine fp16 is the usual choice). Calibration runs in ONNX Runtime on the CPU."""
    if mode not in QUANT_MODES:
        raise ValueError(f"quantize_onnx(mode={mode!r}): use one of {QUANT_MODES}")
    if method is not None and method not in CALIBRATION_METHODS:
        raise ValueError(f"quantize_onnx(method={method!r}): use one of {CALIBRATION_METHODS} or None")
    if high_precision not in HIGH_PRECISION:
        raise ValueError(f"quantize_onnx(high_precision={high_precision!r}): use one of {HIGH_PRECISION}")
    data = check_calibration_data(calibration_data, onnx_path)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with _modelopt_session(f"ModelOpt {mode} quantization of {Path(onnx_path).name}"):
        from modelopt.onnx.quantization import quantize

        quantize(str(onnx_path), quantize_mode=mode, calibration_data=data, calibration_method=method,
                 calibration_eps=["cpu"], output_path=str(out_path), high_precision_dtype=high_precision,
                 log_level="ERROR")
    if not out_path.exists():
        raise QuantizationError(f"ModelOpt wrote no {out_path.name}: nothing in the graph was quantizable?")
    return out_path


def qdq_summary(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What quantization put in the graph: Q and DQ node counts, the types of the quantized tensors, and
    which compute nodes (Conv, Gemm, MatMul) read a dequantized input."""
    model = onnx.load(str(path), load_external_data=False)
    nodes = model.graph.node
    dq_out = {o for n in nodes if n.op_type == "DequantizeLinear" for o in n.output}
    compute = [n for n in nodes if n.op_type in ("Conv", "Gemm", "MatMul", "ConvTranspose")]
    quantized = [n for n in compute if any(i in dq_out for i in n.input)]
    types = set()
    inits = {i.name: i for i in model.graph.initializer}
    for n in nodes:
        if n.op_type == "QuantizeLinear" and len(n.input) > 2 and n.input[2] in inits:
            types.add(onnx.TensorProto.DataType.Name(inits[n.input[2]].data_type).lower())
        for i in n.input:  # weights stored already quantized feed a DequantizeLinear directly
            if n.op_type == "DequantizeLinear" and i in inits and inits[i].data_type not in (1, 10, 11, 16):
                types.add(onnx.TensorProto.DataType.Name(inits[i].data_type).lower())
    return {"quantize_nodes": sum(n.op_type == "QuantizeLinear" for n in nodes),
            "dequantize_nodes": sum(n.op_type == "DequantizeLinear" for n in nodes), "quantized_types": sorted(types),
            "compute_nodes": len(compute), "quantized_compute_nodes": [f"{n.op_type} {n.name}" for n in quantized],
            "float_compute_nodes": [f"{n.op_type} {n.name}" for n in compute if n not in quantized]}


def evaluate_onnx(path: str | os.PathLike[str], x: np.ndarray, y: np.ndarray | None = None,
                  reference_logits: np.ndarray | None = None, batch_size: int = 512) -> dict[str, float]:
    """Accuracy (with labels ``y``), and against ``reference_logits``: top-1 agreement, max |diff| and the
    mean |diff| relative to the mean |reference| (ONNX Runtime on the CPU, all optimizations)."""
    logits = ort_predict(ort_session(path, "all"), x, batch_size=batch_size)
    out: dict[str, float] = {}
    if y is not None:
        out["accuracy"] = accuracy(logits, y)
    if reference_logits is not None:
        out.update(logit_error(logits, reference_logits))
        out["max_abs_diff"] = float(np.abs(logits - reference_logits).max())
    return out


def calibration_sweep(onnx_path: str | os.PathLike[str], x_calibration: np.ndarray, x_test: np.ndarray,
                      y_test: np.ndarray, sizes: Sequence[int] = (16, 64, 256, 1000),
                      methods: Sequence[str] = CALIBRATION_METHODS, workdir: str | os.PathLike[str] = ".",
                      mode: str = "int8") -> pd.DataFrame:
    """Quantize with the first n calibration images for each n in ``sizes`` and each calibrator in ``methods``;
    score each model on the test set against the FP32 model.

    Columns: method, calibration_images, accuracy, accuracy_delta_points (against FP32), top1_agreement,
    rel_logit_error (mean |logit difference| / mean |FP32 logit|), quantize_s. The images are taken in the
    order given: shuffle them first (the digits training split already is)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    x_calibration = check_calibration_data(x_calibration, onnx_path)
    if too_many := [n for n in sizes if n > len(x_calibration)]:
        raise ValueError(f"calibration_sweep(sizes=...): {too_many} exceed the {len(x_calibration)} calibration "
                         "images given")
    ref = ort_predict(ort_session(onnx_path, "all"), x_test)
    fp32_acc = accuracy(ref, y_test)
    rows = []
    for method in methods:
        for n in sizes:
            out = workdir / f"{Path(onnx_path).stem}.{mode}-{method}-{n}.onnx"
            t0 = time.perf_counter()
            quantize_onnx(onnx_path, out, x_calibration[:n], mode=mode, method=method)
            seconds = time.perf_counter() - t0
            scores = evaluate_onnx(out, x_test, y_test, ref)
            rows.append({"method": method, "calibration_images": int(n), "accuracy": scores["accuracy"],
                         "accuracy_delta_points": (scores["accuracy"] - fp32_acc) * 100,
                         "top1_agreement": scores["top1_agreement"], "rel_logit_error": scores["rel_logit_error"],
                         "quantize_s": seconds})
    return pd.DataFrame(rows)


def plot_calibration_sweep(df: pd.DataFrame, ax: Axes | None = None, title: str | None = None) -> Figure:
    """Relative logit error (left axis, log) and accuracy change (right axis) against calibration images."""
    require_columns(df, {"method", "calibration_images", "rel_logit_error", "accuracy_delta_points"},
                    "plot_calibration_sweep", "calibration_sweep")
    fig, ax = new_axes(ax, (7.0, 4.0))
    right = ax.twinx()
    for method, group in df.groupby("method", sort=False):
        group = group.sort_values("calibration_images")
        (line,) = ax.plot(group["calibration_images"], group["rel_logit_error"] * 100, marker="o",
                          label=f"{method}: logit error")
        right.plot(group["calibration_images"], group["accuracy_delta_points"], marker="x", linestyle="--",
                   color=line.get_color(), label=f"{method}: accuracy change")
    ax.set(xscale="log", xlabel="calibration images", ylabel="mean |logit error| / mean |FP32 logit|, %")
    right.set_ylabel("accuracy change vs FP32, points")
    right.axhline(0.0, color="gray", linewidth=0.8)
    ax.set_title(title or "INT8 calibration: how many images?")
    ax.grid(True, which="both", alpha=0.3)
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize="small", loc="upper right")
    return fig


# --- FP8 ------------------------------------------------------------------------------------------


def ort_runs_fp8() -> tuple[bool, str]:
    """Whether this onnxruntime runs FP8 (float8e4m3fn) Q/DQ on the CPU: tried on a two-node graph."""
    import onnxruntime as ort

    graph = helper.make_graph([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
                               helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])], "fp8_probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                              [helper.make_tensor("s", TensorProto.FLOAT, [], [1.0]),
                               helper.make_tensor("z", TensorProto.FLOAT8E4M3FN, [], [0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        y = sess.run(None, {"x": np.array([0.5, 1.0, 300.0, -2.0], np.float32)})[0]
    except Exception as err:
        return False, f"onnxruntime {ort.__version__} cannot run FP8 Q/DQ on the CPU ({type(err).__name__})"
    if not np.allclose(y[[0, 1, 3]], [0.5, 1.0, -2.0]):
        return False, f"onnxruntime {ort.__version__} ran FP8 Q/DQ but got {y}"
    return True, f"onnxruntime {ort.__version__} runs FP8 (e4m3) Q/DQ on the CPU (onnx {onnx.__version__})"


def fp8_status(compute_capability: tuple[int, int] | None) -> tuple[bool, str]:
    """Whether to make an FP8 model here, and why: a GPU with FP8 tensor cores (compute capability >= 8.9)
    for the engine to use it, and an onnxruntime that runs FP8 Q/DQ, so its accuracy can be measured."""
    if compute_capability is None:
        return False, "no GPU here: FP8 needs tensor cores of compute capability >= 8.9 (Ada, Hopper, Blackwell)"
    if tuple(compute_capability) < FP8_MIN_CAPABILITY:
        cc = ".".join(map(str, compute_capability))
        return False, f"this GPU is compute capability {cc}: FP8 tensor cores need >= 8.9"
    return ort_runs_fp8()
