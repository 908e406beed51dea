"""Lab 08's tracking: a real MLflow server (started once for the module), training runs logged and compared, the
best registered with aliases, lineage from a served version back to its run, data hash and commit, the retraining
pipeline, and nothing left after stop() or after the owning Python is SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lab_utils.mlops import drift, pipeline
from lab_utils.mlops import tracking as tr
from lab_utils.procs import group_members, pid_alive, popen_owned, port_free, stop_group

pytestmark = pytest.mark.skipif(tr.mlflow_missing() is not None, reason=str(tr.mlflow_missing()))


@pytest.fixture(scope="module")
def server(shared_tracking):
    return shared_tracking  # shared with lab 08's checks (tests/conftest.py)


@pytest.fixture(scope="module")
def data():
    return tr.digits_data()


@pytest.fixture(scope="module")
def runs(server, data):
    """Two runs of the service's classifier: 1 epoch at lr 0.01 (weaker) and 3 epochs at lr 0.05."""
    weak = tr.log_training_run(server, epochs=1, lr=0.01, seed=0, run_name="weak")
    strong = tr.log_training_run(server, epochs=3, lr=0.05, seed=1, run_name="strong")
    return weak, strong


def _head() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(tr.__file__).parent, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else tr.NOT_GIT


def test_server_is_ready_and_owned(server):
    assert server.ready() and server.alive() and server.url.startswith("http://127.0.0.1:")
    assert len(group_members(server.pid)) >= 2  # the mlflow CLI and its uvicorn server, one process group
    assert server.folder.name.startswith(f"nvlab-mlflow-{os.getpid()}-") and server.artifacts_path.is_dir()
    log = server.log_path.read_text()  # the whole log: lab 08's checks, on the same server, may have run first
    assert "Uvicorn running" in log or "Application startup complete" in log


def test_runs_are_logged_with_history_hash_and_commit(server, runs, data):
    weak, strong = runs
    assert strong.metrics["val_accuracy"] > weak.metrics["val_accuracy"]
    assert weak.data_sha256 == tr.dataset_sha256(data["x_train"].astype(np.float32), data["y_train"])
    assert strong.git_commit == _head()
    hist = tr.metric_history(server, strong.run_id, "val_accuracy")
    assert list(hist["step"]) == [1, 2, 3] and hist["value"].between(0, 1).all()  # one point per epoch
    files = [f.path for f in server.client().list_artifacts(strong.run_id, tr.MODEL_ARTIFACT)]
    assert f"{tr.MODEL_ARTIFACT}/{tr.ONNX_FILE}" in files
    df = tr.compare_runs(server)
    assert list(df["run_name"][:2]) == ["strong", "weak"]  # best val_accuracy first
    assert {"lr", "epochs", "val_accuracy", "val_loss", "train_loss", "data_sha256", "git_commit"} <= set(df.columns)
    assert df.loc[df.run_name == "weak", "lr"].iloc[0] == 0.01


def test_register_best_aliases_and_lineage(server, runs, data):
    weak, strong = runs
    run_id, version = tr.register_best(server, alias="champion")
    assert run_id == strong.run_id
    v2 = tr.register_run(server, weak.run_id, alias="challenger")
    assert int(v2) == int(version) + 1
    champ = tr.lineage(server, alias="champion")
    assert (champ.run_id, champ.version, champ.run_name) == (strong.run_id, version, "strong")
    assert champ.data_sha256 == strong.data_sha256 == tr.dataset_sha256(data["x_train"].astype(np.float32),
                                                                         data["y_train"])
    assert champ.git_commit == _head() and champ.params["epochs"] == "3" and "champion" in champ.aliases
    assert tr.lineage(server, version=v2).run_id == weak.run_id
    table = champ.table()
    assert table.set_index("what").loc["git commit", "value"] == _head()
    # the alias moves: the challenger becomes champion
    tr.set_alias(server, tr.REGISTERED_MODEL, "champion", v2)
    assert tr.lineage(server, alias="champion").run_id == weak.run_id
    tr.set_alias(server, tr.REGISTERED_MODEL, "champion", version)


def test_the_registered_onnx_is_the_model_that_scored(server, runs, data, tmp_path):
    import onnxruntime as ort

    _, strong = runs
    tr.register_run(server, strong.run_id, alias="scored")
    path = tr.download_onnx(server, alias="scored", dst=tmp_path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = ((data["x_test"][:, None] - data["mean"]) / data["std"]).astype(np.float32)
    acc = float((sess.run(None, {sess.get_inputs()[0].name: x})[0].argmax(1) == data["y_test"]).mean())
    assert acc == pytest.approx(strong.metrics["val_accuracy"], abs=1 / 357)


def test_bad_requests_say_what_to_do(server, data):
    with pytest.raises(ValueError, match="exactly one of version"):
        tr.lineage(server, version=1, alias="champion")
    with pytest.raises(tr.TrackingError, match="has no alias 'nobody'"):
        tr.lineage(server, alias="nobody")
    with pytest.raises(ValueError, match="MLflow reserves"):
        tr.set_alias(server, tr.REGISTERED_MODEL, "latest", 1)
    with pytest.raises(ValueError, match="not normalized"):
        tr.train_digits((data["x_train"] - 5) * 9, data["y_train"], data["x_test"], data["y_test"], epochs=1)
    with pytest.raises(ValueError, match=r"shape \(N, 8, 8\)"):
        tr.train_digits(np.zeros((4, 28, 28)), np.zeros(4, int), data["x_test"], data["y_test"])
    with pytest.raises(TypeError, match="started TrackingServer"):
        tr.compare_runs("localhost:5000")
    with pytest.raises(tr.TrackingError, match="no experiment 'nope'"):
        tr.compare_runs(server, "nope")


def test_retraining_pipeline_registers_a_challenger(server, runs, data):
    x_new = drift.rotated(data["x_train"], 25)
    x_val = drift.rotated(data["x_test"], 25)
    lines: list[str] = []
    rec = pipeline.retrain(server, x_new, data["y_train"], x_val, data["y_test"], epochs=3, log=lines.append)
    assert rec.ok, rec.table()
    assert list(rec.table()["step"]) == list(pipeline.STEPS) and len(lines) == len(pipeline.STEPS)
    lin = tr.lineage(server, alias="challenger")
    assert (lin.version, lin.run_id) == (rec.version, rec.run_id)
    assert lin.data_sha256 == tr.dataset_sha256(x_new, data["y_train"]) and lin.data_name == "digits-retrain"
    # a gate it cannot pass: stops at evaluate, registers nothing, the alias stays
    bad = pipeline.retrain(server, x_new, data["y_train"], x_val, data["y_test"], epochs=1, min_accuracy=0.999,
                           log=None)
    assert not bad.ok and [s.name for s in bad.steps][-1] == "evaluate" and bad.version is None
    assert "below the gate" in bad.steps[-1].error
    with pytest.raises(pipeline.PipelineError, match="step 'evaluate' failed"):
        bad.raise_for_failure()
    assert tr.lineage(server, alias="challenger").version == rec.version
    missing = pipeline.retrain(server, x_new[data["y_train"] != 3], data["y_train"][data["y_train"] != 3], x_val,
                               data["y_test"], log=None)
    assert missing.steps[0].name == "check data" and "class(es) [3]" in missing.steps[0].error


def test_a_taken_port_is_named_and_nothing_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(tr.TrackingError, match=rf"port={port} is already in use on 127.0.0.1 by pid"):
            tr.TrackingServer(port=port).start()
    with pytest.raises(ValueError, match="workers=0"):
        tr.TrackingServer(workers=0)


def test_missing_mlflow_is_said_with_the_install_line(monkeypatch):
    monkeypatch.setattr(tr, "mlflow_missing", lambda: "mlflow is not installed in python: pip install 'mlflow>=2.16'")
    s = tr.TrackingServer()
    with pytest.raises(tr.MlflowMissing, match="pip install 'mlflow>=2.16'"):
        s.start()
    assert s.folder is None and s.pid is None


def test_stop_leaves_no_process_port_or_folder(server):
    pids, folder, port = group_members(server.pid), server.folder, server.port
    assert pids and folder.is_dir()
    server.stop()
    server.stop()  # twice is fine
    assert not any(pid_alive(p) for p in pids) and not folder.exists() and port_free(port)
    assert server not in tr.TrackingServer.running()


CHILD = r"""
import json, threading
from lab_utils.mlops.tracking import TrackingServer
from lab_utils.procs import group_members
s = TrackingServer().start()
print(json.dumps({"folder": str(s.folder), "pids": group_members(s.pid), "port": s.port}), flush=True)
threading.Event().wait(120)
"""


def _mlflow_processes(folder: str) -> list[int]:
    """Live processes whose command line names the server's folder, or that run in it."""
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(d / "cwd").removesuffix(" (deleted)")
        except OSError:
            continue
        if (folder in cmd or cwd == folder) and pid_alive(int(d.name)):
            out.append(int(d.name))
    return out


def test_nothing_left_when_the_owner_is_killed():
    child = popen_owned([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(child.stdout.readline())
        folder, pids, port = info["folder"], info["pids"], info["port"]
        assert len(pids) >= 2 and all(pid_alive(p) for p in pids) and os.path.isdir(folder)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        deadline = time.monotonic() + 15
        while (_mlflow_processes(folder) or os.path.exists(folder)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _mlflow_processes(folder) == [] and not any(pid_alive(p) for p in pids)  # uvicorn too
        assert not os.path.exists(folder) and port_free(port)
    finally:
        child.stdout.close()
        stop_group(child, grace_s=1.0)
