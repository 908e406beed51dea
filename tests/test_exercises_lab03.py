"""Lab 03's exercise checks. The code exercises run against the real components here (the torch exporter, ONNX
Runtime, ModelOpt; TensorRT where it imports, else mypy against tensorrt-stubs) with right implementations
written two or three ways, blanks, and the plausible wrong ones, each told its own symptom. The fixed-data
exercises against right, wrong and blank answers; hints, solutions and the notebook's by-hand calls."""

from __future__ import annotations

import copy
import importlib.util
import json
import linecache
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _exercise_harness import check, exercises_of, hint_and_solution_tests, standard_tests

from lab_utils.exercises import lab03
from lab_utils.exercises.framework import CodeExercise, Exercise, Status

ROOT = Path(__file__).resolve().parents[1]
_SPEEDUP = 1 / (1 - 30 / (2_000_000 * 14 / 5000 / 60))  # 1.4737

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
for _name in ("modelopt", "onnxscript"):
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"lab 03's checks need {_name}: pip install -e '.[lab]'", allow_module_level=True)

from lab_utils.inference import onnx as lab_onnx  # noqa: E402
from lab_utils.inference import tensorrt as trt_engine  # noqa: E402
from lab_utils.timing import benchmark  # noqa: E402

TRT_RUNS, _ = trt_engine.tensorrt_status()


# ==================================================================================================
# 03.1 the export: right (the solution and two more ways), wrong (five symptoms), blank


def export_legacy_dynamic_axes(model, path, example):
    model.eval()  # the TorchScript exporter with dynamic_axes: deprecated, still right
    torch.onnx.export(model, (example,), path, dynamo=False, opset_version=18, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "n"}, "y": {0: "n"}})


def export_through_torch_export(model, path, example):
    program = torch.export.export(model.eval(), (example,), dynamic_shapes=({0: torch.export.Dim("b")},))
    torch.onnx.export(program, f=str(path))  # the exporter's default opset


def export_in_train_mode(model, path, example):
    torch.onnx.export(model, (example,), str(path), dynamo=True, opset_version=18,
                      dynamic_shapes=({0: torch.export.Dim("batch")},))


def export_static(model, path, example):
    model.eval()
    torch.onnx.export(model, (example,), str(path), dynamo=True, opset_version=18)


def export_old_opset(model, path, example):
    model.eval()
    torch.onnx.export(model, (example,), str(path), dynamo=False, opset_version=11, input_names=["input"],
                      dynamic_axes={"input": {0: "batch"}})


def export_no_file(model, path, example):
    model.eval()
    return torch.onnx.export(model, (example,), dynamo=True, dynamic_shapes=({0: torch.export.Dim("batch")},))


def export_raises(model, path, example):
    model.eval()
    torch.onnx.export(model, (example[:1],), str(path), dynamo=True,  # a batch of 1 cannot be dynamic
                      dynamic_shapes=({0: torch.export.Dim("batch", min=2)},))


def export_blank(model, path, example):
    """Write `model` to the ONNX file `path`, batch dimension dynamic."""
    ...  # YOUR CODE HERE


# ==================================================================================================
# 03.2 ONNX Runtime session, timed


def _level(level):
    return getattr(ort.GraphOptimizationLevel, lab03.ORT_LEVELS[level])


def ort_right(onnx_path, x, level):
    so = ort.SessionOptions()
    so.graph_optimization_level = _level(level)
    session = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: x}
    return session, benchmark(lambda: session.run(None, feed), reps=10, warmup=2, device="cpu")


def ort_right_differently(onnx_path, x, level):
    import functools

    levels = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
              "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED}
    options = ort.SessionOptions()
    options.graph_optimization_level = levels[level]
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(onnx_path, sess_options=options,
                                   providers=[("CPUExecutionProvider", {})])
    name = session.get_inputs()[0].name
    return session, benchmark(functools.partial(session.run, ["logits"], {name: x}), reps=8, warmup=1, device="cpu")


def ort_options_not_passed(onnx_path, x, level):
    so = ort.SessionOptions()
    so.graph_optimization_level = _level(level)
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: x}
    return session, benchmark(lambda: session.run(None, feed), reps=10, warmup=2, device="cpu")


def ort_no_providers(onnx_path, x, level):
    so = ort.SessionOptions()
    so.graph_optimization_level = _level(level)
    session = ort.InferenceSession(str(onnx_path), so)
    feed = {session.get_inputs()[0].name: x}
    return session, benchmark(lambda: session.run(None, feed), reps=10, warmup=2, device="cpu")


def ort_session_in_timed_loop(onnx_path, x, level):
    so = ort.SessionOptions()
    so.graph_optimization_level = _level(level)

    def run():
        s = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
        return s.run(None, {s.get_inputs()[0].name: x})

    session = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    return session, benchmark(run, reps=5, warmup=1, device="cpu")


def ort_returns_a_number(onnx_path, x, level):
    session, timing = ort_right(onnx_path, x, level)
    return session, timing.median_ms


def ort_no_warmup(onnx_path, x, level):
    so = ort.SessionOptions()
    so.graph_optimization_level = _level(level)
    session = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: x}
    return session, benchmark(lambda: session.run(None, feed), reps=10, warmup=0, device="cpu")


def ort_times_nothing(onnx_path, x, level):
    so = ort.SessionOptions()
    so.graph_optimization_level = _level(level)
    session = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    return session, benchmark(lambda: None, reps=10, warmup=2, device="cpu")


# ==================================================================================================
# 03.3 ModelOpt INT8


def quantize_right(onnx_path, out_path, x_train):
    from modelopt.onnx.quantization import quantize

    quantize(str(onnx_path), quantize_mode="int8", calibration_data=x_train[:512], calibration_method="max",
             calibration_eps=["cpu"], output_path=str(out_path))


mo_quantize = None  # bound to ModelOpt's quantize by the fixture below, as a cell's top-level import would


def quantize_right_differently(onnx_path, out_path, x_train):
    rng = np.random.default_rng(0)
    images = x_train[rng.choice(len(x_train), 256, replace=False)]  # a random subset, as a dict by input name
    mo_quantize(onnx_path=str(onnx_path), calibration_data={"input": images}, output_path=str(out_path))


def quantize_nhwc(onnx_path, out_path, x_train):
    from modelopt.onnx.quantization import quantize

    quantize(str(onnx_path), quantize_mode="int8", calibration_data=x_train[:512].transpose(0, 2, 3, 1),
             output_path=str(out_path))


def quantize_float64(onnx_path, out_path, x_train):
    from modelopt.onnx.quantization import quantize

    quantize(str(onnx_path), quantize_mode="int8", calibration_data=x_train[:512].astype(float),
             output_path=str(out_path))


def quantize_fp8(onnx_path, out_path, x_train):
    from modelopt.onnx.quantization import quantize

    quantize(str(onnx_path), quantize_mode="fp8", calibration_data=x_train[:256], calibration_eps=["cpu"],
             output_path=str(out_path))


def quantize_no_output_path(onnx_path, out_path, x_train):
    from modelopt.onnx.quantization import quantize

    quantize(str(onnx_path), quantize_mode="int8", calibration_data=x_train[:256], calibration_eps=["cpu"])


def quantize_no_data(onnx_path, out_path, x_train):
    from modelopt.onnx.quantization import quantize

    quantize(str(onnx_path), quantize_mode="int8", output_path=str(out_path))


def quantize_zeros(onnx_path, out_path, x_train):
    from modelopt.onnx.quantization import quantize

    quantize(str(onnx_path), calibration_data=np.zeros_like(x_train[:64]), output_path=str(out_path))


@pytest.fixture(autouse=True, scope="module")
def _cell_level_modelopt_import():
    from modelopt.onnx.quantization import quantize

    globals()["mo_quantize"] = quantize
    yield


# ==================================================================================================
# 03.6 the TensorRT builder (run where TensorRT imports, read and type-checked elsewhere)


def _cell(source: str, name: str, cell: str) -> object:
    """``name`` from ``source`` exec'd as a notebook runs a cell: its lines in linecache under the cell's name, so
    the check can read the function's source (as it reads a notebook cell's; exec alone leaves none)."""
    filename = f"<cell {cell}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict = {"np": np, "torch": torch}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


# The right answer is the solution's own text, not a copy of it: the wrong variants below are made from it.
TRT_RIGHT_SOURCE = lab03.q6.solution_text
trt_right = _cell(TRT_RIGHT_SOURCE, lab03.q6.var, "trt_right")


def trt_right_differently(onnx_path, batches):
    """Parsed from bytes, Dims objects, the flag looked up defensively (TensorRT 11 may drop it), tensor names
    by mode, the output read on the current stream."""
    import tensorrt as trt

    log = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(log)
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    net = builder.create_network(0 if flag is None else 1 << int(flag))
    parser = trt.OnnxParser(net, log)
    with open(onnx_path, "rb") as f:
        ok = parser.parse(f.read(), str(onnx_path))
    if not ok:
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise RuntimeError("\n".join(errors))
    cfg = builder.create_builder_config()
    cfg.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 256 << 20)
    inp = net.get_input(0)
    lo = min(b.shape[0] for b in batches)
    hi = max(b.shape[0] for b in batches)
    prof = builder.create_optimization_profile()
    prof.set_shape(inp.name, trt.Dims([lo, 1, 8, 8]), trt.Dims([hi, 1, 8, 8]), trt.Dims([hi, 1, 8, 8]))
    cfg.add_optimization_profile(prof)
    serialized = builder.build_serialized_network(net, cfg)
    runtime = trt.Runtime(log)
    engine = runtime.deserialize_cuda_engine(serialized)
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    out_name = next(n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT)
    ctx = engine.create_execution_context()
    stream = torch.cuda.current_stream()
    outs = []
    for x in batches:
        ctx.set_input_shape(inp.name, list(x.shape))
        out = torch.empty((x.shape[0], 10), device="cuda")
        ctx.set_tensor_address(inp.name, x.contiguous().data_ptr())
        ctx.set_tensor_address(out_name, out.data_ptr())
        ctx.execute_async_v3(stream.cuda_stream)
        stream.synchronize()
        outs.append(out.cpu())
    return outs


def trt_blank(onnx_path, batches, workspace_bytes=1 << 30):
    """Build a strongly typed engine ... (YOUR CODE HERE)"""
    ...


def _variant(old: str, new: str) -> str:
    """The solution's source with one change: a plausible wrong version, defined from real source (so the check can
    read it, as it reads a notebook cell)."""
    assert old in TRT_RIGHT_SOURCE, old
    return TRT_RIGHT_SOURCE.replace(old, new, 1)


TRT_WRONG_SOURCES = {
    "explicit_batch": (_variant("1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)",
                                "1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)"),
                       "`NetworkDefinitionCreationFlag.EXPLICIT_BATCH` is gone"),
    "max_workspace_size": (_variant("config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)",
                                    "config.max_workspace_size = workspace_bytes"),
                           "`max_workspace_size` is gone (removed in TensorRT 10): use `config.set_memory_pool_limit"),
    "build_engine": (_variant("plan = builder.build_serialized_network(network, config)",
                              "plan = builder.build_engine(network, config)"),
                     "`build_engine` is gone"),
    "fp16_flag": (_variant("config.add_optimization_profile(profile)",
                           "config.add_optimization_profile(profile)\n    config.set_flag(trt.BuilderFlag.FP16)"),
                  "`BuilderFlag.FP16` is gone (removed in TensorRT 11; a strongly typed network refuses it in 10)"),
    "max_batch_size": (_variant("config = builder.create_builder_config()",
                                "builder.max_batch_size = 8\n    config = builder.create_builder_config()"),
                       "`max_batch_size` is gone"),
    "no_profile": (_variant("""    profile = builder.create_optimization_profile()
    profile.set_shape(name, (sizes[0], *sample), (sizes[-1], *sample), (sizes[-1], *sample))
    config.add_optimization_profile(profile)
""", ""), "a step is missing from your function: an optimization profile (and 1 more step)"),
    "no_parser_errors": (_variant("""        for i in range(parser.num_errors):
            print(parser.get_error(i))
""", ""), "the parser's errors printed"),
    "weakly_typed": (_variant("builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))",
                              "builder.create_network(0)"), "a strongly typed network"),
    "no_execute": (_variant("context.execute_async_v3(stream.cuda_stream)", "pass"), "execute_async_v3"),
}
# Wrong only by the API's types, which the stubs know: caught by mypy where TensorRT cannot run.
TRT_TYPE_ERRORS = {
    "parse_with_a_verbosity": (_variant("parser.parse_from_file(str(onnx_path))",
                                        "parser.parse_from_file(str(onnx_path), 2)"),
                               'Too many arguments for "parse_from_file"'),
    "shape_by_index": (_variant("context.get_tensor_shape(output)", "context.get_tensor_shape(1)"),
                       'Argument 1 to "get_tensor_shape"'),
    "misspelled_method": (_variant("builder.create_builder_config()", "builder.create_config()"),
                          '"Builder" has no attribute "create_config"'),
}


def _load_functions(tmp_path: Path, sources: dict[str, str], prefix: str) -> dict[str, object]:
    """Each source as a function defined in a real file (the check reads a function's source, as in a notebook)."""
    text = "import numpy as np\nimport torch\n\n" + "\n\n".join(
        src.replace("def trt_build_and_run(", f"def {prefix}{key}(", 1) for key, src in sources.items())
    path = tmp_path / f"{prefix}variants.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"{prefix}variants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {key: getattr(module, f"{prefix}{key}") for key in sources}


# ==================================================================================================
# The fixed-data exercises

CASES = [
    (lab03.q4, ["int8", " INT8 ", "Int8"], ["fp8", "fp16", "fp32", "int4", 8, "best"]),
    (lab03.q5, [_SPEEDUP, 1.47, 1.48, "1.474"], [1.32, 1.0054, 2.0, 1.0, 0.68, "fast"]),
    (lab03.q7, [["a", "b", "c", "f"], {"f", "c", "b", "a"}, ("A", "B", "C", "F"), "abcf", "a, b, c, f"],
     [["a", "b", "c", "d", "f"], ["a", "b", "c", "e", "f"], ["a", "b", "f"], ["b", "c", "f"], [], ["z"], 3]),
    (lab03.q8, [32, 32.0, "32"], [48, 64, 128, 16, 1, 40, 32.5, "big"]),
]

(
    test_right_answers_are_correct,
    test_wrong_answers_are_incorrect_and_show_the_value,
    test_blank_answers_are_not_attempted,
) = standard_tests(CASES)


CODE = [lab03.q1, lab03.q2, lab03.q3, lab03.q6]


def test_cases_cover_every_exercise():
    assert {id(ex) for ex, *_ in CASES} | {id(ex) for ex in CODE} == {id(ex) for ex in exercises_of(lab03)}


def test_at_least_half_of_the_graded_exercises_run_code():
    exercises = exercises_of(lab03)
    code = [e for e in exercises if isinstance(e, CodeExercise)]
    assert set(map(id, code)) == set(map(id, CODE)) and len(code) * 2 >= len(exercises)


@pytest.mark.parametrize("exercise", CODE, ids=lambda e: e.name)
@pytest.mark.parametrize("blank", [None, ..., "stub"])
def test_code_blanks_are_not_attempted(exercise, blank):
    value = (trt_blank if exercise is lab03.q6 else export_blank) if blank == "stub" else blank
    out = check(exercise, value)
    assert out.status is Status.NOT_ATTEMPTED, out.message
    assert exercise.var in out.message


def test_code_exercises_refuse_a_value_that_is_not_a_function():
    out = check(lab03.q2, 3.0)
    assert out.status is Status.INCORRECT and "expected a function" in out.message


# --- 03.1 ------------------------------------------------------------------------------------------------


# The solution's own export (torch.onnx.export with dynamo=True) is test_solution_code_passes_its_check's: an export
# costs seconds of CPU, so it is not exported a second time here.
@pytest.mark.parametrize("fn", [export_legacy_dynamic_axes, export_through_torch_export],
                         ids=lambda f: f.__name__)
def test_export_right_ways(fn):
    out = check(lab03.q1, fn)
    assert out.correct, out.message
    assert "ONNX Runtime ran batch 1 and 7 like PyTorch" in out.message


# Each wrong export is exported and checked once (seconds of CPU each): every symptom of its message checked together.
@pytest.mark.parametrize(("fn", "symptoms"), [
    (export_in_train_mode, ("exported in train mode (model.training is still True)",  # names the random graph too
                            "RandomUniformLike: random numbers at every run", "Call model.eval()")),
    (export_static, ("the batch is fixed at 4",)),
    (export_old_opset, ("the file is opset 11",)),
    (export_no_file, ("It returned an ONNXProgram",)),
    (export_raises, ("raised", "torch.onnx.export(model, (example[:1],)")),  # the student's own line
], ids=lambda v: getattr(v, "__name__", "symptom"))
def test_export_wrong_ways_are_told_their_symptom(fn, symptoms):
    out = check(lab03.q1, fn)
    assert out.status is Status.INCORRECT, out.message
    assert all(s in out.message for s in symptoms) and "`export_dynamic`" in out.message, out.message
    if fn is export_raises:
        assert "lab_utils" not in out.message  # no trace through the course's code


def test_the_export_opset_is_the_course_opset():
    assert lab03.ONNX_OPSET == lab_onnx.ONNX_OPSET
    assert set(lab03.ORT_LEVELS.items()) <= set(lab_onnx.ORT_LEVELS.items())


# --- 03.2 ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [ort_right, ort_right_differently], ids=lambda f: f.__name__)
def test_ort_right_ways(fn):
    out = check(lab03.q2, fn)
    assert out.correct, out.message
    assert "at 'disable'" in out.message and f"for {lab03.ORT_BATCH} images" in out.message


@pytest.mark.parametrize(("fn", "symptom"), [
    (ort_options_not_passed, "runs at ORT_ENABLE_ALL, not ORT_DISABLE_ALL: that is ONNX Runtime's default"),
    (ort_no_providers, "without providers=: it works with the CPU-only onnxruntime, but onnxruntime-gpu refuses it"),
    (ort_session_in_timed_loop, "time only session.run, with the session made"),
    (ort_returns_a_number, "the Timing that the lab-01 timer returns"),
    (ort_no_warmup, "the timing has no warm-up"),
    (ort_times_nothing, "does the timed function call session.run?"),
], ids=lambda v: getattr(v, "__name__", "symptom"))
def test_ort_wrong_ways_are_told_their_symptom(fn, symptom):
    out = check(lab03.q2, fn)
    assert out.status is Status.INCORRECT, out.message
    assert symptom in out.message and "`ort_timed`" in out.message


# --- 03.3 ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [quantize_right, quantize_right_differently], ids=lambda f: f.__name__)
def test_quantize_right_ways(fn):
    out = check(lab03.q3, fn)
    assert out.correct, out.message
    assert "Q/DQ nodes" in out.message and "images)" in out.message
    _assert_modelopt_as_it_was()


def _assert_modelopt_as_it_was():
    """The check's wrapper of ModelOpt's quantize is gone after it, under both names the student reaches it by."""
    import modelopt.onnx.quantization as mq

    assert mq.quantize is mo_quantize and mo_quantize.__module__.startswith("modelopt")


@pytest.mark.parametrize(("fn", "symptom"), [
    (quantize_nhwc, "has shape (512, 8, 8, 1); expected (N, 1, 8, 8) float32"),
    (quantize_float64, "has dtype float64; expected (N, 1, 8, 8) float32"),
    (quantize_fp8, "quantize to float8e4m3fn, not int8"),
    (quantize_no_output_path, "no file at out_path: pass output_path"),
    (quantize_no_data, "got no calibration_data: ModelOpt then calibrates on random inputs"),
    (quantize_zeros, "all the same value"),
], ids=lambda v: getattr(v, "__name__", "symptom"))
def test_quantize_wrong_ways_are_told_their_symptom(fn, symptom):
    out = check(lab03.q3, fn)
    assert out.status is Status.INCORRECT, out.message
    assert symptom in out.message and "`quantize_int8`" in out.message
    _assert_modelopt_as_it_was()


# --- 03.6 ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [trt_right, trt_right_differently], ids=lambda f: f.__name__)
def test_trt_right_ways(fn):
    out = check(lab03.q6, fn)
    assert out.correct, out.message
    if TRT_RUNS:
        assert "built and run here" in out.message
    else:
        assert "read and type-checked, not run: TensorRT cannot run here" in out.message
        assert "mypy" in out.message and "tensorrt-stubs" in out.message


@pytest.fixture(scope="module")
def trt_wrongs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trt-variants")
    return (_load_functions(folder, {k: v[0] for k, v in TRT_WRONG_SOURCES.items()}, "wrong_"),
            _load_functions(folder, {k: v[0] for k, v in TRT_TYPE_ERRORS.items()}, "typed_"))


@pytest.mark.parametrize("key", list(TRT_WRONG_SOURCES))
def test_trt_removed_calls_and_missing_steps_are_told_on_every_tier(trt_wrongs, key):
    out = check(lab03.q6, trt_wrongs[0][key])
    assert out.status is Status.INCORRECT, out.message
    assert TRT_WRONG_SOURCES[key][1] in out.message and "`trt_build_and_run`" in out.message
    if not TRT_RUNS:
        assert "read and type-checked, not run: TensorRT cannot run here" in out.message


@pytest.mark.parametrize("key", list(TRT_TYPE_ERRORS))
def test_trt_type_errors(trt_wrongs, key):
    out = check(lab03.q6, trt_wrongs[1][key])
    assert out.status is Status.INCORRECT, out.message
    if not TRT_RUNS:  # where TensorRT runs, the same code fails when it runs instead
        assert TRT_TYPE_ERRORS[key][1] in out.message and "tensorrt-stubs" in out.message


def test_trt_findings_name_the_line_of_the_cell(trt_wrongs):
    fn = trt_wrongs[0]["max_workspace_size"]
    line = next(i for i, ln in enumerate(Path(fn.__code__.co_filename).read_text().splitlines(), 1)
                if "config.max_workspace_size" in ln)
    assert f"line {line}:" in check(lab03.q6, fn).message


@pytest.mark.skipif(TRT_RUNS, reason="TensorRT runs here: the check runs the code instead of reading it")
def test_trt_function_without_source_is_told_why():
    namespace: dict = {}
    exec(textwrap.dedent("""
        def trt_build_and_run(onnx_path, batches):
            import tensorrt as trt
            return trt.Builder(trt.Logger())
    """), namespace)
    out = check(lab03.q6, namespace["trt_build_and_run"])
    assert out.status is Status.INCORRECT and "could not read your function's source" in out.message


# --- the fixed-data exercises' messages ------------------------------------------------------------------------


def test_q4_messages():
    assert "more than the 1.0 point budget" in check(lab03.q4, "fp8").message
    for p in ("fp16", "fp32"):
        assert "take the fastest one that fits" in check(lab03.q4, p).message
    assert "one of ['fp32', 'fp16', 'int8', 'fp8']" in check(lab03.q4, "int4").message
    assert lab03.PRECISION_CHOICES == ("fp32", "fp16", "int8", "fp8")


def test_q4_grader_ignores_a_mutated_table():
    saved = copy.deepcopy(lab03.PRECISION_CANDIDATES)
    try:
        lab03.PRECISION_CANDIDATES["fp8"]["accuracy_delta_points"] = 0.0  # a student's cell may change the dict
        assert check(lab03.q4, "int8").correct
    finally:
        lab03.PRECISION_CANDIDATES.clear()
        lab03.PRECISION_CANDIDATES.update(saved)


def test_q5_value_and_messages():
    assert _SPEEDUP == pytest.approx(1.47368, rel=1e-5)
    assert check(lab03.q5, _SPEEDUP * 1.009).correct and not check(lab03.q5, _SPEEDUP * 1.02).correct
    assert "1 + C/T" in check(lab03.q5, 1 + 30 / (2_000_000 * 14 / 5000 / 60)).message
    assert "seconds" in check(lab03.q5, 1 / (1 - 30 / (2_000_000 * 14 / 5000))).message
    message = check(lab03.q5, 2.0).message
    assert "too high" in message and "1.47" not in message  # not given away
    assert "number" in check(lab03.q5, "fast").message


def test_q7_each_mistake_has_its_reason():
    assert "one over the max" in check(lab03.q7, "abcdf").message
    assert "fixes the image at 224x224" in check(lab03.q7, "abcef").message
    assert "exactly the profile's max" in check(lab03.q7, "abf").message
    assert "exactly the profile's min" in check(lab03.q7, "bcf").message
    assert "opt shape itself" in check(lab03.q7, "acf").message
    assert "between min 1 and max 64" in check(lab03.q7, "abc").message
    assert "not requests" in check(lab03.q7, ["a", "z"]).message
    assert "names of the requests" in check(lab03.q7, 3).message


def test_q7_agrees_with_the_profile_class():
    p = trt_engine.Profile("input", lab03.PROFILE["min"], lab03.PROFILE["opt"], lab03.PROFILE["max"])
    runs = sorted(k for k, shape in lab03.REQUESTS.items() if p.accepts(shape))
    assert runs == ["a", "b", "c", "f"] and check(lab03.q7, runs).correct


def test_q8_each_latency_model_slip_has_its_message():
    forgot_the_batch_in_flight = check(lab03.q8, 128).message
    assert "arrive just after a batch has started" in forgot_the_batch_in_flight and "50 ms > 30" in \
        forgot_the_batch_in_flight
    p50 = check(lab03.q8, 64).message
    assert "fits with the p50 times (13.0 + 13.0 = 26 ms)" in p50 and "36 ms > 30" in p50
    assert "30.4 ms > 30" in check(lab03.q8, 48).message
    assert "take the largest that fits" in check(lab03.q8, 16).message
    assert "measured batch sizes" in check(lab03.q8, 40).message
    assert "whole number" in check(lab03.q8, 32.5).message


def test_q8_the_sum_model_gives_the_same_batch():
    """Planning with queue + in-flight + own execution (a bound looser than the max) picks the same batch."""
    summed = max(b for b, t in lab03.LATENCY_P95_MS.items() if lab03.QUEUE_DELAY_MS + 2 * t <= lab03.SLO_P95_MS)
    assert summed == 32 and check(lab03.q8, summed).correct


# --- hints, solutions, completeness ---------------------------------------------------------------------------


def test_every_exercise_has_hints_and_solution():
    exercises = exercises_of(lab03)
    assert len(exercises) == 8
    names = sorted(k for k, v in vars(lab03).items() if isinstance(v, Exercise))
    assert names == [f"q{i}" for i in range(1, len(names) + 1)]
    for i, exercise in enumerate(sorted(exercises, key=lambda e: e.name), 1):
        assert exercise.name.startswith(f"03.{i} ")
        assert 2 <= len(exercise.hints) <= 3, exercise.name
        assert exercise.solution_text.strip(), exercise.name


@pytest.mark.parametrize("exercise", exercises_of(lab03), ids=lambda e: e.name)
def test_solution_code_passes_its_check(exercise, tmp_path):
    """Each solution text, run as a student's cell would run it (from a file, so its source can be read)."""
    header = ("import numpy as np\nimport onnxruntime as ort\nimport torch\n"
              "from lab_utils.exercises import lab03 as ex\nfrom lab_utils.exercises.lab03 import *\n"
              "from lab_utils.inference import onnx\nfrom lab_utils.timing import benchmark\n\n")
    path = tmp_path / f"solution_{exercise.var}.py"
    path.write_text(header + exercise.solution_text + "\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = check(exercise, getattr(module, exercise.var))
    assert out.correct, out.message


test_hints_step_from_first_to_last, test_solution_prints = hint_and_solution_tests(exercises_of(lab03))


def test_all_exports_exist():
    for name in lab03.__all__:
        assert hasattr(lab03, name), name


def test_the_solution_writes_the_stack_calls_by_hand():
    cells = json.loads((ROOT / "solutions" / "03_tensorrt.ipynb").read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    for call in ("torch.onnx.export", "InferenceSession", "quantize(", "trt.Builder", "OnnxParser",
                 "build_serialized_network", "execute_async_v3", "set_tensor_address", "create_optimization_profile"):
        assert call in code, call
    for exercise in CODE:
        assert f"ex.{next(k for k, v in vars(lab03).items() if v is exercise)}.check({exercise.var})" in code
