"""Lab 05's exercise checks against right, wrong and blank answers; the specific messages; the recorded data
the PromQL answers are evaluated on; hints and solutions."""

from __future__ import annotations

import pytest
from _exercise_harness import check, exercises_of, hint_and_solution_tests, standard_tests

from lab_utils.exercises import lab05
from lab_utils.exercises.framework import Exercise
from lab_utils.monitoring import promql

QPS = "sum by (model) (rate(nv_inference_request_success[1m]))"
LAT = ("sum by (model) (rate(nv_inference_request_duration_us[1m])) / "
       "sum by (model) (rate(nv_inference_request_success[1m])) / 1000")
GOOD_SNAPSHOT = {"qps": 240.0, "avg_batch": 8.0, "avg_queue_ms": 12.5}
GOOD_BOTTLENECK = {"detector": "queue", "ranker": "compute", "embedder": "outside"}

CASES = [
    (lab05.q1, [QPS, "rate(nv_inference_request_success[5m])", "sum(irate(nv_inference_request_success[1m]))",
                'sum(rate(nv_inference_request_success{model="resnet50"}[2m]))',
                "increase(nv_inference_request_success[1m]) / 60"],
     ["rate(nv_inference_count[1m])", "rate(nv_inference_exec_count[1m])", "nv_inference_request_success",
      "increase(nv_inference_request_success[1m])", "rate(up[1m])", "rate(nv_inference_request_success)",
      'rate(nv_inference_request_success{model="bert"}[1m])', 42]),
    (lab05.q2, [LAT, "rate(nv_inference_request_duration_us[5m]) / rate(nv_inference_request_success[5m]) / 1e3"],
     ["rate(nv_inference_request_duration_us[1m]) / rate(nv_inference_request_success[1m])",
      "nv_inference_request_duration_us / nv_inference_request_success / 1000",
      "rate(nv_inference_queue_duration_us[1m]) / rate(nv_inference_request_success[1m]) / 1000",
      "rate(nv_inference_compute_infer_duration_us[1m]) / rate(nv_inference_request_success[1m]) / 1000",
      "rate(nv_inference_request_duration_us[1m]) / rate(nv_inference_count[1m]) / 1000",
      "rate(nv_inference_request_duration_us[1m]) / rate(nv_inference_exec_count[1m]) / 1000", "25"]),
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

(
    test_right_answers_are_correct,
    test_wrong_answers_are_incorrect_and_show_the_value,
    test_blank_answers_are_not_attempted,
) = standard_tests(CASES)


def test_cases_cover_every_exercise():
    assert {id(ex) for ex, *_ in CASES} == {id(ex) for ex in exercises_of(lab05)}


# --- the recorded data behind q1 and q2 --------------------------------------------------------------------


def test_recorded_data_is_what_the_questions_say():
    store = lab05.recorded_store()
    t = lab05.RECORDED_AT
    assert promql.instant(store, QPS, t)["result"][0]["value"][1] == "120"
    assert float(promql.instant(store, LAT, t)["result"][0]["value"][1]) == pytest.approx(25.0)
    batch = "rate(nv_inference_count[1m]) / rate(nv_inference_exec_count[1m])"
    assert float(promql.instant(store, batch, t)["result"][0]["value"][1]) == pytest.approx(8.0)
    assert lab05.evaluate_recorded("sum(nv_inference_pending_request_count)") == 3.0


def test_grader_data_cannot_be_changed_by_a_query():
    before = len(lab05.RECORDED)
    lab05.evaluate_recorded(QPS)
    assert len(lab05.RECORDED) == before and lab05.recorded_store() is not lab05.recorded_store()


# --- specific messages -----------------------------------------------------------------------------------


def test_q1_messages():
    assert "inferences" in check(lab05.q1, "rate(nv_inference_count[1m])").message
    assert "executions" in check(lab05.q1, "rate(nv_inference_exec_count[1m])").message
    assert "since the server started" in check(lab05.q1, "nv_inference_request_success").message
    assert "increase()" in check(lab05.q1, "increase(nv_inference_request_success[1m])").message
    assert "range vector" in check(lab05.q1, "rate(nv_inference_request_success)").message
    assert "no series" in check(lab05.q1, 'rate(nv_inference_request_success{model="bert"}[1m])').message
    assert "as a string" in check(lab05.q1, 42).message
    assert "reads no metric" in check(lab05.q1, "120").message
    assert "not from constants" in check(lab05.q1, "vector(120) + 0 * sum(up)").message
    assert "not from constants" in check(lab05.q2, "25 + 0 * sum(rate(nv_inference_request_success[1m]))").message


def test_q1_multi_series_answer_is_asked_to_aggregate():
    store_expr = 'label_replace(x, "a", "b", "c", "d")'
    assert "not supported" in check(lab05.q1, store_expr).message
    assert "aggregate" in check(lab05.q1, '{__name__=~"nv_inference_request_success|up"}').message


def test_q2_messages():
    assert "microseconds" in check(lab05.q2, CASES[1][2][0]).message
    assert "since the server started" in check(lab05.q2, CASES[1][2][1]).message
    assert "queue" in check(lab05.q2, CASES[1][2][2]).message
    assert "compute" in check(lab05.q2, CASES[1][2][3]).message
    assert "inferences" in check(lab05.q2, CASES[1][2][4]).message
    assert "per execution" in check(lab05.q2, CASES[1][2][5]).message


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
    assert "# TYPE nv_inference_request_success counter" in lab05.SNAPSHOT_AFTER


def test_q5_each_model_explained():
    msgs = {m: check(lab05.q5, {**GOOD_BOTTLENECK, m: "compute" if m != "ranker" else "queue"}).message
            for m in GOOD_BOTTLENECK}
    assert "instances" in msgs["detector"] and "faster model" in msgs["ranker"] and "network" in msgs["embedder"]
    assert "one of" in check(lab05.q5, {**GOOD_BOTTLENECK, "embedder": "network"}).message


@pytest.mark.parametrize("exercise", exercises_of(lab05), ids=lambda e: e.name)
def test_solution_code_passes_its_check(exercise):
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
