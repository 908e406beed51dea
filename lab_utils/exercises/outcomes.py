"""What a check says: the five outcomes (``Status``, ``Outcome``), the exceptions a grader raises to say it
(``Wrong``, ``NotApplicable``, ``NotNow``), and what counts as a blank answer.

Design notes: docs/internals.md#lab_utilsexercisesframeworkpy
"""

from __future__ import annotations

import dis
import enum
import functools
import re
from dataclasses import dataclass
from typing import Any


class Status(enum.Enum):
    NOT_ATTEMPTED = "not attempted"
    INCORRECT = "incorrect"
    CORRECT = "correct"
    NOT_APPLICABLE = "not applicable on this tier"
    NOT_NOW = "not checked now"


_MARK = {Status.NOT_ATTEMPTED: "[ ]", Status.INCORRECT: "[x]", Status.CORRECT: "[ok]", Status.NOT_APPLICABLE: "[n/a]",
         Status.NOT_NOW: "[..]"}


@dataclass
class Outcome:
    """What a check said. Printed in the notebook; also returned so tests can assert on it."""

    exercise: str
    status: Status
    message: str

    @property
    def correct(self) -> bool:
        return self.status is Status.CORRECT

    @property
    def graded(self) -> bool:
        """Whether the answer was judged (correct or incorrect), as opposed to blank or not applicable here."""
        return self.status in (Status.CORRECT, Status.INCORRECT)

    def _ipython_display_(self) -> None:
        """Nothing: ``check`` has already printed the outcome; a cell ending in a check shows it once."""

    def __str__(self) -> str:
        return f"{_MARK[self.status]} {self.exercise}: {self.status.value}. {self.message}"


class Wrong(Exception):
    """Raised by a grading function: the answer is wrong, and the message says why."""


class NotApplicable(Exception):
    """Raised by a grading function: this machine cannot run the check; the message says why."""


class NotNow(Exception):
    """Raised by a grading function (or a code exercise's ``applicable``): the check can run on this machine, but not
    now (its server is stopped); the message says what to run first."""


def is_blank(value: Any) -> bool:
    """True for an answer not filled in: None, ``...``, or a function whose body is only ``...``/``pass``
    (a docstring and comments allowed)."""
    if value is None or value is Ellipsis:
        return True
    code = getattr(value, "__code__", None)
    if code is None:
        return False
    ops = [(i.opname, i.argval) for i in dis.get_instructions(code) if i.opname not in ("RESUME", "NOP", "CACHE")]
    return ops in ([("LOAD_CONST", None), ("RETURN_VALUE", None)], [("RETURN_CONST", None)])


class Shown(str):
    """Text a method has already printed, returned for tests and scripts: a notebook cell that ends in it shows
    nothing more (a plain ``str`` would be shown a second time, as its repr)."""

    def _ipython_display_(self) -> None:
        pass


_PLAIN_WORD = re.compile(r"(?:a|i|[a-z]{2,})(?=[\s,.:;!?]|$)")  # "the", "is", "a": not "x", "load_model's", "config="


def sentence(text: str) -> str:
    """``text`` with its first letter capitalised when it starts with a plain word ("the model's ..." -> "The
    model's ..."); a code name stays as written ("load_model's config=", "x is float32")."""
    return text[:1].upper() + text[1:] if _PLAIN_WORD.match(text) else text


def _short(value: Any, limit: int = 120) -> str:
    if isinstance(value, functools.partial):
        return f"functools.partial({_short(value.func)}, ...)"
    if callable(value) and hasattr(value, "__name__"):
        return f"<function {value.__name__}>"  # no address: outputs stay the same from run to run
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
