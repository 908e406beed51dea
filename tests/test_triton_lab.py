"""Lab 04 against the compose stack's server: where models are written, and what is deployed there."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from lab_utils.serving import repository as triton_repo
from lab_utils.serving import server as triton_server
from lab_utils.serving import steps as triton_lab


def test_own_server_writes_under_the_work_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(triton_server.URL_ENV, raising=False)
    monkeypatch.setenv(triton_lab.REPOSITORY_ENV, str(tmp_path / "ignored"))
    assert triton_lab.model_repository(tmp_path) == tmp_path / "models"


def test_external_server_uses_the_shared_repository(tmp_path, monkeypatch):
    monkeypatch.setenv(triton_server.URL_ENV, "http://triton:8000")
    monkeypatch.setenv(triton_lab.REPOSITORY_ENV, str(tmp_path))
    assert triton_lab.model_repository(tmp_path / "work") == tmp_path


def test_external_server_without_a_shared_repository_says_how_to_fix_it(tmp_path, monkeypatch):
    monkeypatch.setenv(triton_server.URL_ENV, "http://triton:8000")
    monkeypatch.delenv(triton_lab.REPOSITORY_ENV, raising=False)
    with pytest.raises(RuntimeError, match="NVLAB_MODEL_REPOSITORY is not.*unset TRITON_URL"):
        triton_lab.model_repository(tmp_path)
    monkeypatch.setenv(triton_lab.REPOSITORY_ENV, str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="not a writable folder"):
        triton_lab.model_repository(tmp_path)


def test_external_server_gets_the_onnx_runtime_form_of_the_model(tmp_path):
    cfg = triton_repo.mlp_config("mlp", kind="KIND_GPU", dynamic_batching={"max_queue_delay_microseconds": 200})
    own = triton_lab.serving_config(cfg, SimpleNamespace(external=False))
    assert own == cfg
    ngc = triton_lab.serving_config(cfg, SimpleNamespace(external=True))
    assert ngc["platform"] == "onnxruntime_onnx" and "backend" not in ngc and "parameters" not in ngc
    assert ngc["dynamic_batching"] == cfg["dynamic_batching"] and ngc["instance_group"] == cfg["instance_group"]
    # valid for Triton's schema and the semantic checks, and served from the model.onnx the builder writes
    triton_repo.validate_config(ngc, gpus=1)
    assert triton_repo.model_file(triton_repo.parse_config(ngc)) == "model.onnx"


# --- the headline from stable windows only ------------------------------------------------------------------


def _row(step, tput, p95, stable, **kw):
    return {"step": step, "concurrency": 8, "throughput_infer_s": tput, "p50_ms": p95 / 2, "p95_ms": p95,
            "p99_ms": p95 * 1.1, "mean_ms": p95 / 2, "errors": 0, "stable": stable, "windows": 4, "window_s": 0.5,
            "server_batch_avg": 1.0, **kw}


def test_headline_ratio_only_from_stable_measurements():
    base, batched = _row("1 baseline", 300.0, 68.0, True), _row("2 dynamic batching", 1700.0, 11.0, True)
    head = triton_lab.batching_headline(base, batched)
    assert head.stable and head.ratio == pytest.approx(1700 / 300) and "5.67x" in head.text
    # the committed reference run: a baseline marked stable False, and a 5.69x printed from it
    head = triton_lab.batching_headline({**base, "stable": False}, batched)
    assert head.ratio is None and not head.stable
    assert "no ratio" in head.text and "1 baseline" in head.text and "x the throughput" not in head.text
    assert "quick=False" in head.text  # measured once: longer windows would help
    head = triton_lab.batching_headline(base, {**batched, "stable": False, "attempts": 2, "window_s": 1.0})
    assert head.ratio is None and "even with longer windows" in head.text and "1 s" in head.text


def test_step_table_leaves_ratios_next_to_unstable_rows_empty():
    rows = [_row("1", 100.0, 10.0, True), _row("2", 200.0, 8.0, True), _row("3", 300.0, 9.0, False),
            _row("4", 330.0, 9.0, True)]
    df = triton_lab.step_table(rows)
    assert df["x_prev_throughput"].tolist()[1] == pytest.approx(2.0)
    assert df["x_prev_throughput"].isna().tolist() == [True, False, True, True]
    assert df["x_prev_p95"].isna().tolist() == [True, False, True, True]


def test_measure_extends_an_unstable_measurement_with_longer_windows(monkeypatch):
    calls = []

    class Result:
        def __init__(self, stable):
            self.stable = stable

        def to_row(self):
            return {"throughput_infer_s": 10.0, "stable": self.stable, "windows": 4}

    def fake_run_load(url, model, make_inputs, concurrency, **kw):
        calls.append((kw["window_s"], kw["max_windows"]))
        return Result(stable=len(calls) == 2)

    monkeypatch.setattr(triton_lab.triton_load, "run_load", fake_run_load)
    server = SimpleNamespace(grpc_url="h:1", http_url="http://h:2", alive=lambda: True)  # a running server
    settings = triton_lab.LoadSettings(window_s=1.0, max_windows=10, extensions=2, extension_windows=6)
    row = triton_lab.measure(server, "m", {}, 4, settings)
    assert calls == [(1.0, 10), (2.0, 6)] and row["stable"] and row["attempts"] == 2 and row["window_s"] == 2.0
    calls.clear()
    monkeypatch.setattr(triton_lab.triton_load, "run_load", lambda *a, **kw: calls.append(kw) or Result(False))
    row = triton_lab.measure(server, "m", {}, 4, triton_lab.LoadSettings(extensions=1))
    assert len(calls) == 2 and not row["stable"] and row["attempts"] == 2  # said unstable, not hidden
    quick = triton_lab.LoadSettings.for_run(quick=True, gpu=False)
    assert quick.extensions == 0 and triton_lab.LoadSettings.for_run(quick=False, gpu=True).extensions >= 1


def test_perf_analyzer_beside_the_generator():
    from lab_utils.serving import perf_analyzer

    ours = _row("dynamic batching", 1700.0, 10.0, True, mean_ms=9.4, server_request_us=7500.0,
                server_queue_us=3500.0, server_compute_infer_us=3800.0)
    pa = perf_analyzer.parse_perf_analyzer_csv(
        "Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,"
        "Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency\n"
        "8,1794.6,21,1337,3561,38,3790,25,6,8803,9981,10433,11702\n")[0]
    table = triton_lab.perf_analyzer_table(ours, pa)
    assert list(table["tool"]) == ["course generator (Python, asyncio)", "perf_analyzer (C++)", "perf_analyzer / ours"]
    assert table["throughput_infer_s"].iloc[2] == pytest.approx(1794.6 / 1700)
    assert table["p95_ms"].iloc[2] == pytest.approx(10.433 / 10.0)
    assert triton_lab.perf_analyzer_verdict(ours, pa).startswith("agree within 10%")
    far = {**ours, "throughput_infer_s": 1200.0, "p95_ms": 15.0, "mean_ms": 13.0}
    verdict = triton_lab.perf_analyzer_verdict(far, pa)
    assert verdict.startswith("differ by more than 10%") and "C++ client costs less per request" in verdict


# --- the tier names the stand-in server -------------------------------------------------------------------


def _report(where):
    from lab_utils.course import probe

    comps = {"tensorrt": probe.Component("TensorRT", False), "prometheus": probe.Component("Prometheus", True),
             "tritonserver": probe.Component("Triton server", True, None, where)}
    return probe.EnvReport("nvml", "580.159.04", "13.0", [probe.GpuInfo(0, "NVIDIA H200")], None,
                           {"cuda_available": True, "device_count": 1, "nccl": "2.28.9"}, comps, True, [], [], [])


def test_lab04_tier_is_not_full_with_the_wheel_server(monkeypatch):
    from lab_utils.course import probe

    monkeypatch.setattr(probe, "pytriton_server", lambda: Path("/site/pytriton/tritonserver/bin/tritonserver"))
    wheel = {t.lab: t for t in probe.lab_tiers(_report("/site/pytriton/tritonserver/bin/tritonserver"))}["04"]
    assert wheel.tier == "partial" and "nvidia-pytriton" in wheel.substitutes and "NGC" in wheel.substitutes
    ngc = {t.lab: t for t in probe.lab_tiers(_report("/opt/tritonserver/bin/tritonserver"))}["04"]
    assert ngc.tier == "full"
