"""Lab 08 exercises: MLOps, checked against the real tools: an MLflow tracking server, a Prometheus scraping metric
sources whose history the check scripts, and the canary loop of ``lab_utils.mlops.canary``.

``use_tracking(server)``, ``use_ab(result)`` and ``use_bench(bench)`` (optional) hand the checks what the lab
started or measured. q1 ``log_run(tracking_uri, experiment, result, onnx_path) -> run_id``; q2
``canary_queries(window) -> {"error_rate", "p95_ms", "accuracy"}``; q3 ``decide(state, metrics, guards) ->
Decision``; q4 ``sample_size(p_a, p_b, alpha=0.05, power=0.8) -> int`` per group; q5 the A/B verdict, ``"real"`` or
``"not real"``; q6 ``psi(reference, current, bins=10) -> float``. Nothing is imported or started at import.

Design notes: docs/internals.md#lab_utilsexerciseslab08py
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from lab_utils.exercises.framework import (
    CodeExercise,
    Exercise,
    NotApplicable,
    References,
    Wrong,
    choice,
    hands_out,
    integer,
    number,
    run_student,
    source_as,
)
from lab_utils.exercises.outcomes import _short
from lab_utils.mlops import canary
from lab_utils.mlops.canary import CanaryState, Decision, Guards, VariantMetrics
from lab_utils.mlops.feedback import FEEDBACK_CORRECT, FEEDBACK_TOTAL, MetricsServer
from lab_utils.mlops.tracking import TrainResult, git_commit, mlflow_missing
from lab_utils.monitoring import prometheus
from lab_utils.monitoring.prometheus import PrometheusError, PrometheusServer
from lab_utils.procs import temporary_folder

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6", "use_tracking", "use_ab", "use_bench", "MetricsBench",
    "reference_log_run", "reference_canary_queries", "reference_decide", "reference_sample_size", "reference_psi",
    "reference_verdict", "SERVICE_MODEL", "Q2_WINDOW", "LIVE_GUARDS",
]

SERVICE_MODEL = "digits_service"
DECOY_MODEL = "digits_preprocess"  # another model on the same Triton servers: its requests are not the service's
Q2_WINDOW = "3s"
_SPLIT_S = 3.0  # q2's scripted history: an early phase of this length, then the recent one
_AT_S = 6.5  # q2's queries are evaluated at start + this: the window (3.5 s .. 6.5 s) holds only the recent phase
_SCRAPE_S = 0.5
VARIANTS = ("champion", "challenger")
METRIC_KEYS = ("train_loss", "val_loss", "val_accuracy")


# --- what the checks are bound to -----------------------------------------------------------------------------

_BOUND: dict[str, Any] = {}


def use_tracking(server: Any) -> None:
    """The MLflow tracking server (a started ``TrackingServer``) q1 logs its runs to."""
    _BOUND["tracking"] = server
    print(f"q1 logs to the tracking server at {server.url}")


def use_ab(result: Any) -> None:
    """The A/B result (``abtest.AbResult``) q5 compares the verdict with."""
    _BOUND["ab"] = result
    print(f"q5 checks the verdict against the measured result: B - A = {result.test.diff:+.2%}, 95 % interval "
          f"[{result.boot_low:+.2%}, {result.boot_high:+.2%}]")


def use_bench(bench: MetricsBench | None) -> None:
    """A started ``MetricsBench`` that q2 and q3 share (else each check starts its own and stops it); None unbinds."""
    if bench is None:
        _BOUND.pop("bench", None)
    else:
        _BOUND["bench"] = bench


def _tracking() -> Any:
    server = _BOUND.get("tracking")
    if server is None:
        raise NotApplicable("no tracking server to log to yet: run the cell that starts it (it calls "
                            "ex.use_tracking(server)).")
    if not server.alive():
        raise NotApplicable("the lab's tracking server is not running: start it again (the cell with "
                            "TrackingServer()) and rerun this check.")
    return server


def _prometheus_missing() -> str | None:
    why = prometheus.missing()
    return f"this check runs your code on a real Prometheus: {why}" if why else None


# --- reference implementations (later cells use these) --------------------------------------------------------


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


def reference_canary_queries(window: str) -> dict[str, str]:
    """The canary's PromQL over ``window``: per scrape job (one Triton per variant), per ``variant`` for feedback."""
    model = 'model="digits_service"'
    ok = f"sum by (job) (rate(nv_inference_request_success{{{model}}}[{window}]))"
    # no failure yet: the failure counter does not exist; "or ... * 0" gives 0 where successes exist
    failed = f"(sum by (job) (rate(nv_inference_request_failure{{{model}}}[{window}])) or {ok} * 0)"
    return {
        "error_rate": f"{failed} / ({ok} + {failed})",
        "p95_ms": f'max by (job) (nv_inference_request_summary_us{{{model},quantile="0.95"}}) / 1000',
        "accuracy": (f"sum by (variant) (increase(nvlab_feedback_correct_total[{window}])) / "
                     f"sum by (variant) (increase(nvlab_feedback_total[{window}]))"),
    }


def reference_decide(state: Any, metrics: Mapping[str, Any], guards: Any) -> Any:
    """One check of the canary: roll back when a guard trips, hold while evidence is short or the step's healthy
    checks are not all in, promote after ``guards.checks_per_step`` healthy checks in a row."""
    import math
    from dataclasses import replace

    from lab_utils.mlops.canary import Decision  # in the function: its source is the solution shown

    champ, chall = metrics["champion"], metrics["challenger"]

    def nan(x):
        return x is None or math.isnan(x)

    if state.finished:
        return Decision("done", state, f"the canary is {state.status}")

    def rollback(alert, why):
        return Decision("rollback", replace(state, status="rolled_back", healthy=0), why, alert)

    enough = chall.requests >= guards.min_requests and not nan(chall.error_rate)
    if enough:
        limit = guards.max_error_rate  # absolute, and relative to the champion when it has traffic
        if not nan(champ.error_rate):
            limit = min(limit, champ.error_rate + guards.max_error_rate_delta)
        if chall.error_rate > limit:
            return rollback("CanaryErrors", f"error rate {chall.error_rate:.2%} over {limit:.2%}")
        if not nan(chall.p95_ms):
            limit = math.inf if guards.max_p95_ms is None else guards.max_p95_ms  # the SLO
            # relative, on enough requests for a p95, and never below the floor (noise)
            if not nan(champ.p95_ms) and champ.p95_ms > 0 and chall.requests >= guards.min_latency_requests:
                limit = min(limit, max(guards.max_p95_ratio * champ.p95_ms, guards.p95_floor_ms))
            if chall.p95_ms > limit:
                return rollback("CanaryLatency", f"p95 {chall.p95_ms:.1f} ms over {limit:.1f} ms")
    # accuracy: only on enough labelled answers, and only against a champion that has a measured accuracy
    if chall.feedback >= guards.min_feedback and not nan(chall.accuracy) and not nan(champ.accuracy):
        if chall.accuracy < champ.accuracy - guards.max_accuracy_drop:
            return rollback("CanaryAccuracy", f"accuracy {chall.accuracy:.1%}, champion {champ.accuracy:.1%}")
    if enough and guards.min_feedback > 0 and chall.feedback < guards.min_feedback:  # fast is not right
        idle = state.idle + 1
        if idle >= guards.max_idle_checks:
            return rollback("CanaryNoTraffic", f"{idle} checks without enough labelled answers")
        return Decision("hold", replace(state, idle=idle, healthy=0), "waiting for labelled feedback")
    if not enough:  # too little evidence decides nothing, unless it lasts
        idle = state.idle + 1
        if idle >= guards.max_idle_checks:
            return rollback("CanaryNoTraffic", f"{idle} checks without enough challenger requests")
        return Decision("hold", replace(state, idle=idle, healthy=0), "waiting for challenger requests")
    healthy = state.healthy + 1
    if healthy < guards.checks_per_step:
        return Decision("hold", replace(state, healthy=healthy, idle=0), f"healthy check {healthy}")
    nxt = min(state.step + 1, len(state.steps) - 1)
    status = "promoted" if nxt == len(state.steps) - 1 else "running"
    return Decision("promote", replace(state, step=nxt, healthy=0, idle=0, status=status),
                    f"{guards.checks_per_step} healthy checks in a row")


def reference_sample_size(p_a: float, p_b: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Labelled requests per group to detect ``p_a`` vs ``p_b`` (two-sided z-test, pooled variance under H0)."""
    import math
    from statistics import NormalDist

    z_a = NormalDist().inv_cdf(1 - alpha / 2)  # two-sided
    z_b = NormalDist().inv_cdf(power)
    p = (p_a + p_b) / 2
    n = (z_a * math.sqrt(2 * p * (1 - p)) + z_b * math.sqrt(p_a * (1 - p_a) + p_b * (1 - p_b))) ** 2 \
        / (p_a - p_b) ** 2
    return math.ceil(n)


def reference_psi(reference: Any, current: Any, bins: int = 10) -> float:
    """Population stability index: sum over bins of (c - r) ln(c / r), bins at the reference's quantiles."""
    import numpy as np

    ref = np.asarray(reference, dtype=float).ravel()
    cur = np.asarray(current, dtype=float).ravel()
    edges = np.unique(np.quantile(ref, np.linspace(0, 1, bins + 1)[1:-1]))  # inner edges; outer bins open-ended

    def shares(x):
        counts = np.bincount(np.searchsorted(edges, x, side="right"), minlength=len(edges) + 1)
        return np.maximum(counts / counts.sum(), 1e-4)  # an empty bin would make the log infinite

    r, c = shares(ref), shares(cur)
    return float(np.sum((c - r) * np.log(c / r)))


@hands_out  # its result passes the check it answers: refused as an answer
def reference_verdict(result: Any) -> str:
    """``"real"`` when the 95 % interval of B - A excludes 0, else ``"not real"``."""
    return "not real" if result.boot_low <= 0 <= result.boot_high else "real"


# --- q1: a tracking run ----------------------------------------------------------------------------------------


def _onnx_bytes(rng: random.Random) -> bytes:
    """A small valid ONNX model (Identity), different from check to check."""
    try:
        from onnx import TensorProto, helper

        name = f"x{rng.randrange(10**9)}"
        graph = helper.make_graph([helper.make_node("Identity", [name], ["logits"])], "digits_check",
                                  [helper.make_tensor_value_info(name, TensorProto.FLOAT, [None, 10])],
                                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 10])])
        return helper.make_model(graph, producer_name="lab08-check").SerializeToString()
    except ImportError:  # onnx missing: any bytes stand for the file
        return bytes(rng.randrange(256) for _ in range(2048))


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
    out = []
    for f in client.list_artifacts(run_id, path):
        out.extend(_artifact_files(client, run_id, f.path) if f.is_dir else [f])
    return out


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
    references=References("make the MLflow calls yourself", reference_log_run, "lab_utils.mlops.tracking.log_run"),
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


# --- the metrics bench (q2, q3): sources with Triton's and the feedback exporter's names, and a Prometheus ------

# q2's script, per scrape job: (model, version, successes/s early, late, failures/s early, late, p95 ms).
# Failures None: the series never exists (no failure yet); early 0: it appears with the first failure.
_Q2_TRITON = {
    "champion": [(SERVICE_MODEL, "1", 30.0, 30.0, None, None, 20.0),
                 (SERVICE_MODEL, "2", 10.0, 10.0, None, None, 24.0),
                 (DECOY_MODEL, "1", 100.0, 100.0, 50.0, 50.0, 80.0)],
    "challenger": [(SERVICE_MODEL, "1", 6.0, 6.0, None, None, 30.0),
                   (SERVICE_MODEL, "2", 2.0, 2.0, 0.0, 2.0, 45.0),
                   (DECOY_MODEL, "1", 100.0, 100.0, 50.0, 50.0, 80.0)],
}
# feedback, per exporter instance and variant: (labelled answers/s, accuracy early, accuracy late)
_Q2_FEEDBACK = [{"champion": (10.0, 0.80, 0.95), "challenger": (10.0, 1.00, 0.50)},
                {"champion": (30.0, 0.80, 0.95), "challenger": (30.0, 1.00, 0.70)}]

LIVE_RPS = 100.0
LIVE_FEEDBACK_RPS = 20.0


def _piecewise(t: float, early: float, late: float) -> float:
    return early * min(t, _SPLIT_S) + late * max(0.0, t - _SPLIT_S)


class _LiveVariant:
    """One variant of a live run: its counters follow the rate, error share and p95 set (as Triton's would)."""

    def __init__(self, accuracy: float, p95_ms: float):
        self.rps, self.error_rate, self.p95_ms, self.accuracy = 0.0, 0.0, p95_ms, accuracy
        self.success = self.failure = self.labelled = 0.0
        self.t = self.t_start = time.monotonic()

    def advance(self) -> None:
        now = time.monotonic()
        n = self.rps * (now - self.t)
        self.success += n * (1 - self.error_rate)
        self.failure += n * self.error_rate
        self.t = now
        self.labelled = LIVE_FEEDBACK_RPS * (now - self.t_start)


class _LiveRun:
    """A champion and a challenger under their own model name (Triton) and feedback label, weight set by the loop."""

    def __init__(self, n: int, challenger_accuracy: float, challenger_p95_ms: float, lock: threading.Lock):
        self.model, self.label = f"canary_{n}", f"arm_{n}"
        self.variants = {"champion": _LiveVariant(0.97, 20.0),
                         "challenger": _LiveVariant(challenger_accuracy, challenger_p95_ms)}
        self.weights: list[int] = []
        self._lock = lock

    def set_weight(self, w: int) -> None:
        with self._lock:
            self.weights.append(int(w))
            for v, share in (("champion", 100 - w), ("challenger", w)):
                self.variants[v].advance()
                self.variants[v].rps = LIVE_RPS * share / 100


class _TritonSource:
    """Triton's metric names for one scrape job: q2's scripted series and the live runs' series."""

    def __init__(self, bench: MetricsBench, variant: str):
        self.bench, self.variant = bench, variant

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        s = GaugeMetricFamily("nv_inference_request_success", "successful requests", labels=["model", "version"])
        f = GaugeMetricFamily("nv_inference_request_failure", "failed requests", labels=["model", "version", "reason"])
        q = GaugeMetricFamily("nv_inference_request_summary_us", "request latency", labels=["model", "version",
                                                                                          "quantile"])
        t = self.bench.elapsed()
        for model, version, s1, s2, f1, f2, p95 in _Q2_TRITON[self.variant]:
            s.add_metric([model, version], _piecewise(t, s1, s2))
            if f1 is not None and (f1 > 0 or t >= _SPLIT_S):
                f.add_metric([model, version, "BACKEND"], _piecewise(t, f1, f2))
            q.add_metric([model, version, "0.95"], p95 * 1000)
        with self.bench._lock:
            for run in list(self.bench._runs):
                v = run.variants[self.variant]
                v.advance()
                s.add_metric([run.model, "1"], v.success)
                f.add_metric([run.model, "1", "BACKEND"], v.failure)
                q.add_metric([run.model, "1", "0.95"], v.p95_ms * 1000)
        yield from (s, f, q)


class _FeedbackSource:
    """``nvlab_feedback_total`` and ``nvlab_feedback_correct_total`` of one exporter instance."""

    def __init__(self, bench: MetricsBench, instance: int):
        self.bench, self.instance = bench, instance

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        t = self.bench.elapsed()
        total = GaugeMetricFamily(FEEDBACK_TOTAL, "labelled requests answered", labels=["variant"])
        right = GaugeMetricFamily(FEEDBACK_CORRECT, "labelled requests answered correctly", labels=["variant"])
        for variant, (rate, a1, a2) in _Q2_FEEDBACK[self.instance].items():
            total.add_metric([variant], rate * t)
            right.add_metric([variant], _piecewise(t, rate * a1, rate * a2))
        families = [total, right]
        if self.instance == 0:
            with self.bench._lock:
                for run in list(self.bench._runs):
                    lt = GaugeMetricFamily(FEEDBACK_TOTAL, "labelled", labels=[run.label])
                    lc = GaugeMetricFamily(FEEDBACK_CORRECT, "labelled, right", labels=[run.label])
                    for variant, v in run.variants.items():
                        v.advance()
                        lt.add_metric([variant], v.labelled)
                        lc.add_metric([variant], v.labelled * v.accuracy)
                    families += [lt, lc]
        yield from families


class MetricsBench:
    """A Prometheus (scrape every 0.5 s) over in-process sources: jobs ``champion`` and ``challenger`` with Triton's
    metric names (two versions of the service's model and another model each), and job ``feedback`` (two exporter
    instances) with the labelled-feedback counters. q2's history is scripted from the start; q3's live runs add
    series of their own. A context manager; ``stop()`` ends Prometheus and the sources (safe twice)."""

    def __init__(self) -> None:
        self.prom: Any = None
        self.t0: float | None = None
        self._servers: list[Any] = []
        self._runs: list[_LiveRun] = []
        self._lock = threading.Lock()
        self._count = 0

    def elapsed(self) -> float:
        return 0.0 if self.t0 is None else max(0.0, time.time() - self.t0)

    def start(self) -> MetricsBench:
        try:
            sources = [_TritonSource(self, v) for v in VARIANTS] + [_FeedbackSource(self, i) for i in range(2)]
            self._servers = [MetricsServer([s]).start() for s in sources]
            jobs = {"champion": [self._servers[0].address], "challenger": [self._servers[1].address],
                    "feedback": [self._servers[2].address, self._servers[3].address]}
            self.prom = PrometheusServer(jobs, scrape_interval_s=_SCRAPE_S, evaluation_interval_s=_SCRAPE_S).start()
            self.prom.wait_for("count(up == 1) == 4", timeout_s=30, poll_s=0.2)
            self.t0 = time.time()  # q2's history starts now: every source is being scraped
        except BaseException:
            self.stop()
            raise
        return self

    def alive(self) -> bool:
        return self.prom is not None and self.prom.alive()

    def stop(self) -> None:
        if self.prom is not None:
            self.prom.stop()
            self.prom = None
        for s in self._servers:
            s.stop()
        self._servers = []

    def history_time(self) -> float:
        """When q2's queries are evaluated (unix s); waits until Prometheus has scraped past it."""
        assert self.t0 is not None
        at = self.t0 + _AT_S
        wait = at + 2 * _SCRAPE_S + 0.2 - time.time()
        if wait > 0:
            time.sleep(wait)
        return at

    def live(self, challenger_accuracy: float, challenger_p95_ms: float = 20.0) -> _LiveRun:
        with self._lock:
            self._count += 1
            run = _LiveRun(self._count, challenger_accuracy, challenger_p95_ms, self._lock)
            self._runs.append(run)
        return run

    def drop(self, run: _LiveRun) -> None:
        with self._lock:
            if run in self._runs:
                self._runs.remove(run)

    def __enter__(self) -> MetricsBench:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@contextmanager
def _bench() -> Iterator[MetricsBench]:
    """The bound bench (started here by the first check that needs it), else one started for this check and
    stopped after it."""
    bound = _BOUND.get("bench")
    if bound is not None and bound.prom is None:  # bound, never started: a lab whose answers are blank never pays
        bound.start()
    if bound is not None and bound.alive():
        yield bound
        return
    with MetricsBench() as bench:
        yield bench


# --- q2: the canary's PromQL -------------------------------------------------------------------------------------

_LABEL = {"error_rate": "job", "p95_ms": "job", "accuracy": "variant"}


def _slip_queries(window: str) -> dict[str, list[tuple[str, str]]]:
    m = f'model="{SERVICE_MODEL}"'
    ok = f"sum by (job) (rate(nv_inference_request_success{{{m}}}[{window}]))"
    failed = f"(sum by (job) (rate(nv_inference_request_failure{{{m}}}[{window}])) or {ok} * 0)"
    ok_all = f"sum by (job) (rate(nv_inference_request_success[{window}]))"
    failed_all = f"(sum by (job) (rate(nv_inference_request_failure[{window}])) or {ok_all} * 0)"
    ok_c = f"sum by (job) (nv_inference_request_success{{{m}}})"
    failed_c = f"(sum by (job) (nv_inference_request_failure{{{m}}}) or {ok_c} * 0)"
    p95 = f'nv_inference_request_summary_us{{{m},quantile="0.95"}}'
    right = "nvlab_feedback_correct_total"
    total = "nvlab_feedback_total"
    return {
        "error_rate": [
            (f"{failed} / {ok}", "failures / successes is not the share of requests that failed: divide by all "
                                 "requests, successes + failures"),
            (f"{failed_c} / ({ok_c} + {failed_c})",
             "it reads the counters' totals since the servers started, not the last window: a canary judges what "
             "happens now; take rate(counter[window]) (or increase) of each counter"),
            (f"{failed_all} / ({ok_all} + {failed_all})",
             f"it counts every model on the servers ({DECOY_MODEL}'s requests too): select the service's model, "
             f'{{model="{SERVICE_MODEL}"}}'),
        ],
        "p95_ms": [
            (f"sum by (job) ({p95}) / 1000", "it adds the p95 of the two versions on a server: a sum of latencies is "
                                             "no latency; the guard bounds the worst one, max by (job)"),
            (f"avg by (job) ({p95}) / 1000", "the mean of the versions' p95 hides the slow one: the guard bounds the "
                                             "worst, max by (job)"),
            ('max by (job) (nv_inference_request_summary_us{quantile="0.95"}) / 1000',
             f"it takes every model on the servers ({DECOY_MODEL}'s latency too): select "
             f'{{model="{SERVICE_MODEL}"}}'),
        ],
        "accuracy": [
            (f"sum by (variant) ({right}) / sum by (variant) ({total})",
             "it reads the counters' totals since the start, not the last window: early answers hide what the "
             "challenger does now; increase(counter[window]) of both counters"),
            (f"sum by (variant) (increase({total}[{window}])) / sum by (variant) (increase({right}[{window}]))",
             "upside down: accuracy is right answers / labelled answers"),
        ],
    }


def _by_variant(df: Any, key: str) -> dict[str, list[float]]:
    label = _LABEL[key]
    out: dict[str, list[float]] = {v: [] for v in VARIANTS}
    if df.empty or label not in df.columns:
        return out
    for _, row in df.iterrows():
        if row[label] in out:
            out[row[label]].append(float(row["value"]))
    return out


def _same(got: Mapping[str, list[float]], want: Mapping[str, list[float]]) -> bool:
    def close(a: float, b: float) -> bool:
        return math.isnan(a) and math.isnan(b) or math.isclose(a, b, rel_tol=2e-3, abs_tol=1e-9)

    return all(len(got[v]) == 1 and len(want[v]) == 1 and close(got[v][0], want[v][0]) for v in VARIANTS)


def _grade_queries(fn: Any) -> str:
    queries = run_student(fn, Q2_WINDOW, what="canary_queries", call=f"canary_queries({Q2_WINDOW!r})",
                          timeout_s=10, returns=Mapping, returns_text="a dict {'error_rate': ..., 'p95_ms': ..., "
                                                                      "'accuracy': ...} of PromQL strings")
    missing = [k for k in _LABEL if k not in queries]
    if missing:
        raise Wrong(f"the dict has no {missing}: return the keys error_rate, p95_ms and accuracy")
    for key in _LABEL:
        if not isinstance(queries[key], str) or not queries[key].strip():
            raise Wrong(f"{key} is {_short(queries[key])}: a PromQL expression (a str)")
    for key in ("error_rate", "accuracy"):
        if f"[{Q2_WINDOW}]" not in queries[key].replace(" ", ""):
            raise Wrong(f"{key} does not use the window: canary_queries({Q2_WINDOW!r}) must take rates over "
                        f"[{Q2_WINDOW}] (an f-string: [{{window}}]); the canary chooses its window")
    with _bench() as bench:
        at = bench.history_time()
        prom = bench.prom
        ref = reference_canary_queries(Q2_WINDOW)
        slips = _slip_queries(Q2_WINDOW)
        notes = []
        for key, label in _LABEL.items():
            agg = "max" if key == "p95_ms" else "sum"
            try:
                df = prom.query(queries[key], at)
            except PrometheusError as err:
                raise Wrong(f"Prometheus refused {key}: {getattr(err, 'why', '') or err}") from None
            want = _by_variant(prom.query(ref[key], at), key)
            if df.empty:
                raise Wrong(f"{key} returns no series at all: check the metric names, the model label "
                            f'(model="{SERVICE_MODEL}") and that each side of an operator has matching labels (a '
                            f"failure counter carries a `reason` label the success counter lacks: aggregate both "
                            f"with sum by ({label}) first)")
            if label not in df.columns:
                labels = sorted(set(df.columns) - {"time", "value"})
                raise Wrong(f"{key}'s result has no `{label}` label (labels: {labels}):"
                            f" the canary tells the variants apart by it; aggregate with {agg} by ({label}) (...)")
            got = _by_variant(df, key)
            for v in VARIANTS:
                if len(got[v]) > 1:
                    extra = sorted(set(df.columns) - {"time", "value", label, "__name__"})
                    why = ("feedback comes from two exporter instances" if label == "variant" else
                           "each server runs two versions of the model")
                    raise Wrong(f"{key} gives {len(got[v])} series for {label}={v!r} (they differ by {extra}): {why}; "
                                f"aggregate them with {agg} by ({label}) (...)")
            for v in VARIANTS:
                if not got[v] and want[v]:
                    if key == "error_rate" and v == "champion":
                        raise Wrong("error_rate has no value for the champion: it has never failed, so Triton has no "
                                    "nv_inference_request_failure series for it yet, and `failures / ...` with "
                                    "failures missing is no result at all (the guard would never see 0 %). Add "
                                    "`or sum by (job) (rate(nv_inference_request_success{...}[window])) * 0` to the "
                                    "failures")
                    raise Wrong(f"{key} has no value for {label}={v!r}: check the metric names and labels")
            if _same(got, want):
                notes.append(f"{key} champion {want['champion'][0]:.3g}, challenger {want['challenger'][0]:.3g}")
                continue
            vals = {v: got[v][0] for v in VARIANTS if got[v]}
            if key == "p95_ms" and all(want[v] and math.isclose(vals.get(v, 0) / want[v][0], 1000, rel_tol=1e-2)
                                       for v in VARIANTS):
                raise Wrong("p95_ms is 1000 x too large: Triton's summary is in microseconds "
                            "(nv_inference_request_summary_us); divide by 1000 for ms")
            for expr, why in slips[key]:
                if _same(got, _by_variant(prom.query(expr, at), key)):
                    raise Wrong(f"{key}: {why}")
            shown = {v: round(x, 4) for v, x in vals.items()}
            expected = {v: round(want[v][0], 4) for v in VARIANTS if want[v]}
            raise Wrong(f"{key} gives {shown} where the window's true values are {expected}")
    return "on a real Prometheus: " + "; ".join(notes) + "."


q2 = CodeExercise(
    name="08.2 the canary's PromQL", var="canary_queries", grade=_grade_queries,
    references=References("write the PromQL yourself",
                           reference_canary_queries, "lab_utils.mlops.canary.render_queries"),
    signature="canary_queries(window: str) -> dict[str, str]", applicable=_prometheus_missing,
    hints=(
        "Every number is over the last window: rate(counter[window]) (or increase) of Triton's counters "
        f"nv_inference_request_success and nv_inference_request_failure, filtered to {{model=\"{SERVICE_MODEL}\"}}, "
        "each summed by (job) (a server runs several versions); accuracy: increase of nvlab_feedback_correct_total "
        "/ increase of nvlab_feedback_total, summed by (variant).",
        "error_rate = failures / (successes + failures). A variant that never failed has no failure series: "
        "`(failures or successes * 0)` makes it 0.",
        "p95_ms: max by (job) of nv_inference_request_summary_us{model=..., quantile=\"0.95\"}, / 1000 "
        "(Triton reports microseconds).",
    ),
    solution_text=source_as(reference_canary_queries, "canary_queries"),
)


# --- q3: the canary's decision -------------------------------------------------------------------------------------

# q3's live runs: canary.Guards(**LIVE_GUARDS)
LIVE_GUARDS = {"min_requests": 5, "min_feedback": 10, "checks_per_step": 2, "max_idle_checks": 8}


def _healthy(champion: Mapping[str, float] | None = None, **chall: float) -> dict[str, Any]:
    """A healthy champion and challenger, their figures changed by ``champion`` and ``chall``."""
    champ = {"error_rate": 0.001, "p95_ms": 40.0, "accuracy": 0.97, "requests": 4500.0, "feedback": 900.0}
    base = {"error_rate": 0.001, "p95_ms": 40.0, "accuracy": 0.96, "requests": 500.0, "feedback": 100.0}
    return {"champion": VariantMetrics(**{**champ, **(champion or {})}),
            "challenger": VariantMetrics(**{**base, **chall})}


def _sequences() -> list[tuple[str, Any, list[dict[str, Any]]]]:
    """(what, guards, metrics per check): the reference's decisions on them are the expected ones."""
    g = Guards()
    return [
        ("a good challenger", g, [_healthy() for _ in range(6)]),
        ("a good challenger, checks_per_step=3", Guards(checks_per_step=3), [_healthy() for _ in range(9)]),
        ("a challenger wrong on one digit in ten", g, [_healthy(accuracy=0.87)]),
        ("a few labelled answers, noisy", g,
         [_healthy(accuracy=0.6, feedback=5.0), _healthy(accuracy=0.6, feedback=5.0), _healthy()]),
        ("a slow challenger (p95 over the SLO, within 1.5 x a slow champion)", g,
         [_healthy({"p95_ms": 120.0}, p95_ms=150.0, accuracy=0.97)]),
        ("a slower challenger (2 x the champion's p95, under the SLO)", g, [_healthy(p95_ms=85.0)]),
        ("a slower challenger on 100 requests (too few for a p95 against the champion's)", g,
         [_healthy(p95_ms=85.0, requests=100.0)]),
        ("an error spike", g, [_healthy(), _healthy(error_rate=0.05)]),
        ("errors under 1 % but well above the champion's", g, [_healthy(error_rate=0.008)]),
        ("too few requests", g, [_healthy(requests=3.0, error_rate=0.0) for _ in range(g.max_idle_checks)]),
        ("a streak broken by a check without evidence", g, [_healthy(), _healthy(requests=3.0), _healthy(),
                                                            _healthy()]),
        ("no labelled feedback for the champion (its accuracy NaN)", g,
         [_healthy({"accuracy": math.nan, "feedback": 0.0}, accuracy=0.5)] * 2),
    ]


def _describe(m: Mapping[str, Any]) -> str:
    def one(x: Any) -> str:
        return (f"errors {x.error_rate:.1%}, p95 {x.p95_ms:g} ms, accuracy {x.accuracy:.0%} on {x.feedback:g} "
                f"labelled, {x.requests:g} requests")

    return f"challenger {one(m['challenger'])}; champion {one(m['champion'])}"


def _why(mine: Any, ref: Any, state: Any, m: Mapping[str, Any], g: Any) -> str:
    """What the student's decision got wrong, from how it differs from the reference's."""
    champ, chall = m["champion"], m["challenger"]
    if mine.action == "promote" and ref.action == "hold":
        if chall.requests < g.min_requests:
            return (f"it promoted on {chall.requests:g} challenger requests (< guards.min_requests = "
                    f"{g.min_requests}): too little evidence is a hold, not a healthy check")
        return (f"it promoted after {state.healthy + 1} healthy check(s) at {state.weight} %: wait for "
                f"guards.checks_per_step ({g.checks_per_step}) healthy checks in a row, counted in state.healthy; a "
                "check without evidence breaks the streak (healthy back to 0)")
    if mine.action == "rollback" and ref.action != "rollback":
        if mine.alert == "CanaryNoTraffic":
            return (f"it rolled back for lack of traffic after {state.idle + 1} check(s): hold while evidence is "
                    f"short (count them in state.idle) and roll back only after guards.max_idle_checks "
                    f"({g.max_idle_checks}) in a row")
        if mine.alert == "CanaryAccuracy" and chall.feedback < g.min_feedback:
            return (f"it applied the accuracy guard on {chall.feedback:g} labelled answers: below "
                    f"guards.min_feedback ({g.min_feedback}) the accuracy is noise; skip the guard until then")
        if mine.alert == "CanaryLatency" and chall.requests < g.min_latency_requests and \
                (g.max_p95_ms is None or chall.p95_ms <= g.max_p95_ms):
            return (f"it compared the challenger's p95 with the champion's on {chall.requests:g} challenger requests: "
                    f"below guards.min_latency_requests ({g.min_latency_requests}) a p95 is a few slow requests; "
                    "only the SLO bound (guards.max_p95_ms) applies until then")
        if mine.alert == "CanaryAccuracy" and math.isnan(champ.accuracy):
            return ("it rolled back on accuracy while the champion's accuracy is NaN (no labelled answers): with "
                    "nothing to compare with, the accuracy guard is not evaluated (`not (a >= nan)` is True)")
        return f"it rolled back ({mine.alert}) though every guard passes"
    if ref.action == "rollback" and mine.action != "rollback":
        if ref.alert == "CanaryLatency":
            if g.max_p95_ms is not None and chall.p95_ms > g.max_p95_ms:
                return (f"the challenger's p95 ({chall.p95_ms:g} ms) is over the SLO guards.max_p95_ms "
                        f"({g.max_p95_ms:g} ms): roll back (CanaryLatency) even when it is within "
                        f"{g.max_p95_ratio:g} x the champion's; check both bounds")
            return (f"the challenger's p95 ({chall.p95_ms:g} ms) is over guards.max_p95_ratio ({g.max_p95_ratio:g}) "
                    f"x the champion's ({champ.p95_ms:g} ms): roll back (CanaryLatency) even under the SLO")
        if ref.alert == "CanaryErrors":
            if chall.error_rate > g.max_error_rate:
                return (f"the challenger's error rate {chall.error_rate:.1%} is over guards.max_error_rate: roll "
                        "back (CanaryErrors)")
            return (f"the challenger's error rate {chall.error_rate:.1%} is more than guards.max_error_rate_delta "
                    f"({g.max_error_rate_delta:.1%}) above the champion's ({champ.error_rate:.1%}): roll back "
                    "(CanaryErrors) even under the absolute limit")
        if ref.alert == "CanaryAccuracy":
            return (f"the challenger's accuracy ({chall.accuracy:.0%}) is more than guards.max_accuracy_drop below "
                    f"the champion's ({champ.accuracy:.0%}) on {chall.feedback:g} labelled answers: roll back "
                    "(CanaryAccuracy)")
        if ref.alert == "CanaryNoTraffic":
            return (f"after guards.max_idle_checks ({g.max_idle_checks}) checks in a row without enough requests, "
                    "roll back (CanaryNoTraffic): a canary that gets no traffic must not hold forever")
    if mine.action == "hold" and ref.action == "promote":
        return f"it held after {g.checks_per_step} healthy checks in a row: promote to the next step"
    if mine.action == ref.action == "rollback":
        return f"it raised {mine.alert!r} where {ref.alert!r} tripped: name the guard that tripped"
    return (f"expected {ref.action} to {ref.state.weight} % ({ref.state.status}); the steps are state.steps, the "
            "last (100 %) is status 'promoted', a rollback is status 'rolled_back' (weight 0)")


def _run_decide(fn: Any, state: Any, m: Mapping[str, Any], g: Any) -> Any:
    d = run_student(fn, state, m, g, what="decide", call="decide(state, metrics, guards)", timeout_s=10,
                    returns=Decision, returns_text="a canary.Decision(action, state, reason, alert)")
    if not isinstance(d.state, CanaryState):
        raise Wrong(f"its Decision's state is {_short(d.state)}: the new CanaryState (dataclasses.replace(state, "
                    "...))")
    return d


def _grade_scripted(fn: Any) -> int:
    checks = 0
    for what, g, seq in _sequences():
        mine_state = ref_state = canary.CanaryState()
        for i, m in enumerate(seq, start=1):
            ref = canary.decide(ref_state, m, g)
            mine = _run_decide(fn, mine_state, m, g)
            checks += 1
            same = (mine.action == ref.action and mine.state.weight == ref.state.weight
                    and mine.state.status == ref.state.status and (mine.alert or None) == (ref.alert or None))
            if not same:
                yours = f"{mine.action} to {mine.state.weight} % ({mine.state.status}" + \
                    (f", alert {mine.alert}" if mine.alert else "") + ")"
                raise Wrong(f"{what}, check {i} at {mine_state.weight} % ({_describe(m)}): yours says {yours}; "
                            f"{_why(mine, ref, mine_state, m, g)}")
            mine_state, ref_state = mine.state, ref.state
            if ref_state.finished:
                break
    return checks


def _live(fn: Any) -> str:
    guards = canary.Guards(**LIVE_GUARDS)
    decide_fn = functools.partial(_run_decide, fn)  # the student's decide, its Decision checked at every step
    out = []
    with _bench() as bench:
        for what, acc, want in (("a good challenger", 0.97, "promoted"), ("a challenger wrong on 4 answers in 10",
                                                                            0.6, "rolled_back")):
            run = bench.live(acc)
            try:
                t0 = time.perf_counter()
                result = canary.run_canary(bench.prom, run.set_weight, guards=guards, interval_s=0.6, timeout_s=20,
                                           window="2s", model=run.model, feedback_by=run.label, decide_fn=decide_fn)
                secs = time.perf_counter() - t0
            finally:
                bench.drop(run)
            actions = [r["action"] for r in result.rows]
            if result.state.status != want:
                raise Wrong(f"live, {what}: run_canary with your decide ended {result.state.status} (weights "
                            f"{run.weights}, alerts {result.alerts}, actions {actions}) where it should be {want}")
            if want == "promoted" and run.weights != [10, 50, 100]:
                raise Wrong(f"live, {what}: the weights went {run.weights}, not 10 -> 50 -> 100")
            if want == "rolled_back" and result.alerts != ["CanaryAccuracy"]:
                raise Wrong(f"live, {what}: rolled back with alerts {result.alerts}, expected ['CanaryAccuracy']")
            out.append(f"{what} {want.replace('_', ' ')} in {secs:.0f} s")
    return "; ".join(out)


def _grade_decide(fn: Any) -> str:
    checks = _grade_scripted(fn)
    why = _prometheus_missing()
    if why:
        return f"it decides as the reference on {checks} scripted checks. (The live run is skipped: {why})"
    return f"it decides as the reference on {checks} scripted checks, and live on Prometheus: {_live(fn)}."


q3 = CodeExercise(
    name="08.3 the canary's decision", var="decide", grade=_grade_decide,
    references=References("write the canary's decision rules yourself",
                           reference_decide, "lab_utils.mlops.canary.decide"),
    signature="decide(state: CanaryState, metrics: dict[str, VariantMetrics], guards: Guards) -> Decision",
    hints=(
        "Guards in order: errors (above guards.max_error_rate, or above the champion's + max_error_rate_delta), "
        "latency (p95 above guards.max_p95_ms, or above max_p95_ratio x the champion's once the challenger has "
        "guards.min_latency_requests requests), accuracy (below the "
        "champion's - max_accuracy_drop, only once feedback >= min_feedback and both accuracies are numbers). "
        "A trip: Decision('rollback', replace(state, status='rolled_back'), why, alert).",
        "Fewer than guards.min_requests challenger requests: a hold (state.idle + 1, healthy back to 0); after "
        "guards.max_idle_checks of those in a row: rollback 'CanaryNoTraffic'.",
        "A healthy check adds 1 to state.healthy; at guards.checks_per_step: promote, replace(state, step=step + 1, "
        "healthy=0, idle=0), with status 'promoted' when the new step is the last (100 %).",
    ),
    solution_text=source_as(reference_decide, "decide"),
)


# --- q4: the sample size -----------------------------------------------------------------------------------------

_Q4_FIXED = [(0.90, 0.92, 0.05, 0.8), (0.95, 0.96, 0.05, 0.8), (0.50, 0.55, 0.05, 0.8), (0.80, 0.85, 0.01, 0.9),
             (0.97, 0.95, 0.05, 0.8)]


def _n(p_a: float, p_b: float, alpha: float, power: float, *, pooled: bool = True, two_sided: bool = True,
       sqrt: bool = True, square: bool = True, power_z: str = "power") -> float:
    from statistics import NormalDist

    nd = NormalDist()
    z_a = nd.inv_cdf(1 - alpha / 2 if two_sided else 1 - alpha)
    z_b = nd.inv_cdf(power if power_z == "power" else 1 - power)
    var = p_a * (1 - p_a) + p_b * (1 - p_b)
    d2 = (p_a - p_b) ** 2
    if pooled:
        p = (p_a + p_b) / 2
        s0, s1 = (math.sqrt(2 * p * (1 - p)), math.sqrt(var)) if sqrt else (2 * p * (1 - p), var)
        return (z_a * s0 + z_b * s1) ** 2 / d2
    return (z_a + z_b) ** (2 if square else 1) * var / d2


def _grade_sample_size(fn: Any) -> str:
    rng = random.Random(random.randrange(10**6))
    cases = list(_Q4_FIXED)
    for _ in range(12):
        p_a = round(rng.uniform(0.6, 0.97), 3)
        p_b = round(min(0.995, p_a + rng.choice([-1, 1]) * rng.uniform(0.01, 0.06)), 3)
        cases.append((p_a, p_b, rng.choice([0.05, 0.01, 0.1]), rng.choice([0.8, 0.9])))
    got = []
    for p_a, p_b, alpha, power in cases:
        call = f"sample_size({p_a:g}, {p_b:g}, alpha={alpha:g}, power={power:g})"
        v = run_student(fn, p_a, p_b, alpha=alpha, power=power, what="sample_size", call=call, timeout_s=10)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise Wrong(f"{call} returned {_short(v)}: a number of requests per group (an int)")
        if isinstance(v, (float, np.floating)) and not float(v).is_integer():
            raise Wrong(f"{call} returned {float(v):g}: a count of requests is whole; round up (math.ceil): "
                        "{:g} requests are not enough for the power asked".format(math.floor(v)))
        got.append(integer(v, call))

    def ok(value: int, n: float) -> bool:
        return value in (math.ceil(n - 1e-6), math.ceil(n + 1e-6))

    for pooled, form in ((True, "pooled"), (False, "unpooled")):
        if all(ok(g_, _n(*c, pooled=pooled)) for g_, c in zip(got, cases, strict=True)):
            other = "unpooled (Chow, Shao & Wang)" if pooled else "pooled (Fleiss; ex.reference_sample_size)"
            return (f"the {form} formula, right on {len(cases)} cases (the {other} form differs by a few "
                    f"requests). sample_size(0.90, 0.92) = {got[0]} per group.")
    slips = [
        ("it is one-sided: a two-sided test splits alpha, z = Phi^-1(1 - alpha/2) (1.96 at 5 %), not "
         "Phi^-1(1 - alpha)", lambda c, p: math.ceil(_n(*c, pooled=p, two_sided=False) - 1e-6)),
        ("that is both groups together: the formula gives the requests in EACH group",
         lambda c, p: 2 * math.ceil(_n(*c, pooled=p) - 1e-6), lambda c, p: math.ceil(2 * _n(*c, pooled=p) - 1e-6)),
        ("rounded down (or to the nearest): fewer requests than the formula asks give less power than asked; "
         "round up, math.ceil", lambda c, p: math.floor(_n(*c, pooled=p)), lambda c, p: round(_n(*c, pooled=p))),
        ("a square root is missing: the standard deviations are sqrt(2 p (1 - p)) and sqrt(p_a q_a + p_b q_b)",
         lambda c, p: math.ceil(_n(*c, pooled=True, sqrt=False) - 1e-6)),
        ("(z_a + z_b) is not squared: n = (z_a + z_b)^2 (p_a q_a + p_b q_b) / (p_a - p_b)^2",
         lambda c, p: math.ceil(_n(*c, pooled=False, square=False) - 1e-6)),
        ("the power's z is Phi^-1(power) (0.84 for 80 %), not Phi^-1(1 - power): that one is negative and makes "
         "the sample far too small", lambda c, p: math.ceil(_n(*c, pooled=p, power_z="1-power") - 1e-6)),
    ]
    for why, *forms in slips:  # a slip's message, and the answers that make it
        for slip, pooled in itertools.product(forms, (True, False)):
            try:
                if all(g_ == slip(c, pooled) for g_, c in zip(got, cases, strict=True)):
                    raise Wrong(why)
            except (ValueError, ZeroDivisionError):
                continue
    i = next(k for k, (g_, c) in enumerate(zip(got, cases, strict=True)) if not ok(g_, _n(*c)))
    p_a, p_b, alpha, power = cases[i]
    raise Wrong(f"sample_size({p_a:g}, {p_b:g}, alpha={alpha:g}, power={power:g}) = {got[i]}, expected "
                f"{math.ceil(_n(*cases[i]) - 1e-6)} (pooled) or {math.ceil(_n(*cases[i], pooled=False) - 1e-6)} "
                "(unpooled): n = (z_a sqrt(2 p q) + z_b sqrt(p_a q_a + p_b q_b))^2 / (p_a - p_b)^2")


q4 = CodeExercise(
    name="08.4 the A/B test's sample size", var="sample_size", grade=_grade_sample_size,
    references=References("compute the sample size from the z-test yourself",
                           reference_sample_size, "lab_utils.mlops.abtest.sample_size"),
    signature="sample_size(p_a, p_b, alpha=0.05, power=0.8) -> int",
    hints=(
        "Two quantiles of the standard normal: z_a at 1 - alpha/2 (the test is two-sided) and z_b at the power; "
        "statistics.NormalDist().inv_cdf gives both.",
        "Pooled under H0 with p = (p_a + p_b) / 2: n = (z_a sqrt(2 p (1 - p)) + z_b sqrt(p_a (1 - p_a) + p_b (1 - "
        "p_b)))^2 / (p_a - p_b)^2 per group; math.ceil it.",
    ),
    solution_text=source_as(reference_sample_size, "sample_size"),
)


# --- q6: PSI -----------------------------------------------------------------------------------------------------


def _psi(ref: np.ndarray, cur: np.ndarray, bins: int, *, edges_from: str = "ref", eps: float = 1e-4,
         shares: bool = True, form: str = "psi", closed: bool = False) -> float:
    base = ref if edges_from == "ref" else cur
    if closed:  # np.histogram over [min, max] of the reference: the current sample's values outside are dropped
        full = np.quantile(base, np.linspace(0, 1, bins + 1))
        rc, cc = np.histogram(ref, full)[0].astype(float), np.histogram(cur, full)[0].astype(float)
    else:
        edges = np.unique(np.quantile(base, np.linspace(0, 1, bins + 1)[1:-1]))
        rc = np.bincount(np.searchsorted(edges, ref, side="right"), minlength=len(edges) + 1).astype(float)
        cc = np.bincount(np.searchsorted(edges, cur, side="right"), minlength=len(edges) + 1).astype(float)
    r, c = (rc / rc.sum(), cc / cc.sum()) if shares else (rc, cc)
    r, c = np.maximum(r, eps), np.maximum(c, eps)
    with np.errstate(divide="ignore", invalid="ignore"):
        if form == "kl":
            return float(np.sum(c * np.log(c / r)))
        if form == "kl_rev":
            return float(np.sum(r * np.log(r / c)))
        return float(np.sum((c - r) * np.log(c / r)))


def _psi_cases(seed: int) -> list[tuple[str, np.ndarray, np.ndarray, int, bool]]:
    """(what, reference, current, bins, has empty bins)."""
    rng = np.random.default_rng(seed)
    ref = rng.normal(0, 1, 2000)
    return [
        ("a shifted and wider sample", ref, rng.normal(0.8, 1.5, 1200), 10, False),
        ("a skewed sample, bins=5", rng.exponential(1.0, 1500), rng.exponential(1.6, 900) + 0.1, 5, False),
        ("a sample from the same distribution", ref, rng.normal(0, 1, 2000), 10, False),
        ("a sample that leaves most bins empty", ref, rng.normal(0, 0.1, 500), 10, True),
    ]


def _grade_psi(fn: Any) -> str:
    seed = random.randrange(10**6)
    slips = [
        ({"edges_from": "cur"}, "the bins are at the current sample's quantiles: they must be the reference's (fixed "
                                "once, from the training data), so that every window is measured on the same bins"),
        ({"shares": False}, "it uses counts, not shares: divide each bin's count by its sample's size (the two "
                            "samples differ in size)"),
        ({"form": "kl"}, "that is KL(current || reference), one direction only: PSI is sum (c - r) ln(c / r), "
                         "symmetric in the two samples"),
        ({"form": "kl_rev"}, "that is KL(reference || current), one direction only: PSI is sum (c - r) ln(c / r)"),
        ({"closed": True}, "the outer bins are closed at the reference's min and max, so current values beyond them "
                           "are dropped: the first and last bins are open-ended (-inf, q1] and (q9, inf)"),
    ]
    results = []
    for what, ref, cur, bins, empty in _psi_cases(seed):
        call = f"psi(reference, current, bins={bins}) on {what}"
        got = run_student(fn, ref.copy(), cur.copy(), bins=bins, what="psi", call=call, timeout_s=20)
        if isinstance(got, (float, np.floating)) and not math.isfinite(got):
            shown, why = (("inf", "an empty bin has share 0, and ln(0) is infinite") if math.isinf(got) else
                          ("NaN", "an empty bin makes 0 * ln(0)"))
            raise Wrong(f"{call} is {shown}: {why}; floor the shares at a small epsilon (np.maximum(share, 1e-4))")
        got = number(got, call)
        want = _psi(ref, cur, bins)
        if got < -1e-9:
            raise Wrong(f"{call} is {got:.4g}, negative: each term (c - r) ln(c / r) is >= 0 (both factors have the "
                        "same sign); the factors are reversed somewhere")
        if empty:
            lo, hi = sorted((_psi(ref, cur, bins, eps=1e-2), _psi(ref, cur, bins, eps=1e-9)))
            if lo * 0.99 <= got <= hi * 1.01:
                results.append(got)
                continue
        elif math.isclose(got, want, rel_tol=1e-3, abs_tol=1e-6):
            results.append(got)
            continue
        for kw, why in slips:
            if math.isclose(got, _psi(ref, cur, bins, **kw), rel_tol=1e-3, abs_tol=1e-6):
                raise Wrong(f"{call}: {why}")
        if math.isclose(got, -want, rel_tol=1e-3):
            raise Wrong(f"{call} is {got:.4g}, the negative of PSI: (c - r) ln(c / r), not (r - c) ln(c / r)")
        raise Wrong(f"{call} is {got:.4g}, expected {want:.4g}: inner edges at the reference's quantiles "
                    f"np.quantile(reference, np.linspace(0, 1, bins + 1)[1:-1]), shares per bin, floored at 1e-4")
    return (f"right on four pairs of samples (PSI {results[0]:.3f} for a shifted one, {results[2]:.4f} for the same "
            "distribution, finite with empty bins).")


q6 = CodeExercise(
    name="08.6 the population stability index", var="psi", grade=_grade_psi,
    references=References("bin the values and sum the PSI terms yourself", reference_psi, "lab_utils.mlops.drift.psi"),
    signature="psi(reference, current, bins=10) -> float",
    hints=(
        "Bins from the reference: inner edges = np.quantile(reference, np.linspace(0, 1, bins + 1)[1:-1]); the "
        "outer bins are open-ended. np.searchsorted(edges, x) gives each value's bin; np.bincount counts them.",
        "Shares, not counts (divide by the sample's size), floored at a small epsilon (np.maximum(share, 1e-4)); "
        "PSI = sum((c - r) * np.log(c / r)).",
    ),
    solution_text=source_as(reference_psi, "psi"),
)


# --- q5: the A/B verdict -----------------------------------------------------------------------------------------

_VERDICTS = ("real", "not real")
_VERDICT_SYNONYMS = {
    "real": ["yes", "true", "significant", "statistically significant", "real difference", "it is real",
             "the difference is real"],
    "not real": ["no", "false", "not significant", "noise", "chance", "no real difference", "not distinguishable",
                 "inconclusive", "it is not real", "the difference is not real", "unreal"],
}


def _grade_verdict(value: Any) -> str:
    res = _BOUND.get("ab")
    if res is None:
        raise NotApplicable("no A/B result to compare with yet: run the cell that compares the two groups (it calls "
                            "ex.use_ab(result)), then this one again.")
    picked = ("real" if value else "not real") if isinstance(value, bool) else \
        choice(value, _VERDICTS, _VERDICT_SYNONYMS)
    if picked is None:
        raise Wrong('answer "real" or "not real" (yes / no)')
    lo, hi = res.boot_low, res.boot_high
    real = reference_verdict(res) == "real"
    interval = f"the 95 % interval of B - A is [{lo:+.2%}, {hi:+.2%}] (p = {res.test.p_value:.3g})"
    if picked == "real" and not real:
        raise Wrong(f"{interval}: it contains 0, so no difference at all fits the data as well as the one measured; "
                    "at this sample size the difference is not distinguishable from chance")
    if picked == "not real" and real:
        raise Wrong(f"{interval}: it excludes 0, so a difference of 0 is implausible; the difference is real "
                    "(whether it matters is another question: compare it with the smallest difference worth acting on)")
    return f"{interval}."


q5 = Exercise(
    name="08.5 the A/B verdict", var="ab_verdict", grade=_grade_verdict,
    references=References("read the interval yourself", reference_verdict),
    hints=(
        "Read the 95 % interval of B - A (result.boot_low, result.boot_high) and the p-value (result.test.p_value).",
        "The difference is real when the interval excludes 0 (then p < 0.05 too): a 0 inside means 'no difference' "
        "explains the data as well.",
    ),
    solution_text="ab_verdict = \"real\" if not (result.boot_low <= 0 <= result.boot_high) else \"not real\"",
)
