"""Lab 03 inference helpers on the CPU: the workloads, ONNX export and parity, ONNX Runtime levels, the torch
paths, the comparison."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
if importlib.util.find_spec("onnxscript") is None:  # found, not imported: the exporter imports it when it runs
    pytest.skip("torch's ONNX exporter needs onnxscript: pip install onnxscript", allow_module_level=True)

from _lab03_data import digits_onnx

from lab_utils import models
from lab_utils.inference import compare, model_zoo, onnx, torch_paths
from lab_utils.timing import Timing

ROOT = Path(__file__).resolve().parents[1]
LAB03_MODULES = ["compare", "model_zoo", "onnx", "quantize", "tensorrt", "torch_paths"]


def _imported_after(statement: str, watched: tuple[str, ...]) -> list[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(m for m in {watched!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return out.stdout.split()


def test_import_loads_no_optional_dependency():
    """torch and onnx are lab 03's own; ONNX Runtime, ModelOpt, TensorRT and torchvision load when used."""
    statement = "import " + ", ".join(f"lab_utils.inference.{m}" for m in LAB03_MODULES)
    assert _imported_after(statement, ("onnxruntime", "modelopt", "tensorrt", "torchvision")) == []
    # the comparison and the exercises are numbers and tables: no torch
    assert _imported_after("import lab_utils.inference.compare, lab_utils.exercises.lab03", ("torch", "onnx")) == []


def test_full_size_resnet50_is_torchvisions_layout():
    model = models.BottleneckResNet().eval()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # torchvision.models.resnet50
    assert model_zoo.count_gflop(model, (3, 224, 224)) == pytest.approx(8.18, rel=0.01)  # 4.09 G multiply-adds


def test_cpu_resnet50_is_small_and_in_eval_mode():
    model, info = model_zoo.make_resnet50("cpu")
    assert not model.training and info.input_shape == (3, 64, 64) and info.params_m < 3
    assert "width 16" in info.source and "random weights" in str(info)
    with torch.no_grad():
        out = model(torch.randn(2, *info.input_shape))
    assert out.shape == (2, 1000) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="width"):
        model_zoo.make_resnet50("cpu", width=0)


def test_train_digits_cnn_is_accurate_and_restores_threads():
    threads = torch.get_num_threads()
    _, _, facts = digits_onnx()
    assert facts["accuracy"] > 0.9 and facts["test_images"] == 357 and facts["train_images"] == 1440
    assert torch.get_num_threads() == threads


def test_export_has_a_dynamic_batch_and_matches_pytorch():
    model, path, _ = digits_onnx()
    io = onnx.onnx_io(path)
    assert list(io["kind"]) == ["input", "output"]
    assert io["shape"][0] == ("batch", 1, 8, 8) and io["shape"][1] == ("batch", 10)
    x = models.digits_arrays()["x_test"]
    table = onnx.parity(model, path, [x[:1], x[:5], x[:64]])
    assert list(table["batch"]) == [1, 5, 64]
    assert (table["max_abs_diff"] < 1e-4).all() and (table["top1_agreement"] == 1.0).all()
    assert model.training is False  # the caller's model is left as it was (eval)


def test_export_folds_batchnorm_and_leaves_the_model_alone(tmp_path):
    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.LazyLinear(4))
    model(torch.randn(4, 3, 6, 6))  # settles the batch-norm statistics and the lazy layer
    path = onnx.export_onnx(model, tmp_path / "m.onnx", torch.randn(1, 3, 6, 6))
    counts = onnx.op_counts(path)
    assert "BatchNormalization" not in counts and counts["Conv"] == 1
    assert model.training  # restored
    model.eval()
    assert onnx.parity(model, path, [np.random.default_rng(0).standard_normal((3, 3, 6, 6))])[
        "max_abs_diff"][0] < 1e-4


def test_export_failure_names_the_operator(tmp_path):
    with pytest.raises(onnx.OnnxExportError) as err:
        onnx.export_onnx(onnx.unsupported_model(), tmp_path / "bad.onnx", torch.randn(2, 4, 4))
    assert err.value.operator is not None and "linalg_svd" in err.value.operator
    assert f"operator {err.value.operator} has no ONNX translation" in str(err.value)
    assert "Whitening" in str(err.value) and "\x1b[" not in str(err.value)
    with pytest.raises(TypeError, match="tensor"):
        onnx.export_onnx(onnx.unsupported_model(), tmp_path / "bad.onnx", [1, 2])


def test_failed_operator_reads_both_exporters():
    dynamo = "No ONNX function found for <OpOverload(op='aten._linalg_svd', overload='default')>. Failure"
    assert onnx.failed_operator(dynamo) == "aten._linalg_svd.default"
    assert onnx.failed_operator("translating node call_function[target=torch.ops.my.op.default]") == \
        "my.op.default"
    legacy = "Exporting the operator 'aten::unique_dim' to ONNX opset version 17 is not supported."
    assert onnx.failed_operator(legacy) == "aten::unique_dim"
    assert onnx.failed_operator("something else broke") is None


def test_ort_levels_fuse_the_graph(tmp_path):
    _, path, _ = digits_onnx()
    levels = onnx.ort_levels()
    assert levels[0] == "disable" and levels[-1] == "all" and {"basic", "extended"} <= set(levels)
    x = models.digits_arrays()["x_test"][:16]
    table = onnx.fusion_table(path, tmp_path, x, reps=2, warmup=1)
    assert list(table["level"]) == levels
    by = table.set_index("level")
    assert by.loc["extended", "nodes"] < by.loc["disable", "nodes"]  # Conv+Relu -> FusedConv
    assert "FusedConv[microsoft]" in by.loc["extended", "fused"] and by.loc["disable", "fused"] == ""
    assert (table["p50_ms"] > 0).all() and table["speedup_vs_disable"].iloc[0] == 1.0
    with pytest.raises(ValueError, match="disable"):
        onnx.ort_session(path, "turbo")


def test_ort_predict_batches_and_casts():
    _, path, _ = digits_onnx()
    x = models.digits_arrays()["x_test"][:10].astype(np.float64)
    session = onnx.ort_session(path)
    whole, parts = onnx.ort_predict(session, x), onnx.ort_predict(session, torch.from_numpy(x), 3)
    assert whole.shape == (10, 10) and np.allclose(whole, parts, atol=1e-5)
    t = onnx.time_ort(session, x, reps=2, warmup=0)
    assert isinstance(t, Timing) and t.reps == 2


def test_torch_runners_on_cpu_offer_eager_only():
    model, info = model_zoo.make_resnet50("cpu", width=4, image_size=32)
    runners = list(torch_paths.torch_runners(model, torch.randn(2, *info.input_shape)))
    assert [(r.name, r.precision, r.batch) for r in runners] == [("eager", "fp32", 2)]
    assert runners[0]().shape == (2, 1000)
    assert torch_paths.time_torch(runners[0], "cpu", reps=2, warmup=0).reps == 2
    with pytest.raises(ValueError, match="unknown steps"):
        next(torch_paths.torch_runners(model, torch.randn(2, *info.input_shape), steps=("warp",)))


def test_fp32_semantics_and_modes():
    assert "IEEE" in torch_paths.set_fp32_semantics("cpu")
    assert torch_paths._no_cudagraph_mode("max-autotune") == "max-autotune-no-cudagraphs"
    assert torch_paths._no_cudagraph_mode("reduce-overhead") == "default"
    assert torch_paths._no_cudagraph_mode("default") == "default"
    with pytest.raises(ValueError, match="bf16"):
        torch_paths._amp_dtype("int4")


def _tf32_state():
    switches = torch_paths._tf32_switches()
    if switches is None:
        return (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    return tuple(s.fp32_precision for s in switches)


@pytest.mark.parametrize(("mode", "cudnn"), [("default", "tf32"), ("ieee", "ieee")])
def test_fp32_mode_sets_one_baseline_and_restores_the_settings(mode, cudnn):
    before = _tf32_state()
    with torch_paths.fp32_mode(mode):
        inside = _tf32_state()
        if torch_paths._tf32_switches() is not None:  # torch >= 2.9: cuDNN conv and RNN together, matmul IEEE
            assert inside == (cudnn, cudnn, "ieee")
            if mode == "default":  # PyTorch's defaults: the legacy view stays readable
                assert torch.backends.cudnn.allow_tf32 is True
        else:
            assert inside == (mode == "default", False)
    assert _tf32_state() == before
    with pytest.raises(ValueError, match="ieee"):
        with torch_paths.fp32_mode("tf32"):
            pass


def test_torch_steps_change_one_knob_each():
    assert torch_paths.TORCH_STEPS == ("eager-ieee", "eager", "autocast", "channels-last", "compile", "cuda-graph")
    model, info = model_zoo.make_resnet50("cpu", width=4, image_size=32)
    runners = list(torch_paths.torch_runners(model, torch.randn(2, *info.input_shape), steps=("eager-ieee", "eager")))
    assert [(r.name, r.precision) for r in runners] == [("eager", "fp32")]  # the CPU has no TF32: one FP32


def test_wilson_interval_and_mcnemar():
    lo, hi = compare.wilson_interval(353, 357)
    assert (round(lo, 3), round(hi, 3)) == (0.972, 0.996)
    assert compare.wilson_interval(357, 357)[1] == 1.0 and compare.wilson_interval(0, 10)[0] == 0.0
    with pytest.raises(ValueError, match=r"confidence must lie in \(0, 1\)"):
        compare.wilson_interval(5, 10, confidence=1.0)
    assert compare.mcnemar_p(1, 0) == 1.0 and compare.mcnemar_p(0, 0) == 1.0
    assert compare.mcnemar_p(0, 6) == pytest.approx(2 / 64) and compare.mcnemar_p(10, 0) < 0.01
    with pytest.raises(ValueError, match="0..n"):
        compare.wilson_interval(5, 4)


def test_accuracy_report_counts_images():
    y = np.array([0, 1, 1, 0, 1])
    ref = np.eye(2)[[0, 1, 0, 0, 1]]  # 4 of 5 right
    other = np.eye(2)[[0, 1, 1, 1, 1]]  # fixes image 2, breaks image 3: 4 of 5 right
    report = compare.accuracy_report({"fp32": ref, "int8": other}, y).set_index("precision")
    assert report.loc["int8", "correct"] == 4 and report.loc["int8", "delta_images"] == 0
    assert (report.loc["int8", "changed"], report.loc["int8", "fixed"], report.loc["int8", "broken"]) == (2, 1, 1)
    assert report.loc["int8", "agreement"] == pytest.approx(0.6) and report.loc["int8", "mcnemar_p"] == 1.0
    assert report.loc["fp32", "ci95_low"] < 0.8 < report.loc["fp32", "ci95_high"]
    with pytest.raises(ValueError, match="reference"):
        compare.accuracy_report({"int8": other}, y)


def test_launch_overhead_notes_read_recorded_throughputs():
    values = {"resnet50_torch-eager_fp32_b1_images_per_s": 322.6, "resnet50_torch-autocast_bf16_b1_images_per_s": 240.9,
              "resnet50_torch-autocast_bf16_b32_images_per_s": 4369.2,
              "resnet50_torch-autocast_bf16_b128_images_per_s": 14425.9,
              "resnet50_torch-cuda-graph_bf16_b32_images_per_s": 16773.3}
    notes = compare.launch_overhead_notes(values)
    assert len(notes) == 2
    assert "eager FP32 3.10 ms, autocast BF16 4.15 ms (slower)" in notes[0]
    assert "14,426 images/s, 86% of the CUDA graph's 16,773 at batch 32" in notes[1]
    assert compare.launch_overhead_notes({}) == []


def test_the_export_check_model_differs_between_train_and_eval():
    model = model_zoo.export_check_model()
    assert model.training
    x = torch.randn(8, 1, 8, 8)
    with torch.no_grad():
        a, b = model(x), model(x)
        model.eval()
        c, d = model(x), model(x)
    assert not torch.equal(a, b) and torch.equal(c, d)


def test_trained_digits_is_trained_once():
    assert model_zoo.trained_digits(3) is model_zoo.trained_digits(3)


def test_accuracy_and_logit_error():
    logits = np.array([[2.0, 1.0], [0.0, 3.0], [1.0, 0.5]])
    assert compare.accuracy(logits, [0, 1, 1]) == pytest.approx(2 / 3)
    err = compare.logit_error(logits * 1.1, logits)
    assert err["top1_agreement"] == 1.0 and err["rel_logit_error"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="labels"):
        compare.accuracy(logits, [0, 1])


def test_comparison_table_plot_and_lookup():
    cmp = compare.Comparison()
    cmp.set_reference("digits", 0.98)
    t = Timing("x", np.array([2.0, 2.0, 4.0]), "cpu", 0, False)
    cmp.add("digits", "onnxruntime all", "int8", 32, t, accuracy=0.97)
    cmp.add("digits", "onnxruntime all", "fp32", 64, p50_ms=4.0, accuracy=0.98)
    cmp.add("digits", "tensorrt", "int8", 357, accuracy=0.975)
    df = cmp.frame()
    assert list(df.columns) == compare.COMPARISON_COLUMNS
    assert df["images_per_s"].iloc[0] == pytest.approx(16000) and df["accuracy_delta_points"].iloc[0] == \
        pytest.approx(-1.0)
    assert cmp.throughput("digits", "onnxruntime all", "fp32", 64) == pytest.approx(16000)
    assert np.isnan(cmp.throughput("digits", "tensorrt", "fp8", 1))
    import matplotlib

    matplotlib.use("Agg")
    fig = compare.plot_comparison(df, "digits")
    assert len(fig.axes[0].lines) == 2  # the row without a latency is not drawn
    with pytest.raises(ValueError, match="Comparison.frame"):
        compare.plot_comparison(pd.DataFrame({"a": [1]}))
    with pytest.raises(ValueError, match="batch"):
        cmp.add("digits", "x", "fp32", 0, p50_ms=1.0)


def test_quiet_autotuning_summarizes_instead_of_printing(monkeypatch, capsys):
    """Inductor's autotuning tables and 'out of resource' errors become one summary; nothing else changes."""
    import logging

    from torch._inductor import config as inductor_config
    from torch._inductor import select_algorithm

    seen = []
    monkeypatch.setattr(select_algorithm.AlgorithmSelectorCache, "log_results",
                        staticmethod(lambda *a, **k: seen.append((a, k))))

    class Node:
        def __init__(self, *size):
            self.size = size

        def get_size(self):
            return self.size

    class Choice:
        def __init__(self, name, description=""):
            self.name, self.description = name, description

    before = inductor_config.max_autotune_report_choices_stats
    summary: dict = {}
    with torch_paths.quiet_autotuning(summary):
        assert inductor_config.autotune_num_choices_displayed == 0
        assert not inductor_config.max_autotune_report_choices_stats
        logging.getLogger("torch._inductor.select_algorithm").error(
            "Runtime error during autotuning: \n%s. \nIgnoring this choice.", "OutOfMemoryError: out of resource")
        small = {Choice("mm"): 0.02, Choice("triton_mm_1", "BLOCK_M=64"): 0.01}
        select_algorithm.AlgorithmSelectorCache.log_results("mm", [Node(64, 32), Node(32, 16)], small, 0.1, 0.1)
        big = {Choice("mm"): 0.05, Choice("triton_mm_7", "BLOCK_M=128"): 0.04, Choice("triton_mm_8"): float("inf")}
        select_algorithm.AlgorithmSelectorCache.log_results("addmm", [Node(16), Node(256, 64), Node(64, 16)], big,
                                                            0.1, 0.1, hint_override=None)
    assert len(seen) == 2 and seen[1][1] == {"hint_override": None}  # Inductor's own call still happens
    assert inductor_config.max_autotune_report_choices_stats == before
    assert summary["gemms"] == 2 and summary["choices"] == 5 and summary["skipped"] == 1
    assert summary["biggest"]["op"] == "addmm(16, 256x64, 64x16)" and summary["biggest"]["kernel"] == "triton_mm_7"
    assert summary["biggest"]["cublas_ms"] == 0.05
    assert "Runtime error" not in capsys.readouterr().err
    line = torch_paths.autotuning_line(summary)
    assert "5 candidate kernels for 2 matrix multiplications" in line and "shared memory" in line
    assert "triton_mm_7" in line
    assert "from the cache" in torch_paths.autotuning_line({})
