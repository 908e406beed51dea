import json
import tempfile
from pathlib import Path

import pandas as pd
import pytest

from lab_utils.course import catalog, results
from nvlab import cli


def test_doctor_exits_zero_and_prints_json(capsys):
    assert cli.main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["can_run"] is True and len(report["tiers"]) == len(catalog.LABS)


def test_doctor_require_gpu_fails_with_reason_without_gpu(capsys):
    from lab_utils.course.probe import probe

    if probe().gpu_usable:
        pytest.skip("a GPU is usable here")
    assert cli.main(["doctor", "--require-gpu"]) == 2
    assert "no GPU is usable" in capsys.readouterr().err


def test_doctor_fails_when_a_required_package_is_missing(monkeypatch, capsys):
    monkeypatch.setattr("lab_utils.course.probe.REQUIRED", ("numpy", "surely_not_installed_pkg"))
    assert cli.main(["doctor"]) == 1
    assert "surely_not_installed_pkg" in capsys.readouterr().err


def test_unknown_lab_lists_valid_ones(capsys):
    assert cli.main(["run", "17"]) == 2
    err = capsys.readouterr().err
    assert "unknown lab '17'" in err and "00 (environment)" in err and "01 (cuda_timing)" in err


def test_run_needs_labs_or_all(capsys):
    assert cli.main(["run"]) == 2
    assert "--all" in capsys.readouterr().err


def test_update_expected_needs_solutions(capsys):
    assert cli.main(["run", "00", "--update-expected"]) == 2


def test_build_labs_check_passes_on_the_checkout(capsys):
    assert cli.main(["build-labs", "--check"]) == 0


def test_untyped_parameter_values_are_literals():
    from nvlab.ops.notebooks import literal

    assert literal("True") is True and literal("[1, 2]") == [1, 2] and literal("abc") == "abc"


def test_report_compares_with_reference_as_ratios(tmp_path, capsys):
    ref, run = tmp_path / "ref", tmp_path / "run"
    results.Recorder("01", "full", "NVIDIA H200", {}, ref).record("matmul_bf16", 800.0, "TFLOP/s")
    rec = results.Recorder("01", "cpu", "laptop", {}, run)
    rec.record("matmul_bf16", 0.2, "TFLOP/s")
    rec.record("only_here", 1.0, "s")
    assert cli.main(["report", str(run), "--reference", str(ref), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["matmul_bf16"]["ratio"] == pytest.approx(0.2 / 800)
    assert rows["only_here"]["reference"] is None
    assert cli.main(["report", str(run), "--reference", str(ref)]) == 0
    assert "matmul_bf16" in capsys.readouterr().out


def test_a_cpu_runs_async_ratio_is_not_divided_by_the_h200s():
    # Lab 01's host-clock-over-events ratio is ~1 on a CPU (no asynchronous launch) and 0.023 on the H200: their
    # quotient (~44-57) was shown as if the CPU were 57x something. A ratio is compared only within its tier.
    h200 = next(r["value"] for r in results.load(results.repo_root() / "reference_runs" / "h200")
                if r["lab"] == "01" and r["name"] == "async_naive_over_events")  # the committed run's, ~0.02-0.03
    with tempfile.TemporaryDirectory() as run:
        rec = results.Recorder("01", "cpu", "laptop", {}, Path(run))
        rec.record("async_naive_over_events", 1.29, "ratio", "host clock without synchronize / CUDA events")
        rec.record("matmul_fp32", 0.05, "TFLOP/s")
        table = results.compare(run).set_index("name")
    assert table.loc["async_naive_over_events", "reference"] == pytest.approx(h200) and h200 < 0.1  # still shown
    assert pd.isna(table.loc["async_naive_over_events", "ratio"])
    assert table.loc["matmul_fp32", "ratio"] == pytest.approx(0.05 / table.loc["matmul_fp32", "reference"])
    with tempfile.TemporaryDirectory() as run:  # the same tier: compared
        results.Recorder("01", "full", "NVIDIA H200", {}, Path(run)).record("async_naive_over_events", 0.03, "ratio")
        assert results.compare(run).set_index("name").loc["async_naive_over_events", "ratio"] == pytest.approx(
            0.03 / h200)


def test_report_takes_the_committed_reference_of_the_runs_tier():
    """Lab 02 has a one-GPU reference (h200, partial: gloo ranks) and a two-GPU one (h200x2, full): a run is compared
    with the one of its tier, a CPU run with the first holding the name."""
    name = "ddp_images_per_s_2"
    refs = results.repo_root() / "reference_runs"
    want = {tier: next(r["value"] for r in results.load(refs / d) if r["lab"] == "02" and r["name"] == name)
            for tier, d in (("partial", "h200"), ("full", "h200x2"))}
    assert want["partial"] != want["full"]
    for tier in ("partial", "full", "cpu"):
        with tempfile.TemporaryDirectory() as run:
            results.Recorder("02", tier, "x", {}, Path(run)).record(name, 1.0, "images/s")
            got = results.compare(run).set_index("name").loc[name, "reference"]
        assert got == want.get(tier, want["partial"]), tier


def test_a_run_that_recorded_nothing_compares_to_an_empty_table(tmp_path, capsys):
    # lab 08 on a GPU without MLflow records nothing; its last cell filters the table by lab and raised KeyError: 'lab'
    table = results.compare(tmp_path)
    assert table.empty and list(table.columns) == results.COMPARE_COLUMNS
    assert table[table["lab"] == "08"].empty
    assert cli.main(["report", str(tmp_path), "--json"]) == 2  # a trainer's report of nothing is an error
    assert "no results_*.json" in capsys.readouterr().err


def test_report_on_missing_folder_explains(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "nope")]) == 2
    assert "not a folder of results" in capsys.readouterr().err


def test_recorder_rejects_bad_names_and_writes_nan_as_null(tmp_path):
    rec = results.Recorder("01", "cpu", "x", {}, tmp_path)
    with pytest.raises(ValueError, match="name"):
        rec.record("", 1.0, "s")
    rec.record("skipped", float("nan"), "TFLOP/s")
    assert json.loads((tmp_path / "results_01.json").read_text())[0]["value"] is None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lab_serves_labs_on_loopback_with_a_token(tmp_path):
    """`nvlab lab` starts a real JupyterLab: the token is required, and it listens on loopback only."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "JUPYTER_TOKEN"}
    env["JUPYTER_RUNTIME_DIR"] = str(tmp_path)  # keep the test's server files out of the user's
    proc = subprocess.Popen([sys.executable, "-m", "nvlab", "lab", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        first = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/lab?token=" in first
        token = first.strip().rsplit("token=", 1)[1]
        assert len(token) >= 32
        deadline, status = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents?token={token}", timeout=2) as r:
                    status, listing = r.status, json.loads(r.read())
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.3)
        assert status == 200, "JupyterLab did not become ready within 60 s"
        assert any(item["name"] == "00_environment.ipynb" for item in listing["content"])
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents", timeout=5)
        assert denied.value.code == 403
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_lab_says_ipykernels_tcp_warning_once_not_at_every_kernel_start(tmp_path):
    # A real kernel's log: ipykernel warns about TCP at every start; the student saw it once per notebook opened.
    import io
    import subprocess
    import sys

    conn = tmp_path / "kernel.json"
    kernel = subprocess.Popen([sys.executable, "-m", "ipykernel_launcher", "-f", str(conn)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        first = kernel.stderr.readline()  # the kernel logs the warning as it binds its sockets
    finally:
        kernel.kill()
        kernel.wait(timeout=30)
    assert cli._TCP_WARNING in first, first
    out = io.StringIO()
    cli.relay_log(iter([first, "[I ServerApp] a kernel started\n"] * 8), out)
    lines = out.getvalue().splitlines()
    assert lines.count(cli.TCP_NOTE) == 1 and not any(cli._TCP_WARNING in ln for ln in lines), lines
    assert lines.count("[I ServerApp] a kernel started") == 8  # the rest of the log untouched


def test_course_setup_says_each_step_it_takes(tmp_path):
    # ./course's first setup ran a minute with quiet installers and nothing on the terminal. Its steps here print
    # their lines; the installers themselves are replaced (this test installs nothing).
    import subprocess

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("")
    (venv / "bin" / "python").symlink_to(Path(__import__("sys").executable))
    script = (f'set -e; source ./course; VENV={venv}; pip_install() {{ :; }}; install_tensorrt() {{ :; }}; '
              'compile_all() { :; }; python() { :; }; setup lab')
    run = subprocess.run(["bash", "-c", script], cwd=Path(cli.__file__).parents[1], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    steps = [ln for ln in run.stderr.splitlines() if ln.startswith("course: ")]
    assert steps[0].startswith(f"course: setting up {venv}") and "about a minute" in steps[0], steps
    assert any("installing the course and its dependencies" in s for s in steps), steps
    assert any("NumPy 1 environment" in s for s in steps) and any("compiling" in s for s in steps), steps
    assert steps[-1].startswith("course: set up in ") and steps[-1].endswith(" s"), steps


def test_stub_env_prints_the_built_environment(capsys):
    """`nvlab stub-env` (./course runs it at setup): the python backend's NumPy 1 environment, built once."""
    from lab_utils.compat import numpy1_env

    assert cli.main(["stub-env"]) == 0
    path = Path(json.loads(capsys.readouterr().out)["stub_env"])
    assert path == numpy1_env.default_stub_env() and numpy1_env.stub_env_ready(path)
