"""Running the student's code: a time limit (``run_student``), and the student's own line in a traceback
(``student_frame``) so that a failure names it, never a frame of this package.

Design notes: docs/internals.md#lab_utilsexercisesframeworkpy
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import re
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from lab_utils.distributed.ranks import is_library_file
from lab_utils.exercises.outcomes import NotApplicable, NotNow, Wrong, _short
from lab_utils.procs import Background


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


def student_frame(tb: TracebackType | BaseException | str | types.FrameType | None) -> StudentLine | None:
    """The innermost frame of the student's code in a traceback (an exception, its ``__traceback__``, the text of a
    formatted traceback, e.g. from another process) or a live stack (a thread's frame, e.g. one that ran out of
    time); ``None`` when no frame is the student's."""
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
        summary = traceback.extract_stack(tb) if isinstance(tb, types.FrameType) else traceback.extract_tb(tb)
        frames = [StudentLine(f.filename, f.lineno or 0, f.name, (f.line or "").strip()) for f in summary]
    mine = [f for f in frames if _is_students(f.filename)]
    return mine[-1] if mine else None


def raised_message(call: str, err: BaseException, tb: TracebackType | str | None = None) -> str:
    """``"time_ms(...) raised ZeroDivisionError: division by zero, at line 7 of `time_ms`: `return t / 0`"``."""
    at = student_frame(tb if tb is not None else err)
    first = (str(err).strip().splitlines() or [""])[0]  # the message's first line, at most 200 characters
    first = first if len(first) <= 200 else first[:197] + "..."
    what = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return f"{call} raised {what}" + (f", at {at}" if at else "")


class StudentThread(Background):
    """The student's ``fn(*args, **kwargs)`` running in a daemon thread (``Background``) that a check can stop."""

    def where(self) -> StudentLine | None:
        """The line of the student's code it is at now."""
        return student_frame(sys._current_frames().get(self.thread.ident or -1))

    def interrupt(self) -> StudentLine | None:
        """Raise ``StudentTimeout`` in it (best effort: Python code, not a blocking call into C); where it was."""
        at = self.where()
        if self.thread.ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread.ident),
                                                       ctypes.py_object(StudentTimeout))
        return at


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
    ``NotApplicable`` raised by a grader's callback inside the student's code pass through unchanged, and so does
    ``ReferenceCalled`` (the student's code called a reference implementation: the check refuses it).
    ``call`` is how the call is shown in messages (default: built from ``what`` and the arguments).
    In the main thread the limit is a SIGALRM; elsewhere the function runs in a helper thread, which is
    interrupted (best effort) when it runs over.
    """
    call = call or _describe_call(fn, args, kwargs, what)

    def timed_out(at: StudentLine | None) -> Wrong:
        where = f" (it was at {at})" if at else ""
        return Wrong(f"{call} did not return within {timeout_s:g} s{where}: an endless loop, or waiting for "
                     "work that never finishes?")

    result: Any = None
    err: BaseException | None = None
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        try:
            with _alarm(timeout_s):
                result = fn(*args, **kwargs)
        except BaseException as e:  # judged below (a StudentTimeout too, where the alarm fired outside it)
            err = e
    else:
        worker = StudentThread(functools.partial(fn, *args, **kwargs), name=f"student {what or 'code'}")
        worker.thread.join(timeout_s)
        if worker.thread.is_alive():
            raise timed_out(worker.interrupt())
        result, err = worker.result, worker.error
    if isinstance(err, StudentTimeout):
        raise timed_out(student_frame(err)) from None
    if isinstance(err, Exception) and not isinstance(err, (Wrong, NotApplicable, NotNow)):
        raise Wrong(raised_message(call, err)) from None
    if err is not None:
        raise err
    kinds = returns if isinstance(returns, tuple) else (returns,)
    if returns is not None and (not isinstance(result, kinds) or (isinstance(result, bool) and bool not in kinds)):
        hint = " (does it end with `return ...`?)" if result is None else ""
        raise Wrong(f"{call} returned {_short(result)} ({type(result).__name__}){hint}; "
                    f"expected {returns_text or getattr(returns, '__name__', returns)}")
    return result
