"""The right/wrong/blank tests every lab's exercise checks share: build them once from a CASES table."""

from __future__ import annotations

import pytest

from lab_utils.exercise import Exercise, Outcome, Status


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
