"""What lab 03's code checks run on (the digits CNN as an ONNX file, its data and ONNX Runtime's logits, made
once per process), and 03.1 and 03.2: the ONNX export with a dynamic batch, an ONNX Runtime session timed with the
lab-01 timer."""

from __future__ import annotations

import ast
import contextlib
import copy
import functools
import inspect
import io
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab_utils.exercises.framework import CodeExercise, References, Wrong, amended, items, run_student
from lab_utils.procs import temporary_folder
from lab_utils.timing import Timing, benchmark

ONNX_OPSET = 18  # the course's opset (lab_utils.inference.onnx.ONNX_OPSET): what the exercise asks for
EXPORT_MIN_OPSET = 18  # the oldest the torch.export-based exporter writes natively; older goes through a converter
EXPORT_BATCHES = (1, 7)  # the batch sizes the export check runs in ONNX Runtime
ORT_BATCH = 16  # the batch the session check runs and times
# ONNX Runtime's graph optimization levels by the lab's names (lab_utils.inference.onnx.ORT_LEVELS)
ORT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
              "all": "ORT_ENABLE_ALL"}

_FIXTURE_EPOCHS = 3  # the digits CNN the code checks use: the lab's quick-mode model, trained once per process
_EXPORT_TOLERANCE = 1e-4  # |ONNX Runtime - PyTorch|, FP32 on the CPU


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
