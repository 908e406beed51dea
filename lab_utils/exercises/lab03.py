"""Lab 03 exercises: ONNX export, ONNX Runtime, ModelOpt INT8 and the TensorRT builder run against the real
tools, and the decisions made with their numbers. torch, onnx and the rest are imported when a check runs.

Design notes: docs/internals.md#lab_utilsexerciseslab03py
"""

from __future__ import annotations

import ast
import contextlib
import copy
import functools
import inspect
import io
import re
import sys
import textwrap
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab_utils.exercises.framework import (
    CodeExercise,
    Exercise,
    References,
    Wrong,
    amended,
    choice,
    close_to,
    integer,
    items,
    patched,
    run_student,
    sentence,
)
from lab_utils.inference import compare, trt_check
from lab_utils.procs import temporary_folder
from lab_utils.timing import Timing, benchmark

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6", "q7", "q8",
    "ONNX_OPSET", "EXPORT_MIN_OPSET", "EXPORT_BATCHES", "ORT_BATCH", "ORT_LEVELS",
    "PRECISION_CANDIDATES", "PRECISION_BUDGET_POINTS", "PRECISION_CHOICES",
    "CALIBRATION_GPU_MIN", "IMAGES_PER_DAY", "RETRAIN_DAYS", "FP16_IMAGES_PER_S",
    "PROFILE", "REQUESTS",
    "LATENCY_P50_MS", "LATENCY_P95_MS", "SLO_P95_MS", "QUEUE_DELAY_MS",
]

ONNX_OPSET = 18  # the course's opset (lab_utils.inference.onnx.ONNX_OPSET): what the exercise asks for
EXPORT_MIN_OPSET = 18  # the oldest the torch.export-based exporter writes natively; older goes through a converter
EXPORT_BATCHES = (1, 7)  # the batch sizes the export check runs in ONNX Runtime
ORT_BATCH = 16  # the batch the session check runs and times
# ONNX Runtime's graph optimization levels by the lab's names (lab_utils.inference.onnx.ORT_LEVELS)
ORT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
              "all": "ORT_ENABLE_ALL"}

_FIXTURE_EPOCHS = 3  # the digits CNN the code checks use: the lab's quick-mode model, trained once per process
_EXPORT_TOLERANCE = 1e-4  # |ONNX Runtime - PyTorch|, FP32 on the CPU
_TRT_TOLERANCE = 5e-2  # an FP32 engine may run its convolutions in TF32
_ACCURACY_SLACK = 0.02  # INT8 may lose up to 2 points (7 of 357 test images) against FP32


# --------------------------------------------------------------------------------------------------
# What the code checks run on


@dataclass(frozen=True)
class _Digits:
    """The digits CNN as a self-contained FP32 ONNX file (bytes), the data, and ONNX Runtime's FP32 logits on the
    test set. Kept in memory: a check writes the file into its own temporary folder and removes it after."""

    onnx_bytes: bytes
    x_train: Any  # (1440, 1, 8, 8) float32
    x_test: Any  # (357, 1, 8, 8) float32
    y_test: Any  # (357,) int64
    logits: Any  # (357, 10) float32

    def write(self, folder: Path) -> Path:
        path = folder / "digits.onnx"
        path.write_bytes(self.onnx_bytes)
        return path


@functools.lru_cache(maxsize=1)
def _digits() -> _Digits:
    """Trained and exported once per process (the lab's own quick-mode model: shared with the lab)."""
    import onnx as onnx_lib
    import torch

    from lab_utils import models  # lazy: pulls torch
    from lab_utils.inference import model_zoo, onnx  # lazy: pulls torch and onnx

    model, _ = model_zoo.trained_digits(_FIXTURE_EPOCHS)
    data = models.digits_arrays()
    with temporary_folder("lab03-digits") as tmp:
        path = onnx.export_onnx(model, tmp / "digits.onnx", torch.from_numpy(data["x_test"][:2]))
        proto = onnx_lib.load(str(path))  # with its external data: one self-contained file
        logits = onnx.ort_predict(onnx.ort_session(path), data["x_test"])
    return _Digits(proto.SerializeToString(), data["x_train"], data["x_test"], data["y_test"], logits)


def _calls(fn: Callable[..., Any], name: str) -> list[ast.Call]:
    """The calls in ``fn``'s source of a function or method called ``name`` (``InferenceSession``); none when its
    source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return []
    return [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == name) or getattr(node.func, "attr", None) == name)]


# --------------------------------------------------------------------------------------------------
# 03.1 the export


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RANDOM_OPS = {"RandomUniformLike", "RandomUniform", "RandomNormal", "RandomNormalLike", "Bernoulli", "Multinomial"}


def _grade_export(fn: Any) -> str:
    import numpy as np
    import onnx as onnx_lib
    import onnxruntime as ort
    import torch

    from lab_utils.inference import model_zoo  # lazy: pulls torch
    from lab_utils.inference import onnx as lab_onnx  # lazy: pulls torch and onnx

    model = model_zoo.export_check_model()  # in train mode, as at the end of a training loop
    example = torch.from_numpy(model_zoo.random_images(4, (1, 8, 8), seed=3))
    with temporary_folder("lab03-export") as folder:
        path = folder / "model.onnx"
        # The exporter's progress lines and notices (torchvision ops it skips) are not the news; errors are.
        # the exporter colours its messages for a terminal
        with amended(lambda m: _ANSI.sub("", m)), lab_onnx.quiet_exporter(), contextlib.redirect_stdout(io.StringIO()):
            returned = run_student(fn, model, path, example, call="export_dynamic(model, path, example)", timeout_s=300)
        left_in_training = model.training
        if not path.exists():
            program = " It returned an ONNXProgram: torch.onnx.export saves only when given the file." \
                if type(returned).__name__ == "ONNXProgram" else ""
            raise Wrong(f"export_dynamic(model, path, example) wrote no file at `path`: pass `path` to "
                        f"torch.onnx.export (its third argument).{program}")
        proto = onnx_lib.load(str(path), load_external_data=False)
        opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
        if opset is None or opset < EXPORT_MIN_OPSET:
            raise Wrong(f"the file is opset {opset}: older tutorials' opset_version=11 or 13 (the TorchScript "
                        f"exporter). Export at opset {ONNX_OPSET} or newer: ModelOpt converts older graphs to opset "
                        "19 for its Q/DQ scales, and the conversion can fail; the torch.export-based exporter "
                        f"(dynamo=True) writes {EXPORT_MIN_OPSET} and newer natively.")
        inputs = [i for i in proto.graph.input if i.name not in {t.name for t in proto.graph.initializer}]
        dims = [d.dim_param or d.dim_value for d in inputs[0].type.tensor_type.shape.dim]
        if not isinstance(dims[0], str) or not dims[0]:
            raise Wrong(f"the input's shape is {tuple(dims)}: the batch is fixed at {dims[0]}, so ONNX Runtime and "
                        "TensorRT refuse any other batch. Mark dimension 0 dynamic: dynamic_shapes=({0: "
                        "torch.export.Dim('batch')},) (or dynamic_axes={'input': {0: 'batch'}}).")
        ops = {n.op_type for n in proto.graph.node}
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        reference = copy.deepcopy(model).eval()
        worst = 0.0
        for batch in EXPORT_BATCHES:
            x = model_zoo.random_images(batch, (1, 8, 8), seed=10 + batch)
            try:
                out = session.run(None, {name: x})[0]
            except Exception as err:
                raise Wrong(f"ONNX Runtime could not run your file at batch {batch}: "
                            f"{str(err).strip().splitlines()[0]}") from None
            with torch.no_grad():
                ref = reference(torch.from_numpy(x)).numpy()
            if out.shape != ref.shape:
                raise Wrong(f"at batch {batch} the output has shape {out.shape}; PyTorch's is {ref.shape}")
            diff = float(np.abs(out - ref).max())
            worst = max(worst, diff)
            if diff > _EXPORT_TOLERANCE:
                random = sorted(ops & _RANDOM_OPS)
                if left_in_training:
                    raise Wrong(
                        f"at batch {batch} ONNX Runtime differs from the model in eval mode by {diff:.3g}: the model "
                        "was exported in train mode (model.training is still True), so its training-only behaviour "
                        "went into the graph" + (f" ({', '.join(random)}: random numbers at every run)" if random
                                                 else "") + ". Call model.eval() before exporting.")
                raise Wrong(f"at batch {batch} ONNX Runtime's output differs from PyTorch's (eval mode) by {diff:.3g}; "
                            f"FP32 exports agree within {_EXPORT_TOLERANCE:g}")
    return (f"ONNX Runtime ran batch {' and '.join(map(str, EXPORT_BATCHES))} like PyTorch (max |difference| "
            f"{worst:.1e}); opset {opset}, input {tuple(dims)}.")


q1 = CodeExercise(
    name="03.1 export with a dynamic batch", var="export_dynamic", grade=_grade_export,
    references=References("call torch.onnx.export yourself", "lab_utils.inference.onnx.export_onnx"),
    signature="export_dynamic(model, path, example) -> None",
    hints=[
        "Three things make an export servable: the model in inference mode (model.eval()), the batch dimension "
        "left free, and an opset the tools downstream read (ex.ONNX_OPSET).",
        "torch.onnx.export(model, (example,), path, dynamo=True, opset_version=ex.ONNX_OPSET, "
        "input_names=['input'], output_names=['logits'], dynamic_shapes=...). dynamic_shapes holds one entry per "
        "input: a dict {dimension: torch.export.Dim(...)}.",
        "model.eval() first. For the one input, dynamic_shapes is a tuple of one dict that names dimension 0 a "
        "torch.export.Dim called 'batch', with min=1 and max=4096; pass the path as a str.",
    ],
    solution_text=(
        "def export_dynamic(model, path, example):\n"
        "    model.eval()  # inference behaviour: no dropout, no stochastic depth, batch norm's running statistics\n"
        "    batch = torch.export.Dim('batch', min=1, max=4096)\n"
        "    torch.onnx.export(model, (example,), str(path), dynamo=True, opset_version=ex.ONNX_OPSET,\n"
        "                      input_names=['input'], output_names=['logits'], dynamic_shapes=({0: batch},))\n"
        "# In train mode the torch.export-based exporter traces the training branch: random numbers in the graph.\n"
        "# Without dynamic_shapes the file accepts only the example's batch size."
    ),
)


# --------------------------------------------------------------------------------------------------
# 03.2 an ONNX Runtime session, timed


def _grade_ort(fn: Any) -> str:
    fx = _digits()
    x = fx.x_test[:ORT_BATCH]  # small: a run takes well under a session's creation, so timing one shows
    for node in _calls(fn, "InferenceSession"):
        if len(node.args) < 3 and not any(k.arg == "providers" for k in node.keywords):
            raise Wrong("InferenceSession(...) is created without providers=: it works with the CPU-only "
                        "onnxruntime, but onnxruntime-gpu refuses it (since 1.9 an ONNX Runtime with several "
                        "execution providers must be told which to use, in order of preference). Pass "
                        "providers=['CPUExecutionProvider'] (or ['CUDAExecutionProvider', 'CPUExecutionProvider']).")
    with temporary_folder("lab03-session") as folder:
        medians = _ort_levels(fn, fx, fx.write(folder), x)
    return (f"p50 {medians['disable']:.3f} ms at 'disable', {medians['all']:.3f} ms at 'all' for {len(x)} images "
            "(your timing, within 3x of the check's own).")


def _ort_levels(fn: Any, fx: _Digits, onnx_path: Path, x: Any) -> dict[str, float]:
    import numpy as np
    import onnxruntime as ort

    medians: dict[str, float] = {}
    for level in ("disable", "all"):
        call = f"ort_timed(onnx_path, x, {level!r})"
        session, timing = items(run_student(fn, str(onnx_path), x, level, call=call, timeout_s=120), 2, call,
                                "(session, timing)")
        if not isinstance(session, ort.InferenceSession):
            raise Wrong(f"{call} returned a {type(session).__name__} as the session; expected an "
                        "onnxruntime.InferenceSession")
        if not isinstance(timing, Timing):
            raise Wrong(f"{call} returned a {type(timing).__name__} as the timing; expected the Timing that the "
                        "lab-01 timer returns: benchmark(fn, reps=..., warmup=..., device='cpu')")
        want = getattr(ort.GraphOptimizationLevel, ORT_LEVELS[level])
        got = session.get_session_options().graph_optimization_level
        if got != want:
            default = got == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            raise Wrong(f"{call}: the session runs at {got.name}, not {want.name}"
                        + (": that is ONNX Runtime's default, as if your SessionOptions never reached the session "
                           "(pass them: InferenceSession(path, sess_options, providers=...))" if default else ""))
        name = session.get_inputs()[0].name
        out = session.run(None, {name: x})[0]
        ref_logits = fx.logits[:ORT_BATCH]
        if out.shape != ref_logits.shape or float(np.abs(out - ref_logits).max()) > _EXPORT_TOLERANCE:
            raise Wrong(f"{call}: the session's outputs are not the digits model's (is it the file at onnx_path?)")
        if timing.warmup < 1:
            raise Wrong(f"{call}: the timing has no warm-up: the first runs pay ONNX Runtime's one-time allocations "
                        "and thread start-up. Pass warmup=2 or more.")
        if timing.device != "cpu":
            raise Wrong(f"{call}: timed with device={timing.device!r}: CUDA events on torch's stream do not see ONNX "
                        "Runtime's work (on the CPU, or on its own CUDA stream); session.run returns when its outputs "
                        "are ready, so the host clock times it: device='cpu'.")
        bench = functools.partial(benchmark, functools.partial(session.run, None, {name: x}), warmup=2, device="cpu",
                                  reps=max(5, min(timing.reps, 20)), name="reference")  # the check's own timing
        refs = [bench().min_ms]  # measured again only while yours looks too fast: a slow machine moment
        while len(refs) < 3 and timing.min_ms < min(refs) / 3:
            refs.append(bench().min_ms)
        fastest = min(refs)
        if timing.min_ms < fastest / 3:
            raise Wrong(f"{call}: your timing says {timing.min_ms:.3f} ms per run at its fastest, "
                        f"{fastest / timing.min_ms:.0f}x less than session.run takes at its fastest "
                        f"({fastest:.3f} ms): does the timed function call session.run?")
        if timing.min_ms > 3 * fastest:
            raise Wrong(f"{call}: your timing says {timing.min_ms:.3f} ms per run at its fastest, "
                        f"{timing.min_ms / fastest:.0f}x what session.run takes ({fastest:.3f} ms): time only "
                        "session.run, with the session made and the input prepared before the timed function")
        medians[level] = timing.median_ms
    return medians


q2 = CodeExercise(
    name="03.2 an ONNX Runtime session, timed", var="ort_timed", grade=_grade_ort,
    references=References("build the SessionOptions and the session, and time session.run, yourself",
                           "lab_utils.inference.onnx.ort_session", "lab_utils.inference.onnx.time_ort"),
    signature="ort_timed(onnx_path, x, level) -> (session, timing)",
    hints=[
        "Options go in an ort.SessionOptions: graph_optimization_level (the names are in ex.ORT_LEVELS) and "
        "intra_op_num_threads; the session takes them and the providers: "
        "ort.InferenceSession(path, so, providers=['CPUExecutionProvider']).",
        "Time only session.run: build the feed {session.get_inputs()[0].name: x} once, then, with the lab-01 timer "
        "(from lab_utils.timing import benchmark): benchmark(lambda: session.run(None, feed), reps=20, warmup=3, "
        "device='cpu').",
        "Put together: the options with their level looked up by name (getattr on ort.GraphOptimizationLevel with "
        "ex.ORT_LEVELS[level]), the session on the CPU provider (the path as a str), the feed built once; return "
        "the session and what benchmark measured, as a pair.",
    ],
    solution_text=(
        "def ort_timed(onnx_path, x, level):\n"
        "    from lab_utils.timing import benchmark  # the lab-01 timer\n"
        "    so = ort.SessionOptions()\n"
        "    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, ex.ORT_LEVELS[level])\n"
        "    so.intra_op_num_threads = onnx.cpu_threads()\n"
        "    session = ort.InferenceSession(str(onnx_path), so, providers=['CPUExecutionProvider'])\n"
        "    feed = {session.get_inputs()[0].name: x}  # built once, outside the timed function\n"
        "    return session, benchmark(lambda: session.run(None, feed), reps=20, warmup=3, device='cpu')\n"
        "# A session made without its SessionOptions runs at ORT_ENABLE_ALL whatever you set; onnxruntime-gpu\n"
        "# refuses a session without providers=."
    ),
)


# --------------------------------------------------------------------------------------------------
# 03.3 ModelOpt's INT8 quantize call


def _calibration_array(data: Any, onnx_path: Path) -> Any:
    """The array ModelOpt would calibrate on, or ``Wrong`` saying what is wrong with it."""
    import numpy as np

    from lab_utils.inference import quantize as q  # lazy: pulls torch and onnx

    if data is None:
        raise Wrong("quantize(...) got no calibration_data: ModelOpt then calibrates on random inputs, and the "
                    "scales fit noise, not your images. Pass real, preprocessed images.")
    if isinstance(data, dict):
        if len(data) != 1:
            raise Wrong(f"calibration_data has {len(data)} entries; the model has one input")
        data = next(iter(data.values()))
    if hasattr(data, "detach"):
        raise Wrong("calibration_data is a torch tensor; ModelOpt takes a numpy array (tensor.numpy(), or the "
                    "numpy images themselves)")
    try:
        arr = q.check_calibration_data(data, onnx_path)
    except q.CalibrationDataError as err:
        raise Wrong(str(err)) from None
    if float(np.std(arr)) == 0.0:
        raise Wrong("the calibration images are all the same value: calibration records each tensor's range on "
                    "them, so every scale would come out wrong. Use real training images.")
    return arr


@contextlib.contextmanager
def _checked_quantize(fn: Any, seen: dict[str, Any]) -> Iterator[None]:
    """While the student's function runs, ModelOpt's ``quantize`` first checks its calibration data (by whatever
    name the student reaches it: the module attribute, or a name their cell imported)."""
    import modelopt.onnx.quantization as mq

    original = mq.quantize

    def checked(onnx_path: Any, *args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(original).bind_partial(onnx_path, *args, **kwargs)
        arr = _calibration_array(bound.arguments.get("calibration_data"), Path(str(onnx_path)))
        seen.update(calls=seen.get("calls", 0) + 1, images=int(arr.shape[0]),
                    mode=bound.arguments.get("quantize_mode", "int8"))
        return original(onnx_path, *args, **kwargs)

    submodule = sys.modules.get("modelopt.onnx.quantization.quantize")
    owners = [mq] + ([submodule] if submodule is not None and getattr(submodule, "quantize", None) is original else [])
    glb = getattr(fn, "__globals__", {})
    names = [k for k, v in glb.items() if v is original]
    with patched(*[(o, "quantize", checked) for o in owners], *[(glb, k, checked) for k in names]):
        yield


def _modelopt_missing() -> str | None:
    """Why ModelOpt's quantize cannot run here (the check is then *not applicable*), or None."""
    from lab_utils.inference import quantize as q  # lazy: pulls torch and onnx

    ok, why = q.modelopt_status()
    return None if ok else f"{why}, so this check cannot run here."


def _grade_quantize(fn: Any) -> str:
    from lab_utils.inference import quantize as q  # lazy: pulls torch and onnx

    fx = _digits()
    with temporary_folder("lab03-quantize") as folder:
        src = fx.write(folder)
        out = folder / "digits.int8.onnx"
        seen: dict[str, Any] = {}
        with _checked_quantize(fn, seen), q.quiet_modelopt():
            run_student(fn, src, out, fx.x_train, call="quantize_int8(onnx_path, out_path, x_train)",
                        timeout_s=300)
        if not seen.get("calls"):
            raise Wrong("quantize_int8 never called ModelOpt's quantize (modelopt.onnx.quantization.quantize)")
        if not out.exists():
            elsewhere = sorted(p.name for p in folder.glob("*.onnx") if p.name != src.name)
            raise Wrong("no file at out_path: pass output_path=str(out_path) to quantize"
                        + (f" (ModelOpt wrote {elsewhere[0]} next to the input instead)" if elsewhere else ""))
        summary = q.qdq_summary(out)
        qdq = summary["quantize_nodes"] + summary["dequantize_nodes"]
        if not qdq:
            raise Wrong("the file at out_path has no QuantizeLinear/DequantizeLinear nodes: nothing was quantized")
        if "int8" not in summary["quantized_types"]:
            raise Wrong(f"the Q/DQ nodes quantize to {', '.join(summary['quantized_types'])}, not int8: pass "
                        f"quantize_mode='int8' (you asked for {seen.get('mode')!r})")
        scores = q.evaluate_onnx(out, fx.x_test, fx.y_test, fx.logits)
        fp32 = compare.accuracy(fx.logits, fx.y_test)
        n = len(fx.y_test)
        if scores["accuracy"] < fp32 - _ACCURACY_SLACK:
            raise Wrong(f"accuracy {scores['accuracy']:.4f} against FP32's {fp32:.4f}: "
                        f"{round((fp32 - scores['accuracy']) * n)} of {n} test images lost. Calibrate on real "
                        "training images, preprocessed as in service, a few hundred of them.")
    quantized = len(summary["quantized_compute_nodes"])
    delta = round((scores["accuracy"] - fp32) * n)
    return (f"{qdq} Q/DQ nodes, {quantized} of {summary['compute_nodes']} Conv/Gemm layers in INT8, calibrated on "
            f"{seen['images']} images; accuracy {scores['accuracy']:.4f} vs FP32 {fp32:.4f} ({delta:+d} of {n} "
            "images).")


q3 = CodeExercise(
    name="03.3 INT8 with ModelOpt", var="quantize_int8", grade=_grade_quantize,
    references=References("call ModelOpt's quantize yourself", "lab_utils.inference.quantize.quantize_onnx"),
    signature="quantize_int8(onnx_path, out_path, x_train) -> None", applicable=_modelopt_missing,
    hints=[
        "modelopt.onnx.quantization.quantize(onnx_path, quantize_mode=..., calibration_data=..., "
        "output_path=...) writes a new ONNX file with Q/DQ pairs; calibration_data is a numpy array shaped like "
        "the model's input, batch first, float32.",
        "x_train is already preprocessed (N, 1, 8, 8) float32: a few hundred of its images make a calibration "
        "set. Calibration runs in ONNX Runtime: calibration_eps=['cpu'] keeps it on the CPU.",
        "One call: quantize_mode 'int8', calibration_method 'max', the first 512 images of x_train as the "
        "calibration data, calibration_eps=['cpu'], and out_path as the output (paths as str).",
    ],
    solution_text=(
        "def quantize_int8(onnx_path, out_path, x_train):\n"
        "    from modelopt.onnx.quantization import quantize\n"
        "    calibration = x_train[:512]  # (512, 1, 8, 8) float32: real images, preprocessed as in service\n"
        "    quantize(str(onnx_path), quantize_mode='int8', calibration_data=calibration, calibration_method='max',\n"
        "             calibration_eps=['cpu'], output_path=str(out_path))\n"
        "# Without calibration_data ModelOpt calibrates on random numbers; images of another shape or type\n"
        "# (NHWC, float64, the channel axis dropped) are refused before calibration."
    ),
)


# --------------------------------------------------------------------------------------------------
# 03.4 an accuracy budget -> the precision

# Measured on a 50,000-image validation set for one model: accuracy change against FP32 (points; one image is
# 0.002 points) and engine throughput.
PRECISION_CANDIDATES = {
    "fp32": {"accuracy_delta_points": 0.0, "images_per_s": 1500},
    "fp16": {"accuracy_delta_points": -0.02, "images_per_s": 4200},
    "int8": {"accuracy_delta_points": -0.7, "images_per_s": 6900},
    "fp8": {"accuracy_delta_points": -1.6, "images_per_s": 7300},
}
PRECISION_BUDGET_POINTS = 1.0  # the product accepts at most 1 point of accuracy lost against FP32
PRECISION_CHOICES = tuple(PRECISION_CANDIDATES)

_PRECISION_TABLE = {k: dict(v) for k, v in PRECISION_CANDIDATES.items()}  # the grader's own copy
_PRECISION_BEST = max((k for k, v in _PRECISION_TABLE.items()
                       if -v["accuracy_delta_points"] <= PRECISION_BUDGET_POINTS),
                      key=lambda k: _PRECISION_TABLE[k]["images_per_s"])  # int8


def _grade_precision(value: Any) -> None:
    got = choice(value, PRECISION_CHOICES)
    if got is None:
        raise Wrong(f"answer with one of {list(PRECISION_CHOICES)}, as a string")
    if got == _PRECISION_BEST:
        return
    row = _PRECISION_TABLE[got]
    if -row["accuracy_delta_points"] > PRECISION_BUDGET_POINTS:
        raise Wrong(f"{got} is the fastest, but it loses {-row['accuracy_delta_points']} points, more than the "
                    f"{PRECISION_BUDGET_POINTS} point budget.")
    raise Wrong(f"{got} is within the budget, but another precision is too and runs faster "
                f"({row['images_per_s']} images/s here): take the fastest one that fits.")


q4 = Exercise(
    name="03.4 pick the precision for an accuracy budget", var="precision", grade=_grade_precision,
    hints=[
        "First drop every precision that loses more than PRECISION_BUDGET_POINTS of accuracy; then compare speed.",
        "Of fp32, fp16 and int8 (within budget), which has the highest images_per_s?",
    ],
    solution_text=(
        "budget = PRECISION_BUDGET_POINTS\n"
        "ok = {p: r for p, r in PRECISION_CANDIDATES.items() if -r['accuracy_delta_points'] <= budget}\n"
        "precision = max(ok, key=lambda p: ok[p]['images_per_s'])   # 'int8'\n"
        "# fp8 would be faster still but loses 1.6 points (800 of 50,000 images). Re-measure after every\n"
        "# retraining: the loss of a quantized model depends on the model and the calibration data."
    ),
)

# --------------------------------------------------------------------------------------------------
# 03.5 the speedup that pays for calibration

CALIBRATION_GPU_MIN = 30.0  # GPU-minutes: calibrate, build the INT8 engine, validate accuracy
IMAGES_PER_DAY = 2_000_000
RETRAIN_DAYS = 14  # the model is retrained (and recalibrated) every two weeks
FP16_IMAGES_PER_S = 5000.0  # the FP16 engine's throughput on the same GPU

_SERVE_MIN = IMAGES_PER_DAY * RETRAIN_DAYS / FP16_IMAGES_PER_S / 60  # 93.3 GPU-minutes at FP16
_SPEEDUP = 1 / (1 - CALIBRATION_GPU_MIN / _SERVE_MIN)  # 1.4737

q5 = Exercise(
    name="03.5 the speedup that pays for calibration", var="breakeven_speedup",
    grade=close_to(
        _SPEEDUP, rel=0.01, reveal=False,
        why="INT8 saves T·(1 - 1/s) GPU-minutes over the model's life, T being the FP16 serving time; it must "
            "save at least the calibration's cost.",
        slips={
            (1 + CALIBRATION_GPU_MIN / _SERVE_MIN) / _SPEEDUP:
                "that is 1 + C/T. A speedup s cuts the serving time to T/s, so the saving is T - T/s = T(1 - 1/s); "
                "solve T(1 - 1/s) = C for s.",
            1 / (1 - CALIBRATION_GPU_MIN / (_SERVE_MIN * 60)) / _SPEEDUP:
                "the serving time looks like seconds while the calibration cost is in minutes: put both in "
                "GPU-minutes (or both in seconds).",
        },
    ),
    hints=[
        "Serving at FP16 takes T = images / throughput of GPU time over the model's life (RETRAIN_DAYS days). INT8 "
        "at speedup s takes T / s.",
        "Break-even: T - T/s = C (the calibration's GPU-minutes), so s = 1 / (1 - C/T). Keep C and T in the "
        "same unit.",
        "T: the images of RETRAIN_DAYS days over FP16_IMAGES_PER_S is seconds of GPU time; divide by 60 for "
        "minutes, the unit of CALIBRATION_GPU_MIN. Then hint 2's break-even formula.",
    ],
    solution_text=(
        "T = IMAGES_PER_DAY * RETRAIN_DAYS / FP16_IMAGES_PER_S / 60     # 93.3 GPU-minutes at FP16\n"
        "breakeven_speedup = 1 / (1 - CALIBRATION_GPU_MIN / T)          # 1.47\n"
        "# Below a 1.47x INT8 speedup the calibration costs more GPU time than it saves in two weeks; with\n"
        "# ten times the traffic the break-even drops to 1.03x. (Engineer time is extra.)"
    ),
)


# --------------------------------------------------------------------------------------------------
# 03.6 the TensorRT builder


def _static_trt_findings(src: trt_check.FunctionSource, where: str) -> None:
    removed = trt_check.removed_calls(src.source)
    if removed:
        f = removed[0]
        raise Wrong(f"line {src.first_line + f.line - 1}: {f.message}{where}")
    missing = trt_check.missing_steps(src.source)
    if missing:
        s = missing[0]
        more = f" (and {len(missing) - 1} more step{'s' if len(missing) > 2 else ''})" if len(missing) > 1 else ""
        raise Wrong(f"a step is missing from your function: {s.what}{more}. {sentence(s.how)}{where}")


def _run_trt(fn: Any, why: str) -> str:
    import numpy as np
    import torch

    fx = _digits()
    batches = [torch.from_numpy(fx.x_test[:b]).cuda() for b in EXPORT_BATCHES]
    call = "trt_build_and_run(onnx_path, [batch of 1, batch of 7])"
    with temporary_folder("lab03-builder") as folder:
        outputs = run_student(fn, str(fx.write(folder)), batches, call=call, timeout_s=600)
    outputs = items(outputs, len(batches), call, f"a list of {len(batches)} outputs, one per batch")
    worst = 0.0
    for b, out in zip(EXPORT_BATCHES, outputs, strict=True):
        arr = out.detach().float().cpu().numpy() if hasattr(out, "detach") else np.asarray(out, dtype=np.float32)
        ref = fx.logits[:b]
        if arr.shape != ref.shape:
            raise Wrong(f"{call}: the output for batch {b} has shape {arr.shape}, expected {ref.shape}: was the "
                        "input shape set for this batch (context.set_input_shape) before the output was sized?")
        diff = float(np.abs(arr - ref).max())
        worst = max(worst, diff)
        if diff > _TRT_TOLERANCE:
            raise Wrong(f"{call}: the engine's output for batch {b} differs from ONNX Runtime's by {diff:.3g}: were "
                        "the tensor addresses set for this batch's input and output, and did you wait for the stream "
                        "(stream.synchronize()) before reading the output?")
    return (f"built and run here ({why}): batch 1 and 7 agree with ONNX Runtime within {worst:.1e}.")


def _grade_trt(fn: Any) -> str:
    from lab_utils.inference import tensorrt as trt_engine  # lazy: pulls torch

    ok, why = trt_engine.tensorrt_status()
    try:
        src: trt_check.FunctionSource | None = trt_check.function_source(fn)
    except (OSError, TypeError):
        src = None
    where = "" if ok else " (your function was read and type-checked, not run: TensorRT cannot run here)"
    if src is not None:
        _static_trt_findings(src, where)
    if ok:
        return _run_trt(fn, why)
    if src is None:
        raise Wrong("the check could not read your function's source (was it made with exec or in a console?): "
                    "define it with def in a notebook cell")
    try:
        report = trt_check.type_check_source(src.checked)
    except trt_check.TypeCheckUnavailable as err:
        raise Wrong(f"TensorRT cannot run here ({why}) and the type check could not run either: {err}") from None
    if not report.ok:
        first = report.errors[0]
        more = f" ({len(report.errors) - 1} more)" if len(report.errors) > 1 else ""
        raise Wrong(f"line {src.cell_line(first.line)}: {first.message}{more}: TensorRT's API (tensorrt-stubs "
                    f"{report.stubs}, mypy {report.mypy}) has no such call{where}")
    return (f"read and type-checked, not run: TensorRT cannot run here ({why}). No removed call, every step "
            f"present, mypy {report.mypy} finds no error against tensorrt-stubs {report.stubs}. Where TensorRT "
            "imports (an NGC container), this check builds and runs your engine.")


q6 = CodeExercise(
    name="03.6 the TensorRT builder", var="trt_build_and_run", grade=_grade_trt,
    references=References("build and run the engine with TensorRT's API yourself",
                           "lab_utils.inference.tensorrt.build_plan", "lab_utils.inference.tensorrt.load_engine",
                           "lab_utils.inference.tensorrt.TrtRunner"),
    signature="trt_build_and_run(onnx_path, batches) -> list of outputs",
    hints=[
        "Build: trt.Logger -> trt.Builder -> builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag."
        "STRONGLY_TYPED)) -> trt.OnnxParser(network, logger).parse_from_file(path) (print parser.get_error(i) "
        "when it fails) -> builder.create_builder_config() with set_memory_pool_limit(trt.MemoryPoolType."
        "WORKSPACE, n) and an optimization profile -> builder.build_serialized_network(network, config).",
        "The profile comes from the builder (create_optimization_profile); its set_shape(input_name, min, opt, max) "
        "takes the smallest and largest batch of `batches`; then add the profile to the builder config.",
        "Run: a trt.Runtime deserializes the plan into an engine, which makes an execution context. Per batch: set "
        "the input's shape on the context, allocate the output as a CUDA tensor of the context's output shape "
        "(get_tensor_shape), set_tensor_address for both, execute_async_v3 with a CUDA stream's handle, then "
        "synchronize that stream.",
    ],
    solution_text=textwrap.dedent('''\
        def trt_build_and_run(onnx_path, batches, workspace_bytes=1 << 30):
            import tensorrt as trt

            logger = trt.Logger(trt.Logger.WARNING)
            builder = trt.Builder(logger)
            network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
            parser = trt.OnnxParser(network, logger)
            if not parser.parse_from_file(str(onnx_path)):
                for i in range(parser.num_errors):
                    print(parser.get_error(i))
                raise RuntimeError(f"TensorRT could not parse {onnx_path}")
            config = builder.create_builder_config()
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
            name = network.get_input(0).name
            sizes = sorted(int(x.shape[0]) for x in batches)
            sample = tuple(batches[0].shape[1:])
            profile = builder.create_optimization_profile()
            profile.set_shape(name, (sizes[0], *sample), (sizes[-1], *sample), (sizes[-1], *sample))
            config.add_optimization_profile(profile)
            plan = builder.build_serialized_network(network, config)
            if plan is None:
                raise RuntimeError("the build failed: see TensorRT's log above")
            engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
            context = engine.create_execution_context()
            output = engine.get_tensor_name(engine.num_io_tensors - 1)
            stream = torch.cuda.Stream()
            results = []
            for x in batches:
                x = x.to("cuda", torch.float32).contiguous()
                context.set_input_shape(name, tuple(x.shape))
                y = torch.empty(tuple(context.get_tensor_shape(output)), device="cuda")
                context.set_tensor_address(name, x.data_ptr())
                context.set_tensor_address(output, y.data_ptr())
                context.execute_async_v3(stream.cuda_stream)
                stream.synchronize()
                results.append(y)
            return results
        # The calls older tutorials use instead are gone in TensorRT 10 and 11: lab 03's "What changed".'''),
)


# --------------------------------------------------------------------------------------------------
# 03.7 read an optimization profile

PROFILE = {"input": "input", "min": (1, 3, 224, 224), "opt": (16, 3, 224, 224), "max": (64, 3, 224, 224)}
REQUESTS = {
    "a": (1, 3, 224, 224),
    "b": (16, 3, 224, 224),
    "c": (64, 3, 224, 224),
    "d": (65, 3, 224, 224),
    "e": (32, 3, 256, 256),
    "f": (8, 3, 224, 224),
}

_PROFILE_MIN, _PROFILE_MAX = PROFILE["min"], PROFILE["max"]  # the grader's own (tuples: a later change is no matter)
_SHAPES = dict(REQUESTS)
_RUNS = {k for k, s in _SHAPES.items() if all(lo <= d <= hi for lo, d, hi in zip(_PROFILE_MIN, s, _PROFILE_MAX,
                                                                                  strict=True))}
_WHY = {
    "c": "request c is batch 64, exactly the profile's max: min and max are inclusive, so it runs.",
    "a": "request a is batch 1, exactly the profile's min: min and max are inclusive, so it runs.",
    "b": "request b is the opt shape itself: it runs, and with the kernels TensorRT tuned for.",
    "f": "request f is batch 8, between min 1 and max 64: it runs (on kernels tuned for 16).",
    "d": "request d is batch 65, one over the max of 64: set_input_shape refuses it. Split it, or build with a "
         "larger max.",
    "e": "request e is 256x256 px: every dimension must lie within min..max, and this profile fixes the image "
         "at 224x224.",
}


def _names(value: Any) -> set[str]:
    if isinstance(value, str):
        items: Iterable[Any] = value.replace(",", " ").split() if " " in value or "," in value else list(value)
    elif isinstance(value, (set, frozenset, list, tuple)):
        items = value
    else:
        raise Wrong("answer with the names of the requests that run, e.g. {'a', 'b'}")
    names = {str(v).strip().lower() for v in items if str(v).strip()}
    unknown = names - set(_SHAPES)
    if unknown:
        raise Wrong(f"{sorted(unknown)} are not requests; the requests are {sorted(_SHAPES)}")
    return names


def _grade_runnable(value: Any) -> None:
    got = _names(value)
    if got != _RUNS:  # the first request wrongly in, else the first one missing
        raise Wrong(_WHY[min(got - _RUNS or _RUNS - got)])


q7 = Exercise(
    name="03.7 read an optimization profile", var="runnable", grade=_grade_runnable,
    hints=[
        "An engine built with a profile accepts an input when every dimension lies between the profile's min "
        "and max, both included. opt only says which shape the kernels were tuned for.",
        "Check each request dimension by dimension against PROFILE['min'] and PROFILE['max'].",
        "Keep the keys of REQUESTS whose shape passes: zip the profile's min, the shape and the profile's max, "
        "and require min <= d <= max for every dimension at once (all).",
    ],
    solution_text=(
        "lo, hi = PROFILE['min'], PROFILE['max']\n"
        "runnable = sorted(k for k, s in REQUESTS.items() if all(a <= d <= b for a, d, b in zip(lo, s, hi)))\n"
        "# {'a', 'b', 'c', 'f'}: d is one over max (batch 65), e has 256 px images where the profile fixes 224.\n"
        "# In code: lab_utils.inference.tensorrt.Profile('input', lo, PROFILE['opt'], hi).accepts(shape)"
    ),
)


# --------------------------------------------------------------------------------------------------
# 03.8 a p95 latency target -> the batch size

# One execution of a ResNet-50 FP16 engine by batch size, p50 and p95 over many executions (the shape of an
# engine on one data-centre GPU under load; the point is the trade-off, not the exact numbers).
LATENCY_P50_MS = {1: 0.9, 2: 1.0, 4: 1.3, 8: 2.0, 16: 3.6, 32: 8.0, 48: 11.0, 64: 13.0, 128: 19.0}
LATENCY_P95_MS = {1: 1.2, 2: 1.4, 4: 1.8, 8: 2.8, 16: 5.0, 32: 11.0, 48: 15.2, 64: 18.0, 128: 25.0}
SLO_P95_MS = 30.0  # the service's p95 target, from request arrival to response
QUEUE_DELAY_MS = 2.0  # the dynamic batcher waits up to this long for a batch to fill when the GPU is free

_P50 = dict(LATENCY_P50_MS)  # the grader's own copies
_P95 = dict(LATENCY_P95_MS)


def _worst_ms(execution_ms: float) -> float:
    """A request that arrives just after a batch started waits for that batch (one execution; its own batch
    fills meanwhile, or for the queue delay if that is longer), then for its own execution."""
    return max(QUEUE_DELAY_MS, execution_ms) + execution_ms


_BATCH_BEST = max(b for b, ms in _P95.items() if _worst_ms(ms) <= SLO_P95_MS)  # 32
_BATCH_P50 = max(b for b, ms in _P50.items() if _worst_ms(ms) <= SLO_P95_MS)  # 64: p50 times instead of p95
_BATCH_NO_WAIT = max(b for b, ms in _P95.items() if QUEUE_DELAY_MS + ms <= SLO_P95_MS)  # 128: no batch in flight


def _grade_batch(value: Any) -> None:
    got = integer(value, "the batch size")
    if got not in _P95:
        raise Wrong(f"answer with one of the measured batch sizes {sorted(_P95)}")
    if got == _BATCH_BEST:
        return
    ms = _P95[got]
    if got > _BATCH_BEST and got == _BATCH_P50 and got != _BATCH_NO_WAIT:
        raise Wrong(f"batch {got} fits with the p50 times ({_P50[got]} + {_P50[got]} = {2 * _P50[got]:g} ms), but the "
                    f"target is a p95: with the p95 times it is {ms} + {ms} = {_worst_ms(ms):g} ms > {SLO_P95_MS:g}.")
    if got > _BATCH_BEST and got == _BATCH_NO_WAIT:
        raise Wrong(f"batch {got} runs in {ms} ms at p95, and {QUEUE_DELAY_MS:g} ms of queueing keeps it within "
                    f"{SLO_P95_MS:g} ms, but a request can arrive just after a batch has started: it waits for that "
                    f"batch ({ms} ms) before its own runs ({ms} ms): {_worst_ms(ms):g} ms > {SLO_P95_MS:g}.")
    if got > _BATCH_BEST:
        raise Wrong(f"batch {got}: the batch already executing ({ms} ms at p95) and then its own ({ms} ms) make "
                    f"{_worst_ms(ms):g} ms > {SLO_P95_MS:g} ms.")
    raise Wrong(f"batch {got} fits, but a larger one fits too and serves more images per second "
                f"({got / _P95[got] * 1e3:.0f} images/s here at p95): take the largest that fits.")


q8 = Exercise(
    name="03.8 a p95 latency target -> batch size", var="max_batch", grade=_grade_batch,
    hints=[
        "The target is a p95, so plan with the p95 execution times. One GPU instance runs one batch at a time.",
        "The worst case: a request arrives just after a batch has started. It waits for that batch to finish "
        "(its own batch fills meanwhile, or for QUEUE_DELAY_MS if that is longer), then for its own execution: "
        "max(QUEUE_DELAY_MS, t) + t.",
        "Go through LATENCY_P95_MS (batch -> p95 ms) and keep the largest batch whose worst case (hint 2) is "
        "within SLO_P95_MS.",
    ],
    solution_text=(
        "max_batch = max(b for b, t in LATENCY_P95_MS.items() if max(QUEUE_DELAY_MS, t) + t <= SLO_P95_MS)   # 32\n"
        "# 11 ms for the batch in flight + 11 ms for its own = 22 ms <= 30; batch 48 needs 30.4 ms. Batch 64\n"
        "# passes with the p50 times (26 ms) but not with the p95 (36 ms); batch 128 passes only if you forget\n"
        "# the batch already executing (2 + 25 = 27 ms)."
    ),
)
