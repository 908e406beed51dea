"""Lab 04's exercise checks against a right, a wrong and a blank answer; the specific messages; hints and
solutions; the data the questions rest on is consistent."""

from __future__ import annotations

import copy

import pytest
from _exercise_harness import check, exercises_of, hint_and_solution_tests, standard_tests

from lab_utils.exercises import lab04
from lab_utils.exercises.framework import Exercise, Status

RIGHT_CONFIG = """
name: "digits_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 32
input [{ name: "INPUT__0" data_type: TYPE_FP32 dims: [64] }]
output [{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [10] }]
dynamic_batching { preferred_batch_size: [8, 16] max_queue_delay_microseconds: 100 }
instance_group [{ count: 2 kind: KIND_CPU }]
"""
# the same with the backend named instead of the platform, the preferred sizes reversed, two groups of one
RIGHT_CONFIG_2 = (RIGHT_CONFIG.replace('platform: "onnxruntime_onnx"', 'backend: "onnxruntime"')
                  .replace("[8, 16]", "[16, 8]")
                  .replace("instance_group [{ count: 2 kind: KIND_CPU }]",
                           "instance_group [{ count: 1 kind: KIND_CPU }, { kind: KIND_CPU }]"))


def cfg(old: str, new: str) -> str:
    assert old in RIGHT_CONFIG
    return RIGHT_CONFIG.replace(old, new)


WRONG_CONFIGS = {
    "misspelled field": (cfg("max_batch_size", "max_batch"), "schema"),
    "batch dim in dims": (cfg("dims: [64]", "dims: [-1, 64]"), "includes the batch dimension"),
    "preferred over max": (cfg("max_batch_size: 32", "max_batch_size: 12"), "max_batch_size 12"),
    "gpu instances": (cfg("KIND_CPU", "KIND_GPU"), "KIND_GPU"),
    "python backend": (cfg('platform: "onnxruntime_onnx"', 'backend: "python"'), "does not run model.onnx"),
    "wrong name": (cfg('name: "digits_onnx"', 'name: "digits"'), "digits_onnx"),
    "no batching": (cfg("dynamic_batching { preferred_batch_size: [8, 16] max_queue_delay_microseconds: 100 }",
                        ""), "dynamic_batching"),
    "delay in ms": (cfg("max_queue_delay_microseconds: 100", "max_queue_delay_microseconds: 100000"),
                    "microseconds"),
    "one instance": (cfg("count: 2", "count: 1"), "count: 2"),
    "fp16": (cfg("data_type: TYPE_FP32 dims: [64]", "data_type: TYPE_FP16 dims: [64]"), "TYPE_FP32"),
    "input name": (cfg('name: "INPUT__0"', 'name: "x"'), "not an input of the model"),
    "max 64": (cfg("max_batch_size: 32", "max_batch_size: 64"), "32 rows"),
    "only 8": (cfg("[8, 16]", "[8]"), "8 and 16"),
}

_MS = lab04.Q2_CONCURRENCY / lab04.Q2_THROUGHPUT_INFER_S * 1e3
_BATCH = 6400 / 450
_QUEUE_US = 19_840_000_000 / 6400 / 1e3

CASES = [
    (lab04.q1, [RIGHT_CONFIG, RIGHT_CONFIG_2], [c for c, _ in WRONG_CONFIGS.values()] + [42, {"name": "x"}]),
    (lab04.q2, [_MS, 6.7, "6.703"], [_MS / 1e3, _MS * 1e3, lab04.Q2_THROUGHPUT_INFER_S / 16, _MS / 16, 20.0, "fast"]),
    (lab04.q3, [200, 200.0, "200"], [500, 1000, 0, 100, 300, "fast", 2.5]),
    (lab04.q4, [_BATCH, 14.2, 14.22], [1.0, 1 / _BATCH, 16, 10, 7.0, "big"]),
    (lab04.q5, [_QUEUE_US, 3100, 3.1e3], [_QUEUE_US * 1e3, _QUEUE_US / 1e3, 19_840_000_000 / 450 / 1e3, 6900,
                                          1000, "long"]),
]

(
    test_right_answers_are_correct,
    test_wrong_answers_are_incorrect_and_show_the_value,
    test_blank_answers_are_not_attempted,
) = standard_tests(CASES)


def test_cases_cover_every_exercise():
    assert {id(ex) for ex, *_ in CASES} == {id(ex) for ex in exercises_of(lab04)}


@pytest.mark.parametrize("case", sorted(WRONG_CONFIGS), ids=str)
def test_q1_names_the_problem(case):
    text, expected = WRONG_CONFIGS[case]
    out = check(lab04.q1, text)
    assert out.status is Status.INCORRECT and expected in out.message, out.message


def test_q1_schema_error_names_the_field():
    message = check(lab04.q1, RIGHT_CONFIG.replace("max_batch_size", "max_batch")).message
    assert 'no field named "max_batch"' in message
    assert "str" in check(lab04.q1, 42).message


def test_q2_messages():
    assert "seconds" in check(lab04.q2, _MS / 1e3).message
    assert "microseconds" in check(lab04.q2, _MS * 1e3).message
    assert "not a time" in check(lab04.q2, lab04.Q2_THROUGHPUT_INFER_S / lab04.Q2_CONCURRENCY).message
    assert "multiply by the concurrency" in check(lab04.q2, _MS / 16).message
    message = check(lab04.q2, 20.0).message
    assert "too high" in message and "6.7" not in message


def test_q3_messages_and_data():
    assert "over the 8.0 ms target" in check(lab04.q3, 500).message
    assert "longer delay" in check(lab04.q3, 100).message
    assert "was not measured" in check(lab04.q3, 300).message
    assert "whole number" in check(lab04.q3, 2.5).message
    tputs = [r["throughput_infer_s"] for _, r in sorted(lab04.Q3_MEASURED.items())]
    p95s = [r["p95_ms"] for _, r in sorted(lab04.Q3_MEASURED.items())]
    assert tputs == sorted(tputs) and p95s == sorted(p95s)  # the trade-off the question is about


def test_q3_grader_ignores_a_mutated_table():
    saved = copy.deepcopy(lab04.Q3_MEASURED)
    try:
        lab04.Q3_MEASURED[500]["p95_ms"] = 1.0
        assert check(lab04.q3, 200).correct
    finally:
        lab04.Q3_MEASURED.clear()
        lab04.Q3_MEASURED.update(saved)


def test_q4_q5_messages_and_consistent_stats():
    s = lab04.Q4_STATS["model_stats"][0]
    weighted = sum(b["batch_size"] * b["compute_infer"]["count"] for b in s["batch_stats"])
    assert weighted == s["inference_count"]
    assert sum(b["compute_infer"]["count"] for b in s["batch_stats"]) == s["execution_count"]
    st = s["inference_stats"]
    stages = ("queue", "compute_input", "compute_infer", "compute_output")
    assert sum(st[k]["ns"] for k in stages) <= st["success"]["ns"]
    assert "execution_count" in check(lab04.q4, 1.0).message
    assert "invert" in check(lab04.q4, 1 / _BATCH).message
    assert "weight" in check(lab04.q4, 16).message
    assert "nanoseconds" in check(lab04.q5, _QUEUE_US * 1e3).message
    assert "milliseconds" in check(lab04.q5, _QUEUE_US / 1e3).message
    assert "queue.count" in check(lab04.q5, 19_840_000_000 / 450 / 1e3).message
    assert "whole request" in check(lab04.q5, 6900).message


def test_every_exercise_has_hints_and_solution():
    exercises = exercises_of(lab04)
    assert len(exercises) >= 4
    names = sorted(k for k, v in vars(lab04).items() if isinstance(v, Exercise))
    assert names == [f"q{i}" for i in range(1, len(names) + 1)]
    for exercise in exercises:
        assert exercise.name.startswith("04.")
        assert 2 <= len(exercise.hints) <= 3 and all(h.strip() for h in exercise.hints)
        assert exercise.solution_text.strip()


@pytest.mark.parametrize("exercise", exercises_of(lab04), ids=lambda e: e.name)
def test_solution_code_passes_its_check(exercise):
    namespace = {k: getattr(lab04, k) for k in lab04.__all__}
    exec(exercise.solution_text, namespace)
    assert check(exercise, namespace[exercise.var]).correct


test_hints_step_from_first_to_last, test_solution_prints = hint_and_solution_tests(exercises_of(lab04))


def test_all_exports_exist():
    for name in lab04.__all__:
        assert hasattr(lab04, name), name
