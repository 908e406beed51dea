"""Lab 03 precision in the graph on the CPU: ModelOpt AutoCast and Q/DQ quantization, checked in ONNX Runtime."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
for _name in ("modelopt", "onnxscript"):
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"lab 03's ModelOpt path needs {_name}: pip install -e '.[lab]'", allow_module_level=True)

from _lab03_data import digits_onnx

from lab_utils import models
from lab_utils.inference import onnx, quantize

DATA = models.digits_arrays()


def test_calibration_data_is_refused_with_the_expected_shape_and_type():
    _, path, _ = digits_onnx()
    assert quantize.onnx_input(path) == ("input", (None, 1, 8, 8), np.float32)
    x = DATA["x_train"][:32]
    assert quantize.check_calibration_data(x, path) is x
    assert quantize.check_calibration_data(torch.from_numpy(x), path).shape == (32, 1, 8, 8)
    cases = [
        (x[:, 0], r"shape \(32, 8, 8\); expected \(N, 1, 8, 8\) float32 \(a channel axis is missing"),
        (x.astype(np.float64), r"dtype float64; expected \(N, 1, 8, 8\) float32"),
        (np.zeros((4, 1, 16, 16), np.float32), r"shape \(4, 1, 16, 16\); expected \(N, 1, 8, 8\)"),
        (x.tolist(), r"must be a numpy array of shape \(N, 1, 8, 8\) float32, got list"),
        (np.full((2, 1, 8, 8), np.nan, np.float32), "NaN"),
    ]
    for bad, message in cases:
        with pytest.raises(quantize.CalibrationDataError, match=message):
            quantize.check_calibration_data(bad, path)
    with pytest.raises(quantize.CalibrationDataError, match="at least 8"):
        quantize.check_calibration_data(x[:2], path, min_images=8)
    with pytest.raises(quantize.CalibrationDataError, match="float32"):  # refused before ModelOpt runs
        quantize.quantize_onnx(path, path.with_suffix(".bad.onnx"), x.astype(np.float64))


def test_autocast_fp16_keeps_accuracy(tmp_path):
    _, path, facts = digits_onnx()
    out = quantize.autocast(path, tmp_path / "fp16.onnx")
    counts = onnx.op_counts(out)
    assert counts["Cast"] >= 2  # FP32 in and out, FP16 inside
    assert quantize.onnx_input(out)[2] == np.float32
    ref = onnx.ort_predict(onnx.ort_session(path), DATA["x_test"])
    scores = quantize.evaluate_onnx(out, DATA["x_test"], DATA["y_test"], ref)
    assert abs(scores["accuracy"] - facts["accuracy"]) <= 0.01 and scores["max_abs_diff"] < 0.05
    with pytest.raises(ValueError, match="fp16"):
        quantize.autocast(path, tmp_path / "x.onnx", precision="fp8")


def test_int8_qdq_quantizes_the_convolutions_and_keeps_accuracy(tmp_path):
    _, path, facts = digits_onnx()
    out = quantize.quantize_onnx(path, tmp_path / "int8.onnx", DATA["x_train"][:128], method="max")
    summary = quantize.qdq_summary(out)
    assert summary["quantized_types"] == ["int8"] and summary["quantize_nodes"] >= 2
    assert len(summary["quantized_compute_nodes"]) >= 2 and all(n.startswith("Conv") for n in
                                                                 summary["quantized_compute_nodes"])
    scores = quantize.evaluate_onnx(out, DATA["x_test"], DATA["y_test"])
    assert abs(scores["accuracy"] - facts["accuracy"]) <= 0.01


def test_fp8_qdq_runs_in_onnx_runtime_on_the_cpu(tmp_path):
    ok, why = quantize.ort_runs_fp8()
    if not ok:
        pytest.skip(why)
    _, path, facts = digits_onnx()
    out = quantize.quantize_onnx(path, tmp_path / "fp8.onnx", DATA["x_train"][:64], mode="fp8")
    assert "float8e4m3fn" in quantize.qdq_summary(out)["quantized_types"]
    assert abs(quantize.evaluate_onnx(out, DATA["x_test"], DATA["y_test"])["accuracy"] - facts["accuracy"]) <= 0.02


def test_fp8_logits_match_fp32_at_every_onnx_runtime_level(tmp_path):
    """ONNX Runtime's ReluQuantRewrite drops a Relu before an FP8 QuantizeLinear (FP8 is signed, so the Relu
    mattered): logits were off by ~100 %. ``ort_session`` disables that rewrite for FP8 models."""
    ok, why = quantize.ort_runs_fp8()
    if not ok:
        pytest.skip(why)
    _, path, _ = digits_onnx()
    out = quantize.quantize_onnx(path, tmp_path / "fp8.onnx", DATA["x_train"][:64], mode="fp8")
    assert onnx.has_fp8_qdq(out) and not onnx.has_fp8_qdq(path)
    x = DATA["x_test"]
    ref = onnx.ort_predict(onnx.ort_session(path, "disable"), x)
    errors = {}
    for level in ("disable", "extended", "all"):
        logits = onnx.ort_predict(onnx.ort_session(out, level), x)
        errors[level] = float(np.abs(logits - ref).mean() / np.abs(ref).mean())
    assert max(errors.values()) < 0.05, errors
    assert quantize.evaluate_onnx(out, x, reference_logits=ref)["rel_logit_error"] < 0.05


def test_fp8_status_says_why():
    ok, why = quantize.fp8_status(None)
    assert not ok and "no GPU" in why
    ok, why = quantize.fp8_status((8, 0))
    assert not ok and "8.0" in why and "8.9" in why
    assert quantize.fp8_status((9, 0)) == quantize.ort_runs_fp8()


def test_quantize_arguments_are_checked(tmp_path):
    _, path, _ = digits_onnx()
    x = DATA["x_train"][:8]
    for kwargs, message in (({"mode": "int4"}, "int8"), ({"method": "percentile"}, "entropy"),
                            ({"high_precision": "fp64"}, "fp32")):
        with pytest.raises(ValueError, match=message):
            quantize.quantize_onnx(path, tmp_path / "q.onnx", x, **kwargs)


def test_calibration_sweep_rows(tmp_path):
    _, path, _ = digits_onnx()
    sweep = quantize.calibration_sweep(path, DATA["x_train"], DATA["x_test"], DATA["y_test"], sizes=(1, 32),
                                       methods=("max",), workdir=tmp_path)
    assert list(sweep["calibration_images"]) == [1, 32] and set(sweep["method"]) == {"max"}
    assert (sweep["accuracy_delta_points"].abs() <= 2).all() and (sweep["rel_logit_error"] > 0).all()
    import matplotlib

    matplotlib.use("Agg")
    assert len(quantize.plot_calibration_sweep(sweep).axes) == 2
    with pytest.raises(ValueError, match="exceed"):
        quantize.calibration_sweep(path, DATA["x_train"][:10], DATA["x_test"], DATA["y_test"], sizes=(20,))


def test_modelopt_session_ignores_stub_tensorrt_and_shows_its_log_on_failure():
    from modelopt.onnx import trt_utils

    from lab_utils.course.probe import tensorrt_runtime_present

    before = trt_utils.TRT_PYTHON_AVAILABLE
    with quantize._modelopt_session("probe"):
        inside = trt_utils.TRT_PYTHON_AVAILABLE
        print("calibrating...")  # captured, not shown
    assert trt_utils.TRT_PYTHON_AVAILABLE == before
    if not tensorrt_runtime_present():
        assert inside is False
    with pytest.raises(quantize.QuantizationError, match=r"(?s)probe failed: RuntimeError: boom.*last step"):
        with quantize._modelopt_session("probe"):
            print("last step")
            raise RuntimeError("boom")


def test_quiet_modelopt_passes_a_checkers_verdict_through_unchanged():
    """The exercise check runs the student's quantize call inside quiet_modelopt: its own exceptions (a Wrong
    verdict about the calibration data) must come out as they went in, not wrapped as a ModelOpt failure."""

    class Verdict(Exception):
        pass

    with pytest.raises(Verdict, match="^calibration data$"):
        with quantize.quiet_modelopt() as log:
            print("ModelOpt says something")
            raise Verdict("calibration data")
    assert "ModelOpt says something" in log.getvalue()
