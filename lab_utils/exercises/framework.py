"""Exercise checks with three outcomes: not attempted, incorrect (with the value and why), correct.

A check receives the student's value explicitly (``q1.check(flops)``); it never reads notebook
globals. A blank answer (``None`` or ``...``) is *not attempted*, never an exception, so a lab with
blanks runs top to bottom. Hints come in steps; the solution can be shown.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class Status(enum.Enum):
    NOT_ATTEMPTED = "not attempted"
    INCORRECT = "incorrect"
    CORRECT = "correct"


_MARK = {Status.NOT_ATTEMPTED: "[ ]", Status.INCORRECT: "[x]", Status.CORRECT: "[ok]"}


@dataclass
class Outcome:
    """What a check said. Printed in the notebook; also returned so tests can assert on it."""

    exercise: str
    status: Status
    message: str

    @property
    def correct(self) -> bool:
        return self.status is Status.CORRECT

    def _ipython_display_(self) -> None:
        """Nothing: ``check`` has already printed the outcome; a cell ending in a check shows it once."""

    def __str__(self) -> str:
        return f"{_MARK[self.status]} {self.exercise}: {self.status.value}. {self.message}"


class Wrong(Exception):
    """Raised by a grading function: the answer is wrong, and the message says why."""


def _stub(*args: Any, **kwargs: Any) -> Any:
    ...


def is_blank(value: Any) -> bool:
    """True for an answer not filled in: None, ``...``, or a function whose body is only ``...``/``pass``."""
    if value is None or value is Ellipsis:
        return True
    code = getattr(value, "__code__", None)
    return code is not None and code.co_code == _stub.__code__.co_code and code.co_consts[:1] in ((None,), ())


def _short(value: Any, limit: int = 120) -> str:
    if callable(value) and hasattr(value, "__name__"):
        return f"<function {value.__name__}>"  # no address: outputs stay the same from run to run
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class Exercise:
    """One question: ``grade(value)`` returns normally when right and raises ``Wrong(why)`` when not."""

    name: str
    var: str
    grade: Callable[[Any], None]
    hints: Sequence[str] = ()
    solution_text: str = ""
    _hints_shown: int = field(default=0, repr=False)

    def check(self, value: Any, *, quiet: bool = False) -> Outcome:
        """Grade ``value`` (the student's ``var``); prints and returns the outcome."""
        if is_blank(value):
            out = Outcome(self.name, Status.NOT_ATTEMPTED,
                          f"Set `{self.var}` above and run this cell again (q.hint() helps).")
        else:
            try:
                self.grade(value)
            except Wrong as why:
                out = Outcome(self.name, Status.INCORRECT, f"`{self.var}` = {_short(value)}: {why}")
            except Exception as err:  # the student's code failed inside the check: show it, don't crash
                out = Outcome(self.name, Status.INCORRECT,
                              f"checking `{self.var}` raised {type(err).__name__}: {err}")
            else:
                out = Outcome(self.name, Status.CORRECT, f"`{self.var}` = {_short(value)}.")
        if not quiet:
            print(out)
        return out

    def hint(self, n: int | None = None) -> str:
        """Show hint ``n`` (1-based), or the next one in order."""
        if not self.hints:
            text = "No hints for this one."
        else:
            if n is None:
                self._hints_shown = min(self._hints_shown + 1, len(self.hints))
                n = self._hints_shown
            if not 1 <= n <= len(self.hints):
                raise ValueError(f"hint(n={n}): {self.name} has hints 1..{len(self.hints)}")
            text = f"Hint {n}/{len(self.hints)}: {self.hints[n - 1]}"
        print(text)
        return text

    def solution(self) -> str:
        """Show the worked solution."""
        text = f"Solution ({self.name}):\n{self.solution_text}"
        print(text)
        return text


# --- grading building blocks -------------------------------------------------------------------


def number(value: Any, what: str = "the answer") -> float:
    """The value as a float, or ``Wrong`` saying a number was expected."""
    if isinstance(value, bool):
        raise Wrong(f"{what} should be a number, not a bool")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise Wrong(f"{what} should be a number, got {type(value).__name__}") from None
    if math.isnan(out):
        raise Wrong(f"{what} is NaN")
    return out


def integer(value: Any, what: str = "the answer") -> int:
    """The value as an int (``18`` or ``18.0``), or ``Wrong`` saying a whole number was expected."""
    got = number(value, what)
    if not got.is_integer():
        raise Wrong(f"{what} should be a whole number (a count), got {got:g}")
    return int(got)


def close_to(
    expected: float,
    rel: float = 0.01,
    why: str = "",
    *,
    slips: Mapping[float, str] | None = None,
    reveal: bool = True,
) -> Callable[[Any], None]:
    """A grader accepting numbers within ``rel`` (relative) of ``expected``.

    ``slips`` maps a ratio (answer / expected) that a common mistake produces to the message for it,
    e.g. ``{0.5: "a multiply-add is 2 FLOPs"}``; a ratio matches within ``rel``. With ``reveal=False``
    a wrong answer is told too high or too low, not the expected value (so hints keep their worth).
    """

    def grade(value: Any) -> None:
        got = number(value)
        if math.isclose(got, expected, rel_tol=rel, abs_tol=0.0 if expected else rel):
            return
        ratio = got / expected if expected else float("inf")
        for slip, message in (slips or {}).items():
            if math.isclose(ratio, slip, rel_tol=rel):
                raise Wrong(message)
        if reveal:
            raise Wrong(f"expected about {expected:.4g} (within {rel:.0%}); yours is {ratio:.3g}x that. "
                        f"{why}".strip())
        side = "high" if ratio > 1 else "low"
        raise Wrong(f"not within {rel:.0%} of the expected value: too {side}. {why}".strip())

    return grade


def one_of(expected: str, choices: Sequence[str], why: str = "") -> Callable[[Any], None]:
    """A grader for a choice among ``choices`` (case-insensitive)."""
    normal = {c.lower(): c for c in choices}

    def grade(value: Any) -> None:
        if not isinstance(value, str) or value.strip().lower() not in normal:
            raise Wrong(f"answer with one of {list(choices)}")
        if value.strip().lower() != expected.lower():
            raise Wrong(why or "not this one")

    return grade
