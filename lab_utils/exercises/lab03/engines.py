"""03.3, ModelOpt's INT8 ``quantize`` call (the calibration data checked, the accuracy rerun), and 03.6, the
TensorRT builder (built and run where TensorRT imports, else read and type-checked against tensorrt-stubs)."""

from __future__ import annotations

import contextlib
import inspect
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lab_utils.exercises.framework import CodeExercise, References, Wrong, items, patched, run_student, sentence
from lab_utils.exercises.lab03.onnx_checks import EXPORT_BATCHES, _digits
from lab_utils.inference import compare, trt_check
from lab_utils.procs import temporary_folder

_TRT_TOLERANCE = 5e-2  # an FP32 engine may run its convolutions in TF32
_ACCURACY_SLACK = 0.02  # INT8 may lose up to 2 points (7 of 357 test images) against FP32


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
