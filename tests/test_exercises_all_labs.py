"""What every lab's exercises share: numbered in the order the solution notebook shows them, with check objects that
follow the numbers."""

from __future__ import annotations

import copy
import importlib
import json
import re
from pathlib import Path

import pytest
from _exercise_harness import exercises_of

from lab_utils.course.catalog import NOTEBOOK_GLOB

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "solutions").glob(NOTEBOOK_GLOB))
EXERCISES_IMPORT = re.compile(r"lab_utils\.exercises import (lab\d\d[a-z]?) as ex\b")
HEADING = re.compile(r"^#+ .*?\bExercises? (\d+)((?:(?:, | and )\d+)*)", re.M)
CHECK = re.compile(r"\bex\.q(\d+)\.check\(")


def lab_of(path: Path):
    """The exercise module a solution notebook imports as ``ex`` (None for a notebook without exercises)."""
    cells = json.loads(path.read_text())["cells"]
    found = next((m[1] for c in cells if c["cell_type"] == "code" for m in EXERCISES_IMPORT.finditer("".join(
        c["source"]))), None)
    return importlib.import_module(f"lab_utils.exercises.{found}") if found else None


def exercise_sequence(path: Path) -> list[tuple[str, tuple[int, ...]]]:
    """("heading", the numbers it names) for each exercise heading ("Exercises 3 and 4": (3, 4)), ("check", (n,))
    for each ``ex.qN.check(`` in a code cell, in the notebook's order."""
    seq: list[tuple[str, tuple[int, ...]]] = []
    for cell in json.loads(path.read_text())["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            seq += [("heading", (int(m[1]), *map(int, re.findall(r"\d+", m[2])))) for m in HEADING.finditer(text)]
        elif cell["cell_type"] == "code":
            seq += [("check", (int(n),)) for n in dict.fromkeys(CHECK.findall(text))]
    return seq


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_exercises_are_numbered_in_the_order_the_lab_shows_them(path):
    module = lab_of(path)
    if module is None:
        pytest.skip("no exercises")
    seq = exercise_sequence(path)
    headings = [n for kind, numbers in seq if kind == "heading" for n in numbers]
    checks = [n for kind, (n, *_) in seq if kind == "check"]
    n = len(exercises_of(module))
    assert headings == list(range(1, n + 1)), f"{path.name}: exercise headings in the order {headings}"
    assert checks == list(range(1, n + 1)), f"{path.name}: ex.qN.check cells in the order {checks}"
    # Each check sits under its own exercise's heading ("Exercises 3 and 4" heads two).
    under: tuple[int, ...] = ()
    for kind, numbers in seq:
        if kind == "heading":
            under = numbers
        else:
            assert numbers[0] in under, f"{path.name}: ex.q{numbers[0]}.check under the heading of exercise {under}"
    # The check objects follow the numbers: qN is exercise N, named "NN.N ...".
    lab = path.name.partition("_")[0]  # "06", "01b"
    ids = {id(e) for e in exercises_of(module)}
    public = {k: v for k, v in vars(module).items() if id(v) in ids}
    assert sorted(public, key=lambda k: int(k[1:])) == [f"q{i}" for i in range(1, n + 1)]
    for i in range(1, n + 1):
        assert public[f"q{i}"].name.startswith(f"{lab}.{i} "), (f"q{i}", public[f"q{i}"].name)
    # ... and each check cell passes exercise N's own answer: `ex.q3.check(diagnosis)` where q3.var is "diagnosis".
    text = path.read_text()
    for number, args in re.findall(r"\bex\.q(\d+)\.check\(([^)]*)\)", text):
        want = [v.strip() for v in public[f"q{number}"].var.split("/")]
        assert [a.strip() for a in args.split(",")] == want, f"{path.name}: ex.q{number}.check({args}), want {want}"


def test_the_order_test_sees_an_exercise_out_of_order(tmp_path):
    # A lab showing exercise 5 between 2 and 3, as lab 06 once did: the sequence says so.
    cells = [{"cell_type": "markdown", "source": [f"### Exercise {n} — x\n"]} for n in (1, 2, 5, 3, 4)]
    cells = [c for pair in zip(cells, [{"cell_type": "code", "source": [f"ex.q{n}.check(a)"]} for n in (1, 2, 5, 3, 4)],
                                  strict=True) for c in pair]
    path = tmp_path / "06_x.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    headings = [n for kind, (n, *_) in exercise_sequence(path) if kind == "heading"]
    assert headings == [1, 2, 5, 3, 4] != sorted(headings)


# --- progressive help: a hint at a time, never the answer; the solution after a checked attempt ---------------------

LABS = [(path, module) for path in NOTEBOOKS if (module := lab_of(path)) is not None]
SOLUTION_BLOCK = re.compile(r"# BEGIN SOLUTION\n(.*?)# END SOLUTION", re.S)
GIVEN = ("def ", "class ", "import ", "from ", "@", "# STUDENT:")  # the stub shows these, or they only name a library
MIN_CHARS = 20  # a line shorter than this (without spaces) is an API name, not the answer's work
# A block's header (`for _ in range(warmup):`, `with torch.cuda.graph(g):`) or a call without arguments, perhaps
# assigned (`s = torch.cuda.Stream()`): the structure and the API's names, which a hint may name; not the work.
NAMES_ONLY = re.compile(r"(?:.*:|(?:[\w, ]+=)?\s*[\w.]+\(\))")
ASSIGNED = re.compile(r"(?:return\s+|[\w, ]+=(?!=)\s*)(.+)")  # `x = value`, `return value`
FORMULA = re.compile(r"\s[-+*/@%]\s|\*\*|\bfor\b")  # arithmetic or a comprehension (or a string with a call in it)


def _squashed(text: str) -> str:
    return re.sub(r"\s+", "", text.replace("`", ""))


def solution_lines(path: Path, module) -> set[str]:
    """The lines doing the work in the solution notebook's ``# BEGIN SOLUTION`` blocks and the exercises'
    ``solution_text``, comments dropped, without spaces: at least ``MIN_CHARS`` characters, not a ``def``, an import,
    a decorator, a block's header or a call without arguments (``NAMES_ONLY``); the value of an assignment or a return
    counts on its own too where it is a formula."""
    texts = [b for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"
             for b in SOLUTION_BLOCK.findall("".join(c["source"]))]
    texts += [e.solution_text for e in exercises_of(module)]
    lines = set()
    for text in texts:
        for line in text.splitlines():
            line = re.sub(r"\s#.*$", "", line).strip()
            if not line or line.startswith(("#", *GIVEN)) or NAMES_ONLY.fullmatch(line):
                continue
            value = ASSIGNED.fullmatch(line)  # a formula's value alone too: a hint may give it under no name
            text = value[1] if value else ""
            quoted = text[:1] in "'\"" and text[-1:] == text[:1]
            formula = text.strip(text[:1]) if quoted and "(" in text else text if FORMULA.search(text) else None
            lines |= {_squashed(t) for t in (line, formula) if t and len(_squashed(t)) >= MIN_CHARS}
    return lines


@pytest.mark.parametrize(("path", "module"), LABS, ids=[p.stem for p, _ in LABS])
def test_no_hint_contains_a_line_of_the_solution(path, module):
    lines = solution_lines(path, module)
    assert len(lines) > 5, path.name
    found = [(e.name, k, line) for e in exercises_of(module) for k, hint in enumerate(e.hints, 1)
             for line in lines if line in _squashed(hint)]
    assert not found, "hints that give a line of the solution away: " + "; ".join(
        f"{name} hint {k}: {line}" for name, k, line in found)


def test_the_solution_line_test_sees_a_hint_that_gives_the_answer_away():
    path, module = LABS[1]  # lab 01: its ridge point, written out as the solution writes it
    assert _squashed("ridge_flop_per_byte = 989e12 / 4.8e12") in solution_lines(path, module)


@pytest.mark.parametrize(("path", "module"), LABS, ids=[p.stem for p, _ in LABS])
def test_hint_twice_gives_two_different_hints(path, module, capsys):
    for exercise in exercises_of(module):
        fresh = copy.copy(exercise)
        fresh._hints_shown = 0
        first, second = fresh.hint(), fresh.hint()
        assert first != second and first.startswith("Hint 1/") and second.startswith("Hint 2/"), exercise.name


@pytest.mark.parametrize(("path", "module"), LABS, ids=[p.stem for p, _ in LABS])
def test_the_solution_before_any_attempt_says_what_to_do_first(path, module, capsys):
    for exercise in exercises_of(module):
        fresh = copy.copy(exercise)
        fresh.attempted = False
        text = fresh.solution()
        assert text.startswith("The solution comes after your first checked attempt: write "), text
        assert f"`{exercise.var}`" in text and ".hint()`" in text and "\n" not in text, text
        assert exercise.solution_text not in text


def test_a_checked_attempt_opens_the_solution_and_a_blank_does_not():
    from lab_utils.exercises import lab00

    exercise = copy.copy(lab00.q6)
    exercise.attempted = False
    exercise.check(None, quiet=True)  # a blank: no attempt
    assert "comes after your first checked attempt" in exercise.solution()
    assert not exercise.check(2, quiet=True).correct  # a wrong attempt, checked
    assert exercise.solution_text in exercise.solution()
