"""The right/wrong/blank tests every lab's exercise checks share: build them once from a CASES table."""

from __future__ import annotations

import ast
import copy
import functools
import json
import linecache
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lab_utils.exercises.framework import CodeExercise, Exercise, Outcome, Status

SOLUTIONS = Path(__file__).resolve().parents[1] / "solutions"


def exercises_of(module) -> list[Exercise]:
    """The public exercises a lab's module defines (q1, q2, ...), in their numbers' order (a lab split into a package
    binds them module by module)."""
    found = {k: v for k, v in vars(module).items() if isinstance(v, Exercise) and not k.startswith("_")}
    return [found[k] for k in sorted(found, key=lambda k: (len(k), k))]


def check(exercise: Exercise, value) -> Outcome:
    """The check's outcome for ``value``. A course function given as a right answer (a reference implementation,
    which the delegation guard refuses as an answer: test_no_delegation.py) is graded as the solution notebook's
    own code for that exercise, which is what a student pastes."""
    if isinstance(exercise, CodeExercise) and (getattr(value, "__module__", None) or "").startswith("lab_utils.") \
            and exercise.refusal(value) is not None:
        value = solution_functions(exercise.lab.rsplit("lab", 1)[-1])[exercise.var]
    return exercise.check(value, quiet=True)


def as_written(value: Any) -> Any:
    """``value`` rebuilt as an answer cell writes it out: new dicts, lists, tuples and strings. A course object, what a
    course helper returned, or a copy sharing their parts is refused as an answer (test_no_delegation.py)."""
    if isinstance(value, dict):
        return {as_written(k): as_written(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(as_written(v) for v in value)
    if isinstance(value, str) and len(value) > 1:
        return value[:1] + value[1:]  # a new str object, as a cell's own literal is
    return value


def student_function(source: str, name: str, namespace: dict[str, Any], filename: str = "<answer cell>") -> Any:
    """``name`` defined by ``source`` as a notebook cell defines it (the source readable through linecache)."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 (the test's own answer text)
    return namespace[name]


def _cell_tree(text: str) -> ast.Module | None:
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith(("%", "!"))]  # IPython magics
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _binds(node: ast.Import | ast.ImportFrom) -> set[str]:
    return {(a.asname or a.name).split(".")[0] for a in node.names}


@functools.cache
def solution_functions(lab: str) -> dict[str, Callable[..., Any]]:
    """The functions of the solution notebook's ``# BEGIN SOLUTION`` blocks, defined beside the notebook's imports
    (only those the functions use), as a student's cells define them."""
    path = next(SOLUTIONS.glob(f"{lab}_*.ipynb"))
    cells = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    imports: list[ast.Import | ast.ImportFrom] = []
    defs: list[ast.FunctionDef] = []
    for text in cells:
        tree = _cell_tree(text)
        if tree is not None:
            imports += [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        for block in re.findall(r"# BEGIN SOLUTION\n(.*?)# END SOLUTION", text, re.S):
            tree = _cell_tree(block)
            assert tree is not None, f"{path.name}: a solution block does not parse"
            imports += [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            defs += [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    used = {n.id for d in defs for n in ast.walk(d) if isinstance(n, ast.Name)}
    namespace: dict[str, Any] = {"__name__": f"solution_{lab}"}
    for node in imports:
        if _binds(node) & used:
            exec(compile(ast.Module([node], []), "<solution imports>", "exec"), namespace)  # noqa: S102
    source = "\n\n".join(ast.unparse(d) for d in defs) + "\n"
    student_function(source, defs[0].name, namespace, filename=f"<solution {path.name}>")
    return {d.name: namespace[d.name] for d in defs}


def standard_tests(cases, graded: Callable[[Exercise, Any], Outcome] = check):
    """Three parametrised tests over ``cases`` = [(exercise, right_answers, wrong_answers), ...]; ``graded`` gives
    an answer's outcome (a file whose message tests read the same outcomes passes its own, run once per answer)."""
    ids = [ex.name for ex, *_ in cases]

    @pytest.mark.parametrize(("exercise", "rights", "wrongs"), cases, ids=ids)
    def test_right_answers_are_correct(exercise, rights, wrongs):
        for value in rights:
            out = graded(exercise, value)
            assert out.status is Status.CORRECT, (value, out.message)

    @pytest.mark.parametrize(("exercise", "rights", "wrongs"), cases, ids=ids)
    def test_wrong_answers_are_incorrect_and_show_the_value(exercise, rights, wrongs):
        for value in wrongs:
            out = graded(exercise, value)
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
    """Hints come one per call, from the first to the last, then say there are no more; the solution is shown once an
    attempt was checked, and before that says what to do first."""
    ids = [e.name for e in exercises]

    @pytest.mark.parametrize("exercise", exercises, ids=ids)
    def test_hints_step_from_first_to_last(exercise, capsys):
        exercise = copy.copy(exercise)
        exercise._hints_shown = 0
        n = len(exercise.hints)
        shown = [exercise.hint() for _ in range(n + 1)]
        assert shown[0].startswith(f"Hint 1/{n}:")
        assert shown[n - 1].startswith(f"Hint {n}/{n}:")
        assert len(set(shown[:n])) == n  # a new hint each call
        assert shown[n].startswith("No more hints") and ".solution()" in shown[n]
        assert exercise.hint(1) == shown[0]
        assert "Hint 1/" in capsys.readouterr().out
        with pytest.raises(ValueError):
            exercise.hint(n + 1)

    @pytest.mark.parametrize("exercise", exercises, ids=ids)
    def test_solution_prints(exercise, capsys):
        exercise = copy.copy(exercise)
        exercise.attempted = False
        first = exercise.solution()
        assert exercise.solution_text not in first and f"`{exercise.var}`" in first and "check" in first
        exercise.attempted = True  # what a check of a filled-in answer sets
        text = exercise.solution()
        assert exercise.name in text and exercise.solution_text in text
        assert exercise.solution_text in capsys.readouterr().out

    return test_hints_step_from_first_to_last, test_solution_prints
