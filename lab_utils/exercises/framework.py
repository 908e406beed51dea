"""Exercise checks with four outcomes: not attempted, incorrect (with why), correct, not applicable on this tier; and
*not checked now* when something the check needs is not running yet (a server stopped), with what to run first.

A check takes the student's answer explicitly (``q1.check(flops)``), never notebook globals; a ``CodeExercise`` runs a
code answer (``run_student``) and refuses one that delegates to a reference implementation, which each exercise
names beside itself (``references=References(fix, *targets)``; the guard: ``delegation``).

This module is the labs' one import: the outcomes (``outcomes``), running the student's code (``student``), the
graders' building blocks (``grading``) and the course's own objects (``course_objects``) are re-exported here.

Design notes: docs/internals.md#lab_utilsexercisesframeworkpy
"""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lab_utils.course import progress
from lab_utils.exercises.course_objects import course_object, hands_out
from lab_utils.exercises.delegation import (
    LAB_PACKAGE,
    Guard,
    ReferenceCalled,
    References,
    delegation,
    references_of,
)
from lab_utils.exercises.grading import (
    amended,
    choice,
    close_to,
    fastest_ratio,
    fraction,
    integer,
    items,
    match_slip,
    normal_text,
    number,
    one_of,
    patched,
    per_call_wrong,
    source_as,
    version,
)
from lab_utils.exercises.outcomes import (
    NotApplicable,
    NotNow,
    Outcome,
    Shown,
    Status,
    Wrong,
    _short,
    is_blank,
    sentence,
)
from lab_utils.exercises.student import (
    StudentLine,
    StudentThread,
    StudentTimeout,
    raised_message,
    run_student,
    student_frame,
)

__all__ = [
    "Exercise", "CodeExercise", "References", "lab_references",
    "Status", "Outcome", "Wrong", "NotApplicable", "NotNow", "Shown", "is_blank", "sentence",
    "StudentLine", "StudentThread", "StudentTimeout", "raised_message", "run_student", "student_frame",
    "amended", "choice", "close_to", "fastest_ratio", "fraction", "integer", "items", "match_slip", "normal_text",
    "number", "one_of", "patched", "per_call_wrong", "source_as", "version",
    "course_object", "hands_out", "ReferenceCalled",
]


# What hint() and solution() say when they have nothing to give yet ({n} hints, {var}, the {hint}/{solution} calls)
HELP_TEXTS = {
    "no_more_hints": "No more hints: all {n} were shown. Once you have checked an attempt, {solution} shows the "
                     "solution.",
    "solution_first": "The solution comes after your first checked attempt: write `{var}` and run its check, then "
                      "call this again ({hint} gives the next hint meanwhile).",
}


@dataclass
class Exercise:
    """One question: ``grade(value)`` returns normally when right and raises ``Wrong(why)`` when not.

    ``grade`` may return a short text, added to the *correct* message (e.g. what the student's code measured);
    it may raise ``NotApplicable(why)`` when this machine cannot run the check.
    """

    name: str
    var: str
    grade: Callable[[Any], Any]
    hints: Sequence[str] = ()
    solution_text: str = ""
    hint_call: str = ""  # how the notebook asks for a hint, where not `ex.qN.hint()` (the quiz: runner.hint('id'))
    # the course's own implementations of this answer and the fix: a code answer that reaches one is refused (a value
    # exercise names its hands_out helpers here too, so that every reference of a lab is named by its exercise)
    references: References | None = None
    _hints_shown: int = field(default=0, repr=False)
    # the value of the last check that was correct, None until one is (or after a later one is not): what a later
    # cell uses instead of the student's name, so a blank or a wrong answer cannot fail that cell
    accepted: Any = field(default=None, init=False, repr=False)
    help_texts: Mapping[str, str] = field(default_factory=dict, repr=False)  # HELP_TEXTS in another language
    # whether a check has seen a filled-in answer (a blank is no attempt): the solution is offered from then on
    attempted: bool = field(default=False, init=False, repr=False)

    def check(self, value: Any, *, quiet: bool = False) -> Outcome:
        """Grade ``value`` (the student's ``var``); prints and returns the outcome."""
        out = self._outcome(value)
        self.accepted = value if out.correct else None
        progress.record(self.name, out.status.name, out.message, echo=_short(value))  # the student's record
        self.attempted = self.attempted or not is_blank(value)
        if not quiet:
            print(out)
        return out

    def _call(self, method: str) -> str:
        """How the notebook calls ``method`` ("hint", "solution") of this exercise: `ex.q3.hint()`, or as
        ``hint_call`` says (the quiz's `runner.hint('id')`)."""
        if self.hint_call:
            return f"`{self.hint_call.replace('hint', method, 1)}`"
        number = re.match(r"\d+[a-z]?\.(\d+)\b", self.name)  # "01.3 ..." (or "01b.3 ...") is the lab's `ex.q3`
        return f"`ex.q{number[1]}.{method}()`" if number else f"its `.{method}()`"

    def _outcome(self, value: Any) -> Outcome:
        if is_blank(value):
            return Outcome(self.name, Status.NOT_ATTEMPTED,
                           f"Set `{self.var}` above and run this cell again ({self._call('hint')} helps).")
        lab = re.match(r"(\d\d[a-z]?)\.", self.name)  # "09.7 ..." is lab 09's: its name for an object lab 01 shares
        handed = course_object(value, first=f"{LAB_PACKAGE}lab{lab[1]}" if lab else None)
        if handed:  # before grading: the course's own value would pass every check it was written for
            return self._incorrect(value, f"{handed}: an answer is your own work, not a value the course hands "
                                          f"out. Write `{self.var}` yourself")
        try:
            note = self.grade(value)
        except Wrong as why:
            return self._incorrect(value, why)
        except NotApplicable as why:
            return Outcome(self.name, Status.NOT_APPLICABLE, str(why))
        except NotNow as why:
            return Outcome(self.name, Status.NOT_NOW, sentence(str(why)))
        except Exception as err:  # the student's code failed inside the check: show it, don't crash
            return Outcome(self.name, Status.INCORRECT, f"checking `{self.var}` raised {type(err).__name__}: {err}")
        extra = f" {note}" if isinstance(note, str) and note else ""
        return Outcome(self.name, Status.CORRECT, f"`{self.var}` = {_short(value)}.{extra}")

    def _incorrect(self, value: Any, why: object) -> Outcome:
        return Outcome(self.name, Status.INCORRECT, f"`{self.var}` = {_short(value)}: {why}")

    def hint(self, n: int | None = None) -> Shown:
        """Print the next hint (the first is conceptual, the last close to code, none the answer), or hint ``n``
        (1-based) again; the text is also returned (shown once in a cell)."""
        if not self.hints:
            text = "No hints for this one."
        elif n is None and self._hints_shown >= len(self.hints):
            text = self._help("no_more_hints")
        else:
            if n is None:
                self._hints_shown += 1
                n = self._hints_shown
            if not 1 <= n <= len(self.hints):
                raise ValueError(f"hint(n={n}): {self.name} has hints 1..{len(self.hints)}")
            text = f"Hint {n}/{len(self.hints)}: {self.hints[n - 1]}"
        print(text)
        return Shown(text)

    def solution(self) -> Shown:
        """Print the worked solution once an attempt was checked (before, what to do first); the text is also
        returned (shown once in a cell)."""
        if self.attempted:
            text = f"Solution ({self.name}):\n{self.solution_text}"
        else:
            text = self._help("solution_first")
        print(text)
        return Shown(text)

    def _help(self, key: str) -> str:
        return (self.help_texts.get(key) or HELP_TEXTS[key]).format(
            n=len(self.hints), var=self.var, hint=self._call("hint"), solution=self._call("solution"))


@dataclass
class CodeExercise(Exercise):
    """An exercise whose answer is a function that the check runs (through ``run_student``).

    ``signature`` is what the student must define, e.g. ``"time_ms(fn, iters, warmup, sync) -> float"``;
    ``applicable()`` returns why this machine cannot run the check (the outcome is then *not applicable on
    this tier*), or ``None``.
    """

    signature: str = ""
    applicable: Callable[[], str | None] | None = None
    lab: str = field(default="", init=False, repr=False)  # the lab module whose exercises it is among (the grader's)

    def __post_init__(self) -> None:
        module = getattr(self.grade, "__module__", None) or ""
        # a lab split into a package (lab_utils.exercises.lab08.tracking): the lab is the package, ``ex``
        self.lab = ".".join(module.split(".")[:3]) if module.startswith(LAB_PACKAGE) else module

    def refusal(self, value: Any) -> Outcome | None:
        """*Incorrect* when ``value`` is, or reaches, a reference implementation of this exercise (found without
        running it: ``references``); None otherwise, and for a blank or a value that is not a function."""
        if is_blank(value) or not callable(value):
            return None
        why = delegation(value, self._refs())
        return self._incorrect(value, why) if why else None

    def _refs(self) -> Any:
        module = sys.modules.get(self.lab)
        siblings = lab_references(module).values() if module is not None else ()
        return references_of(self.lab, self.var, self.references, siblings)

    def _outcome(self, value: Any) -> Outcome:
        # Refused first: a delegating answer is wrong on every machine, and nothing expensive has started yet.
        refused = self.refusal(value)
        if refused is not None:
            return refused
        try:
            reason = self.applicable() if self.applicable is not None else None
        except NotNow as why:
            return Outcome(self.name, Status.NOT_NOW, sentence(str(why)))
        if reason:
            still = (f" (`{self.var}` is still blank: write it anyway, it runs where this check can)"
                     if is_blank(value) else f" Your `{self.var}` was not run.")
            return Outcome(self.name, Status.NOT_APPLICABLE, f"{reason}{still}")
        if not is_blank(value) and not callable(value):
            return self._incorrect(value, f"expected a function `{self.signature or self.var}`, got a "
                                          f"{type(value).__name__}. Define it with `def` and pass the function itself "
                                          "(its name, without parentheses).")
        if is_blank(value):
            return super()._outcome(value)
        with Guard(self._refs()) as guard:
            try:
                out = super()._outcome(value)
            except ReferenceCalled:
                if guard.refused is None:  # an enclosing check's trap: that check decides
                    raise
        if guard.refused is not None:
            # However the grader took it (the student's code may even have caught the trap), the call is the verdict.
            return self._incorrect(value, guard.refused)
        return out


def lab_references(module: types.ModuleType) -> dict[str, References]:
    """``var`` -> its ``References``, for every exercise of a lab module that names some (private parts included:
    lab 00's inventory grades one of two functions, each with its own)."""
    return {e.var: e.references for e in list(vars(module).values())
            if isinstance(e, Exercise) and e.references is not None}
