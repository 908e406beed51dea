"""Exercise checks with four outcomes: not attempted, incorrect (with the value and why), correct, and not
applicable on this tier (the machine cannot run the check, e.g. CUDA graphs without a GPU).

A check receives the student's answer explicitly (``q1.check(flops)``); it never reads notebook globals. A
blank answer (``None``, ``...``, or a function whose body is only ``...``/``pass``) is *not attempted*, never
an exception, so a lab with blanks runs top to bottom. Hints come in steps; the solution can be shown.

**Code exercises.** When the answer is code, the check *runs* it against the real component (the GPU when
there is one, else the CPU) and compares what it produced with the reference implementation on the same
input. ``run_student`` calls the student's function with a time limit and turns what can go wrong into a
``Wrong`` that names the symptom and shows the student's own line, never a trace through this package:
it raised (the exception and the line of the student's code where it happened), it hung (the line it was
at when time ran out), or it returned the wrong kind of value. ``student_frame`` finds that line in a
traceback object or in a traceback's text (for code that ran in another process, e.g. the ranks of
``lab_utils.distributed.spawn.launch``: pass ``WorkerError.remote_traceback``). A ``CodeExercise`` adds the
function's signature (told to a student who passes something else) and ``applicable``: a function that
returns why the check cannot run on this machine, or ``None``; then the outcome is *not applicable on this
tier*, which is neither a pass nor a failure. Code checks draw their inputs at random where a fixed input
would let a constant pass.

**Normalizers.** One answer written several ways is one answer: ``version`` ("13.0", "13.0.0", NVML's 13000),
``fraction`` ("85%") and ``choice`` (case, ``-``/``_``, synonyms; a whole answer, never a keyword inside a
sentence) are the one place each is decided.
"""

from __future__ import annotations

import contextlib
import ctypes
import dis
import enum
import math
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from lab_utils.distributed.ranks import is_library_file


class Status(enum.Enum):
    NOT_ATTEMPTED = "not attempted"
    INCORRECT = "incorrect"
    CORRECT = "correct"
    NOT_APPLICABLE = "not applicable on this tier"


_MARK = {Status.NOT_ATTEMPTED: "[ ]", Status.INCORRECT: "[x]", Status.CORRECT: "[ok]", Status.NOT_APPLICABLE: "[n/a]"}


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


def _short(value: Any, limit: int = 120) -> str:
    if callable(value) and hasattr(value, "__name__"):
        return f"<function {value.__name__}>"  # no address: outputs stay the same from run to run
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    _hints_shown: int = field(default=0, repr=False)

    def check(self, value: Any, *, quiet: bool = False) -> Outcome:
        """Grade ``value`` (the student's ``var``); prints and returns the outcome."""
        out = self._outcome(value)
        if not quiet:
            print(out)
        return out

    def _outcome(self, value: Any) -> Outcome:
        if is_blank(value):
            number = re.match(r"\d+\.(\d+)\b", self.name)  # "01.3 copy bandwidth" is the lab's `ex.q3`
            hint = f"`ex.q{number[1]}.hint()`" if number else "its `.hint()`"
            return Outcome(self.name, Status.NOT_ATTEMPTED,
                           f"Set `{self.var}` above and run this cell again ({hint} helps).")
        try:
            note = self.grade(value)
        except Wrong as why:
            return Outcome(self.name, Status.INCORRECT, f"`{self.var}` = {_short(value)}: {why}")
        except NotApplicable as why:
            return Outcome(self.name, Status.NOT_APPLICABLE, str(why))
        except Exception as err:  # the student's code failed inside the check: show it, don't crash
            return Outcome(self.name, Status.INCORRECT, f"checking `{self.var}` raised {type(err).__name__}: {err}")
        extra = f" {note}" if isinstance(note, str) and note else ""
        return Outcome(self.name, Status.CORRECT, f"`{self.var}` = {_short(value)}.{extra}")

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


@dataclass
class CodeExercise(Exercise):
    """An exercise whose answer is a function that the check runs (through ``run_student``).

    ``signature`` is what the student must define, e.g. ``"time_ms(fn, iters, warmup, sync) -> float"``;
    ``applicable()`` returns why this machine cannot run the check (the outcome is then *not applicable on
    this tier*), or ``None``.
    """

    signature: str = ""
    applicable: Callable[[], str | None] | None = None

    def _outcome(self, value: Any) -> Outcome:
        reason = self.applicable() if self.applicable is not None else None
        if reason:
            still = (f" (`{self.var}` is still blank: write it anyway, it runs where this check can)"
                     if is_blank(value) else f" Your `{self.var}` was not run.")
            return Outcome(self.name, Status.NOT_APPLICABLE, f"{reason}{still}")
        if not is_blank(value) and not callable(value):
            return Outcome(self.name, Status.INCORRECT,
                           f"`{self.var}` = {_short(value)}: expected a function `{self.signature or self.var}`, "
                           f"got a {type(value).__name__}. Define it with `def` and pass the function itself "
                           "(its name, without parentheses).")
        return super()._outcome(value)


# --- running the student's code --------------------------------------------------------------------


class StudentTimeout(BaseException):
    """Raised inside the student's code when its time is up (a BaseException, so `except Exception` in the
    student's own code cannot swallow it)."""


@dataclass(frozen=True)
class StudentLine:
    """One frame of the student's code: where it raised or where it was when time ran out."""

    filename: str
    lineno: int
    function: str
    code: str

    def __str__(self) -> str:
        where = "your code" if self.function in ("<module>", "<lambda>") else f"`{self.function}`"
        code = f": `{self.code}`" if self.code else ""
        return f"line {self.lineno} of {where}{code}"


def _is_students(filename: str) -> bool:
    """True for a frame of the student's code: a notebook cell, a test, exec'd text; not a library's file."""
    if filename.startswith("<"):
        return not filename.startswith("<frozen")
    return not is_library_file(filename)


_TB_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


def student_frame(tb: TracebackType | BaseException | str | None) -> StudentLine | None:
    """The innermost frame of the student's code in a traceback (an exception, its ``__traceback__``, or the
    text of a formatted traceback, e.g. from another process); ``None`` when no frame is the student's."""
    if isinstance(tb, BaseException):
        tb = tb.__traceback__
    frames: list[StudentLine] = []
    if isinstance(tb, str):
        block = tb.rsplit("Traceback (most recent call last):", 1)[-1]  # the last of a chain
        lines = block.splitlines()
        for i, line in enumerate(lines):
            m = _TB_LINE.match(line)
            if m:
                code = lines[i + 1].strip() if i + 1 < len(lines) and not _TB_LINE.match(lines[i + 1]) else ""
                frames.append(StudentLine(m["file"], int(m["line"]), m["func"].strip(), code))
    elif tb is not None:
        for f in traceback.extract_tb(tb):
            frames.append(StudentLine(f.filename, f.lineno or 0, f.name, (f.line or "").strip()))
    mine = [f for f in frames if _is_students(f.filename)]
    return mine[-1] if mine else None


def _stack_frame(frame: Any) -> StudentLine | None:
    """The innermost frame of the student's code in a live stack (a thread that ran out of time)."""
    summary = traceback.extract_stack(frame)
    mine = [f for f in summary if _is_students(f.filename)]
    if not mine:
        return None
    f = mine[-1]
    return StudentLine(f.filename, f.lineno or 0, f.name, (f.line or "").strip())


def _first_line(err: BaseException, limit: int = 200) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def raised_message(call: str, err: BaseException, tb: TracebackType | str | None = None) -> str:
    """``"time_ms(...) raised ZeroDivisionError: division by zero, at line 7 of `time_ms`: `return t / 0`"``."""
    at = student_frame(tb if tb is not None else err)
    what = f"{type(err).__name__}: {_first_line(err)}" if _first_line(err) else type(err).__name__
    return f"{call} raised {what}" + (f", at {at}" if at else "")


def _async_raise(thread: threading.Thread, exc: type[BaseException]) -> None:
    # Best effort: interrupts Python code in that thread (not a blocking call into C).
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc))


@contextlib.contextmanager
def _alarm(timeout_s: float) -> Iterator[None]:
    """Raise ``StudentTimeout`` in the main thread after ``timeout_s`` (SIGALRM); an outer timer is re-armed."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise StudentTimeout()

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    t0 = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - t0), 1e-3), old_interval)


def _describe_call(fn: Any, args: Sequence[Any], kwargs: Mapping[str, Any], what: str | None) -> str:
    def show(v: Any) -> str:
        if isinstance(v, (int, float, str, bool)) or v is None:
            return repr(v)
        return getattr(v, "__name__", None) or type(v).__name__

    parts = [show(a) for a in args] + [f"{k}={show(v)}" for k, v in kwargs.items()]
    return f"{what or getattr(fn, '__name__', 'your function')}({', '.join(parts)})"


def run_student(
    fn: Callable[..., Any],
    *args: Any,
    what: str | None = None,
    call: str | None = None,
    timeout_s: float = 60.0,
    returns: type | tuple[type, ...] | None = None,
    returns_text: str = "",
    **kwargs: Any,
) -> Any:
    """Run the student's ``fn(*args, **kwargs)`` with a time limit and return its result.

    Raises ``Wrong`` (never the student's exception) when it raises (the exception and the student's own
    line), when it has not returned after ``timeout_s`` (the line it was at), or when ``returns`` is given
    and the result is not an instance of it (``returns_text`` says what was expected). ``Wrong`` and
    ``NotApplicable`` raised by a grader's callback inside the student's code pass through unchanged.
    ``call`` is how the call is shown in messages (default: built from ``what`` and the arguments).
    In the main thread the limit is a SIGALRM; elsewhere the function runs in a helper thread, which is
    interrupted (best effort) when it runs over.
    """
    call = call or _describe_call(fn, args, kwargs, what)

    def timed_out(at: StudentLine | None) -> Wrong:
        where = f" (it was at {at})" if at else ""
        return Wrong(f"{call} did not return within {timeout_s:g} s{where}: an endless loop, or waiting for "
                     "work that never finishes?")

    in_main = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    if in_main:
        try:
            with _alarm(timeout_s):
                result = fn(*args, **kwargs)
        except StudentTimeout as t:
            raise timed_out(student_frame(t)) from None
        except (Wrong, NotApplicable):
            raise
        except Exception as err:
            raise Wrong(raised_message(call, err)) from None
    else:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["result"] = fn(*args, **kwargs)
            except BaseException as err:  # handed to the caller's thread
                box["error"] = err

        worker = threading.Thread(target=target, name=f"student {what or 'code'}", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            frame = sys._current_frames().get(worker.ident or -1)
            at = _stack_frame(frame) if frame is not None else None
            _async_raise(worker, StudentTimeout)
            raise timed_out(at)
        err = box.get("error")
        if isinstance(err, (Wrong, NotApplicable)):
            raise err
        if isinstance(err, Exception):
            raise Wrong(raised_message(call, err)) from None
        if err is not None:
            raise err
        result = box.get("result")
    kinds = returns if isinstance(returns, tuple) else (returns,)
    if returns is not None and (not isinstance(result, kinds) or (isinstance(result, bool) and bool not in kinds)):
        hint = " (does it end with `return ...`?)" if result is None else ""
        raise Wrong(f"{call} returned {_short(result)} ({type(result).__name__}){hint}; "
                    f"expected {returns_text or getattr(returns, '__name__', returns)}")
    return result


# --- grading building blocks -------------------------------------------------------------------


def number(value: Any, what: str = "the answer") -> float:
    """The value as a float, or ``Wrong`` saying a number was expected."""
    if isinstance(value, bool):
        raise Wrong(f"{what} should be a number, not a bool")
    if value is None:
        raise Wrong(f"{what} should be a number, got None (does the function end with `return ...`?)")
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


# --- normalizers: one answer written several ways means one thing ------------------------------------------

_VERSION_TEXT = re.compile(r"^v?(\d+)(?:\.(\d+))?(?:\.\d+)*$")


def version(value: Any, what: str = "the version") -> tuple[int, int]:
    """A CUDA-style version as (major, minor): ``"13.0"``, ``"13"``, ``"13.0.0"``, ``b"13.0"`` or NVML's
    integer ``13000`` (``12040`` is 12.4). A float is refused: ``12.10`` and ``12.1`` are one float."""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1000:
        return value // 1000, value % 1000 // 10  # NVML's encoding: 1000 * major + 10 * minor
    if isinstance(value, bool) or not isinstance(value, str):
        if isinstance(value, (int, float)):
            raise Wrong(f"{what} is the number {value!r}: give the version as a string such as '13.0'. As a "
                        "number, '12.10' becomes 12.1 and sorts before 12.4")
        raise Wrong(f"{what} should be a version string such as '13.0', got {type(value).__name__}")
    match = _VERSION_TEXT.match(value.strip())
    if not match:
        raise Wrong(f"{what} is {value.strip()!r}: expected a version of the form major.minor, like '12.4'")
    return int(match[1]), int(match[2] or 0)


def fraction(value: Any, what: str = "the answer") -> float:
    """A share as a float: ``0.85``, ``"0.85"`` or the percentage text ``"85%"`` (0.85)."""
    if isinstance(value, str):
        text = value.strip()
        scale = 100.0 if text.endswith("%") else 1.0
        try:
            return number(float(text.removesuffix("%").strip()), what) / scale
        except ValueError:
            raise Wrong(f"{what} should be a number (a fraction such as 0.85, or '85%'), got {text!r}") from None
    return number(value, what)


def normal_text(value: str) -> str:
    """Lower case, no surrounding quotes or space, and ``-``, ``_`` and runs of spaces as one space."""
    return " ".join(re.sub(r"[-_\s]+", " ", value.strip().strip("'\"").lower()).split())


def choice(value: Any, choices: Sequence[str], synonyms: Mapping[str, Sequence[str]] | None = None) -> str | None:
    """The element of ``choices`` that ``value`` names, or ``None``: a whole answer, not a word inside one.

    Case, ``-``/``_``/spaces and surrounding quotes are ignored; ``synonyms`` maps a choice to other whole
    answers that mean it (``{"memory": ["bandwidth-bound"]}``)."""
    if not isinstance(value, str):
        return None
    names = {normal_text(c): c for c in choices}
    for c, others in (synonyms or {}).items():
        names.update({normal_text(o): c for o in others})
    return names.get(normal_text(value))


def match_slip(ratio: float, slips: Mapping[float, str], rel: float) -> str | None:
    """The message of the first slip whose ratio (answer / expected) matches ``ratio`` within ``rel``."""
    for slip, message in slips.items():
        if math.isclose(ratio, slip, rel_tol=rel):
            return message
    return None


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
        message = match_slip(ratio, slips or {}, rel)
        if message:
            raise Wrong(message)
        if reveal:
            raise Wrong(f"expected about {expected:.4g} (within {rel:.0%}); yours is {ratio:.3g}x that. "
                        f"{why}".strip())
        side = "high" if ratio > 1 else "low"
        raise Wrong(f"not within {rel:.0%} of the expected value: too {side}. {why}".strip())

    return grade


def one_of(expected: str, choices: Sequence[str], why: str = "",
           synonyms: Mapping[str, Sequence[str]] | None = None) -> Callable[[Any], None]:
    """A grader for a choice among ``choices`` (normalized by ``choice``; ``synonyms`` as there)."""

    def grade(value: Any) -> None:
        picked = choice(value, choices, synonyms)
        if picked is None:
            raise Wrong(f"answer with one of {list(choices)}")
        if picked != expected:
            raise Wrong(why or "not this one")

    return grade
