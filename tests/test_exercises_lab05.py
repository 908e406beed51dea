"""Lab 05's exercise checks against right, wrong and blank answers; the specific messages; the PromQL checks
graded by a real Prometheus on the recorded samples (and what they say where there is none); hints and
solutions."""

from __future__ import annotations

import pytest
from _exercise_harness import check, exercises_of, hint_and_solution_tests, standard_tests

from lab_utils.exercises import lab05
from lab_utils.exercises.framework import Exercise, Status
from lab_utils.monitoring import prometheus

QPS = "sum by (model) (rate(nv_inference_request_success[1m]))"
LAT = ("sum by (model) (rate(nv_inference_request_duration_us[1m])) / "
       "sum by (model) (rate(nv_inference_request_success[1m])) / 1000")
GOOD_SNAPSHOT = {"qps": 240.0, "avg_batch": 8.0, "avg_queue_ms": 12.5}
GOOD_BOTTLENECK = {"detector": "queue", "ranker": "compute", "embedder": "outside"}

Q1_WRONG = {
    "increase": "sum by (model) (increase(nv_inference_request_success[1m]))",
    "no sum": "rate(nv_inference_request_success[1m])",
    "sum without by": "sum(rate(nv_inference_request_success[1m]))",
    "inferences": "sum by (model) (rate(nv_inference_count[1m]))",
    "executions": "sum by (model) (rate(nv_inference_exec_count[1m]))",
    "counter total": "sum by (model) (nv_inference_request_success)",
    "irate": "sum by (model) (irate(nv_inference_request_success[1m]))",
    "window": "sum by (model) (rate(nv_inference_request_success[5m]))",
    "constant": "120",
    "no range": "rate(nv_inference_request_success)",
    "range vector": "nv_inference_request_success[1m]",
    "one model": 'sum by (model) (rate(nv_inference_request_success{model="bert"}[1m]))',
    "no such metric": "sum by (model) (rate(nv_inference_requests[1m]))",
    "twice": "2 * sum by (model) (rate(nv_inference_request_success[1m]))",
    "increase, no sum": "increase(nv_inference_request_success[1m])",
}
Q2_WRONG = {
    "microseconds": "sum by (model) (rate(nv_inference_request_duration_us[1m])) / "
                    "sum by (model) (rate(nv_inference_request_success[1m]))",
    "since start": "sum by (model) (nv_inference_request_duration_us) / sum by (model) (nv_inference_request_success) "
                   "/ 1000",
    "queue": "sum by (model) (rate(nv_inference_queue_duration_us[1m])) / "
             "sum by (model) (rate(nv_inference_request_success[1m])) / 1000",
    "compute": "sum by (model) (rate(nv_inference_compute_infer_duration_us[1m])) / "
               "sum by (model) (rate(nv_inference_request_success[1m])) / 1000",
    "inferences": "sum by (model) (rate(nv_inference_request_duration_us[1m])) / "
                  "sum by (model) (rate(nv_inference_count[1m])) / 1000",
    "executions": "sum by (model) (rate(nv_inference_request_duration_us[1m])) / "
                  "sum by (model) (rate(nv_inference_exec_count[1m])) / 1000",
    "average of averages": "avg by (model) (rate(nv_inference_request_duration_us[1m]) / "
                           "rate(nv_inference_request_success[1m])) / 1000",
    "no sum": "rate(nv_inference_request_duration_us[1m]) / rate(nv_inference_request_success[1m]) / 1000",
    "constant": "25",
}

PROMQL_CASES = [
    (lab05.q1, [QPS, "sum(rate(nv_inference_request_success[1m])) by (model)",
                "sum by (model) (increase(nv_inference_request_success[1m])) / 60",
                'sum by (model, job) (rate(nv_inference_request_success{job="triton"}[60s]))'],
     [*Q1_WRONG.values(), 42]),
    (lab05.q2, [LAT, "sum(rate(nv_inference_request_duration_us[1m])) by (model) / "
                     "sum(rate(nv_inference_request_success[1m])) by (model) / 1e3",
                "sum by (model) (increase(nv_inference_request_duration_us[1m])) * 0.001 / "
                "sum by (model) (increase(nv_inference_request_success[1m]))",
                "(sum without (instance, job, version) (rate(nv_inference_request_duration_us[1m])) / 1000) "
                "/ on (model) sum by (model) (rate(nv_inference_request_success[1m]))"],
     list(Q2_WRONG.values())),
]
OTHER_CASES = [
    (lab05.q3, [{"p99_ms": 76.5, "pending": 15}, {"p99_ms": 52, "pending": 11}, {"p99_ms": 150.0, "pending": 39}],
     [{"p99_ms": 50, "pending": 15}, {"p99_ms": 76.5, "pending": 10}, {"p99_ms": 200, "pending": 15},
      {"p99_ms": 76.5, "pending": 45}, {"p99_ms": 76.5}, [76.5, 15], {"p99_ms": "high", "pending": 15}]),
    (lab05.q4, [GOOD_SNAPSHOT, {"qps": 240, "avg_batch": 8, "avg_queue_ms": 12.49}],
     [{**GOOD_SNAPSHOT, "qps": 2400}, {**GOOD_SNAPSHOT, "qps": 480}, {**GOOD_SNAPSHOT, "avg_batch": 4},
      {**GOOD_SNAPSHOT, "avg_queue_ms": 12500}, {**GOOD_SNAPSHOT, "avg_queue_ms": 6.25},
      {**GOOD_SNAPSHOT, "avg_queue_ms": 3.05}, {"qps": 240}, 240]),
    (lab05.q5, [GOOD_BOTTLENECK, {"detector": " Queue", "ranker": "COMPUTE", "embedder": "outside"}],
     [{**GOOD_BOTTLENECK, "detector": "compute"}, {**GOOD_BOTTLENECK, "ranker": "queue"},
      {**GOOD_BOTTLENECK, "embedder": "compute"}, {**GOOD_BOTTLENECK, "embedder": "network"},
      {"detector": "queue"}, "queue"]),
]


@pytest.fixture
def prometheus_here():
    """The PromQL checks need prometheus and promtool: skip without, fail under NVLAB_REQUIRE_PROMETHEUS=1."""
    why = prometheus.missing()
    if why is None:
        return
    if prometheus.required():
        pytest.fail(f"{prometheus.REQUIRE_ENV}=1 but {why}")
    pytest.skip(why)


(
    test_right_answers_are_correct,
    test_wrong_answers_are_incorrect_and_show_the_value,
    test_blank_answers_are_not_attempted,
) = standard_tests(OTHER_CASES)

(
    test_right_queries_are_correct,
    test_wrong_queries_are_incorrect_and_show_the_value,
    test_blank_queries_are_not_attempted,
) = (pytest.mark.usefixtures("prometheus_here")(t) for t in standard_tests(PROMQL_CASES))


def test_cases_cover_every_exercise():
    assert {id(ex) for ex, *_ in PROMQL_CASES + OTHER_CASES} == {id(ex) for ex in exercises_of(lab05)}


# --- the recorded data behind q1 and q2, as Prometheus serves it --------------------------------------------


def _reference(expr: str) -> dict[str, list[float]]:
    """{model: [value at each grading time]} of ``expr`` on the recorded samples."""
    with prometheus.recorded_server(lab05.RECORDED) as server:
        df = server.query_range(expr, lab05.GRADING_TIMES[0], lab05.GRADING_TIMES[-1], 180)
    return {m: g.sort_values("time")["value"].tolist() for m, g in df.groupby("model")}


@pytest.mark.usefixtures("prometheus_here")
def test_recorded_data_is_what_the_questions_say():
    qps, latency = _reference(QPS), _reference(LAT)
    # the phases' loads (each 1-minute window wobbles around them) and the two servers' weighted latency (ms)
    for got, want in ((qps["resnet50"], [80, 120, 200, 150]), (qps["bert"], [30, 45, 20, 60]),
                      (latency["resnet50"], [21.8, 25.8, 45.2, 31.8]), (latency["bert"], [9.2, 10.3, 10.5, 15.9])):
        assert got == pytest.approx(want, rel=0.25)
    for values in (*qps.values(), *latency.values()):
        assert len(set(values)) == len(lab05.GRADING_TIMES)  # the reference changes at every grading time
    batch = _reference("sum by (model) (rate(nv_inference_count[1m])) "
                       "/ sum by (model) (rate(nv_inference_exec_count[1m]))")
    assert batch == {"bert": pytest.approx([4.0] * 4), "resnet50": pytest.approx([8.0] * 4)}
    frame = lab05.recorded_frame()
    assert set(frame["model"].dropna()) == {"resnet50", "bert"} and set(frame["instance"]) == {
        "10.0.0.7:8002", "10.0.0.8:8002"}
    assert frame["t_s"].max() == lab05.GRADING_TIMES[-1] - lab05.RECORDING_START


# --- specific messages -----------------------------------------------------------------------------------


def _msg(exercise: Exercise, value) -> str:
    out = check(exercise, value)
    assert out.status is Status.INCORRECT, (value, out.message)
    return out.message


@pytest.mark.usefixtures("prometheus_here")
@pytest.mark.parametrize(("case", "words"), [
    ("increase", ["increase instead of rate", "60x the reference"]),
    ("no sum", ["missing sum by (model)", "4 series for 2 models"]),
    ("sum without by", ["missing sum by (model)", "no model label"]),
    ("inferences", ["counts inferences"]),
    ("executions", ["counts executions"]),
    ("counter total", ["since the server started"]),
    ("irate", ["irate()", "last two samples"]),
    ("window", ["5m window", "[1m]"]),
    ("constant", ["this query is a constant"]),
    ("no range", ["Prometheus refuses it", "expected type range vector"]),
    ("range vector", ["range vector", "rate()"]),
    ("one model", ["drop the label matcher"]),
    ("no such metric", ["no series"]),
    ("twice", ["2x the reference"]),
    ("increase, no sum", ["missing sum by (model)", "increase instead of rate"]),  # two slips, both named
])
def test_q1_messages(case, words):
    msg = _msg(lab05.q1, Q1_WRONG[case])
    assert all(w in msg for w in words), msg


@pytest.mark.usefixtures("prometheus_here")
@pytest.mark.parametrize(("case", "words"), [
    ("microseconds", ["microseconds", "1000x"]),
    ("since start", ["since the server started"]),
    ("queue", ["queue"]),
    ("compute", ["compute"]),
    ("inferences", ["divides by inferences"]),
    ("executions", ["per execution"]),
    ("average of averages", ["averages the servers' averages"]),
    ("no sum", ["missing sum by (model)"]),
    ("constant", ["this query is a constant"]),
])
def test_q2_messages(case, words):
    msg = _msg(lab05.q2, Q2_WRONG[case])
    assert all(w in msg for w in words), msg


@pytest.mark.usefixtures("prometheus_here")
def test_a_constant_that_matches_once_is_not_accepted():
    first = {m: v[0] for m, v in _reference(QPS).items()}  # the reference's values at the first grading time
    constant = " or ".join(f'label_replace(vector({v!r}), "model", "{m}", "", "")' for m, v in first.items())
    assert "this query is a constant" in _msg(lab05.q1, constant)
    assert "as a string" in _msg(lab05.q1, 42)


def test_without_prometheus_the_check_says_how_to_install_it(monkeypatch):
    monkeypatch.setenv(prometheus.BINARY_ENV, "none")  # as on a machine without prometheus and promtool
    for exercise, answer in ((lab05.q1, QPS), (lab05.q2, "nonsense")):
        out = check(exercise, answer)
        assert out.status is Status.NOT_ATTEMPTED  # not graded, so neither right nor wrong
        assert all(w in out.message for w in ("not checked", "sudo apt-get install prometheus",
                                              "brew install prometheus", "compose stack")), out.message
    assert check(lab05.q1, None).status is Status.NOT_ATTEMPTED and "Set `qps_query`" in check(lab05.q1, None).message
    assert check(lab05.q5, GOOD_BOTTLENECK).correct  # the other checks need no Prometheus


def test_q3_messages_and_data():
    assert max(lab05.BASELINE_P99_MS) < min(lab05.INCIDENT_P99_MS[20:])
    assert max(lab05.BASELINE_PENDING) < min(lab05.INCIDENT_PENDING[20:])
    assert lab05.INCIDENT_P99_MS[:20] == lab05.BASELINE_P99_MS[:20]
    msg = check(lab05.q3, {"p99_ms": 50, "pending": 15}).message
    assert "false alarms" in msg and "1 of its 60 minutes" in msg
    assert "sleep through the incident" in check(lab05.q3, {"p99_ms": 200, "pending": 15}).message
    assert "pending" in check(lab05.q3, {"p99_ms": 76.5, "pending": 10}).message
    assert "two keys" in check(lab05.q3, [76.5, 15]).message


def test_q4_messages_and_snapshot_text():
    assert "divide by the seconds" in check(lab05.q4, {**GOOD_SNAPSHOT, "qps": 2400}).message
    assert "inferences" in check(lab05.q4, {**GOOD_SNAPSHOT, "qps": 480}).message
    assert "requests per execution" in check(lab05.q4, {**GOOD_SNAPSHOT, "avg_batch": 4}).message
    assert "microseconds" in check(lab05.q4, {**GOOD_SNAPSHOT, "avg_queue_ms": 12500}).message
    assert "divides by inferences" in check(lab05.q4, {**GOOD_SNAPSHOT, "avg_queue_ms": 6.25}).message
    assert "since the server started" in check(lab05.q4, {**GOOD_SNAPSHOT, "avg_queue_ms": 3.05}).message
    types = prometheus.metric_types(lab05.SNAPSHOT_AFTER)
    assert types["nv_inference_request_success"] == "counter"
    assert types["nv_inference_pending_request_count"] == "gauge"


def test_q5_each_model_explained():
    msgs = {m: check(lab05.q5, {**GOOD_BOTTLENECK, m: "compute" if m != "ranker" else "queue"}).message
            for m in GOOD_BOTTLENECK}
    assert "instances" in msgs["detector"] and "faster model" in msgs["ranker"] and "network" in msgs["embedder"]
    assert "one of" in check(lab05.q5, {**GOOD_BOTTLENECK, "embedder": "network"}).message


@pytest.mark.parametrize("exercise", exercises_of(lab05), ids=lambda e: e.name)
def test_solution_code_passes_its_check(exercise, request):
    if isinstance(exercise, lab05.PromQLExercise):
        request.getfixturevalue("prometheus_here")
    namespace = {k: getattr(lab05, k) for k in lab05.__all__}
    exec(exercise.solution_text, namespace)
    assert check(exercise, namespace[exercise.var]).correct


def test_every_exercise_has_hints_and_solution():
    exercises = exercises_of(lab05)
    assert len(exercises) >= 4
    names = sorted(k for k, v in vars(lab05).items() if isinstance(v, Exercise))
    assert names == [f"q{i}" for i in range(1, len(names) + 1)]
    for exercise in exercises:
        assert exercise.name.startswith("05.") and 2 <= len(exercise.hints) <= 3


test_hints_step_from_first_to_last, test_solution_prints = hint_and_solution_tests(exercises_of(lab05))


def test_all_exports_exist():
    for name in lab05.__all__:
        assert hasattr(lab05, name), name
