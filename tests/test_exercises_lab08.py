"""Lab 08's exercise checks against the real tools: an MLflow tracking server and a Prometheus scraping scripted
metric sources (both started once for the module). Each check with right answers (written differently too), blanks,
and plausible wrong answers told their symptom. Without Prometheus the q2/q3 tests skip (fail under
NVLAB_REQUIRE_PROMETHEUS=1); without mlflow the q1 tests skip."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from statistics import NormalDist

import numpy as np
import pytest
from _exercise_harness import (
    as_written,
    check,
    exercises_of,
    hint_and_solution_tests,
    solution_functions,
    standard_tests,
)
from _prometheus import require_prometheus

from lab_utils.exercises import lab08 as ex
from lab_utils.exercises.framework import Exercise, Status
from lab_utils.exercises.lab08 import common, decision
from lab_utils.mlops import abtest, canary
from lab_utils.mlops import tracking as tr

# --- fixtures ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(shared_tracking):
    if not shared_tracking.alive():  # stopped by test_mlops.py's last test
        shared_tracking.start()
    ex.use_tracking(shared_tracking)  # the server test_mlops.py uses too (tests/conftest.py)
    yield shared_tracking
    common._BOUND.pop("tracking", None)


@pytest.fixture(scope="module")
def bench():
    require_prometheus()
    with ex.MetricsBench() as b:
        ex.use_bench(b)
        yield b
    ex.use_bench(None)
    assert b.prom is None and not b._servers  # stopped: nothing left on ports


def _assert_told(exercise, wrongs):
    """Each wrong answer is incorrect, shows the variable, and names its symptom (the words given with it)."""
    for value, words in wrongs:
        out = check(exercise, value)
        assert out.status is Status.INCORRECT, (value, out.message)
        assert f"`{exercise.var}`" in out.message
        for w in words if isinstance(words, tuple) else (words,):
            assert w in out.message, (w, out.message)


def _assert_right(exercise, rights):
    for value in rights:
        out = check(exercise, value)
        assert out.status is Status.CORRECT, (value, out.message)


def _assert_blank(exercise):
    for blank in (None, ...):
        out = check(exercise, blank)
        assert out.status is Status.NOT_ATTEMPTED and exercise.var in out.message


# --- q1: the tracking run ---------------------------------------------------------------------------------------


def _log_with_client(tracking_uri, experiment, result, onnx_path):
    """Right, written differently: an explicit MlflowClient, one log_batch, the run ended by hand."""
    import time

    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    sha = tr.git_commit()[0]
    run = client.create_run(exp_id, tags={"data_sha256": result.data_sha256, "git_commit": sha})
    now = int(time.time() * 1000)
    metrics = [Metric(k, v, now, row["epoch"] - 1) for row in result.history for k, v in row.items() if k != "epoch"]
    client.log_batch(run.info.run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in result.params.items()])
    client.log_artifact(run.info.run_id, onnx_path)
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def _log(slip):
    def log_run(tracking_uri, experiment, result, onnx_path):
        import mlflow

        mlflow.set_tracking_uri(tracking_uri)
        if slip == "create":
            mlflow.create_experiment(experiment)
        mlflow.set_experiment(experiment)
        run = mlflow.start_run()
        mlflow.log_params(result.params)
        if slip == "last":
            mlflow.log_metrics(result.metrics)
        else:
            for row in result.history:
                for k in ("train_loss", "val_loss", "val_accuracy"):
                    mlflow.log_metric(k, row[k], step=0 if slip == "step0" else row["epoch"])
        if slip == "path":
            mlflow.log_param("onnx_path", onnx_path)
        else:
            mlflow.log_artifact(onnx_path)
        mlflow.set_tag("data_sha256", result.val_sha256 if slip == "val_hash" else result.data_sha256)
        if slip != "no_commit":
            mlflow.set_tag("git_commit", tr.git_commit()[0])
        if slip != "open":
            mlflow.end_run()
        return run.info.run_id

    return log_run


Q1_RIGHT = [ex.reference_log_run, _log_with_client]
Q1_WRONG = [(_log("last"), "has one point (the last epoch's)"), (_log("step0"), "at step 0"),
            (_log("path"), "path is logged"), (_log("val_hash"), "val_sha256"),
            (_log("no_commit"), "no tag git_commit"), (_log("open"), "RUNNING"),
            (_log("create"), ("raised", "already exists"))]


def test_q1_log_run(server):
    _assert_right(ex.q1, Q1_RIGHT)
    _assert_told(ex.q1, Q1_WRONG)
    _assert_blank(ex.q1)
    import mlflow

    assert mlflow.active_run() is None  # the run left open by a wrong answer was ended


def test_q1_without_a_server_is_not_applicable(monkeypatch):
    monkeypatch.setitem(common._BOUND, "tracking", None)  # the dict every check module reads
    out = check(ex.q1, ex.reference_log_run)
    if tr.mlflow_missing():
        assert out.status is Status.NOT_APPLICABLE
    else:
        assert out.status is Status.NOT_APPLICABLE and "use_tracking" in out.message


# --- q2: the PromQL ---------------------------------------------------------------------------------------------

_M = 'model="digits_service"'


def _queries(error_rate=None, p95=None, accuracy=None, window=None):
    def canary_queries(w):
        # the notebook's code: the delegation guard refuses a call of the reference
        q = solution_functions("08")["canary_queries"](window or w)
        for key, v in (("error_rate", error_rate), ("p95_ms", p95), ("accuracy", accuracy)):
            if v is not None:
                q[key] = v.replace("WINDOW", window or w)
        return q

    return canary_queries


def _increase_form(window):
    """Right, written differently: increase() throughout, the missing failures as `or on() vector(0)`-free 0s."""
    ok = f'sum by (job) (increase(nv_inference_request_success{{{_M}}}[{window}]))'
    fail = f'(sum by (job) (increase(nv_inference_request_failure{{{_M}}}[{window}])) or {ok} * 0)'
    return {"error_rate": f"{fail} / ({fail} + {ok})",
            "p95_ms": f'max by (job) (nv_inference_request_summary_us{{quantile="0.95", {_M}}}) * 0.001',
            "accuracy": (f"sum by (variant) (rate(nvlab_feedback_correct_total[{window}])) / "
                         f"sum by (variant) (rate(nvlab_feedback_total[{window}]))"),
            "requests": ok}


_OK = f"sum by (job) (rate(nv_inference_request_success{{{_M}}}[WINDOW]))"
_FAIL = f"(sum by (job) (rate(nv_inference_request_failure{{{_M}}}[WINDOW])) or {_OK} * 0)"
# (a wrapper of canary.render_queries is refused by the delegation guard: tests/test_no_delegation.py)
Q2_RIGHT = [ex.reference_canary_queries, _increase_form]
Q2_WRONG = [
    (_queries(error_rate=f"{_FAIL} / {_OK}"), "failures / successes"),
    (_queries(error_rate=f"sum by (job) (rate(nv_inference_request_failure{{{_M}}}[WINDOW])) / ({_OK} + "
                         f"sum by (job) (rate(nv_inference_request_failure{{{_M}}}[WINDOW])))"), "or sum by (job)"),
    (_queries(error_rate=f"rate(nv_inference_request_failure{{{_M}}}[WINDOW]) / (rate(nv_inference_request_success"
                         f"{{{_M}}}[WINDOW]) + rate(nv_inference_request_failure{{{_M}}}[WINDOW]))"),
     "no series at all"),
    (_queries(error_rate=_FAIL.replace(f"{{{_M}}}", "") + " / (" + _OK.replace(f"{{{_M}}}", "") + " + "
                                                        + _FAIL.replace(f"{{{_M}}}", "") + ")"), "digits_preprocess"),
    (_queries(error_rate=_FAIL.replace("rate(", "(").replace("[WINDOW]", "") + " / (" +
              _OK.replace("rate(", "(").replace("[WINDOW]", "") + " + " +
              _FAIL.replace("rate(", "(").replace("[WINDOW]", "") + ")  # [WINDOW]"), "since the servers started"),
    (_queries(p95=f'max by (job) (nv_inference_request_summary_us{{{_M},quantile="0.95"}})'), "microseconds"),
    (_queries(p95=f'sum by (job) (nv_inference_request_summary_us{{{_M},quantile="0.95"}}) / 1000'), "max by (job)"),
    (_queries(p95=f'nv_inference_request_summary_us{{{_M},quantile="0.95"}} / 1000'), "2 series for job='champion'"),
    (_queries(accuracy="sum by (variant) (nvlab_feedback_correct_total) / sum by (variant) (nvlab_feedback_total)"
                       " # [WINDOW]"), "totals since the start"),
    (_queries(accuracy="increase(nvlab_feedback_correct_total[WINDOW]) / increase(nvlab_feedback_total[WINDOW])"),
     "two exporter instances"),
    (_queries(window="30s"), "does not use the window"),
]


def test_q2_queries(bench):
    _assert_right(ex.q2, Q2_RIGHT)
    _assert_told(ex.q2, Q2_WRONG)
    _assert_blank(ex.q2)


def test_q2_without_prometheus_is_not_applicable(monkeypatch):
    monkeypatch.setattr(ex.q2, "applicable", lambda: "this check runs your code on a real Prometheus: missing")
    assert check(ex.q2, ex.reference_canary_queries).status is Status.NOT_APPLICABLE


# --- q3: the decision -------------------------------------------------------------------------------------------


def _decide(promote_first=False, acc_before_min=False, ratio_only=False, idle_now=False, nan_acc=False,
            abs_errors=False, no_feedback_wait=False, p95_ratio=False, no_floor=False, no_comparison_wait=False):
    def decide(state, metrics, guards):
        ch, cl = metrics["champion"], metrics["challenger"]

        def back(alert):
            return canary.Decision("rollback", replace(state, status="rolled_back"), alert, alert)

        enough = cl.requests >= guards.min_requests
        if enough:
            if cl.error_rate > guards.max_error_rate or (
                    not abs_errors and not math.isnan(ch.error_rate)
                    and cl.error_rate > ch.error_rate + guards.max_error_rate_delta):
                return back("CanaryErrors")
            if p95_ratio:  # the p95s compared, each a summary over its own server's last 60 s
                slow = cl.p95_ms > guards.max_latency_ratio * ch.p95_ms
            else:
                floor = 0.0 if no_floor else guards.latency_floor_ms
                slow = cl.mean_ms > max(guards.max_latency_ratio * ch.mean_ms, floor)  # False on a NaN
            if not ratio_only:
                slow = slow or cl.p95_ms > guards.max_p95_ms
            if slow:
                return back("CanaryLatency")
        if (acc_before_min or cl.feedback >= guards.min_feedback) and not math.isnan(cl.accuracy):
            low = not (cl.accuracy >= ch.accuracy - guards.max_accuracy_drop) if nan_acc else \
                cl.accuracy < ch.accuracy - guards.max_accuracy_drop
            if low:
                return back("CanaryAccuracy")
        if not enough or (not no_feedback_wait and cl.feedback < guards.min_feedback):
            if idle_now or state.idle + 1 >= guards.max_idle_checks:
                return back("CanaryNoTraffic")
            return canary.Decision("hold", replace(state, idle=state.idle + 1, healthy=0), "waiting")
        if not no_comparison_wait and (math.isnan(cl.mean_ms) or math.isnan(ch.mean_ms)):
            return canary.Decision("hold", replace(state, idle=0, healthy=0), "no latency comparison yet")
        healthy = state.healthy + 1
        if healthy < guards.checks_per_step and not promote_first:
            return canary.Decision("hold", replace(state, healthy=healthy, idle=0), "healthy")
        step = state.step + 1
        done = step == len(state.steps) - 1
        return canary.Decision("promote", replace(state, step=step, healthy=0, idle=0,
                                                  status="promoted" if done else "running"), "promote")

    return decide


Q3_RIGHT = [ex.reference_decide, canary.decide]
Q3_WRONG = [(_decide(promote_first=True), "promoted after 1 healthy check"),
            (_decide(acc_before_min=True), "min_feedback"),
            (_decide(ratio_only=True), "over the SLO"),
            (_decide(no_feedback_wait=True), "labelled"),
            (_decide(idle_now=True), "max_idle_checks"),
            (_decide(nan_acc=True), "champion's accuracy is NaN"),
            (_decide(abs_errors=True), "max_error_rate_delta"),
            (_decide(p95_ratio=True), "not the p95s"),
            (_decide(no_floor=True), "latency_floor_ms"),
            (_decide(no_comparison_wait=True), "without the latency comparison"),
            (lambda state, metrics, guards: "promote", "canary.Decision")]


def test_q3_decide(bench):
    for fn in Q3_RIGHT:
        out = check(ex.q3, fn)
        assert out.correct and "promoted" in out.message and "rolled back" in out.message, out.message
    _assert_told(ex.q3, Q3_WRONG)
    _assert_blank(ex.q3)


def test_q3_scripted_sequences_alone_follow_the_reference():
    assert decision._grade_scripted(ex.reference_decide) == decision._grade_scripted(canary.decide) > 20


# --- q4, q6: sample size and PSI (offline) ----------------------------------------------------------------------


def _sample_size_unpooled(p_a, p_b, alpha=0.05, power=0.8):
    """Right, written differently: the unpooled textbook form, a float that is whole."""
    z = NormalDist().inv_cdf
    return float(math.ceil((z(1 - alpha / 2) + z(power)) ** 2 * (p_a * (1 - p_a) + p_b * (1 - p_b))
                           / (p_a - p_b) ** 2))


def _ss(**kw):
    def sample_size(p_a, p_b, alpha=0.05, power=0.8):
        z = NormalDist().inv_cdf
        z_a = z(1 - alpha) if kw.get("one_sided") else z(1 - alpha / 2)
        z_b = z(1 - power) if kw.get("power_z") else z(power)
        p = (p_a + p_b) / 2
        root = (lambda x: x) if kw.get("no_sqrt") else math.sqrt
        n = (z_a * root(2 * p * (1 - p)) + z_b * root(p_a * (1 - p_a) + p_b * (1 - p_b))) ** 2 / (p_a - p_b) ** 2
        if kw.get("float"):
            return n
        if kw.get("total"):
            return 2 * math.ceil(n)
        return int(n) if kw.get("floor") else math.ceil(n)

    return sample_size


def _ss_constant(value):
    def sample_size(p_a, p_b, alpha=0.05, power=0.8):
        return value

    return sample_size


Q4_RIGHT = [ex.reference_sample_size, _sample_size_unpooled]
Q4_WRONG = [(_ss(one_sided=True), "one-sided"), (_ss(total=True), "both groups"), (_ss(float=True), "whole"),
            (_ss(floor=True), "rounded down"), (_ss(no_sqrt=True), "square root"), (_ss(power_z=True), "1 - power"),
            (_ss_constant(math.nan), "a finite number of requests"), (_ss_constant(math.inf), "a finite number")]


def _psi_histogram(reference, current, bins=10):
    """Right, written differently: np.histogram over open-ended outer edges, shares with np.clip."""
    ref, cur = np.asarray(reference, float), np.asarray(current, float)
    inner = np.quantile(ref, np.linspace(0, 1, bins + 1)[1:-1])
    edges = np.concatenate([[min(ref.min(), cur.min()) - 1], inner, [max(ref.max(), cur.max()) + 1]])
    r = np.clip(np.histogram(ref, edges)[0] / len(ref), 1e-4, None)
    c = np.clip(np.histogram(cur, edges)[0] / len(cur), 1e-4, None)
    return float(((c - r) * np.log(c / r)).sum())


def _psi(**kw):
    def psi(reference, current, bins=10):
        ref, cur = np.asarray(reference, float), np.asarray(current, float)
        base = cur if kw.get("cur_edges") else ref
        edges = np.quantile(base, np.linspace(0, 1, bins + 1)[1:-1])
        r = np.bincount(np.searchsorted(edges, ref, side="right"), minlength=bins).astype(float)
        c = np.bincount(np.searchsorted(edges, cur, side="right"), minlength=bins).astype(float)
        if not kw.get("counts"):
            r, c = r / r.sum(), c / c.sum()
        if not kw.get("no_eps"):
            r, c = np.maximum(r, 1e-4), np.maximum(c, 1e-4)
        with np.errstate(divide="ignore", invalid="ignore"):
            if kw.get("kl"):
                return float(np.sum(c * np.log(c / r)))
            if kw.get("neg"):
                return float(np.sum((r - c) * np.log(c / r)))
            return float(np.sum((c - r) * np.log(c / r)))

    return psi


def _psi_closed(reference, current, bins=10):
    ref, cur = np.asarray(reference, float), np.asarray(current, float)
    edges = np.quantile(ref, np.linspace(0, 1, bins + 1))
    r = np.maximum(np.histogram(ref, edges)[0] / len(ref), 1e-4)
    c = np.histogram(cur, edges)[0]
    c = np.maximum(c / c.sum(), 1e-4)
    return float(np.sum((c - r) * np.log(c / r)))


Q6_RIGHT = [ex.reference_psi, _psi_histogram]
Q6_WRONG = [(_psi(cur_edges=True), "current sample's quantiles"), (_psi(no_eps=True), "epsilon"),
            (_psi(counts=True), "counts, not shares"), (_psi(kl=True), "KL"), (_psi(neg=True), "negative"),
            (_psi_closed, "open-ended")]

OFFLINE_CASES = [(ex.q4, Q4_RIGHT, [w for w, _ in Q4_WRONG]), (ex.q6, Q6_RIGHT, [w for w, _ in Q6_WRONG])]
(test_offline_right, test_offline_wrong, test_offline_blank) = standard_tests(OFFLINE_CASES)


def test_offline_wrong_answers_are_told_their_symptom():
    _assert_told(ex.q4, Q4_WRONG)
    _assert_told(ex.q6, Q6_WRONG)


# --- q5: the verdict --------------------------------------------------------------------------------------------


def _ab(acc_b, n=2000):
    a = np.array([1] * int(0.90 * n) + [0] * (n - int(0.90 * n)))
    b = np.array([1] * int(acc_b * n) + [0] * (n - int(acc_b * n)))
    return abtest.compare_groups(a, b, n_boot=500)


def test_q6_verdict(monkeypatch):
    monkeypatch.setitem(common._BOUND, "ab", None)  # the dict every check module reads
    assert check(ex.q5, "real").status is Status.NOT_APPLICABLE and "use_ab" in check(ex.q5, "real").message
    real, noise = _ab(0.94), _ab(0.905)
    assert real.real and not noise.real
    ex.use_ab(real)
    _assert_right(ex.q5, ["real", "Yes", True, as_written(ex.reference_verdict(real))])
    _assert_told(ex.q5, [("not real", "excludes 0"), ("no", "excludes 0"), ("maybe", 'answer "real" or "not real"')])
    _assert_blank(ex.q5)
    ex.use_ab(noise)
    _assert_right(ex.q5, ["not real", "not significant", False])
    _assert_told(ex.q5, [("real", "contains 0"), ("yes", "contains 0")])


# --- the module as a whole --------------------------------------------------------------------------------------


def test_cases_cover_every_exercise():
    wrongs = [(ex.q1, Q1_WRONG), (ex.q2, Q2_WRONG), (ex.q3, Q3_WRONG), (ex.q4, Q4_WRONG), (ex.q6, Q6_WRONG)]
    assert {id(e) for e, _ in wrongs} | {id(ex.q5)} == {id(e) for e in exercises_of(ex)}
    assert all(len(w) >= 2 for _, w in wrongs)


def test_at_least_half_of_the_exercises_run_code():
    code = [e for e in exercises_of(ex) if hasattr(e, "signature")]
    assert len(code) == 5 and 2 * len(code) >= len(exercises_of(ex))


def test_solution_code_passes_its_check(server, bench):
    for exercise in exercises_of(ex):
        result = _ab(0.94)
        ex.use_ab(result)
        namespace = {k: getattr(ex, k) for k in ex.__all__} | {"ex": ex, "np": np, "math": math, "result": result}
        exec(exercise.solution_text, namespace)
        out = check(exercise, namespace[exercise.var])
        assert out.correct, (exercise.name, out.message)


def test_every_exercise_has_hints_and_solution():
    exercises = exercises_of(ex)
    assert len(exercises) == 6
    names = sorted(k for k, v in vars(ex).items() if isinstance(v, Exercise))
    assert names == [f"q{i}" for i in range(1, len(names) + 1)]
    for e in exercises:
        assert e.name.startswith("08.") and 2 <= len(e.hints) <= 3


test_hints_step_from_first_to_last, test_solution_prints = hint_and_solution_tests(exercises_of(ex))


def test_all_exports_exist():
    for name in ex.__all__:
        assert hasattr(ex, name), name
    assert copy.copy(ex.q1).var == "log_run"
