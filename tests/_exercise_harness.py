"""The right/wrong/blank tests every lab's exercise checks share: build them once from a CASES table."""

from __future__ import annotations

import copy

import pytest

from lab_utils.exercises.framework import Exercise, Outcome, Status


def exercises_of(module) -> list[Exercise]:
    """The public exercises a lab's module defines (q1, q2, ...), in definition order."""
    return [v for k, v in vars(module).items() if isinstance(v, Exercise) and not k.startswith("_")]


def check(exercise: Exercise, value) -> Outcome:
    return exercise.check(value, quiet=True)


def standard_tests(cases):
    """Three parametrised tests over ``cases`` = [(exercise, right_answers, wrong_answers), ...]."""
    ids = [ex.name for ex, *_ in cases]

    @pytest.mark.parametrize(("exercise", "rights", "wrongs"), cases, ids=ids)
    def test_right_answers_are_correct(exercise, rights, wrongs):
        for value in rights:
            out = check(exercise, value)
            assert out.status is Status.CORRECT, (value, out.message)

    @pytest.mark.parametrize(("exercise", "rights", "wrongs"), cases, ids=ids)
    def test_wrong_answers_are_incorrect_and_show_the_value(exercise, rights, wrongs):
        for value in wrongs:
            out = check(exercise, value)
            assert out.status is Status.INCORRECT, (value, out.message)
            assert f"`{exercise.var}`" in out.message
            assert len(out.message) > len(exercise.var) + 20  # says why, not just "wrong"

    @pytest.mark.parametrize(("exercise", "rights", "wrongs"), cases, ids=ids)
    @pytest.mark.parametrize("blank", [None, ...])
    def test_blank_answers_are_not_attempted(exercise, rights, wrongs, blank):
        out = check(exercise, blank)
        assert out.status is Status.NOT_ATTEMPTED
        assert exercise.var in out.message

    return test_right_answers_are_correct, test_wrong_answers_are_incorrect_and_show_the_value, \
        test_blank_answers_are_not_attempted


def hint_and_solution_tests(exercises):
    """Hints step from the first to the last and stay there; every solution prints its text."""
    ids = [e.name for e in exercises]

    @pytest.mark.parametrize("exercise", exercises, ids=ids)
    def test_hints_step_from_first_to_last(exercise, capsys):
        exercise = copy.copy(exercise)
        exercise._hints_shown = 0
        n = len(exercise.hints)
        shown = [exercise.hint() for _ in range(n + 1)]
        assert shown[0].startswith(f"Hint 1/{n}:")
        assert shown[n - 1].startswith(f"Hint {n}/{n}:")
        assert shown[n] == shown[n - 1]  # stays on the last one
        assert exercise.hint(1) == shown[0]
        assert "Hint 1/" in capsys.readouterr().out
        with pytest.raises(ValueError):
            exercise.hint(n + 1)

    @pytest.mark.parametrize("exercise", exercises, ids=ids)
    def test_solution_prints(exercise, capsys):
        text = exercise.solution()
        assert exercise.name in text and exercise.solution_text in text
        assert exercise.solution_text in capsys.readouterr().out

    return test_hints_step_from_first_to_last, test_solution_prints
