"""Lab 03's exercise checks against right, wrong and blank answers; the specific messages; hints and
solutions; the exported constants."""

from __future__ import annotations

import copy

import pytest
from _exercise_harness import check, exercises_of, hint_and_solution_tests, standard_tests

from lab_utils.exercises import lab03
from lab_utils.exercises.framework import Exercise, Status

_SPEEDUP = 1 / (1 - 30 / (2_000_000 * 14 / 5000 / 60))  # 1.4737

CASES = [
    (lab03.q1, ["int8", " INT8 ", "Int8"], ["fp8", "fp16", "fp32", "int4", 8, "best"]),
    (lab03.q2, [_SPEEDUP, 1.47, 1.48, "1.474"], [1.32, 1.0054, 2.0, 1.0, 0.68, "fast"]),
    (lab03.q3, [["a", "b", "c", "f"], {"f", "c", "b", "a"}, ("A", "B", "C", "F"), "abcf", "a, b, c, f"],
     [["a", "b", "c", "d", "f"], ["a", "b", "c", "e", "f"], ["a", "b", "f"], ["b", "c", "f"], [], ["z"], 3]),
    (lab03.q4, [32, 32.0, "32"], [64, 128, 16, 1, 48, 32.5, "big"]),
]

(
    test_right_answers_are_correct,
    test_wrong_answers_are_incorrect_and_show_the_value,
    test_blank_answers_are_not_attempted,
) = standard_tests(CASES)


def test_cases_cover_every_exercise():
    assert {id(ex) for ex, *_ in CASES} == {id(ex) for ex in exercises_of(lab03)}


# --- q1: precision for an accuracy budget ------------------------------------------------------------------


def test_q1_messages():
    assert "more than the 1.0 point budget" in check(lab03.q1, "fp8").message
    for p in ("fp16", "fp32"):
        assert "take the fastest one that fits" in check(lab03.q1, p).message
    assert "one of ['fp32', 'fp16', 'int8', 'fp8']" in check(lab03.q1, "int4").message
    assert lab03.Q1_CHOICES == ("fp32", "fp16", "int8", "fp8")


def test_q1_grader_ignores_a_mutated_table():
    saved = copy.deepcopy(lab03.Q1_CANDIDATES)
    try:
        lab03.Q1_CANDIDATES["fp8"]["accuracy_delta_points"] = 0.0  # a student's cell may change the shared dict
        assert check(lab03.q1, "int8").correct
    finally:
        lab03.Q1_CANDIDATES.clear()
        lab03.Q1_CANDIDATES.update(saved)


# --- q2: break-even speedup --------------------------------------------------------------------------------


def test_q2_value_and_messages():
    assert _SPEEDUP == pytest.approx(1.47368, rel=1e-5)
    assert check(lab03.q2, _SPEEDUP * 1.009).correct and not check(lab03.q2, _SPEEDUP * 1.02).correct
    assert "1 + C/T" in check(lab03.q2, 1 + 30 / (2_000_000 * 14 / 5000 / 60)).message
    assert "seconds" in check(lab03.q2, 1 / (1 - 30 / (2_000_000 * 14 / 5000))).message
    message = check(lab03.q2, 2.0).message
    assert "too high" in message and "1.47" not in message  # not given away
    assert "number" in check(lab03.q2, "fast").message


# --- q3: optimization profile ------------------------------------------------------------------------------


def test_q3_each_mistake_has_its_reason():
    assert "one over the max" in check(lab03.q3, "abcdf").message
    assert "fixes the image at 224x224" in check(lab03.q3, "abcef").message
    assert "exactly the profile's max" in check(lab03.q3, "abf").message
    assert "exactly the profile's min" in check(lab03.q3, "bcf").message
    assert "opt shape itself" in check(lab03.q3, "acf").message
    assert "between min 1 and max 64" in check(lab03.q3, "abc").message
    assert "not requests" in check(lab03.q3, ["a", "z"]).message
    assert "names of the requests" in check(lab03.q3, 3).message


def test_q3_agrees_with_the_profile_class():
    from lab_utils.inference.tensorrt import Profile

    p = Profile("input", lab03.Q3_PROFILE["min"], lab03.Q3_PROFILE["opt"], lab03.Q3_PROFILE["max"])
    runs = sorted(k for k, shape in lab03.Q3_REQUESTS.items() if p.accepts(shape))
    assert runs == ["a", "b", "c", "f"] and check(lab03.q3, runs).correct


# --- q4: latency budget ------------------------------------------------------------------------------------


def test_q4_messages():
    assert "queue" in check(lab03.q4, 64).message and "9.1 + 2.5 > 10.0" in check(lab03.q4, 64).message
    assert "highest throughput" in check(lab03.q4, 128).message
    assert "take the largest that fits" in check(lab03.q4, 16).message
    assert "measured batch sizes" in check(lab03.q4, 48).message
    assert "whole number" in check(lab03.q4, 32.5).message


def test_q4_blank_function_style_answer_is_not_attempted():
    assert check(lab03.q4, ...).status is Status.NOT_ATTEMPTED


# --- hints, solutions, completeness ------------------------------------------------------------------------


def test_every_exercise_has_hints_and_solution():
    exercises = exercises_of(lab03)
    assert len(exercises) >= 4
    names = sorted(k for k, v in vars(lab03).items() if isinstance(v, Exercise))
    assert names == [f"q{i}" for i in range(1, len(names) + 1)]
    for i, exercise in enumerate(sorted(exercises, key=lambda e: e.name), 1):
        assert exercise.name.startswith(f"03.{i} ")
        assert 2 <= len(exercise.hints) <= 3, exercise.name
        assert exercise.solution_text.strip(), exercise.name


@pytest.mark.parametrize("exercise", exercises_of(lab03), ids=lambda e: e.name)
def test_solution_code_passes_its_check(exercise):
    namespace = {k: getattr(lab03, k) for k in lab03.__all__}
    exec(exercise.solution_text, namespace)
    assert check(exercise, namespace[exercise.var]).correct


test_hints_step_from_first_to_last, test_solution_prints = hint_and_solution_tests(exercises_of(lab03))


def test_all_exports_exist():
    for name in lab03.__all__:
        assert hasattr(lab03, name), name
