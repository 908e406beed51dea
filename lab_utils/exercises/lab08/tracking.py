"""08.1: the MLflow calls of a training run, checked by reading the run back from the lab's tracking server."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

from lab_utils.exercises.framework import CodeExercise, NotApplicable, References, Wrong, run_student, source_as
from lab_utils.exercises.lab08.common import _BOUND
from lab_utils.mlops.tracking import TrainResult, git_commit, mlflow_missing
from lab_utils.procs import temporary_folder

METRIC_KEYS = ("train_loss", "val_loss", "val_accuracy")


def _tracking() -> Any:
    server = _BOUND.get("tracking")
    if server is None:
        raise NotApplicable("no tracking server to log to yet: run the cell that starts it (it calls "
                            "ex.use_tracking(server)).")
    if not server.alive():
        raise NotApplicable("the lab's tracking server is not running: start it again (the cell with "
                            "TrackingServer()) and rerun this check.")
    return server


def reference_log_run(tracking_uri: str, experiment: str, result: Any, onnx_path: str) -> str:
    """Log ``result`` (a ``TrainResult``) as one MLflow run; returns the run's id."""
    import mlflow

    from lab_utils.mlops.tracking import git_commit  # in the function: its source is the solution shown

    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_experiment(experiment)  # created if it does not exist yet
    sha, _dirty = git_commit()
    with mlflow.start_run() as run:  # ended (FINISHED) when the block ends, FAILED on an exception
        mlflow.log_params(result.params)
        for row in result.history:  # one point per epoch, at its step
            for key in ("train_loss", "val_loss", "val_accuracy"):
                mlflow.log_metric(key, row[key], step=int(row["epoch"]))
        mlflow.log_artifact(onnx_path, artifact_path="model")  # the file itself, uploaded to the server
        mlflow.set_tags({"data_sha256": result.data_sha256, "git_commit": sha})
    return run.info.run_id


def _onnx_bytes(rng: random.Random) -> bytes:
    """A small valid ONNX model (Identity), different from check to check (onnx comes with mlflow, in the lab extra)."""
    from onnx import TensorProto, helper

    name = f"x{rng.randrange(10**9)}"
    graph = helper.make_graph([helper.make_node("Identity", [name], ["logits"])], "digits_check",
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, [None, 10])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 10])])
    return helper.make_model(graph, producer_name="lab08-check").SerializeToString()


def _check_result(rng: random.Random) -> Any:
    n = rng.randint(3, 5)
    history, loss = [], rng.uniform(1.5, 2.2)
    for epoch in range(1, n + 1):
        loss *= rng.uniform(0.4, 0.8)
        history.append({"epoch": epoch, "train_loss": round(loss, 6), "val_loss": round(loss * 1.1, 6),
                        "val_accuracy": round(min(0.99, 0.6 + 0.08 * epoch + rng.uniform(0, 0.05)), 6)})
    params = {"epochs": n, "lr": round(rng.uniform(0.01, 0.1), 4), "seed": rng.randrange(100), "width": 32,
              "batch_size": rng.choice([32, 64, 128])}
    sha = f"{rng.getrandbits(256):064x}"
    val_sha = f"{rng.getrandbits(256):064x}"
    return TrainResult(None, history, params, sha, val_sha, round(rng.uniform(1, 5), 3))


def _artifact_files(client: Any, run_id: str, path: str | None = None) -> list[Any]:
    return [g for f in client.list_artifacts(run_id, path)
            for g in (_artifact_files(client, run_id, f.path) if f.is_dir else [f])]


def _grade_log_run(fn: Any) -> str:
    import mlflow

    server = _tracking()
    client = server.client()
    rng = random.Random(random.randrange(10**9))
    result = _check_result(rng)
    experiment = f"lab08-check-{rng.randrange(10**9)}"
    exp_id = client.create_experiment(experiment)  # it exists already, as the lab's does after its first run
    sha, _ = git_commit()
    with temporary_folder("lab08-onnx") as tmp:
        onnx_path = tmp / "model.onnx"
        data = _onnx_bytes(rng)
        onnx_path.write_bytes(data)
        try:
            run_id = run_student(fn, server.url, experiment, result, str(onnx_path), what="log_run",
                                 call="log_run(tracking_uri, experiment, result, onnx_path)", timeout_s=120,
                                 returns=str, returns_text="the run's id, `run.info.run_id` (a str)")
            try:
                run = client.get_run(run_id)
            except Exception:
                raise Wrong(f"it returned {run_id!r}, which is no run on the server: return `run.info.run_id` of the "
                            "run it logged") from None
            return _check_run(client, run, exp_id, experiment, result, str(onnx_path), data, sha)
        finally:  # the checks above use the client only: a run active now is one the student's code left open
            if mlflow.active_run() is not None:  # (not ended, or it raised inside): end it, so that the next
                mlflow.end_run(status="FAILED")  # start_run() in the notebook works


def _check_run(client: Any, run: Any, exp_id: str, experiment: str, result: Any, onnx_path: str, data: bytes,
               sha: str) -> str:
    run_id = run.info.run_id
    if run.info.experiment_id != exp_id:
        got = client.get_experiment(run.info.experiment_id).name
        raise Wrong(f"the run is in experiment {got!r}, not {experiment!r}: mlflow.set_experiment(experiment) "
                    "before start_run()")
    if run.info.status != "FINISHED":
        raise Wrong(f"the run is {run.info.status}, not FINISHED: end it (`with mlflow.start_run() as run:` ends it "
                    "when the block ends; or mlflow.end_run()), or the tracking UI shows it running forever")
    want = {k: str(v) for k, v in result.params.items()}
    got = dict(run.data.params)
    missing = sorted(set(want) - set(got))
    if missing:
        raise Wrong(f"params {missing} are missing: log every entry of result.params (mlflow.log_params)")
    bad = {k: got[k] for k in want if got[k] != want[k]}
    if bad:
        raise Wrong(f"params {bad} differ from result.params {({k: want[k] for k in bad})}")
    epochs = [int(row["epoch"]) for row in result.history]
    n = len(epochs)
    for key in METRIC_KEYS:
        points = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
        values = [row[key] for row in result.history]
        if not points:
            raise Wrong(f"no metric {key!r}: log {', '.join(METRIC_KEYS)} of every row of result.history")
        if len(points) == 1:
            last = math.isclose(points[0].value, values[-1], rel_tol=1e-6)
            raise Wrong(f"{key} has one point{' (the last epoch' + chr(39) + 's)' if last else ''} where the run had "
                        f"{n} epochs: log one point per epoch, mlflow.log_metric(key, value, step=epoch), so the UI "
                        "draws the curve")
        steps = [p.step for p in points]
        if len(set(steps)) == 1:
            raise Wrong(f"every point of {key} is at step {steps[0]}: pass step=epoch (mlflow.log_metric(key, value, "
                        "step=row['epoch'])), or the curve is one column of dots")
        if steps not in (epochs, list(range(n))):
            raise Wrong(f"{key} is at steps {steps}: one point per epoch, at step = the epoch ({epochs})")
        if not all(math.isclose(p.value, v, rel_tol=1e-6, abs_tol=1e-9) for p, v in zip(points, values, strict=True)):
            raise Wrong(f"{key}'s values {[round(p.value, 4) for p in points]} are not result.history's "
                        f"{[round(v, 4) for v in values]}")
    files = _artifact_files(client, run_id)
    found = None
    with temporary_folder("lab08-artifacts") as tmp:
        for f in files:
            if f.file_size not in (None, len(data)):
                continue
            local = client.download_artifacts(run_id, f.path, str(tmp))
            if Path(local).read_bytes() == data:
                found = f.path
                break
    if found is None:
        where = [k for k, v in {**run.data.params, **run.data.tags}.items()
                 if onnx_path in v or v.endswith("model.onnx")]
        if where:
            raise Wrong(f"the ONNX file's path is logged (as {where[0]!r}), not the file: a path on this machine "
                        "means nothing to whoever downloads the run; upload it with mlflow.log_artifact(onnx_path)")
        listed = [f.path for f in files]
        raise Wrong(f"no artifact of the run holds the ONNX file's bytes (artifacts: {listed or 'none'}): upload it "
                    "with mlflow.log_artifact(onnx_path, artifact_path='model')")
    tags = run.data.tags
    if "data_sha256" not in tags:
        raise Wrong("no tag data_sha256: tag the run with result.data_sha256, the hash of the training data")
    if tags["data_sha256"] == result.val_sha256:
        raise Wrong("tag data_sha256 is result.val_sha256, the validation set's hash: lineage asks which data the "
                    "model was trained on, result.data_sha256")
    if tags["data_sha256"] != result.data_sha256:
        raise Wrong(f"tag data_sha256 is {tags['data_sha256']!r}, not result.data_sha256 "
                    f"({result.data_sha256[:12]}...)")
    if "git_commit" not in tags:
        raise Wrong("no tag git_commit: tag the run with the commit of the code (sha, dirty = git_commit(); tag "
                    "sha), or nobody can tell which code trained the model")
    if tags["git_commit"] != sha:
        extra = (": git_commit() returns (sha, dirty); tag the sha alone" if sha in tags["git_commit"] else "")
        raise Wrong(f"tag git_commit is {tags['git_commit']!r}, not this checkout's commit {sha!r}{extra}")
    return (f"run {run_id[:8]}: {len(want)} params, {len(METRIC_KEYS)} metrics x {n} epochs, {found} "
            f"({len(data)} bytes), tags data_sha256 and git_commit; FINISHED.")


q1 = CodeExercise(
    name="08.1 log a training run", var="log_run", grade=_grade_log_run,
    references=References("make the MLflow calls yourself", "lab_utils.exercises.lab08.reference_log_run",
                           "lab_utils.mlops.tracking.log_run"),
    signature="log_run(tracking_uri, experiment, result, onnx_path) -> str", applicable=mlflow_missing,
    hints=(
        "Point mlflow at the tracking server (set_tracking_uri) and the experiment (set_experiment creates it when "
        "new); then open a run in a `with` block (it ends FINISHED with the block); the run's info holds the id.",
        "Inside the run: the params (log_params, of result.params); for each row of result.history, "
        "mlflow.log_metric(key, row[key], step=row['epoch']) for train_loss, val_loss, val_accuracy; the ONNX file "
        "with log_artifact.",
        "Tags: mlflow.set_tags({'data_sha256': result.data_sha256, 'git_commit': git_commit()[0]}) "
        "(from lab_utils.mlops.tracking import git_commit; it returns (sha, dirty)).",
    ),
    solution_text=source_as(reference_log_run, "log_run"),
)
